"""Which runs a ladder report compares.

The baseline's latest ok run sets the configuration (Utils.results.schema.MATCH_KEYS: batch size, sequence
length, model, data, device, GPU); each rung is represented by its latest ok run with that configuration.
Runs that do not match, or whose step times are NaN or not positive, are left out and named with the
reason. A rung without such a run keeps the status of its latest run with those settings on any GPU, so
that an OOM or a skip recorded on another machine is reported rather than silently dropped.
"""
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pandas as pd

from Utils.ladder.registry import rung_order
from Utils.results.schema import MATCH_KEYS, RUN_DEFAULTS, STEP_COLUMNS, step_timing

BASELINE = "baseline"
# MATCH_KEYS without the GPU: the settings under which a rung's non-ok run still speaks for it.
STATUS_KEYS = tuple(k for k in MATCH_KEYS if k != "gpu_name")
KEY_LABELS = {"batch_size": "batch", "seq_len": "seq_len", "model": "model", "data": "data",
              "device": "device", "gpu_name": "gpu", "gpu_memory_gib": "GPU_MEMORY_GIB", "nproc": "nproc",
              "parallel": "parallel",
              "step_timing": "step timing"}
# What two compared runs must share: MATCH_KEYS, and how their steps were timed (schema version 2 changed it).
COMPARED_KEYS = (*MATCH_KEYS, "step_timing")


class Excluded(NamedTuple):
    """A run left out of the comparison, and why (e.g. "batch 8 != 16")."""
    run_id: str
    rung: str
    reason: str


def norm(value: object) -> str:
    """Cells as comparable text: 16, 16.0 and "16" are the same batch size; NaN is blank."""
    if isinstance(value, float):
        if np.isnan(value):
            return ""
        return str(int(value)) if value.is_integer() else repr(float(value))   # numpy's repr names its type
    return str(value).strip()


def mismatches(run: pd.Series, ref: pd.Series, keys: tuple = COMPARED_KEYS) -> list[str]:
    """How `run`'s settings differ from `ref`'s in `keys`, e.g. ["batch 8 != 16"]; empty when they match."""
    def value(row, k):   # a frame without a later version's column has that column's default
        if k == "step_timing":
            return step_timing(row.get("schema_version"))
        return norm(row.get(k, RUN_DEFAULTS.get(k, "")))
    return [f"{KEY_LABELS[k]} {value(run, k) or '(blank)'} != {value(ref, k) or '(blank)'}"
            for k in keys if value(run, k) != value(ref, k)]


def measured(run_steps: pd.DataFrame) -> pd.DataFrame:
    """The step rows that are not warm-up: the only ones any summary uses."""
    return run_steps[run_steps["warmup"] != 1]


def steps_by_run(steps_df: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """{run_id: that run's step rows in step order}."""
    return {rid: g.sort_values("step") for rid, g in steps_df.groupby("run_id", sort=False)}


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
    if not problems and measured(run_steps).empty:
        problems.append("no measured steps (all are warm-up)")
    return "; ".join(problems) or None


@dataclass
class Selection:
    """The outcome of select(): the compared runs and everything said about the others."""
    reference: "pd.Series | None"     # the run whose configuration the compared runs share
    has_baseline: bool                # the reference is an ok baseline run
    chosen: dict                      # rung -> runs_df row
    excluded: list                    # [Excluded]
    status_rows: dict                 # rung -> runs_df row shown for a rung with nothing chosen (or None)
    superseded: int = 0               # older ok runs of a chosen configuration that a later run replaced
    newer_not_ok: list = field(default_factory=list)   # runs_df rows that ended badly after the chosen one
    repeats: dict = field(default_factory=dict)        # rung -> runs_df rows of its ok runs from the chosen
                                                       # run's commit, when there are several


def names_one_tree(commit: str) -> bool:
    """Whether a recorded commit names one tree of code: a commit does, and so does one with uncommitted
    changes and their hash ("-dirty-1a2b3c4d", Utils.train.provenance); a blank one does not, nor one marked
    "-dirty" alone (files of earlier versions), whose changes are unknown."""
    commit = str(commit).strip()
    return commit not in ("", "nan") and not commit.endswith("-dirty")


def select(runs_df: pd.DataFrame, steps_df: "pd.DataFrame | None" = None) -> Selection:
    """Choose the run that represents each rung, and keep what the summary's notes say about the rest.

    chosen: {rung id: runs_df row} holding, for each rung that has one, its latest ok run whose batch_size,
    seq_len, model, data, device and gpu_name equal those of the baseline's latest ok run. Without an ok
    baseline the latest ok run overall sets that configuration (the latest run of any status when none is
    ok). excluded: [Excluded(run_id, rung, reason)] for every run whose configuration differs (reason like
    "batch 8 != 16") and, when steps_df is given, every ok run whose step times are NaN, not positive, or
    absent; such runs are never chosen."""
    by_run = steps_by_run(steps_df) if steps_df is not None else None
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
        return Selection(None, False, {}, [], {})

    excluded, mismatched = [], set()
    for i, run in runs_df.iterrows():
        reasons = mismatches(run, reference, COMPARED_KEYS)
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
            commit = str(runs_df.at[candidates[-1], "git_commit"]).strip()
            same_code = [i for i in candidates if names_one_tree(commit)
                         and str(runs_df.at[i, "git_commit"]).strip() == commit]
            if len(same_code) > 1:
                repeats[rung] = [runs_df.loc[i] for i in same_code]
            newer_not_ok += [runs_df.loc[i] for i in rows.index
                             if i > candidates[-1] and runs_df.at[i, "status"] != "ok"
                             and not mismatches(runs_df.loc[i], reference, STATUS_KEYS)]
            continue
        same_kind = [i for i in rows.index if not mismatches(runs_df.loc[i], reference, STATUS_KEYS)]
        status_rows[rung] = runs_df.loc[same_kind[-1]] if same_kind else None
    return Selection(reference, has_baseline, chosen, excluded, status_rows, superseded, newer_not_ok, repeats)
