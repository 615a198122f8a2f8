"""Each addition against the rung it was added to or taken from: `make ablation` records fused+<addition> runs
(the fused rung with one addition more), `make ablation FROM=max` records max-<addition> runs (max with one
addition less); additions tried together make fused+<a>+<b> and max-<a>-<b>. summary.md and the notebook show
the same tables.

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

from Utils.ladder.registry import ADDITIONS, MAX_ADDITIONS
from Utils.report.selection import measured, names_one_tree, steps_by_run
from Utils.report.stats import Report, build_report

# base rung -> what joins it to an addition in a run's name: fused+loss, max-fp8_head
SEPARATOR = {"fused": "+", "max": "-"}


@dataclass
class Ablation:
    """One base's comparison: the table (see ablation_table) and the runs left out of it, with why."""
    base: str
    table: pd.DataFrame
    left_out: list[str] = field(default_factory=list)   # e.g. "max-sync_every (no max run of its commit)"

    @property
    def compared(self) -> bool:
        """Whether any run was divided by the base (the table holds more than the base's row)."""
        return len(self.table.index.drop(self.base, errors="ignore")) > 0


def compare(report: Report, steps: pd.DataFrame, runs: pd.DataFrame, base: str) -> Ablation:
    """The runs <base><separator><addition> that `report` (build_report of these frames) compares, each against
    the median of the median steps of the compared ok runs of `base` from its commit (a rung run several times
    from one commit is summarized the same way); see ablation_table for the columns."""
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

    prefix = base + SEPARATOR[base]
    order = list(ADDITIONS)

    def parts(name: str) -> list[str]:   # the additions a run's name adds to or takes from the base
        return name[len(prefix):].split(SEPARATOR[base])

    # One addition a row first, in the registry's order; then the rows of several together
    names = sorted((r for r in report.rungs_with_steps() if r.startswith(prefix)),
                   key=lambda r: (len(parts(r)), [order.index(a) if a in order else len(order) for a in parts(r)], r))
    columns = ["commit", "runs", "median ms", "IQR ms", f"vs {base}", f"{base} ms, same commit", "peak alloc GiB"]
    columns += ["in max"] if base == "fused" else []
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
        if base == "fused":
            rows[name]["in max"] = all(a in MAX_ADDITIONS for a in parts(name))
    if not rows:
        return Ablation(base, pd.DataFrame(columns=columns), left_out)
    # The base's row: its runs from the commit most rows were divided by (the latest such run's IQR and memory).
    commit = Counter(used).most_common(1)[0][0]
    latest = base_runs[base_commits == commit].iloc[-1]
    q25, q75 = np.percentile(measured(by_run[latest["run_id"]])["step_ms"], [25, 75])
    head = {"commit": commit[:7], "runs": int((base_commits == commit).sum()), "median ms": base_ms[commit],
            "IQR ms": q75 - q25, f"vs {base}": np.nan, f"{base} ms, same commit": np.nan,
            "peak alloc GiB": latest["peak_mem_allocated_gib"]}
    if base == "fused":
        head["in max"] = None
    return Ablation(base, pd.DataFrame.from_dict({base: head, **rows}, orient="index", columns=columns), left_out)


def ablation_table(steps: pd.DataFrame, runs: pd.DataFrame, base: str = "fused") -> pd.DataFrame:
    """The base, then each run <base><separator><addition> in the registry's order, of the runs the summary
    compares: base "fused" (`make ablation`), with a column "in max" (whether the addition is one of the max
    rung's); base "max" (`make ablation FROM=max`). Columns: commit (short), runs, median ms (the median of the
    run's or, repeated from one commit, of its runs' medians; the base's over its runs from the commit most rows
    were divided by), IQR ms (the latest run's), vs <base> (fraction; negative is faster), <base> ms, same commit,
    peak alloc GiB. Runs without a base run of their commit are left out; empty where no run is compared."""
    return compare(build_report(steps, runs), steps, runs, base).table


def ablation_sets(report: Report, steps: pd.DataFrame, runs: pd.DataFrame) -> list[Ablation]:
    """compare() for each base that has runs named after it (fused+..., max-...), in SEPARATOR's order."""
    found = [compare(report, steps, runs, base) for base in SEPARATOR]
    return [f for f in found if f.compared or f.left_out]
