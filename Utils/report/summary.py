"""summary.md: the ladder table in ladder order, how its numbers were made, the runs left out, the notes."""
import os

import pandas as pd

from Utils.report import markdown
from Utils.report.stats import BOOTSTRAP_RESAMPLES, NO_BASELINE_NOTE, NOISY_IQR, TRIM, Report
from Utils.results.files import write_atomic
from Utils.results.gpus import gpu_spec

SUMMARY_FILE = "summary.md"
TABLE_HEADER = ["rung", "runs", "median ms", "IQR ms", "trimmed mean ms", "spread", "noisy", "speedup", "tokens/s",
                "MFU", "MFU of measured peak", "peak alloc GiB", "peak reserved GiB", "compile s", "cache",
                "final loss", "status"]


def table_rows(table: pd.DataFrame) -> list[list[str]]:
    """summarize()'s frame as the text cells of summary.md's table, header first."""
    rows = [TABLE_HEADER]
    for rung, r in table.iterrows():
        rows.append([rung, markdown.cell(r["runs"], ".0f"), markdown.cell(r["median_step_ms"], ".1f"),
                     markdown.cell(r["iqr_step_ms"], ".1f"), markdown.cell(r["trimmed_mean_ms"], ".1f"),
                     markdown.cell(100 * r["spread"], ".1f", "%"), "yes" if r["noisy"] == 1 else "-",
                     markdown.cell(r["speedup"], ".2f", "x"), markdown.cell(r["tokens_per_s"], ",.0f"),
                     markdown.cell(100 * r["mfu"], ".1f", "%"), markdown.cell(100 * r["mfu_measured"], ".1f", "%"),
                     markdown.cell(r["peak_mem_allocated_gib"], ".1f"), markdown.cell(r["peak_mem_reserved_gib"], ".1f"),
                     markdown.cell(r["compile_s"], ".1f"), r["compile_cache"] or "-",
                     markdown.cell(r["final_loss"], ".3f"), r["status"]])
    return rows


def mfu_text(report: Report) -> str:
    """What the two MFU columns divide by."""
    ref = report.reference
    spec = gpu_spec(str(ref["gpu_name"])) if ref is not None else None
    text = (f"MFU divides the model's FLOPs (6N + attention, per token) at the median step time by the "
            f"datasheet's dense bf16 peak ({spec.bf16 / 1e12:,.0f} TFLOP/s, {spec.source})" if spec else
            "MFU divides the model's FLOPs (6N + attention, per token) at the median step time by the GPU's "
            "datasheet dense bf16 peak (none known for this device)")
    if report.peak is not None:
        p = report.peak
        text += (f"; MFU of measured peak by the {p['matmul_tflops']:,.0f} TFLOP/s that a "
                 f"{p['matmul_n']:.0f}-square bf16 matmul reached on this machine (make peak, "
                 f"{str(p['measured_at'])[:10]})")
    else:
        text += "; MFU of measured peak needs `make peak PREFIX=...` on this machine"
    return text + "."


def render_summary(report: Report) -> str:
    """summary.md's text: heading (what was measured, and where the figures come from), the table in ladder
    order, excluded runs, notes."""
    lines = [f"# Ladder results: {report.context} · {report.provenance}", ""]
    if not report.has_baseline:
        lines += [f"**{NO_BASELINE_NOTE}**", ""]
    lines += [markdown.table(table_rows(report.table), left=(0, len(TABLE_HEADER) - 1)), ""]
    lines.append("A step's time runs from the previous step's end to its own end on the device, so that the "
                 "measured steps add up to the wall clock. Median and IQR (75th minus 25th percentile) of the "
                 "step time over each run's measured steps, warm-up left out; a rung run several times from one "
                 "commit (REPEAT=n) shows the median of its runs' medians, the spread between those medians "
                 f"((max - min) / median) and the mean of all its steps without the {TRIM:.0%} at each end. "
                 f"noisy: a run's IQR is over {NOISY_IQR:.0%} of its median. "
                 "speedup = baseline median / rung median; tokens/s = batch × seq_len / median step time. "
                 f"{mfu_text(report)} speedup.png's whiskers: 95% bootstrap interval of the ratio of medians "
                 f"({BOOTSTRAP_RESAMPLES} resamples of the measured step times): the spread within runs, not "
                 f"between them, which the spread column shows.")
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
