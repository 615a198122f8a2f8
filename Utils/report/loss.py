"""The loss with each addition and without it: whether an addition keeps the loss, from the runs of
`make ablation` repeated at two seeds or more (SEED=n, STEPS=300).

An addition keeps the loss when, at each seed, the mean loss over the last LOSS_WINDOW steps with it lies within
the gap that two seeds make without it over the same steps: the recipe without the addition sets how far two of
its own runs fall apart, and a smaller change cannot be told from a change of seed. The runs "with" and "without"
are those of `make ablation`: with `make ablation FROM=max`, max is with and max-<a> without; with `make
ablation`, fused+<a> is with and fused without.

A card changes the step time, not the loss, so runs of any GPU are paired; runs of other settings (selection's
STATUS_KEYS: batch, sequence length, model, data...) or another number of steps are not. Runs of any commit are
paired too, and the table names them: a commit that changes the numerics changes the loss. Short runs (under
LOSS_MIN_STEPS, the step-time runs) are left out: over their last steps the loss still falls fast. A run that
did not end ok (a loss that went to NaN stops it) is named, since it is the case an addition most plainly fails.
"""
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from Utils.ladder.registry import ABLATION_SEPARATOR
from Utils.report.ablation import ablation_order
from Utils.report.selection import STATUS_KEYS, mismatches, steps_by_run
from Utils.report.stats import Report
from Utils.results.read import recorded_seed

LOSS_WINDOW = 50      # the last steps whose mean loss is compared: of 300, as BENCHMARKS.md's loss sections
LOSS_MIN_STEPS = 100  # runs shorter than this are step-time runs: their loss is still falling fast


@dataclass
class SeedRow:
    """One seed of one addition: the runs with it and without it at that seed, their means over the last
    LOSS_WINDOW steps (of each run's mean, where a seed ran several times), and the verdict."""
    name: str                 # the ablation run's name: max-<a> or fused+<a>
    steps: int
    seed: int
    commits: list[str]        # the short commits of the runs with and without, in that order, each once
    runs_with: int
    runs_without: int
    with_mean: float
    without_mean: float
    seeds_gap: float          # the largest minus the smallest mean of the runs without, over their seeds; NaN with one seed

    @property
    def gap(self) -> float:
        return self.with_mean - self.without_mean

    @property
    def kept(self) -> bool | None:
        """Whether the gap lies within the seeds' gap; None where the runs without ran at one seed only."""
        return None if np.isnan(self.seeds_gap) else bool(abs(self.gap) <= self.seeds_gap)


@dataclass
class LossSet:
    """One ablation base's SeedRows, and the runs of its names that did not end ok, as "run_id (status)"."""
    base: str
    rows: list[SeedRow]
    left_out: list[str] = field(default_factory=list)


def last_steps_mean(run_steps: pd.DataFrame) -> float:
    """The mean loss over a run's last LOSS_WINDOW steps (by step number, a step recorded twice counted once;
    losses that are not finite left out)."""
    frame = run_steps.drop_duplicates("step", keep="last").sort_values("step").tail(LOSS_WINDOW)
    loss = pd.to_numeric(frame["loss"], errors="coerce").replace([np.inf, -np.inf], np.nan).dropna()
    return float(loss.mean()) if len(loss) else np.nan


def _means(runs: pd.DataFrame, by_run: dict, name: str, steps: int) -> dict[int, list[tuple[float, str]]]:
    """{seed: [(last_steps_mean, short commit), ...]} of the runs named `name` with `steps` steps."""
    found: dict[int, list[tuple[float, str]]] = {}
    for _, run in runs[(runs["optimization"] == name) & (runs["steps"] == steps)].iterrows():
        seed, mean = recorded_seed(run), last_steps_mean(by_run[run["run_id"]])
        if seed is not None and np.isfinite(mean):
            found.setdefault(seed, []).append((mean, str(run["git_commit"]).strip()[:7]))
    return found


def loss_set(report: Report, steps: pd.DataFrame, runs: pd.DataFrame, base: str) -> LossSet:
    """A SeedRow for each run named after `base` (in ablation_order) and each seed at which it and its
    counterpart both ran ok, with the same number of steps, at least LOSS_MIN_STEPS, under the compared runs'
    settings on any GPU; and those names' runs of such length and settings that did not end ok."""
    by_run = steps_by_run(steps)
    ref = report.reference
    same = (runs.apply(lambda run: not mismatches(run, ref, STATUS_KEYS), axis=1).astype(bool)
            if ref is not None and len(runs) else pd.Series(False, index=runs.index))
    long = pd.to_numeric(runs["steps"], errors="coerce") >= LOSS_MIN_STEPS
    candidates = runs[same & long].drop_duplicates("run_id", keep="last")
    usable = candidates[(candidates["status"] == "ok") & candidates["run_id"].isin(by_run)]
    prefix = base + ABLATION_SEPARATOR[base]
    names = ablation_order([n for n in usable["optimization"].astype(str).unique() if n.startswith(prefix)], base)
    rows = []
    for name in names:
        with_name, without_name = (base, name) if base == "max" else (name, base)
        for n_steps in sorted(set(usable.loc[usable["optimization"] == name, "steps"])):
            with_, without = _means(usable, by_run, with_name, n_steps), _means(usable, by_run, without_name, n_steps)
            seed_means = [np.mean([m for m, _ in v]) for v in without.values()]
            seeds_gap = float(max(seed_means) - min(seed_means)) if len(seed_means) > 1 else np.nan
            for seed in sorted(set(with_) & set(without)):
                commits = list(dict.fromkeys(c for _, c in with_[seed] + without[seed] if c))
                rows.append(SeedRow(name, int(n_steps), seed, commits, len(with_[seed]), len(without[seed]),
                                    float(np.mean([m for m, _ in with_[seed]])),
                                    float(np.mean([m for m, _ in without[seed]])), seeds_gap))
    rung = candidates["optimization"].astype(str)
    if not rung.str.startswith(prefix).any():   # no ablation run of this base: nothing to name
        return LossSet(base, rows)
    failed = candidates[((rung == base) | rung.str.startswith(prefix)) & (candidates["status"] != "ok")]
    return LossSet(base, rows, [f"{r.run_id} ({r.optimization}, {r.status})" for r in failed.itertuples()])


def loss_sets(report: Report, steps: pd.DataFrame, runs: pd.DataFrame) -> list[LossSet]:
    """loss_set() for each ablation base, in ABLATION_SEPARATOR's order, where it has a row or a run left out."""
    found = [loss_set(report, steps, runs, base) for base in ABLATION_SEPARATOR]
    return [f for f in found if f.rows or f.left_out]
