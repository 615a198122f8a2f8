"""The breakdown's files in PREFIX: trace_<rung>.json.gz, each rung's latest trace, which a profiled run
writes (Utils.train.loop.profile_steps) with what its split needs in the trace's metadata; breakdown.csv,
a row per class appended for each profiled run once its trace is split, and kernels.csv, a row per kernel
(add_traces; columns in Utils.results.schema); and breakdown.md and breakdown.png, redrawn from the latest run
of each rung in breakdown.csv and its trace."""
import contextlib
import glob
import os

import pandas as pd

from Utils.ladder.registry import rung_order
from Utils.report.breakdown.chart import plot_breakdown
from Utils.report.breakdown.kernels import UNKNOWN
from Utils.report.breakdown.render import MATCH_TOLERANCE, off_median, render_report
from Utils.report.breakdown.trace import Breakdown, TraceError, load_trace, split
from Utils.report.figures import save_figure
from Utils.report.stats import provenance
from Utils.results.files import write_atomic
from Utils.results.read import read_table
from Utils.results.schema import (BREAKDOWN_COLUMNS, BREAKDOWN_FILE, BREAKDOWN_NUMERIC, KERNEL_COLUMNS, KERNELS_FILE,
                                  RUN_COLUMNS, RUNS_FILE)
from Utils.results.store import ResultsError, append_rows, check_file, writing

REPORT_FILE = "breakdown.md"
CHART_FILE = "breakdown.png"


def trace_path(prefix: str | os.PathLike, rung: str) -> str:
    """PREFIX/trace_<rung>.json, or its .json.gz when only that exists."""
    path = os.path.join(prefix, f"trace_{rung}.json")
    return path + ".gz" if not os.path.exists(path) and os.path.exists(path + ".gz") else path


def append_breakdown_csv(prefix: str | os.PathLike, rung: str, run_id: str, breakdown: Breakdown,
                         median_step_ms: "float | None") -> None:
    """Append one row per class of `breakdown` to PREFIX/breakdown.csv: whole or absent, under the results
    lock, refusing a file whose header is not BREAKDOWN_COLUMNS (ResultsError). median_step_ms is the
    run's median over its unprofiled measured steps (None when it has none)."""
    flops = breakdown.compute_flops
    common = {"run_id": run_id, "rung": rung, "profiled_step_ms": breakdown.step_ms,
              "median_step_ms": median_step_ms, "profiled_steps": breakdown.steps,
              "compute_tflops": flops / 1e12 if flops else None,
              "peak_tflops": breakdown.peak_flops / 1e12 if breakdown.peak_flops else None}
    shares = breakdown.shares
    rows = [{**common, "class": c, "ms_per_step": breakdown.ms[c], "share": shares[c]} for c in breakdown.classes]
    append_rows(prefix, BREAKDOWN_FILE, BREAKDOWN_COLUMNS, rows)


def append_kernels_csv(prefix: str | os.PathLike, rung: str, run_id: str, breakdown: Breakdown) -> None:
    """Append one row per kernel of `breakdown` (copies and memsets included, longest first) to PREFIX/kernels.csv,
    as append_breakdown_csv does to breakdown.csv."""
    rows = [{"run_id": run_id, "rung": rung, "class": k.cls or UNKNOWN, "kind": k.label or "",
             "calls_per_step": k.calls_per_step, "ms_per_step": k.ms_per_step,
             "share": k.ms_per_step / breakdown.step_ms if breakdown.step_ms else None, "kernel": k.name}
            for k in breakdown.kernels]
    if rows:
        append_rows(prefix, KERNELS_FILE, KERNEL_COLUMNS, rows)


def _run_ids(path: str, columns: list[str]) -> set:
    """The run_ids in the results file at path (none where it is absent or empty); ResultsError where it is
    foreign."""
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return set()
    check_file(path, columns)
    return set(read_table(path, columns, ())["run_id"])


def _number(trace: dict, key: str) -> "float | None":
    value = trace.get(key)
    try:
        return float(value) if value not in (None, "") else None
    except (TypeError, ValueError):
        return None


def add_traces(prefix: str | os.PathLike) -> tuple[list[tuple[str, Breakdown]], list[str]]:
    """Split every trace in PREFIX that a profiled run wrote and whose run is not yet in breakdown.csv, append
    its rows there and its kernels' to kernels.csv, and redraw breakdown.md and breakdown.png; return ((rung,
    Breakdown) for each trace split, oldest run first; a problem per trace that could not be split, which the
    others do not wait for). A GPU trace whose run was split before kernels.csv existed (schema version 6) adds
    its kernels alone. A trace without the run's metadata (none, or from before traces carried their figures) is
    left alone. Raises ResultsError where breakdown.csv or kernels.csv cannot be read or written."""
    done = _run_ids(os.path.join(prefix, BREAKDOWN_FILE), BREAKDOWN_COLUMNS)
    # A run is split once: breakdown.csv's rows mark it done, so its kernels go first, and where a stop came between
    # the two appends, they are not appended twice.
    kernels_kept = _run_ids(os.path.join(prefix, KERNELS_FILE), KERNEL_COLUMNS)
    new, kernels_only, problems = [], [], []
    for file in sorted(glob.glob(os.path.join(glob.escape(str(prefix)), "trace_*.json*"))):
        if not file.endswith((".json", ".json.gz")):
            continue
        try:
            trace = load_trace(file)
            run_id, rung = trace.get("run_id"), trace.get("rung")
            if not run_id or not rung:
                continue
            if str(run_id) in done:
                # a CPU trace has no kernels to add: it is not split again on every call
                events = trace.get("traceEvents") or ()
                if str(run_id) not in kernels_kept and any(isinstance(e, dict) and e.get("cat") == "kernel"
                                                           for e in events):
                    kernels_only.append((str(rung), split(trace)))
                continue
            bd = split(trace, flops_per_step=_number(trace, "flops_per_step"), peak_flops=_number(trace, "peak_flops"))
        except (TraceError, TypeError, AttributeError, KeyError, ValueError) as e:
            problems.append(f"{os.path.basename(file)}: {e}")
            continue
        new.append((str(trace.get("started_at") or ""), str(rung), bd, _number(trace, "median_step_ms"),
                    trace.get("context")))
    for rung, bd in kernels_only:
        append_kernels_csv(prefix, rung, bd.run_id, bd)
    new.sort(key=lambda item: item[0])
    for _, rung, bd, median, _ in new:
        if bd.run_id not in kernels_kept:
            append_kernels_csv(prefix, rung, bd.run_id, bd)
        append_breakdown_csv(prefix, rung, bd.run_id, bd, median)
    if new or (done and not os.path.exists(os.path.join(prefix, REPORT_FILE))):   # a report that failed before
        newest_context = new[-1][4] if new else None
        write_report(prefix, context=newest_context or None)   # None: from runs.csv
    return [(rung, bd) for _, rung, bd, _, _ in new], problems


def load_breakdown(prefix: str | os.PathLike) -> pd.DataFrame:
    """PREFIX/breakdown.csv's rows of the latest run of each rung (the last run_id appended for it), in
    ladder order, numeric columns as floats. Raises ResultsError when the file is missing, foreign, damaged
    or empty."""
    path = os.path.join(prefix, BREAKDOWN_FILE)
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        raise ResultsError(f"{path} not found or empty: profile a rung first, "
                           f"e.g. make profile STEPS=20 BATCH_SIZE=8 PREFIX={prefix}")
    check_file(path, BREAKDOWN_COLUMNS)
    df = read_table(path, BREAKDOWN_COLUMNS, BREAKDOWN_NUMERIC)
    if df.empty:
        raise ResultsError(f"{path} records no profiled run: profile a rung first")
    latest = {rung: g["run_id"].iloc[-1] for rung, g in df.groupby("rung", sort=False)}
    frames = [df[(df["rung"] == r) & (df["run_id"] == latest[r])] for r in rung_order(latest)]
    return pd.concat(frames, ignore_index=True)


def _recorded_runs(prefix, df):
    """runs.csv's rows (as text) of the runs in df, or None when runs.csv cannot be read. A profiled run
    is recorded by its trace, and so in breakdown.csv only: most have none."""
    with contextlib.suppress(ResultsError, OSError, ValueError):
        runs = read_table(os.path.join(prefix, RUNS_FILE), RUN_COLUMNS, ())
        return runs[runs["run_id"].isin(set(df["run_id"]))]
    return None


def _context(runs, breakdowns):
    """"GPU · model (N params) · batch B × seq_len T" from runs.csv's rows of the shown runs, else the GPUs
    the traces name."""
    gpus = sorted({bd.gpu_name for bd in breakdowns.values() if bd and bd.gpu_name})
    if runs is None or runs.empty:
        return " / ".join(gpus)

    def values(col):
        return " / ".join(dict.fromkeys(v for v in runs[col] if v)) or "?"

    device = "CPU" if set(runs["device"]) == {"cpu"} else values("gpu_name")
    model = values("model")
    with contextlib.suppress(ValueError):
        n = {float(v) for v in runs["n_params"] if v}
        if len(n) == 1:
            model += f" ({n.pop() / 1e6:.0f}M params)"
    return f"{device} · {model} · batch {values('batch_size')} × seq_len {values('seq_len')}"


def _provenance(df, runs, breakdowns):
    """Utils.report.stats.provenance of the shown runs: each figure from the run's runs.csv row where it has
    one, else from its trace's metadata."""
    recorded = {} if runs is None else {r["run_id"]: r for _, r in runs.iterrows()}
    keys = ("torch_version", "git_commit", "started_at")
    rows = []
    for rung in rung_order(df["rung"]):
        run_id = df.loc[df["rung"] == rung, "run_id"].iloc[0]
        bd = breakdowns.get(rung)
        traced = bd if bd is not None and bd.run_id == run_id else None
        row = recorded.get(run_id, {})
        rows.append({k: row.get(k) or (getattr(traced, k) if traced else None) or "" for k in keys})
    return provenance(pd.DataFrame(rows, columns=list(keys)))


def write_report(prefix: str | os.PathLike, context: "str | None" = None) -> list[str]:
    """Write PREFIX/breakdown.md and PREFIX/breakdown.png from the latest run of each rung in
    breakdown.csv and the rungs' trace_<rung>.json.gz; return the written paths. context (GPU, model,
    batch, seq_len) defaults to what runs.csv records for those runs. Raises ResultsError when
    breakdown.csv is missing, foreign or empty."""
    df = load_breakdown(prefix)
    breakdowns, notes, trace_files = {}, [], {}
    for rung in rung_order(df["rung"]):
        path = trace_path(prefix, rung)
        trace_files[rung] = os.path.basename(path)
        run_id = df.loc[df["rung"] == rung, "run_id"].iloc[0]
        if not os.path.exists(path):
            breakdowns[rung] = None
            continue
        try:
            trace = load_trace(path)
            bd = split(trace)
        except TraceError as e:
            breakdowns[rung] = None
            notes.append(f"{rung}: {e}")
            continue
        if bd.run_id and bd.run_id != run_id:
            notes.append(f"{rung}: {os.path.basename(path)} is from run {bd.run_id}, not {run_id}: "
                         f"its kernel tables belong to that run")
        breakdowns[rung] = bd
    for rung in rung_order(df["rung"]):
        first = df[df["rung"] == rung].iloc[0]
        off = off_median(first["profiled_step_ms"], first["median_step_ms"])
        if off is not None and abs(off) > MATCH_TOLERANCE:
            notes.append(f"{rung}: the profiled step ({first['profiled_step_ms']:.1f} ms) is more than "
                         f"{MATCH_TOLERANCE:.0%} from the median step time ({first['median_step_ms']:.1f} ms): "
                         f"the profiler's own cost, or a run that did not settle")
    runs = _recorded_runs(prefix, df)
    if context is None:
        context = _context(runs, breakdowns)
    text = render_report(df, breakdowns, context, notes, trace_files)
    md_path, png_path = os.path.join(prefix, REPORT_FILE), os.path.join(prefix, CHART_FILE)
    fig = plot_breakdown(df, context, _provenance(df, runs, breakdowns))
    with writing(prefix):   # as make plots writes: no append, no other report meanwhile
        write_atomic(md_path, lambda f: f.write(text.encode("utf-8")))
        save_figure(fig, png_path)
    return [md_path, png_path]
