"""Runs divided by a base rung's runs from the same commit on the same GPU: each addition against the rung it was
added to or taken from (Utils.report.ablation), and the peers against the suite's fastest rung (Utils.report.peers).

The runs are those the summary compares (Utils.report.selection: one configuration, usable step times). A run
is divided by the median of the median steps of its base's runs from the same commit on the same card (its
gpu_uuid), not by the base's latest run: two commits, or two H200s under their power cap, differ by about as
much as some additions gain (BENCHMARKS.md), so a run with no base run of its commit on its card, or whose
commit names no one tree of code, is left out and named rather than compared across commits or cards.
"""
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from Utils.report.selection import measured, names_one_tree, norm, steps_by_run
from Utils.report.stats import Report

SAME = "same commit and GPU"   # the column of the base's median each row is divided by: f"{base} ms, {SAME}"
# The lowest and highest of a row's runs' median SM clocks (runs.csv's sm_clock_mhz_median, from NVML): under a
# power cap the clock, and with it the step time, moves from run to run and card to card.
CLOCK_LOW, CLOCK_HIGH = "SM MHz low", "SM MHz high"


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
    return ["commit", "runs", "median ms", "IQR ms", f"vs {base}", f"{base} ms, {SAME}", "peak alloc GiB",
            CLOCK_LOW, CLOCK_HIGH]


def clock_range(runs: pd.DataFrame) -> tuple[float, float]:
    """(lowest, highest) of the runs' median SM clocks in MHz; NaN where none is recorded (a CPU, or a runs.csv
    from before schema 2)."""
    column = runs["sm_clock_mhz_median"] if "sm_clock_mhz_median" in runs else pd.Series(dtype=float)
    mhz = pd.to_numeric(column, errors="coerce").dropna()
    return (float(mhz.min()), float(mhz.max())) if len(mhz) else (np.nan, np.nan)


def cards(runs: pd.DataFrame) -> pd.Series:
    """Each run's GPU as its UUID, blank where runs.csv has none (a CPU run, or a row from before schema 2)."""
    column = runs["gpu_uuid"] if "gpu_uuid" in runs else pd.Series("", index=runs.index)
    return column.map(norm)


def compare_runs(report: Report, steps: pd.DataFrame, runs: pd.DataFrame, base: str, names: list[str]) -> Comparison:
    """The runs `names`, in that order, among those `report` (build_report of these frames) compares, each
    against the median of the median steps of the compared ok runs of `base` from its commit on its GPU (a rung
    run several times from one commit is summarized the same way; a row's commit and GPU are its latest run's).
    Columns: commit (short), runs, median ms (the median of the run's or, repeated from one commit, of its runs'
    medians; the base's over its runs from the commit and GPU most rows were divided by), IQR ms (the latest
    run's), vs <base> (fraction; negative is faster), <base> ms, same commit and GPU, peak alloc GiB, SM MHz low
    and high (clock_range over the row's runs from its commit and GPU). A run without a base run of its commit
    on its GPU is left out and named; the table is empty where no run is compared."""
    table = report.table
    left = {e.run_id for e in report.excluded}
    commit_of = runs.set_index("run_id")["git_commit"].astype(str).str.strip()
    card_of = pd.Series(cards(runs).values, index=runs["run_id"])
    by_run = steps_by_run(steps)
    usable = runs[(runs["status"] == "ok") & ~runs["run_id"].isin(left) & runs["run_id"].isin(by_run)
                  & runs["git_commit"].map(names_one_tree)]
    # each usable run's commit and card, the key a row is divided and its clocks gathered by
    usable_commit, usable_card = usable["git_commit"].astype(str).str.strip(), cards(usable)
    base_runs = usable[usable["optimization"] == base]
    base_keys = list(zip(usable_commit[base_runs.index], usable_card[base_runs.index]))
    # each base run's median over its measured steps, as summarize() takes a run's
    medians: dict[tuple[str, str], list[float]] = {}
    for key, rid in zip(base_keys, base_runs["run_id"]):
        medians.setdefault(key, []).append(float(np.median(measured(by_run[rid])["step_ms"])))
    base_ms = {key: float(np.median(values)) for key, values in medians.items()}
    base_commits = {commit for commit, _ in base_keys}

    rows, left_out, used = {}, [], []
    for name in names:
        run_id = table.at[name, "run_id"]
        commit, card = commit_of[run_id], card_of[run_id]
        same = base_ms.get((commit, card)) if names_one_tree(commit) else None
        if same is None:
            why = ("its commit is not recorded" if not names_one_tree(commit) else
                   f"no {base} run of its commit on its GPU" if commit in base_commits else
                   f"no {base} run of its commit")
            left_out.append(f"{name} ({why})")
            continue
        used.append((commit, card))
        row = table.loc[name]
        row_runs = usable[(usable["optimization"] == name) & (usable_commit == commit) & (usable_card == card)]
        rows[name] = {"commit": commit[:7], "runs": row["runs"], "median ms": row["median_step_ms"],
                      "IQR ms": row["iqr_step_ms"], f"vs {base}": row["median_step_ms"] / same - 1,
                      f"{base} ms, {SAME}": same, "peak alloc GiB": row["peak_mem_allocated_gib"],
                      **dict(zip((CLOCK_LOW, CLOCK_HIGH), clock_range(row_runs)))}
    if not rows:
        return Comparison(base, pd.DataFrame(columns=columns(base)), left_out)
    # The base's row: its runs from the commit and GPU most rows were divided by (the latest such run's IQR and
    # memory).
    key = Counter(used).most_common(1)[0][0]
    mine = [k == key for k in base_keys]
    latest = base_runs[mine].iloc[-1]
    q25, q75 = np.percentile(measured(by_run[latest["run_id"]])["step_ms"], [25, 75])
    head = {"commit": key[0][:7], "runs": sum(mine), "median ms": base_ms[key],
            "IQR ms": q75 - q25, f"vs {base}": np.nan, f"{base} ms, {SAME}": np.nan,
            "peak alloc GiB": latest["peak_mem_allocated_gib"],
            **dict(zip((CLOCK_LOW, CLOCK_HIGH), clock_range(base_runs[mine])))}
    return Comparison(base, pd.DataFrame.from_dict({base: head, **rows}, orient="index", columns=columns(base)),
                      left_out)
