"""The Markdown tables of summary.md and breakdown.md: one cell format and one aligned table."""
import math
from collections.abc import Collection, Sequence


def cell(value: object, spec: str, suffix: str = "") -> str:
    """`value` formatted with `spec`, or "-" where it is missing (None or NaN)."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:{spec}}{suffix}"


def table(rows: Sequence[Sequence[object]], left: Collection[int] = (0,)) -> str:
    """rows[0] is the header; columns whose index is in `left` are left-aligned, the others right-aligned
    (numbers), with the alignment written into the rule line too."""
    cells = [[str(c).replace("|", "\\|") for c in row] for row in rows]
    widths = [max(len(r[j]) for r in cells) for j in range(len(cells[0]))]

    def line(row):
        return "| " + " | ".join(c.ljust(w) if j in left else c.rjust(w)
                                 for j, (c, w) in enumerate(zip(row, widths))) + " |"

    rule = "|" + "|".join("-" * (w + 2) if j in left else "-" * (w + 1) + ":" for j, w in enumerate(widths)) + "|"
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])
