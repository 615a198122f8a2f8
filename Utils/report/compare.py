"""One table and one chart across results folders: the same ladder on two machines, or from two commits.

    python -m Utils.report.compare [--out DIR] PREFIX PREFIX [PREFIX ...]
    make compare PREFIXES="a b ..." [OUT=dir]

Each folder is read and judged exactly as `make plots` judges it (Utils.results.read.load, then
Utils.report.stats.build_report): the same runs are compared, with the same medians and speedups. Across
folders each rung gets the ratio of the first folder's median step time to each other folder's, with a 95%
bootstrap interval from the two runs' measured steps, and the provenance of every folder's compared runs
(GPU, driver, libraries, commit, work, clocks, power) says what differs between them: a step time moves
with the card and its software as much as with the code.

Writes compare.md and compare.png into OUT (default: the first folder) and prints compare.md. Exit codes:
0 when both were written; 2 for bad arguments, unusable results or an unwritable OUT, with a single
"error: ..." line on stderr.
"""
import argparse
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from Utils.ladder.registry import rung_order
from Utils.report import markdown
from Utils.report.charts import PALETTE, rung_label
from Utils.report.cli import Parser
from Utils.report.figures import FOOTNOTE_SIZE, TITLE_SIZE, add_footnote, new_figure, save_figure, wrap
from Utils.report.selection import steps_by_run
from Utils.report.stats import BOOTSTRAP_RESAMPLES, Report, bootstrap_speedup, build_report, distinct, short_commit
from Utils.report.stopping import Stopped, stopped_on_the_way_out
from Utils.results.files import write_atomic
from Utils.results.read import load
from Utils.results.schema import RUN_DEFAULTS, step_timing
from Utils.results.store import ResultsError, writing

COMPARE_MD = "compare.md"
COMPARE_PNG = "compare.png"
OUTPUT_FILES = (COMPARE_MD, COMPARE_PNG)
EXAMPLE = 'e.g. make compare PREFIXES="results/h200-b16 results/h100-b16" OUT=./compare'

NOT_RUN = "not run"      # the status of a rung that a folder holds no run of
UNKNOWN = "unknown"      # a provenance value that is blank, or a column older files lack

# runs.csv columns read as text, and the name each goes by on the chart.
TEXT_KEYS = {"gpu_name": "GPU", "gpu_uuid": "UUID", "driver_version": "driver", "torch_version": "torch",
             "cuda_version": "CUDA", "cudnn_version": "cuDNN", "git_commit": "commit", "batch_size": "batch",
             "seq_len": "seq_len", "model": "model", "data": "data", "nproc": "processes",
             "parallel": "parallel", "step_timing": "step timing"}
# runs.csv columns of which the compared runs' median is shown, with its unit and chart name.
MEDIAN_KEYS = {"sm_clock_mhz_median": ("MHz", "SM clock"), "power_w_median": ("W", "power")}
PROVENANCE_KEYS = (*TEXT_KEYS, *MEDIAN_KEYS)
# Keys that change the work a step does: folders that differ in them are compared only under a warning.
WORK_KEYS = ("batch_size", "seq_len", "model", "nproc", "parallel", "step_timing")

TABLE_COLUMNS = ["run_id", "status", "median_step_ms", "speedup", "speedup_lo", "speedup_hi",
                 "ratio", "ratio_lo", "ratio_hi"]
RATIO_EXPLAINED = (f"95% bootstrap interval of the ratio of medians ({BOOTSTRAP_RESAMPLES} resamples of each "
                   f"run's measured step times): the spread within one run, not between runs, which is larger")


class CompareError(Exception):
    """Arguments that cannot make a comparison; the message is one line and names the fix."""


@dataclass
class FolderComparison:
    """Everything compare.md and compare.png show; build it with compare_folders(prefixes)."""
    prefixes: list[str]              # the folders, as given; the first is the reference of every ratio
    labels: list[str]                # a short name for each folder (the end of its path), in the same order
    rungs: list[str]                 # every rung of any folder, in ladder order
    table: pd.DataFrame              # index (rung, folder label); TABLE_COLUMNS
    provenance: list[dict[str, str]]  # per folder: PROVENANCE_KEYS -> value text (UNKNOWN when not recorded)
    differs: list[str]               # PROVENANCE_KEYS whose values are not the same in every folder
    same: list[str]                  # the other PROVENANCE_KEYS
    warnings: list[str]              # lines that must be read before the numbers (different work)
    notes: list[str]                 # lines for the notes section
    context: str                     # what was measured, for the chart's title
    reports: list[Report]            # each folder's report, as make plots builds it

    def cell(self, rung: str, label: str) -> pd.Series:
        """The table's row for `rung` in the folder labelled `label`."""
        return self.table.loc[(rung, label)]


def folder_labels(prefixes: Sequence[str]) -> list[str]:
    """The shortest ends of the folders' paths that tell them apart (after-b16 and before-b16 rather than
    runs/redesign/after-b16 ...), so that table headers and legends stay short."""
    parts = [os.path.normpath(os.path.abspath(p)).split(os.sep) for p in prefixes]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [os.path.normpath(p) for p in prefixes]


def check_prefixes(prefixes: Sequence[str]) -> None:
    """Raise CompareError unless there are two folders or more, none named twice: a folder compared with
    itself says nothing, and its label would name two columns."""
    if len(prefixes) < 2:
        raise CompareError(f"compare needs at least two results folders, got {len(prefixes)}: name them all, "
                           f"{EXAMPLE}")
    seen = {}
    for p in prefixes:
        real = os.path.realpath(p)
        if real in seen:
            raise CompareError(f"the folder {p} is named twice (as {seen[real]} too): name each folder once")
        seen[real] = p


def _text_value(runs: pd.DataFrame, key: str) -> str:
    if key == "step_timing":
        versions = runs["schema_version"] if "schema_version" in runs.columns else [None] * len(runs)
        return ", ".join(distinct(step_timing(v) for v in versions)) or UNKNOWN
    if key == "parallel":   # blank, or a file from before torchrun runs: one process, no wrapper
        values = runs[key] if key in runs.columns else [None] * len(runs)
        return ", ".join(distinct(v if isinstance(v, str) and v else "none" for v in values))
    if key not in runs.columns:
        return RUN_DEFAULTS.get(key) or UNKNOWN
    values = runs[key]
    if key == "git_commit":
        values = [short_commit(c) for c in values]
    return ", ".join(distinct(values)) or UNKNOWN


def _median_value(runs: pd.DataFrame, key: str) -> str:
    if key not in runs.columns:
        return UNKNOWN
    values = pd.to_numeric(runs[key], errors="coerce").to_numpy(dtype=float)
    values = values[np.isfinite(values)]
    return f"{np.median(values):.0f} {MEDIAN_KEYS[key][0]}" if values.size else UNKNOWN


def folder_provenance(report: Report) -> dict[str, str]:
    """PROVENANCE_KEYS -> the text of their values over the report's compared runs: every distinct value for
    the text columns (commits shortened), the median for clocks and power. A column that is absent (a file
    written before schema version 2) or blank is UNKNOWN. A folder without a compared run speaks through the
    run that set its configuration."""
    runs = report.runs
    if runs.empty and report.reference is not None:
        runs = pd.DataFrame([report.reference])
    return {key: _text_value(runs, key) if key in TEXT_KEYS else _median_value(runs, key)
            for key in PROVENANCE_KEYS}


def differences(provenance: Sequence[dict[str, str]]) -> tuple[list[str], list[str]]:
    """(keys whose values differ between folders, keys that are the same in all), in PROVENANCE_KEYS order.
    UNKNOWN is a value like any other: a key known in one folder and unknown in another is not known to be
    the same."""
    differs = [k for k in PROVENANCE_KEYS if len({p[k] for p in provenance}) > 1]
    return differs, [k for k in PROVENANCE_KEYS if k not in differs]


def work_warnings(labels: Sequence[str], provenance: Sequence[dict[str, str]]) -> list[str]:
    """One warning naming every key of WORK_KEYS in which the folders differ: their step times then measure
    different work, not only different machines or code."""
    parts = [f"{k} " + ", ".join(f"{p[k]} in {label}" for label, p in zip(labels, provenance))
             for k in WORK_KEYS if len({p[k] for p in provenance}) > 1]
    if not parts:
        return []
    return [f"warning: the folders ran different work ({'; '.join(parts)}): their step times and ratios "
            f"differ by the work as well as by the machine or the code"]


def _ok_ms(report: Report, by_run: dict, rung: str) -> "np.ndarray | None":
    """The measured step times of every run that `rung`'s row in `report` stands for (its repeats included),
    or None when it has no ok run with a median there."""
    if rung not in report.table.index:
        return None
    row = report.table.loc[rung]
    if row["status"] != "ok" or not np.isfinite(row["median_step_ms"]):
        return None
    return report.measured_ms[rung]


def _row(report: Report, rung: str, ms: "np.ndarray | None", ref_ms: "np.ndarray | None", reference: bool,
         ref_median: "float | None" = None) -> dict:
    """One (rung, folder) row of the table: numbers only where the rung has an ok run in this folder (and,
    for the ratio, in the first folder too); the status otherwise."""
    row = dict.fromkeys(TABLE_COLUMNS, np.nan)
    if rung not in report.table.index:
        row.update(run_id="", status=NOT_RUN)
        return row
    t = report.table.loc[rung]
    row.update(run_id=t["run_id"], status=t["status"])
    if ms is None:
        return row
    row.update({c: t[c] for c in ("median_step_ms", "speedup", "speedup_lo", "speedup_hi")})
    if reference:
        row.update(ratio=1.0, ratio_lo=1.0, ratio_hi=1.0)
    elif ref_ms is not None and ref_median is not None and np.isfinite(ref_median):
        row["ratio"] = ref_median / float(t["median_step_ms"])   # the medians the table shows
        row["ratio_lo"], row["ratio_hi"] = bootstrap_speedup(ref_ms, ms)
    return row


def _table(reports: Sequence[Report], labels: Sequence[str], rungs: Sequence[str]) -> pd.DataFrame:
    """FolderComparison.table: a row per rung per folder, the folders of a rung together, in ladder order."""
    by_runs = [steps_by_run(r.steps) for r in reports]
    rows, index = [], []
    for rung in rungs:
        ms = [_ok_ms(r, b, rung) for r, b in zip(reports, by_runs)]
        ref_median = float(reports[0].table.at[rung, "median_step_ms"]) if ms[0] is not None else None
        for i, (report, label) in enumerate(zip(reports, labels)):
            rows.append(_row(report, rung, ms[i], ms[0], reference=i == 0, ref_median=ref_median))
            index.append((rung, label))
    table = pd.DataFrame(rows, columns=TABLE_COLUMNS,
                         index=pd.MultiIndex.from_tuples(index, names=["optimization", "folder"]))
    for col in TABLE_COLUMNS[2:]:
        table[col] = table[col].astype(float)
    return table


def _notes(reports: Sequence[Report], labels: Sequence[str], prefixes: Sequence[str]) -> list[str]:
    """Each folder's own notes (why a rung is not ok, what ran instead), its missing baseline and the runs it
    left out, each line naming the folder."""
    notes = []
    for report, label, prefix in zip(reports, labels, prefixes):
        if not report.has_baseline:
            notes.append(f"{label}: no ok baseline run: its speedups are left out")
        if report.excluded:
            notes.append(f"{label}: {len(report.excluded)} run(s) left out (another configuration, or unusable "
                         f"step times): make plots PREFIX={prefix} lists them in summary.md")
        notes += [f"{label}: {n}" for n in report.notes]
    return notes


def _context(reports: Sequence[Report], labels: Sequence[str]) -> str:
    contexts = list(dict.fromkeys(r.context for r in reports))
    if len(contexts) == 1:
        return contexts[0]
    return "; ".join(f"{label}: {r.context or UNKNOWN}" for label, r in zip(labels, reports))


def compare_folders(prefixes: Sequence[str]) -> FolderComparison:
    """Read every folder as make plots does and compare them rung by rung (see the module's docstring).
    Raises CompareError for fewer than two folders or one named twice, ResultsError for a folder whose
    results are missing, foreign or damaged."""
    prefixes = [str(p) for p in prefixes]
    check_prefixes(prefixes)
    reports = [build_report(*load(p)) for p in prefixes]
    labels = folder_labels(prefixes)
    rungs = rung_order({r for report in reports for r in report.table.index})
    provenance = [folder_provenance(r) for r in reports]
    differs, same = differences(provenance)
    return FolderComparison(prefixes=prefixes, labels=labels, rungs=rungs, table=_table(reports, labels, rungs),
                      provenance=provenance, differs=differs, same=same,
                      warnings=work_warnings(labels, provenance), notes=_notes(reports, labels, prefixes),
                      context=_context(reports, labels), reports=reports)


# ---------------------------------------------------------------------------------------------------------
# compare.md


def _ratio_cell(r: pd.Series) -> str:
    if not math.isfinite(r["ratio"]):
        return "-"
    return f"{r['ratio']:.2f}x [{r['ratio_lo']:.2f}, {r['ratio_hi']:.2f}]"


def table_rows(c: FolderComparison) -> list[list[str]]:
    """The comparison as compare.md's table, header first: per folder its median and speedup (its status
    where it has no ok run of the rung), and for every folder after the first the ratio to the first."""
    ref = c.labels[0]
    header = ["rung"]
    for i, label in enumerate(c.labels):
        header += [f"{label} ms", f"{label} speedup"] + ([f"{label} vs {ref}"] if i else [])
    rows = [header]
    for rung in c.rungs:
        row = [rung]
        for i, label in enumerate(c.labels):
            r = c.cell(rung, label)
            ms = markdown.cell(r["median_step_ms"], ".1f") if math.isfinite(r["median_step_ms"]) else r["status"]
            row += [ms, markdown.cell(r["speedup"], ".2f", "x")] + ([_ratio_cell(r)] if i else [])
        rows.append(row)
    return rows


def _provenance_rows(c: FolderComparison, keys: Sequence[str]) -> list[list[str]]:
    return [["key", *c.labels]] + [[k, *(p[k] for p in c.provenance)] for k in keys]


def render_compare(c: FolderComparison) -> str:
    """compare.md's text: the folders, any warning, the table, how its numbers were made, what differs
    between the folders and what does not, the notes."""
    ref = c.labels[0]
    lines = [f"# Comparison: {' vs '.join(c.labels)}", ""]
    if c.context:
        lines += [c.context, ""]
    lines += [f"- {label}: {prefix}" for label, prefix in zip(c.labels, c.prefixes)] + [""]
    lines += [f"**{w}**" for w in c.warnings] + ([""] if c.warnings else [])
    lines += [markdown.table(table_rows(c)), ""]
    lines.append(f"Each folder's runs are chosen and summarized as make plots does (its summary.md): median step "
                 f"time over the measured steps, warm-up left out, and speedup over that folder's own baseline. "
                 f"X vs {ref}: {ref}'s median step time / X's (above 1x: X is faster), with its {RATIO_EXPLAINED}. "
                 f"A rung without an ok run in a folder shows its status there ({NOT_RUN}: the folder holds no "
                 f"run of it), and no ratio.")
    lines += ["", "## What differs", ""]
    if c.differs:
        lines += [markdown.table(_provenance_rows(c, c.differs), left=range(len(c.labels) + 1)), ""]
    else:
        lines += ["Nothing recorded differs between the folders.", ""]
    same = [f"{k} {c.provenance[0][k]}" for k in c.same if c.provenance[0][k] != UNKNOWN]
    nowhere = [k for k in c.same if c.provenance[0][k] == UNKNOWN]
    lines.append(f"The same in every folder: {'; '.join(same) if same else 'nothing'}."
                 + (f" Recorded in no folder: {', '.join(nowhere)}." if nowhere else "")
                 + f" {UNKNOWN}: not recorded (blank, or a column that results written before schema version 2 "
                   f"lack); clocks and power are the median over the compared runs.")
    if c.notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in c.notes]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------
# compare.png


def _folder_colors(n: int) -> list[str]:
    return [PALETTE[i % len(PALETTE)] for i in range(n)]


def _offsets(n: int, group: float = 0.8) -> tuple[list[float], float]:
    """Where each of n bars sits around its rung's line, and their height, so that a rung's bars fill
    `group` of the space between rungs."""
    h = group / max(n, 1)
    return [(i - (n - 1) / 2) * h for i in range(n)], h


def _missing_label(ax, y: float, text: str) -> None:
    ax.text(0.01, y, text, transform=ax.get_yaxis_transform(), va="center", fontsize=8, color="#777777",
            style="italic")


def _rung_axis(ax, rungs: Sequence[str]) -> None:
    ax.set_yticks(range(len(rungs)), [rung_label(r) for r in rungs])
    ax.set_ylim(len(rungs) - 0.5, -0.5)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)


def _plot_ms(ax, c: FolderComparison, colors: Sequence[str]) -> None:
    offsets, h = _offsets(len(c.labels))
    top = np.nanmax(c.table["median_step_ms"].to_numpy()) if c.table["median_step_ms"].notna().any() else 1.0
    for y, rung in enumerate(c.rungs):
        for label, dy, color in zip(c.labels, offsets, colors):
            r = c.cell(rung, label)
            if not math.isfinite(r["median_step_ms"]):
                _missing_label(ax, y + dy, f"{label}: {r['status']}")
                continue
            ax.barh(y + dy, r["median_step_ms"], height=h * 0.92, color=color)
            ax.text(r["median_step_ms"], y + dy, f" {r['median_step_ms']:.1f}", va="center", fontsize=8)
    ax.set_xlim(0, top * 1.2)
    _rung_axis(ax, c.rungs)
    ax.set_xlabel("median step time (ms), measured steps only (lower is better)", fontsize=9)


def _no_ratio(c: FolderComparison, rung: str, label: str) -> str:
    own = c.cell(rung, label)["status"]
    ref = c.cell(rung, c.labels[0])["status"]
    return f"{label}: {own}" if own != "ok" else f"{label}: no ratio ({c.labels[0]}: {ref})"


def _plot_ratio(ax, c: FolderComparison, colors: Sequence[str]) -> None:
    others = list(zip(c.labels[1:], colors[1:]))
    offsets, h = _offsets(len(others))
    x_max = 1.0
    for y, rung in enumerate(c.rungs):
        for (label, color), dy in zip(others, offsets):
            r = c.cell(rung, label)
            if not math.isfinite(r["ratio"]):
                _missing_label(ax, y + dy, _no_ratio(c, rung, label))
                continue
            s, lo, hi = r["ratio"], r["ratio_lo"], r["ratio_hi"]
            ax.barh(y + dy, s, height=h * 0.92, color=color, xerr=[[max(s - lo, 0)], [max(hi - s, 0)]],
                    error_kw={"capsize": 2, "lw": 1})
            ax.text(max(hi, s), y + dy, f"  {s:.2f}x", va="center", fontsize=8, fontweight="bold")
            x_max = max(x_max, hi, s)
    ax.axvline(1.0, color="black", lw=1, ls="--")
    ax.text(1.0, 1.0, f"1x = {c.labels[0]}", transform=ax.get_xaxis_transform(), ha="center", va="bottom",
            fontsize=8)
    ax.set_xlim(0, x_max * 1.25)
    _rung_axis(ax, c.rungs)
    ax.set_xlabel(f"{c.labels[0]}'s median step time / the folder's (higher: faster than {c.labels[0]})",
                  fontsize=9)


def provenance_line(label: str, prefix: str, provenance: dict[str, str]) -> str:
    """One folder's provenance for the chart's foot: "A = path: GPU ... · commit ... · power ..."."""
    names = {**TEXT_KEYS, **{k: name for k, (_, name) in MEDIAN_KEYS.items()}}
    return f"{label} = {prefix}: " + " · ".join(f"{names[k]} {provenance[k]}" for k in PROVENANCE_KEYS)


def _footnote_height(fig: Figure, paragraphs: Sequence[str]) -> float:
    """Inches the wrapped footnote takes, so that the figure grows by it instead of squeezing the plots."""
    lines = sum(wrap(p, fig, FOOTNOTE_SIZE).count("\n") + 1 for p in paragraphs if p)
    return lines * FOOTNOTE_SIZE * 1.4 / 72 + 0.1


def plot_compare(c: FolderComparison) -> Figure:
    """Two panels sharing the rungs: each folder's median step time, and each later folder's ratio to the
    first with its bootstrap whiskers; the folders' provenance at the foot."""
    title = f"Across folders: {' vs '.join(c.labels)}"
    plot_height = 1.6 + 0.32 * max(len(c.rungs), 1) * max(len(c.labels), 2)
    fig = new_figure(title, c.context, plot_height, width=13.0)
    foot = [f"Whiskers: {RATIO_EXPLAINED}."] + [provenance_line(label, prefix, p)
                                                for label, prefix, p in zip(c.labels, c.prefixes, c.provenance)]
    foot += c.warnings
    title_height = (fig.get_suptitle().count("\n") + 1) * TITLE_SIZE * 1.4 / 72
    fig.set_figheight(plot_height + title_height + _footnote_height(fig, foot) + 0.4)
    ax_ms, ax_ratio = fig.subplots(1, 2, sharey=True)
    colors = _folder_colors(len(c.labels))
    _plot_ms(ax_ms, c, colors)
    _plot_ratio(ax_ratio, c, colors)
    # Above the step-time panel, where constrained layout leaves it room and no bar can fall under it.
    ax_ms.legend(handles=[Patch(facecolor=col, label=label) for label, col in zip(c.labels, colors)],
                 loc="lower left", bbox_to_anchor=(0, 1.01), borderaxespad=0, ncols=min(len(c.labels), 3),
                 fontsize=9, frameon=False)
    add_footnote(fig, *foot)
    return fig


# ---------------------------------------------------------------------------------------------------------
# Writing, and the command line


def write_compare(comparison: FolderComparison, out_dir: str | os.PathLike) -> str:
    """Write compare.png and compare.md into out_dir (made if absent), each through a temporary file so that
    neither is ever half-written; the chart first, so that a chart that cannot be drawn or written leaves
    both files as they were. Returns compare.md's text.
    Raises OSError when out_dir cannot be written."""
    text = render_compare(comparison)
    fig = plot_compare(comparison)
    os.makedirs(out_dir, exist_ok=True)
    with writing(out_dir):
        save_figure(fig, os.path.join(out_dir, COMPARE_PNG))
        write_atomic(os.path.join(out_dir, COMPARE_MD), lambda f: f.write(text.encode("utf-8")))
    return text


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m Utils.report.compare",
                description="One table (compare.md) and one chart (compare.png) across results folders.")
    p.add_argument("--out", help="folder to write compare.md and compare.png into (default: the first PREFIX)")
    p.add_argument("prefixes", nargs="+", metavar="PREFIX",
                   help="results folders (each with results.csv and runs.csv); the first is the reference")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; returns the exit code (0 written, 2 bad arguments, input or OUT, 128 + n where
    signal n stopped it: compare.md and compare.png then whole, the old ones or the new)."""
    args = _parser().parse_or_status(argv)
    if isinstance(args, int):
        return args
    out = args.prefixes[0] if args.out is None else args.out
    try:
        if not out.strip():
            raise CompareError(f"OUT is empty: name the folder to write compare.md into, or leave OUT out to "
                               f"write into the first folder ({EXAMPLE})")
        with stopped_on_the_way_out():
            comparison = compare_folders(args.prefixes)
            text = write_compare(comparison, out)
    except Stopped as e:
        return e.exit_status
    except (CompareError, ResultsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot write into OUT={out} ({e.strerror or e}): choose a folder you can write to "
              f"(--out DIR; make compare OUT=dir)", file=sys.stderr)
        return 2
    print(text, end="")
    print(f"wrote {', '.join(OUTPUT_FILES)} into {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
