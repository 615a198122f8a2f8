"""What every chart shares: its resolution, text wrapped to the figure's width, a footnote, and writing it.

pyplot is never imported: figures are plain Figure objects rendered by Agg on savefig, so that the report
needs no display and importing it from a notebook leaves the notebook's backend alone.
"""
import os

from matplotlib.backends.backend_agg import RendererAgg
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.text import Text

from Utils.results.files import write_atomic

DPI = 120
TITLE_SIZE = 11
FOOTNOTE_SIZE = 8
FOOTNOTE_COLOR = "#444444"
# Text is wrapped this far inside the figure's edges (inches), so that nothing is cut off when it is saved.
MARGIN_IN = 0.12


def wrap(text: str, fig: Figure, fontsize: float) -> str:
    """`text` with each of its lines broken at spaces so that no line is wider than the figure less its
    margins, as Agg renders it at `fontsize` points; a word wider than that on its own (a long path) is
    broken where it reaches the margin."""
    renderer = RendererAgg(1, 1, fig.dpi)
    prop = FontProperties(size=fontsize)
    limit = fig.get_figwidth() * fig.dpi - 2 * MARGIN_IN * fig.dpi

    def fits(s):
        return renderer.get_text_width_height_descent(s, prop, ismath=False)[0] <= limit

    out = []
    for paragraph in text.split("\n"):
        line = ""
        for word in paragraph.split(" "):
            candidate = f"{line} {word}" if line else word
            if fits(candidate):
                line = candidate
                continue
            if line:
                out.append(line)
            while len(word) > 1 and not fits(word):
                cut = next((i for i in range(len(word) - 1, 1, -1) if fits(word[:i])), 1)
                out.append(word[:cut])
                word = word[cut:]
            line = word
        out.append(line)
    return "\n".join(out)


def new_figure(title: str, context: str, height: float, width: float = 9.0) -> Figure:
    """A figure laid out by constrained layout (which leaves room for the title and the footnote), titled
    `title` with `context` (what was measured) beneath, both wrapped to its width."""
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    text = f"{title}\n{context}" if context else title
    fig.suptitle(wrap(text, fig, TITLE_SIZE), fontsize=TITLE_SIZE)
    return fig


def add_footnote(fig: Figure, *paragraphs: str) -> None:
    """Set the non-empty paragraphs, each wrapped to the figure's width, as its footnote, left-aligned at its
    foot (fig.supxlabel, for which constrained layout leaves room)."""
    text = "\n".join(wrap(p, fig, FOOTNOTE_SIZE) for p in paragraphs if p)
    if text:
        fig.supxlabel(text, x=MARGIN_IN / fig.get_figwidth(), ha="left", multialignment="left",
                      fontsize=FOOTNOTE_SIZE, color=FOOTNOTE_COLOR)


def save_figure(fig: Figure, path: str | os.PathLike) -> None:
    """Render fig as PNG to path through a temporary file. Its text is drawn as written, as wrap measured it:
    matplotlib would read a folder's name with a "$" in it (PREFIX='runs $5') as TeX, and fail on a single one."""
    for text in fig.findobj(Text):
        text.set_parse_math(False)
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=DPI))
