"""Each addition against the rung it was added to or taken from: `make ablation` records fused+<addition> runs
(the fused rung with one addition more), `make ablation FROM=max` records max-<addition> runs (max with one
addition less); additions tried together make fused+<a>+<b> and max-<a>-<b>. Each run is divided by its base's
runs from the same commit on the same GPU (Utils.report.comparison). summary.md and the notebook show the same tables.
"""
import pandas as pd

from Utils.ladder.registry import ABLATION_SEPARATOR, ADDITIONS, MAX_ADDITIONS
from Utils.report.comparison import Comparison, compare_runs
from Utils.report.stats import Report, build_report


def parts(name: str, base: str) -> list[str]:
    """The additions a run's name adds to or takes from the base: fused+loss+prefetch -> [loss, prefetch]."""
    return name[len(base) + 1:].split(ABLATION_SEPARATOR[base])


def ablation_order(names: list[str], base: str) -> list[str]:
    """Runs named after `base`, one addition a row first, in the registry's order; then the rows of several
    together."""
    order = list(ADDITIONS)
    return sorted(names, key=lambda r: (len(parts(r, base)),
                                        [order.index(a) if a in order else len(order) for a in parts(r, base)], r))


def ablation_names(report: Report, base: str) -> list[str]:
    """The runs named after `base` that the report compares, in ablation_order."""
    return ablation_order([r for r in report.rungs_with_steps() if r.startswith(base + ABLATION_SEPARATOR[base])], base)


def ablation(report: Report, steps: pd.DataFrame, runs: pd.DataFrame, base: str) -> Comparison:
    """compare_runs() of the runs named after `base`; with base "fused", a column "in max": whether the run's
    additions are all the max rung's."""
    found = compare_runs(report, steps, runs, base, ablation_names(report, base))
    if base == "fused":
        found.table["in max"] = [None if name == base else all(a in MAX_ADDITIONS for a in parts(name, base))
                                 for name in found.table.index]
    return found


def ablation_table(steps: pd.DataFrame, runs: pd.DataFrame, base: str = "fused") -> pd.DataFrame:
    """The base, then each run <base><separator><addition> in the registry's order, of the runs the summary
    compares: base "fused" (`make ablation`), with a column "in max" (whether the addition is one of the max
    rung's); base "max" (`make ablation FROM=max`). The columns are compare_runs()'s; runs without a base run of
    their commit are left out; empty where no run is compared."""
    return ablation(build_report(steps, runs), steps, runs, base).table


def ablation_sets(report: Report, steps: pd.DataFrame, runs: pd.DataFrame) -> list[Comparison]:
    """ablation() for each base that has runs named after it (fused+..., max-...), in ABLATION_SEPARATOR's order."""
    found = [ablation(report, steps, runs, base) for base in ABLATION_SEPARATOR]
    return [f for f in found if f.compared or f.left_out]
