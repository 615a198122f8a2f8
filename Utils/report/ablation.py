"""Each addition against the rung it was added to or taken from: `make ablation` records fused+<addition> runs
(the fused rung with one addition more), `make ablation FROM=max` records max-<addition> runs (max with one
addition less). summary.md and the notebook show the same tables.

A run is divided by the mean of the median steps of its base's ok runs from the same commit, not by the base's
latest run: two calls, or two cards, differ by about as much as some additions gain (BENCHMARKS.md), so a row
whose commit has no base run is left out rather than compared across commits.
"""
import numpy as np
import pandas as pd

from Utils.ladder.registry import MAX_ADDITIONS
from Utils.report.selection import measured, steps_by_run
from Utils.report.stats import summarize

# base rung -> what joins it to an addition in a run's name: fused+loss, max-fp8_head
SEPARATOR = {"fused": "+", "max": "-"}


def ablation_table(steps: pd.DataFrame, runs: pd.DataFrame, base: str = "fused") -> pd.DataFrame:
    """Each ok run of an ablation set against the mean median step of the ok runs of `base` made by the same
    commit. base "fused": the runs fused+<addition>, with a column "in max" (whether the addition is one of the
    max rung's); base "max": the runs max-<addition>. Index: the base, then those runs, in ladder order.
    Columns: median ms, IQR ms (the run's, or the latest base run's), vs <base> (fraction; negative is faster),
    <base> ms, same commit, peak alloc GiB. Runs without a base run of their commit are left out; empty without
    any ok base run."""
    table = summarize(steps, runs)
    commit = runs.set_index("run_id")["git_commit"]
    by_run = steps_by_run(steps)
    base_runs = runs[(runs["status"] == "ok") & (runs["optimization"] == base) & runs["run_id"].isin(by_run)]
    # each base run's median over its measured steps, as summarize() takes a run's
    medians = base_runs["run_id"].map(lambda rid: float(np.median(measured(by_run[rid])["step_ms"]))).astype(float)
    base_ms = medians.groupby(base_runs["git_commit"]).mean().dropna()
    columns = ["median ms", "IQR ms", f"vs {base}", f"{base} ms, same commit", "peak alloc GiB"]
    columns += ["in max"] if base == "fused" else []
    rows = {}
    if len(base_ms):
        for r in table.index:
            if table.at[r, "status"] != "ok" or not (r == base or r.startswith(base + SEPARATOR[base])):
                continue
            same = base_ms.get(commit[table.at[r, "run_id"]]) if r != base else None
            if r != base and same is None:
                continue
            rows[r] = {"median ms": table.at[r, "median_step_ms"], "IQR ms": table.at[r, "iqr_step_ms"],
                       f"vs {base}": table.at[r, "median_step_ms"] / same - 1 if same else np.nan,
                       f"{base} ms, same commit": same if same else np.nan,
                       "peak alloc GiB": table.at[r, "peak_mem_allocated_gib"]}
            if base == "fused":
                rows[r]["in max"] = r.split("+", 1)[-1] in MAX_ADDITIONS if r != base else None
    return pd.DataFrame.from_dict(rows, orient="index", columns=columns)


def ablation_tables(steps: pd.DataFrame, runs: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """{base: ablation_table(steps, runs, base)} for each base with at least one run compared against it."""
    tables = {}
    for base in SEPARATOR:
        frame = ablation_table(steps, runs, base)
        if len(frame.index.drop(base, errors="ignore")):
            tables[base] = frame
    return tables
