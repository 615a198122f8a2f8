"""The notebook's text on each addition, taken from its registry entry (Addition.title, notebook, phrase, why and
its roofline facts) and set as markdown for notebooks/build_notebook.py. Imports the registry only, so that
building the notebook's cells needs neither torch nor pandas."""
import re
import textwrap
from collections.abc import Callable, Iterable

from Utils.ladder.registry import ADDITIONS, Addition

WIDTH = 104   # columns of the markdown source, as the cells written by hand are wrapped
# A line that starts like this would begin a list, a heading or a quote instead of continuing the paragraph.
_BLOCK_START = re.compile(r"([-+*>#]|\d+[.)])(\s|$)")


def paragraph(text: str) -> str:
    """One markdown paragraph with its whitespace collapsed, wrapped to WIDTH columns. A line is never broken
    inside a word or at a hyphen, nor so that the next starts like a list item or a heading."""
    lines: list[str] = []
    for line in textwrap.wrap(" ".join(text.split()), WIDTH, break_long_words=False, break_on_hyphens=False):
        if lines and _BLOCK_START.match(line):
            lines[-1] += " " + line
        else:
            lines.append(line)
    return "\n".join(lines)


def paragraphs(*texts: str) -> str:
    """Markdown paragraphs (a heading is one), each wrapped, a blank line between."""
    return "\n\n".join(paragraph(t) for t in texts)


def section(name: str) -> str:
    """The notebook's section on the rung that adds addition `name` alone (the rung shares its name): its title
    as the heading, then its paragraphs."""
    addition = ADDITIONS[name]
    return paragraphs(f"### {name}: {addition.title}", *addition.notebook)


def listing(names: Iterable[str]) -> str:
    """What each of these additions changes (Addition.phrase), as one list in prose: a and b; a, b, and c (the
    comma before the last, since phrases hold commas of their own)."""
    phrases = [ADDITIONS[n].phrase for n in names]
    return " and ".join(phrases) if len(phrases) < 3 else ", ".join(phrases[:-1]) + ", and " + phrases[-1]


def reasons(names: Iterable[str]) -> str:
    """Why each of these additions can help (Addition.why), as clauses joined by semicolons; a reason that several
    share is given once, where the first of them stands, and an addition without one adds none."""
    return "; ".join(dict.fromkeys(ADDITIONS[n].why for n in names if ADDITIONS[n].why))


def named(names: Iterable[str], last: str = " or ") -> str:
    """The additions as code, `a`, `b` and the last joined by `last`."""
    quoted = [f"`{n}`" for n in names]
    return last.join([", ".join(quoted[:-1]), quoted[-1]]) if len(quoted) > 1 else "".join(quoted)


def floor_inputs() -> str:
    """Which additions set each input of the floors, from their roofline facts (Addition.matmuls, compiled,
    scores_on_chip, optimizer, clip_folded)."""
    def having(fact: Callable[[Addition], object]) -> list[str]:
        return [n for n, a in ADDITIONS.items() if fact(a)]
    return (f"the matmul precision (FP32 units, or the tensor cores with {named(having(lambda a: a.matmuls))}), "
            f"the bytes per activation ({named(having(lambda a: a.matmuls == 'bf16'))}), the attention (scores "
            f"written out, fused by {named(having(lambda a: a.compiled))}, or none with "
            f"{named(having(lambda a: a.scores_on_chip))}) and the optimizer "
            f"({named(having(lambda a: a.optimizer or a.clip_folded), last=', ')})")
