"""Runs divided by a base rung's runs from the same commit: each addition against the rung it was added to or
taken from (Utils.report.ablation), and the peers against the suite's fastest rung (Utils.report.peers).

The runs are those the summary compares (Utils.report.selection: one configuration, usable step times). A run
is divided by the median of the median steps of its base's runs from the same commit, not by the base's latest
run: two calls, or two cards, differ by about as much as some additions gain (BENCHMARKS.md), so a run whose
commit has no base run, or names no one tree of code, is left out and named rather than compared across
commits.
"""
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from Utils.report.selection import measured, names_one_tree, steps_by_run
from Utils.report.stats import Report


@dataclass
class Comparison:
    """Runs against one base: the table (see compare) and the runs left out of it, with why."""
    base: str
    table: pd.DataFrame
    left_out: list[str] = field(default_factory=list)   # e.g. "max-sync_every (no max run of its commit)"

    @property
    def compared(self) -> bool:
        """Whether any run was divided by the base (the table holds more than the base's row)."""
        return len(self.table.index.drop(self.base, errors="ignore")) > 0


def columns(base: str) -> list[str]:
    return ["commit", "runs", "median ms", "IQR ms", f"vs {base}", f"{base} ms, same commit", "peak alloc GiB"]


def compare(report: Report, steps: pd.DataFrame, runs: pd.DataFrame, base: str, names: list[str]) -> Comparison:
    """The runs `names`, in that order, among those `report` (build_report of these frames) compares, each
    against the median of the median steps of the compared ok runs of `base` from its commit (a rung run
    several times from one commit is summarized the same way). Columns: commit (short), runs, median ms (the
    median of the run's or, repeated from one commit, of its runs' medians; the base's over its runs from the
    commit most rows were divided by), IQR ms (the latest run's), vs <base> (fraction; negative is faster),
    <base> ms, same commit, peak alloc GiB. A run without a base run of its commit is left out and named;
    the table is empty where no run is compared."""
    table = report.table
    left = {e.run_id for e in report.excluded}
    commit_of = runs.set_index("run_id")["git_commit"].astype(str).str.strip()
    by_run = steps_by_run(steps)
    usable = runs[(runs["status"] == "ok") & ~runs["run_id"].isin(left) & runs["run_id"].isin(by_run)
                  & runs["git_commit"].map(names_one_tree)]
    base_runs = usable[usable["optimization"] == base]
    base_commits = base_runs["git_commit"].astype(str).str.strip()
    # each base run's median over its measured steps, as summarize() takes a run's
    medians = base_runs["run_id"].map(lambda rid: float(np.median(measured(by_run[rid])["step_ms"]))).astype(float)
    base_ms = medians.groupby(base_commits).median()

    rows, left_out, used = {}, [], []
    for name in names:
        commit = commit_of[table.at[name, "run_id"]]
        same = base_ms.get(commit) if names_one_tree(commit) else None
        if same is None:
            why = "its commit is not recorded" if not names_one_tree(commit) else f"no {base} run of its commit"
            left_out.append(f"{name} ({why})")
            continue
        used.append(commit)
        row = table.loc[name]
        rows[name] = {"commit": commit[:7], "runs": row["runs"], "median ms": row["median_step_ms"],
                      "IQR ms": row["iqr_step_ms"], f"vs {base}": row["median_step_ms"] / same - 1,
                      f"{base} ms, same commit": same, "peak alloc GiB": row["peak_mem_allocated_gib"]}
    if not rows:
        return Comparison(base, pd.DataFrame(columns=columns(base)), left_out)
    # The base's row: its runs from the commit most rows were divided by (the latest such run's IQR and memory).
    commit = Counter(used).most_common(1)[0][0]
    latest = base_runs[base_commits == commit].iloc[-1]
    q25, q75 = np.percentile(measured(by_run[latest["run_id"]])["step_ms"], [25, 75])
    head = {"commit": commit[:7], "runs": int((base_commits == commit).sum()), "median ms": base_ms[commit],
            "IQR ms": q75 - q25, f"vs {base}": np.nan, f"{base} ms, same commit": np.nan,
            "peak alloc GiB": latest["peak_mem_allocated_gib"]}
    return Comparison(base, pd.DataFrame.from_dict({base: head, **rows}, orient="index", columns=columns(base)),
                      left_out)
