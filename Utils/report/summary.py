"""summary.md: the ladder table in ladder order, how its numbers were made, the runs left out, the notes."""
import os

import pandas as pd

from Utils.report import markdown
from Utils.report.stats import BOOTSTRAP_RESAMPLES, NO_BASELINE_NOTE, Report
from Utils.results.files import write_atomic

SUMMARY_FILE = "summary.md"
TABLE_HEADER = ["rung", "median ms", "IQR ms", "speedup", "tokens/s", "MFU", "peak alloc GiB",
                "peak reserved GiB", "compile s", "final loss", "status"]


def table_rows(table: pd.DataFrame) -> list[list[str]]:
    """summarize()'s frame as the text cells of summary.md's table, header first."""
    rows = [TABLE_HEADER]
    for rung, r in table.iterrows():
        rows.append([rung, markdown.cell(r["median_step_ms"], ".1f"), markdown.cell(r["iqr_step_ms"], ".1f"),
                     markdown.cell(r["speedup"], ".2f", "x"), markdown.cell(r["tokens_per_s"], ",.0f"),
                     markdown.cell(100 * r["mfu"], ".1f", "%"), markdown.cell(r["peak_mem_allocated_gib"], ".1f"),
                     markdown.cell(r["peak_mem_reserved_gib"], ".1f"), markdown.cell(r["compile_s"], ".1f"),
                     markdown.cell(r["final_loss"], ".3f"), r["status"]])
    return rows


def render_summary(report: Report) -> str:
    """summary.md's text: heading (what was measured, and where the figures come from), the table in ladder
    order, excluded runs, notes."""
    lines = [f"# Ladder results: {report.context} · {report.provenance}", ""]
    if not report.has_baseline:
        lines += [f"**{NO_BASELINE_NOTE}**", ""]
    lines += [markdown.table(table_rows(report.table), left=(0, len(TABLE_HEADER) - 1)), ""]
    lines.append("Median and IQR (75th minus 25th percentile) of the step time over each run's measured "
                 "steps, warm-up left out; speedup = baseline median / rung median; "
                 "tokens/s = batch × seq_len / median step time; MFU is the median of the measured steps. "
                 f"speedup.png's whiskers: 95% bootstrap interval of the ratio of medians "
                 f"({BOOTSTRAP_RESAMPLES} resamples of each run's measured step times): the spread within one "
                 f"run, not between runs, which is larger.")
    if report.excluded:
        lines += ["", "## Excluded runs", ""]
        lines += [f"- {e.run_id} ({e.rung}): {e.reason}" for e in report.excluded]
    if report.notes:
        lines += ["", "## Notes", ""]
        lines += [f"- {n}" for n in report.notes]
    return "\n".join(lines) + "\n"


def write_summary(report: Report, path: str | os.PathLike) -> str:
    """Write render_summary(report) to path through a temporary file; return the text."""
    text = render_summary(report)
    write_atomic(path, lambda f: f.write(text.encode("utf-8")))
    return text
