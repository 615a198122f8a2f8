"""Charts and a summary table for the ladder runs recorded under one PREFIX.

    python plot_results.py --prefix DIR        (or: make plots PREFIX=DIR)

reads DIR/results.csv (a row per step) and DIR/runs.csv (a row per run) and writes into DIR:
speedup.png, step_time.png, throughput.png, memory.png, loss.png and summary.md; the summary is
printed to the terminal too.

Which runs are compared: the baseline's latest ok run sets the configuration (batch size, sequence
length, model, data, device, GPU); each rung is represented by its latest ok run with that
configuration. Runs that do not match, or whose step times are NaN or not positive, are left out
and listed in summary.md. A rung without such a run keeps its table row with the status of its
latest run, and gets no bar. A rung run several times from one commit (`make max` three times, say) gets
a note with each run's median and the median of those, since runs differ more than steps within one.

Median and IQR are recomputed here from the measured (non-warm-up) step times in results.csv, so
that the table and the charts rest on the same numbers; runs.csv supplies status, memory, compile
time and the environment.

For a notebook: `steps, runs = load(prefix)`, then `summarize(steps, runs)` for the table as a
DataFrame, or `build_report(steps, runs)` and the plot_* functions for the figures.

Exit codes: 0 when everything was written; 2 for bad arguments, unusable input or an unwritable
PREFIX, with a single "error: ..." line on stderr.
"""
import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter

from Utils.report import markdown
from Utils.results.files import write_atomic
from Utils.ladder.registry import LADDER, rung_order
from Utils.results.store import RUN_COLUMNS, RUNS_FILE, STEP_COLUMNS, STEPS_FILE, ResultsError, check_file

# pyplot is never imported: figures are plain Figure objects rendered by Agg on savefig, so the
# script needs no display and importing it from a notebook leaves the notebook's backend alone.

BASELINE = "baseline"
MATCH_KEYS = ("batch_size", "seq_len", "model", "data", "device", "gpu_name")
# A rung with no comparable run shows the status of its latest run with these settings on any GPU,
# so that an OOM or a skip recorded on another machine is reported rather than silently dropped.
STATUS_KEYS = ("batch_size", "seq_len", "model", "data", "device")
KEY_LABELS = {"batch_size": "batch", "seq_len": "seq_len", "model": "model", "data": "data",
              "device": "device", "gpu_name": "gpu"}

STEP_NUMERIC = ["step", "warmup", "step_ms", "tokens_per_s", "loss", "mfu"]
RUN_NUMERIC = ["steps", "warmup_steps", "batch_size", "seq_len", "n_params", "compile_s",
               "peak_mem_allocated_gib", "peak_mem_reserved_gib", "median_step_ms", "iqr_step_ms",
               "median_tokens_per_s", "mfu", "final_loss"]

BOOTSTRAP_RESAMPLES = 1000
BOOTSTRAP_SEED = 0
LOG_SCALE_SPAN = 10.0
NO_BASELINE_NOTE = "no ok baseline run: speedups left out"
OUTPUT_FILES = ("speedup.png", "step_time.png", "throughput.png", "memory.png", "loss.png", "summary.md")
DPI = 120

SUMMARY_COLUMNS = ["run_id", "status", "message", "median_step_ms", "iqr_step_ms", "speedup",
                   "speedup_lo", "speedup_hi", "tokens_per_s", "mfu", "peak_mem_allocated_gib",
                   "peak_mem_reserved_gib", "compile_s", "final_loss", "measured_steps"]


class Excluded(NamedTuple):
    """A run left out of the comparison, and why (e.g. "batch 8 != 16")."""
    run_id: str
    rung: str
    reason: str


# ---------------------------------------------------------------------------------------------
# Loading


def _first_run_hint(prefix):
    return f"run a rung first, e.g. make baseline STEPS=20 BATCH_SIZE=8 PREFIX={prefix}"


def load(prefix):
    """Read PREFIX/results.csv and PREFIX/runs.csv and return (steps_df, runs_df).

    steps_df: a row per step with STEP_COLUMNS; run_id and optimization are str, and step, warmup,
    step_ms, tokens_per_s, loss, mfu are floats (a blank cell is NaN).
    runs_df: a row per run with RUN_COLUMNS in file order, oldest first (rows are appended as runs
    end, so the last row is the newest); the columns in RUN_NUMERIC are floats (blank -> NaN), the
    others str ('' when blank). The index is 0..n-1 in that order.

    Raises ResultsError, whose message is one line naming the file and the fix, when a file is
    missing, empty, cut off mid-row, has a foreign header, or no run is recorded. Step rows are not
    judged here: NaN or non-positive step times are the business of select_runs.
    """
    steps_path = os.path.join(prefix, STEPS_FILE)
    runs_path = os.path.join(prefix, RUNS_FILE)
    if os.path.exists(prefix) and not os.path.isdir(prefix):
        raise ResultsError(f"PREFIX={prefix} is a file, not a folder: pass the folder the runs wrote into")
    if not os.path.isfile(steps_path):
        raise ResultsError(f"{steps_path} not found: {_first_run_hint(prefix)}")
    if os.path.getsize(steps_path) == 0:
        raise ResultsError(f"{steps_path} is empty: {_first_run_hint(prefix)}")
    check_file(steps_path, STEP_COLUMNS)
    if not os.path.isfile(runs_path):
        raise ResultsError(f"{runs_path} not found: each run records itself there when it ends; "
                           f"{_first_run_hint(prefix)}")
    check_file(runs_path, RUN_COLUMNS)
    steps = _read_csv(steps_path, STEP_NUMERIC)
    runs = _read_csv(runs_path, RUN_NUMERIC)
    if runs.empty:
        raise ResultsError(f"{runs_path} records no runs: {_first_run_hint(prefix)}")
    return steps, runs


def _read_csv(path, numeric):
    try:
        df = pd.read_csv(path, dtype=str, keep_default_na=False, na_filter=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise ResultsError(f"{path} is not a readable CSV ({str(e).splitlines()[0]}): move it aside")
    for col in numeric:
        text = df[col].str.strip()
        values = pd.to_numeric(text, errors="coerce")
        bad = values.isna() & ~text.isin(["", "nan", "NaN"])
        if bad.any():
            line = int(bad.idxmax()) + 2   # the header is line 1
            raise ResultsError(f"{path} line {line}: {col}={text[bad].iloc[0]!r} is not a number: the file is "
                               f"damaged; move it aside or repair that line")
        df[col] = values.astype(float)
    return df.reset_index(drop=True)


# ---------------------------------------------------------------------------------------------
# Choosing the runs to compare


def _norm(value):
    """Cells as comparable text: 16, 16.0 and "16" are the same batch size."""
    if isinstance(value, float):
        if np.isnan(value):
            return ""
        return str(int(value)) if value.is_integer() else repr(value)
    return str(value).strip()


def _mismatches(run, ref, keys):
    return [f"{KEY_LABELS[k]} {_norm(run[k]) or '(blank)'} != {_norm(ref[k]) or '(blank)'}"
            for k in keys if _norm(run[k]) != _norm(ref[k])]


def _measured(run_steps):
    return run_steps[run_steps["warmup"] != 1]


def _step_problem(run_steps):
    """Why this run's step times cannot be compared, or None when they can."""
    if run_steps.empty:
        return "no step rows in results.csv"
    ms = run_steps["step_ms"].to_numpy()
    problems = []
    n_nan = int((~np.isfinite(ms)).sum())
    n_bad = int((np.isfinite(ms) & (ms <= 0)).sum())
    if n_nan:
        problems.append(f"{n_nan} NaN or missing step_ms")
    if n_bad:
        problems.append(f"{n_bad} non-positive step_ms")
    if not problems and _measured(run_steps).empty:
        problems.append("no measured steps (all are warm-up)")
    return "; ".join(problems) or None


@dataclass
class _Selection:
    reference: "pd.Series | None"
    has_baseline: bool
    chosen: dict                      # rung -> runs_df row
    excluded: list                    # [Excluded]
    status_rows: dict                 # rung -> runs_df row shown for a rung with nothing chosen
    superseded: int = 0
    newer_not_ok: list = field(default_factory=list)   # runs_df rows that ended badly after the chosen one
    repeats: dict = field(default_factory=dict)        # rung -> runs_df rows of its ok runs from the chosen
                                                       # run's commit, when there are several


def _select(runs_df, steps_df):
    by_run = {rid: g.sort_values("step") for rid, g in steps_df.groupby("run_id", sort=False)} \
        if steps_df is not None else None
    empty = pd.DataFrame(columns=STEP_COLUMNS)
    problems = {}
    if by_run is not None:
        for i, run in runs_df.iterrows():
            if run["status"] == "ok":
                problem = _step_problem(by_run.get(run["run_id"], empty))
                if problem:
                    problems[i] = problem
    usable = [i for i, run in runs_df.iterrows() if run["status"] == "ok" and i not in problems]
    baselines = [i for i in usable if runs_df.at[i, "optimization"] == BASELINE]
    if baselines:
        reference, has_baseline = runs_df.loc[baselines[-1]], True
    elif usable:
        reference, has_baseline = runs_df.loc[usable[-1]], False
    elif len(runs_df):
        reference, has_baseline = runs_df.iloc[-1], False
    else:
        return _Selection(None, False, {}, [], {})

    excluded, mismatched = [], set()
    for i, run in runs_df.iterrows():
        reasons = _mismatches(run, reference, MATCH_KEYS)
        if reasons:
            mismatched.add(i)
        if i in problems:
            reasons.insert(0, problems[i])
        if reasons:
            excluded.append(Excluded(run["run_id"], run["optimization"], "; ".join(reasons)))

    chosen, status_rows, superseded, newer_not_ok, repeats = {}, {}, 0, [], {}
    for rung in rung_order(runs_df["optimization"]):
        rows = runs_df[runs_df["optimization"] == rung]
        candidates = [i for i in rows.index if i in usable and i not in mismatched]
        if candidates:
            chosen[rung] = runs_df.loc[candidates[-1]]
            superseded += len(candidates) - 1
            # One commit names one tree, unless the tree had uncommitted changes ("-dirty"), which may differ.
            commit = str(runs_df.at[candidates[-1], "git_commit"]).strip()
            known = commit not in ("", "nan") and not commit.endswith("-dirty")
            same_code = [i for i in candidates if known and str(runs_df.at[i, "git_commit"]).strip() == commit]
            if len(same_code) > 1:
                repeats[rung] = [runs_df.loc[i] for i in same_code]
            newer_not_ok += [runs_df.loc[i] for i in rows.index
                             if i > candidates[-1] and runs_df.at[i, "status"] != "ok"
                             and not _mismatches(runs_df.loc[i], reference, STATUS_KEYS)]
            continue
        same_kind = [i for i in rows.index if not _mismatches(runs_df.loc[i], reference, STATUS_KEYS)]
        if same_kind:
            status_rows[rung] = runs_df.loc[same_kind[-1]]
        else:
            status_rows[rung] = None
    return _Selection(reference, has_baseline, chosen, excluded, status_rows, superseded, newer_not_ok, repeats)


def select_runs(runs_df, steps_df=None):
    """Choose the run that represents each rung; return (chosen, excluded).

    chosen: {rung id: runs_df row (a Series)} holding, for each rung that has one, its latest ok run
    whose batch_size, seq_len, model, data, device and gpu_name equal those of the baseline's latest
    ok run. Without an ok baseline the latest ok run overall sets that configuration (the latest run
    of any status when none is ok). excluded: [Excluded(run_id, rung, reason)] for every run whose
    configuration differs (reason like "batch 8 != 16") and, when steps_df is given, every ok run
    whose step times are NaN, not positive, or absent; such runs are never chosen.
    """
    sel = _select(runs_df, steps_df)
    return sel.chosen, sel.excluded


# ---------------------------------------------------------------------------------------------
# The numbers


def bootstrap_speedup(base_ms, rung_ms, resamples=BOOTSTRAP_RESAMPLES, seed=BOOTSTRAP_SEED):
    """95% bootstrap interval (2.5th, 97.5th percentile) of median(base_ms) / median(rung_ms)."""
    rng = np.random.default_rng(seed)
    base = np.asarray(base_ms, dtype=float)
    rung = np.asarray(rung_ms, dtype=float)
    base_medians = np.median(rng.choice(base, size=(resamples, base.size)), axis=1)
    rung_medians = np.median(rng.choice(rung, size=(resamples, rung.size)), axis=1)
    lo, hi = np.percentile(base_medians / rung_medians, [2.5, 97.5])
    return float(lo), float(hi)


@dataclass
class Report:
    """Everything the summary and the charts show; build it with build_report(steps_df, runs_df)."""
    table: pd.DataFrame          # summarize()'s frame
    steps: pd.DataFrame          # step rows of the compared runs, sorted by rung then step
    runs: pd.DataFrame           # runs.csv rows of the compared runs, in ladder order
    reference: "pd.Series | None"   # the run whose configuration the compared runs share
    has_baseline: bool
    excluded: list               # [Excluded]
    notes: list                  # lines for the notes section
    context: str                 # GPU, model, batch, seq_len, data: goes on every chart

    def rungs_with_steps(self):
        return [r for r in self.table.index if np.isfinite(self.table.at[r, "median_step_ms"])]


def build_report(steps_df, runs_df):
    """Select the runs (see select_runs) and compute the table, notes and captions from load()'s frames."""
    sel = _select(runs_df, steps_df)
    by_run = {rid: g.sort_values("step") for rid, g in steps_df.groupby("run_id", sort=False)}
    base_run = sel.chosen.get(BASELINE) if sel.has_baseline else None
    base_ms = _measured(by_run[base_run["run_id"]])["step_ms"].to_numpy() if base_run is not None else None

    rows, step_frames, notes = {}, [], []
    for rung in rung_order(runs_df["optimization"]):
        row = dict.fromkeys(SUMMARY_COLUMNS, np.nan)
        run = sel.chosen.get(rung)
        if run is not None:
            run_steps = by_run[run["run_id"]]
            ms = _measured(run_steps)["step_ms"].to_numpy()
            q25, median, q75 = np.percentile(ms, [25, 50, 75])
            row.update(run_id=run["run_id"], status=run["status"], message=run["message"],
                       median_step_ms=median, iqr_step_ms=q75 - q25, measured_steps=ms.size,
                       tokens_per_s=run["batch_size"] * run["seq_len"] / (median / 1000.0),
                       peak_mem_allocated_gib=run["peak_mem_allocated_gib"],
                       peak_mem_reserved_gib=run["peak_mem_reserved_gib"], compile_s=run["compile_s"])
            mfu = _measured(run_steps)["mfu"].dropna()
            row["mfu"] = float(mfu.median()) if len(mfu) else np.nan
            losses = run_steps["loss"].dropna()
            row["final_loss"] = float(losses.iloc[-1]) if len(losses) else run["final_loss"]
            if base_ms is not None:
                row["speedup"] = float(np.median(base_ms) / median)
                row["speedup_lo"], row["speedup_hi"] = bootstrap_speedup(base_ms, ms)
            step_frames.append(run_steps.assign(optimization=rung))
            if run["notes"].strip():
                notes.append(f"{rung}: {_one_line(run['notes'])}")
        else:
            shown = sel.status_rows.get(rung)
            if shown is None:
                row.update(run_id="", status="excluded",
                           message="no run with the compared configuration (see excluded runs)")
            else:
                left_out = next((e.reason for e in sel.excluded if e.run_id == shown["run_id"]), "")
                if shown["status"] == "ok":
                    row.update(run_id=shown["run_id"], status="excluded", message=left_out)
                else:
                    message = _one_line(shown["message"]) + (f" ({left_out})" if left_out else "")
                    row.update(run_id=shown["run_id"], status=shown["status"], message=message.strip())
            notes.append(f"{rung} ({row['status']}): {_one_line(row['message']) or 'no message recorded'}")
        rows[rung] = row
    for run in sel.newer_not_ok:
        notes.append(f"{run['optimization']}: a later run, {run['run_id']}, ended {run['status']}"
                     f"{': ' + _one_line(run['message']) if run['message'].strip() else ''}; "
                     f"the table shows the earlier ok run")
    if sel.superseded:
        notes.append(f"{sel.superseded} older ok run(s) of the same configuration were superseded "
                     f"by a later run of their rung")
    notes += _repeat_notes(sel.repeats, by_run, base_ms)

    table = pd.DataFrame.from_dict(rows, orient="index", columns=SUMMARY_COLUMNS)
    table.index.name = "optimization"
    for col in SUMMARY_COLUMNS:
        if col not in ("run_id", "status", "message"):
            table[col] = table[col].astype(float)
    steps = pd.concat(step_frames, ignore_index=True) if step_frames else steps_df.iloc[0:0]
    compared = pd.DataFrame([sel.chosen[r] for r in table.index if r in sel.chosen], columns=runs_df.columns)
    return Report(table=table, steps=steps, runs=compared, reference=sel.reference, has_baseline=sel.has_baseline,
                  excluded=sel.excluded, notes=notes, context=_context(sel.reference))


def summarize(steps_df, runs_df):
    """The summary table as a DataFrame: a row per rung present in runs_df, in ladder order.

    Index: rung id ("optimization"). Columns: run_id, status, message (str); median_step_ms and
    iqr_step_ms (75th minus 25th percentile, numpy's linear interpolation) over the chosen run's
    measured steps in results.csv; speedup (baseline median / this median; NaN without an ok
    baseline) with speedup_lo/speedup_hi (95% bootstrap interval); tokens_per_s (batch_size *
    seq_len / median step seconds); mfu (fraction, median of the measured steps; NaN when unknown);
    peak_mem_allocated_gib, peak_mem_reserved_gib, compile_s (from runs.csv); final_loss (last
    step's loss); measured_steps. A rung with no comparable run has NaN numbers and the status of
    its latest run ("excluded" when its runs were left out). Takes the frames load() returns.
    """
    return build_report(steps_df, runs_df).table


def _repeat_notes(repeats, by_run, base_ms):
    """One line per rung run several times from one commit: each run's median step time, and the median
    of those medians, so that a rung is not judged on one run where runs differ (a GPU at its power
    limit moves them by a few percent). Speedups divide the baseline's median of medians where it was
    repeated too, else its latest run's median (the table's)."""
    def medians(runs):
        return [float(np.median(_measured(by_run[r["run_id"]])["step_ms"])) for r in runs]

    base = None
    if BASELINE in repeats:
        base = float(np.median(medians(repeats[BASELINE])))
    elif base_ms is not None:
        base = float(np.median(base_ms))
    notes = []
    for rung, runs in repeats.items():
        each = medians(runs)
        middle = float(np.median(each))
        speedup = f", {base / middle:.2f}x" if base is not None and rung != BASELINE else ""
        notes.append(f"{rung}: {len(runs)} ok runs of this configuration from commit "
                     f"{str(runs[-1]['git_commit']).strip()}, median step times "
                     f"{', '.join(f'{m:.1f}' for m in each)} ms, oldest first (their median {middle:.1f} ms"
                     f"{speedup}); the table shows the latest")
    return notes


def _one_line(text):
    return " ".join(str(text).split())


def _context(ref):
    if ref is None:
        return ""
    gpu = "CPU" if _norm(ref["device"]) == "cpu" else (_norm(ref["gpu_name"]) or "unknown GPU")
    model = _norm(ref["model"]) or "unknown model"
    if np.isfinite(ref["n_params"]):
        model += f" ({ref['n_params'] / 1e6:.0f}M params)"
    return (f"{gpu} · {model} · batch {_norm(ref['batch_size']) or '?'} × seq_len "
            f"{_norm(ref['seq_len']) or '?'} · data {_norm(ref['data']) or '?'}")


# ---------------------------------------------------------------------------------------------
# summary.md


TABLE_HEADER = ["rung", "median ms", "IQR ms", "speedup", "tokens/s", "MFU", "peak alloc GiB",
                "peak reserved GiB", "compile s", "final loss", "status"]


def table_rows(table):
    """summarize()'s frame as the text cells of summary.md's table, header first."""
    rows = [TABLE_HEADER]
    for rung, r in table.iterrows():
        rows.append([rung, markdown.cell(r["median_step_ms"], ".1f"), markdown.cell(r["iqr_step_ms"], ".1f"),
                     markdown.cell(r["speedup"], ".2f", "x"), markdown.cell(r["tokens_per_s"], ",.0f"),
                     markdown.cell(100 * r["mfu"], ".1f", "%"), markdown.cell(r["peak_mem_allocated_gib"], ".1f"),
                     markdown.cell(r["peak_mem_reserved_gib"], ".1f"), markdown.cell(r["compile_s"], ".1f"),
                     markdown.cell(r["final_loss"], ".3f"), r["status"]])
    return rows


def render_summary(report):
    """summary.md's text: heading, the table in ladder order, excluded runs, notes."""
    t = report.table
    lines = [f"# Ladder results: {report.context}{_environment(report.runs)}", ""]
    if not report.has_baseline:
        lines += [f"**{NO_BASELINE_NOTE}**", ""]
    lines += [markdown.table(table_rows(t), left=(0, len(TABLE_HEADER) - 1)), ""]
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


def _environment(runs):
    def distinct(col, width=None):
        values = [_norm(v)[:width] for v in runs[col] if _norm(v)]
        return ", ".join(dict.fromkeys(values))
    torch_versions, commits = distinct("torch_version"), distinct("git_commit", 12)
    return (f" · torch {torch_versions or 'unknown'}"
            f" · commit{'s' if ', ' in commits else ''} {commits or 'unknown'}")


def write_summary(report, path):
    """Write render_summary(report) to path through a temporary file; return the text."""
    text = render_summary(report)
    write_atomic(path, lambda f: f.write(text.encode("utf-8")))
    return text


# ---------------------------------------------------------------------------------------------
# Charts: each plot_* takes a Report and returns a Figure; nothing is written.


def rung_colors(rungs):
    """One color per rung, fixed by its place in the ladder so every chart agrees."""
    palette = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3",
               "#8c8c8c", "#ccb974", "#64b5cd"]
    unknown = sorted(set(rungs) - set(LADDER))
    return {r: palette[(LADDER.index(r) if r in LADDER else len(LADDER) + unknown.index(r)) % len(palette)]
            for r in rungs}


def _figure(title, report, height, width=9.0, ncols=1, sharey=False):
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    axes = fig.subplots(1, ncols, sharey=sharey, squeeze=False)[0]
    fig.suptitle(f"{title}\n{report.context}", fontsize=11)
    return fig, axes


def _empty(ax, text):
    ax.set_axis_off()
    ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=11, color="#555555", wrap=True,
            transform=ax.transAxes)


def _bar_height(n):
    return 1.6 + 0.45 * max(n, 1)


def _no_bar_label(ax, y, row):
    ax.text(0.01, y, f"no bar: {row['status']}", transform=ax.get_yaxis_transform(), va="center",
            fontsize=9, color="#777777", style="italic")


def _rung_axis(ax, rungs):
    ax.set_yticks(range(len(rungs)), rungs)
    ax.set_ylim(len(rungs) - 0.5, -0.5)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)


def plot_speedup(report):
    """Horizontal bars of the median speedup over the baseline, with 95% bootstrap whiskers."""
    t = report.table
    rungs = list(t.index)
    fig, (ax,) = _figure("Speedup over the baseline (higher is better)", report, _bar_height(len(rungs)) + 0.4)
    if not report.has_baseline:
        _empty(ax, f"{NO_BASELINE_NOTE}\nrun the baseline rung with the same settings to get speedups")
        return fig
    colors = rung_colors(rungs)
    x_max = 1.0
    for y, rung in enumerate(rungs):
        r = t.loc[rung]
        if not np.isfinite(r["speedup"]):
            _no_bar_label(ax, y, r)
            continue
        s, lo, hi = r["speedup"], r["speedup_lo"], r["speedup_hi"]
        ax.barh(y, s, color=colors[rung], height=0.62,
                xerr=[[max(s - lo, 0)], [max(hi - s, 0)]], error_kw={"capsize": 3, "lw": 1})
        ax.text(max(hi, s), y, f"  {s:.2f}x", va="center", fontsize=9, fontweight="bold")
        x_max = max(x_max, hi, s)
    ax.axvline(1.0, color="black", lw=1, ls="--")
    ax.text(1.0, -0.03, "1x", transform=ax.get_xaxis_transform(), ha="center", va="top", fontsize=8)
    ax.set_xlim(0, x_max * 1.18)
    _rung_axis(ax, rungs)
    ax.set_xlabel("median baseline step time / median rung step time, measured steps only\n"
                  f"whiskers: 95% bootstrap interval of the ratio of medians "
                  f"({BOOTSTRAP_RESAMPLES} resamples of each run's step times; spread within one run, not between runs)",
                  fontsize=9)
    return fig


def _warmup_spans(steps):
    spans = set()
    for _, g in steps[steps["warmup"] == 1].groupby("run_id"):
        spans.add((g["step"].min() - 0.5, g["step"].max() + 0.5))
    return sorted(spans)


def _fmt_ms(ms):
    return f"{ms / 1000:.1f} s" if ms >= 1000 else f"{ms:.0f} ms"


def plot_step_time(report):
    """Step time against step for every compared rung; warm-up shaded; log scale past a 10x spread."""
    fig, (ax,) = _figure("Step time over the run (lower is better)", report, 5.2)
    rungs = report.rungs_with_steps()
    if not rungs:
        _empty(ax, "no run with usable step times to plot")
        return fig
    colors = rung_colors(report.table.index)
    steps = report.steps
    measured = _measured(steps)["step_ms"]
    medians = report.table.loc[rungs, "median_step_ms"]
    log = medians.max() / medians.min() > LOG_SCALE_SPAN
    # A compile step can be a thousand times a measured one; the axis follows the measured steps and
    # the warm-up points above it are listed instead, so the lines that matter keep their height.
    top = measured.max() * (1.6 if log else 1.15)
    bottom = measured.min() / 1.6 if log else 0
    for i, (lo, hi) in enumerate(_warmup_spans(steps)):
        ax.axvspan(lo, hi, color="#999999", alpha=0.15, lw=0,
                   label="warm-up (left out of the summary)" if i == 0 else None)
    off_chart = []
    for rung in rungs:
        g = steps[steps["optimization"] == rung]
        ax.plot(g["step"], g["step_ms"], color=colors[rung], lw=1.3, label=rung)
        high = g[g["step_ms"] > top]
        if len(high):
            ax.plot(high["step"], [top] * len(high), ls="none", marker="^", ms=7, color=colors[rung],
                    clip_on=False)
            off_chart += [f"{rung} step {int(s)}: {_fmt_ms(v)}" for s, v in zip(high["step"], high["step_ms"])]
    if log:
        ax.set_yscale("log")
    ax.set_ylim(bottom, top)
    if off_chart:
        ax.text(1.03, 0.0, "warm-up steps above the chart (▲):\n" + "\n".join(off_chart),
                transform=ax.transAxes, ha="left", va="bottom", fontsize=8, color="#333333")
    ax.set_xlabel("step")
    ax.set_ylabel("step time (ms)" + (", log scale" if log else ""))
    ax.grid(alpha=0.3, which="both" if log else "major")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=9, frameon=False)
    return fig


def _si(value, _pos=None):
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:g}{suffix}"
    return f"{value:g}"


def plot_throughput(report):
    """Tokens per second and MFU per rung, side by side."""
    t = report.table
    rungs = list(t.index)
    fig, (ax_tok, ax_mfu) = _figure("Throughput (higher is better)", report, _bar_height(len(rungs)),
                                    width=10, ncols=2, sharey=True)
    colors = rung_colors(rungs)
    for ax, col, label, fmt in ((ax_tok, "tokens_per_s", "tokens / s (batch × seq_len / median step time)",
                                 lambda v: f"  {v:,.0f}"),
                                (ax_mfu, "mfu", "MFU (% of the GPU's peak FLOP/s)",
                                 lambda v: f"  {100 * v:.1f}%")):
        scale = 100 if col == "mfu" else 1
        values = t[col]
        if not np.isfinite(values).any():
            _rung_axis(ax, rungs)
            ax.set_xticks([])
            ax.text(0.5, 0.5, "MFU unknown: no peak FLOP/s\nrecorded for this device" if col == "mfu"
                    else "no throughput to plot", transform=ax.transAxes, ha="center", va="center",
                    fontsize=10, color="#555555")
            ax.set_xlabel(label, fontsize=9)
            continue
        for y, rung in enumerate(rungs):
            v = values[rung]
            if not np.isfinite(v):
                _no_bar_label(ax, y, t.loc[rung])
                continue
            ax.barh(y, v * scale, color=colors[rung], height=0.62)
            ax.text(v * scale, y, fmt(v), va="center", fontsize=9)
        ax.set_xlim(0, np.nanmax(values) * scale * 1.25)
        if col == "tokens_per_s":
            ax.xaxis.set_major_formatter(FuncFormatter(_si))
        _rung_axis(ax, rungs)
        ax.set_xlabel(label, fontsize=9)
    return fig


def plot_memory(report):
    """Peak allocated and reserved GPU memory per rung."""
    t = report.table
    rungs = list(t.index)
    fig, (ax,) = _figure("Peak GPU memory (lower is better)", report, _bar_height(len(rungs)) + 0.3)
    alloc, reserved = t["peak_mem_allocated_gib"], t["peak_mem_reserved_gib"]
    if not (np.isfinite(alloc).any() or np.isfinite(reserved).any()):
        _empty(ax, "no GPU memory recorded for these runs (CPU runs record none)")
        return fig
    colors = rung_colors(rungs)
    h = 0.36
    for y, rung in enumerate(rungs):
        a, r = alloc[rung], reserved[rung]
        if not (np.isfinite(a) or np.isfinite(r)):
            _no_bar_label(ax, y, t.loc[rung])
            continue
        for value, dy, style in ((a, -h / 2, {"alpha": 1.0}),
                                 (r, h / 2, {"alpha": 0.4, "hatch": "///", "edgecolor": colors[rung]})):
            if np.isfinite(value):
                ax.barh(y + dy, value, height=h, color=colors[rung], **style)
                ax.text(value, y + dy, f" {value:.1f}", va="center", fontsize=8)
    ax.set_xlim(0, np.nanmax(np.concatenate([alloc.to_numpy(), reserved.to_numpy()])) * 1.15)
    _rung_axis(ax, rungs)
    ax.set_xlabel("peak memory (GiB), as recorded in runs.csv", fontsize=9)
    ax.legend(handles=[Patch(facecolor="#777777", label="allocated by tensors"),
                       Patch(facecolor="#777777", alpha=0.4, hatch="///", edgecolor="#777777",
                             label="reserved by the caching allocator")],
              loc="best", fontsize=8)
    return fig


def plot_loss(report):
    """Training loss against step for every compared rung on one axis, and beside it each rung's loss
    minus the baseline's at the same step, where curves that overlap can be told apart."""
    fig, (ax, gap_ax) = _figure("Training loss (the same learning on every rung should overlap)", report, 5.2,
                                width=13.0, ncols=2)
    rungs = report.rungs_with_steps()
    steps = report.steps.dropna(subset=["loss"]) if len(report.steps) else report.steps
    if not rungs or steps.empty:
        _empty(ax, "no loss recorded to plot")
        _empty(gap_ax, "")
        return fig
    colors = rung_colors(report.table.index)
    for rung in rungs:
        g = steps[steps["optimization"] == rung]
        ax.plot(g["step"], g["loss"], color=colors[rung], lw=1.3, label=rung, alpha=0.9)
    ax.set_xlabel("step (warm-up steps included)")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if "baseline" in rungs:
        base = steps[steps["optimization"] == "baseline"].set_index("step")["loss"]
        for rung in rungs:
            if rung == "baseline":
                continue
            g = steps[steps["optimization"] == rung].set_index("step")["loss"]
            gap = (g - base).dropna()
            gap_ax.plot(gap.index, gap.values, color=colors[rung], lw=1.0, alpha=0.9, label=rung)
        gap_ax.axhline(0, color="#333333", lw=0.8)
        gap_ax.set_xlabel("step")
        gap_ax.set_ylabel("loss − baseline's loss at the same step")
        gap_ax.grid(alpha=0.3)
    else:
        _empty(gap_ax, "no ok baseline run: no gap to the baseline")
    ax.legend(loc="upper right", fontsize=9, frameon=False)
    return fig


CHARTS = {
    "speedup.png": plot_speedup,
    "step_time.png": plot_step_time,
    "throughput.png": plot_throughput,
    "memory.png": plot_memory,
    "loss.png": plot_loss,
}


# ---------------------------------------------------------------------------------------------
# Writing


def save_figure(fig, path):
    """Render fig as PNG to path through a temporary file."""
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=DPI))


def write_outputs(prefix, report):
    """Write every chart and summary.md into prefix; return (summary text, written paths)."""
    written = []
    for name, plot in CHARTS.items():
        path = os.path.join(prefix, name)
        save_figure(plot(report), path)
        written.append(path)
    path = os.path.join(prefix, "summary.md")
    text = write_summary(report, path)
    written.append(path)
    return text, written


# ---------------------------------------------------------------------------------------------
# Command line


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        usage = self.format_usage().strip().removeprefix("usage: ")
        self.exit(2, f"error: {message} (usage: {usage})\n")


def _parser():
    p = _Parser(prog="plot_results.py",
                description="Draw the ladder's charts and summary.md from PREFIX/results.csv and PREFIX/runs.csv.")
    p.add_argument("--prefix", required=True, help="folder holding results.csv and runs.csv; outputs go there too")
    return p


def main(argv=None):
    """Command line entry point; returns the exit code (0 written, 2 bad arguments or input)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    prefix = args.prefix
    try:
        steps, runs = load(prefix)
        report = build_report(steps, runs)
        text, written = write_outputs(prefix, report)
    except ResultsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot write into PREFIX={prefix} ({e.strerror or e}): "
              f"choose a folder you can write to", file=sys.stderr)
        return 2
    print(text, end="")
    print("wrote " + ", ".join(os.path.basename(p) for p in written) + f" into {prefix}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
