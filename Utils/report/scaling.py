"""Scaling across GPUs: one rung run at several GPU counts (`make scaling RUNG=max NPROC="1 2 4 8"`), its
global tokens/s against the GPU count and its scaling efficiency, for scaling.png and summary.md.

The ladder report compares runs on equal MATCH_KEYS, nproc included; here nproc is the variable. For each
rung, the latest ok 1-GPU run sets the work (batch per GPU, sequence length, model, data, device, GPU) and
each GPU count is represented by its latest ok run of that work, every multi-GPU run with one parallel
strategy (the 1-GPU run's when it went through torchrun, else the latest multi-GPU run's), so that the only
thing that changes along a line is the number of GPUs.

Efficiency is global tokens/s on n GPUs / (n x global tokens/s on one). It is given only where the n-GPU run
and the 1-GPU run come from the same commit on the same kind of GPU: otherwise it would measure the code or
the card as well as the scaling. The goals it is read against: 97% on 2 GPUs, 93% on 8.
"""
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import EngFormatter

from Utils.ladder.registry import rung_order
from Utils.report.charts import rung_colors, rung_label
from Utils.report.figures import add_footnote, new_figure
# _step_problem: the ladder's own test of usable step times, so that both reports leave out the same runs.
from Utils.report.selection import _step_problem, measured, mismatches, names_one_tree, norm, steps_by_run
from Utils.report.stats import context, provenance, short_commit
from Utils.results.schema import RUN_DEFAULTS, STEP_COLUMNS

SCALING_FILE = "scaling.png"
GOALS = {2: 0.97, 8: 0.93}        # the efficiency the multi-GPU work aims at, by GPU count
# The work a scaling line holds fixed: MATCH_KEYS less nproc (the variable) and parallel, which is checked
# apart since a single process outside torchrun has none.
WORK_KEYS = ("batch_size", "seq_len", "model", "data", "device", "gpu_name")
COLUMNS = ["rung", "nproc", "parallel", "run_id", "git_commit", "median_step_ms", "global_tokens_per_s",
           "tokens_per_s_per_gpu", "efficiency", "note"]
NO_EFFICIENCY_KEYS = {"git_commit": "commit", "gpu_name": "gpu"}   # efficiency compares runs equal in these


@dataclass
class Scaling:
    """What scaling.png and summary.md's scaling section show; build it with build_scaling."""
    table: pd.DataFrame                # scaling_table's frame: a row per (rung, nproc)
    notes: list[str] = field(default_factory=list)   # runs left out, efficiencies not given, and why
    context: str = ""                  # what was measured, for the figure's title
    provenance: str = ""               # torch, commits, dates of the tabled runs, for its foot

    def scaled(self) -> pd.DataFrame:
        """The rows of the rungs measured at two or more GPU counts: the ones worth a figure."""
        return scaled(self.table)


def scaled(table: pd.DataFrame) -> pd.DataFrame:
    """The rows of `table` (scaling_table's frame) whose rung has two or more GPU counts."""
    counts = table.groupby("rung")["nproc"].transform("nunique") if len(table) else table["nproc"]
    return table[counts >= 2]


def nproc_of(run: pd.Series) -> int:
    """The run's GPU count; a row written before the column existed ran one process."""
    text = norm(run.get("nproc", "")) or RUN_DEFAULTS.get("nproc", "1")
    return int(float(text))


def _latest_single(runs: pd.DataFrame) -> "pd.Series | None":
    """The latest of `runs` on one GPU, or None."""
    single = [i for i, run in runs.iterrows() if nproc_of(run) == 1]
    return runs.loc[single[-1]] if single else None


def _strategy(runs: pd.DataFrame, work: pd.Series) -> str:
    """The parallel strategy the multi-GPU runs must share: the 1-GPU run's when it names one, else that of
    the latest multi-GPU run of the same work."""
    if nproc_of(work) == 1 and norm(work.get("parallel", "")):
        return norm(work["parallel"])
    multi = [run for _, run in runs.iterrows() if nproc_of(run) > 1 and not mismatches(run, work, WORK_KEYS)]
    return norm(multi[-1].get("parallel", "")) if multi else ""


def _left_out_reasons(run: pd.Series, work: pd.Series, strategy: str) -> list[str]:
    """Why `run` is not on the scaling line set by `work`; empty when it is."""
    reasons = mismatches(run, work, WORK_KEYS)
    parallel = norm(run.get("parallel", ""))
    if nproc_of(run) > 1 and parallel != strategy:
        reasons.append(f"parallel {parallel or '(blank)'} != {strategy or '(blank)'}")
    return reasons


def _gpus(n: int) -> str:
    return f"{n} GPU" + ("" if n == 1 else "s")


def _choose(rung: str, runs: pd.DataFrame, by_run: dict) -> tuple["pd.Series | None", dict, list[str]]:
    """(the 1-GPU reference or None, {nproc: chosen run}, notes on the runs left out) for one rung's ok runs."""
    empty = pd.DataFrame(columns=STEP_COLUMNS)
    notes, usable = [], []
    for i, run in runs.iterrows():
        problem = _step_problem(by_run.get(run["run_id"], empty))
        if problem:
            notes.append(f"{rung}: run {run['run_id']} ({_gpus(nproc_of(run))}) left out: {problem}")
        else:
            usable.append(i)
    usable_runs = runs.loc[usable]
    if usable_runs.empty:
        return None, {}, notes
    reference = _latest_single(usable_runs)
    work = reference if reference is not None else usable_runs.iloc[-1]
    strategy = _strategy(usable_runs, work)
    chosen = {}
    for _, run in usable_runs.iterrows():
        reasons = _left_out_reasons(run, work, strategy)
        if reasons:
            notes.append(f"{rung}: run {run['run_id']} ({_gpus(nproc_of(run))}) left out: {'; '.join(reasons)}")
        else:
            chosen[nproc_of(run)] = run      # runs are in file order: the latest wins
    return reference, dict(sorted(chosen.items())), notes


def _why_no_efficiency(run: pd.Series, reference: pd.Series) -> str:
    """Why the run's efficiency against the 1-GPU reference would not measure scaling alone ('' when it
    would): another commit or another GPU, or one that is not recorded."""
    reasons = []
    for key, label in NO_EFFICIENCY_KEYS.items():
        mine, theirs = norm(run.get(key, "")), norm(reference.get(key, ""))
        shown = short_commit if key == "git_commit" else norm
        if not mine or not theirs:
            reasons.append(f"{label} not recorded")
        elif key == "git_commit" and not names_one_tree(mine):
            reasons.append(f"commit {shown(mine)}: uncommitted changes of unknown content")
        elif mine != theirs:
            reasons.append(f"{label} {shown(mine)} != {shown(theirs)} of the 1-GPU run {reference['run_id']}")
    return "; ".join(reasons)


def _row(rung: str, run: pd.Series, by_run: dict) -> dict:
    """A scaling row's measurements for one run, efficiency not yet set."""
    n = nproc_of(run)
    median = float(np.median(measured(by_run[run["run_id"]])["step_ms"]))
    tokens = n * run["batch_size"] * run["seq_len"] / (median / 1000.0)
    return dict(rung=rung, nproc=n, parallel=norm(run.get("parallel", "")), run_id=run["run_id"],
                git_commit=norm(run["git_commit"]), median_step_ms=median, global_tokens_per_s=tokens,
                tokens_per_s_per_gpu=tokens / n, efficiency=np.nan, note="")


def _rung_rows(rung: str, reference: "pd.Series | None", chosen: dict, by_run: dict) -> tuple[list, list]:
    """The rows of one rung's scaling line, with their efficiencies, and the notes on those left out."""
    rows = [_row(rung, run, by_run) for run in chosen.values()]
    notes = []
    if reference is None:
        for row in rows:
            row["note"] = "no 1-GPU run"
        if len(rows) > 1:
            notes.append(f"{rung}: no ok 1-GPU run of this work: no scaling efficiency, which divides by "
                         f"the 1-GPU run's tokens/s")
        return rows, notes
    one = next(row for row in rows if row["nproc"] == 1)
    one["efficiency"] = 1.0       # the reference itself, by definition
    for row, run in zip(rows, chosen.values()):
        if row is one:
            continue
        why = _why_no_efficiency(run, reference)
        if why:
            row["note"] = why
            notes.append(f"{rung}, {_gpus(row['nproc'])}: no efficiency for run {row['run_id']} ({why}): "
                         f"efficiency compares runs of one commit on one kind of GPU")
        else:
            row["efficiency"] = row["global_tokens_per_s"] / (row["nproc"] * one["global_tokens_per_s"])
    return rows, notes


def build_scaling(steps_df: pd.DataFrame, runs_df: pd.DataFrame) -> Scaling:
    """The scaling table of load()'s frames (see scaling_table), with its notes, title and footnote. Notes
    are kept for the rungs that have an ok multi-GPU run, the only ones a reader asked to scale."""
    by_run = steps_by_run(steps_df)
    rows, notes, works, tabled = [], [], [], []
    ok = runs_df[runs_df["status"] == "ok"]
    for rung in rung_order(ok["optimization"]):
        runs = ok[ok["optimization"] == rung]
        reference, chosen, left_out = _choose(rung, runs, by_run)
        rung_rows, rung_notes = _rung_rows(rung, reference, chosen, by_run)
        rows += rung_rows
        if any(nproc_of(run) > 1 for _, run in runs.iterrows()):
            notes += left_out + rung_notes
        if len(chosen) > 1:
            works.append(reference if reference is not None else next(iter(chosen.values())))
            tabled += list(chosen.values())
    table = pd.DataFrame(rows, columns=COLUMNS).astype({"nproc": int})
    runs = pd.DataFrame(tabled, columns=runs_df.columns)
    return Scaling(table=table, notes=notes, context="; ".join(dict.fromkeys(context(w) for w in works)),
                   provenance=provenance(runs) if len(runs) else "")


def scaling_table(steps_df: pd.DataFrame, runs_df: pd.DataFrame) -> pd.DataFrame:
    """A row per (rung, nproc), rungs in ladder order and GPU counts ascending, from load()'s frames.

    Each row is the latest ok run of that rung and GPU count whose batch_size, seq_len, model, data, device and
    gpu_name equal those of the rung's latest ok 1-GPU run (of its latest ok run where it has none), every
    multi-GPU run with one parallel strategy; runs whose step times are NaN, not positive or absent are left
    out. Columns: rung, nproc (int), parallel, run_id, git_commit; median_step_ms over the run's measured
    steps in results.csv (the slowest rank's); global_tokens_per_s (nproc x batch_size x seq_len / median
    step seconds); tokens_per_s_per_gpu; efficiency (global tokens/s / (nproc x the 1-GPU run's), a fraction:
    NaN where the rung has no 1-GPU run, or the run's commit or GPU differs from the 1-GPU run's or is not
    recorded); note (why efficiency is NaN, '' otherwise).
    """
    return build_scaling(steps_df, runs_df).table


def _counts_axis(ax, counts: list[int]) -> None:
    ax.set_xticks(counts, [str(n) for n in counts])
    ax.set_xlim(min(counts) - 0.5, max(counts) + 0.5)
    ax.set_xlabel("GPUs (torchrun processes)")
    ax.grid(alpha=0.3)
    ax.set_axisbelow(True)


def _plot_tokens(ax, table: pd.DataFrame, colors: dict) -> None:
    """Global tokens/s per rung, with the ideal n x its 1-GPU tokens/s dashed beside it."""
    top = table["global_tokens_per_s"].max()
    for rung, g in table.groupby("rung", sort=False):
        ax.plot(g["nproc"], g["global_tokens_per_s"], color=colors[rung], marker="o", lw=1.6,
                label=rung_label(rung))
        one = g[g["nproc"] == 1]
        if len(one):
            ideal = g["nproc"] * one["global_tokens_per_s"].iloc[0]
            ax.plot(g["nproc"], ideal, color=colors[rung], ls="--", lw=1.0, alpha=0.7)
            top = max(top, ideal.max())
    ax.set_ylim(0, top * 1.12)
    ax.yaxis.set_major_formatter(EngFormatter(sep=""))
    ax.set_ylabel("global tokens / s")
    ideal = Line2D([], [], color="#555555", ls="--", lw=1.0, label="ideal: n × the 1-GPU tokens/s")
    ax.legend(handles=[*ax.get_legend_handles_labels()[0], ideal], loc="upper left", fontsize=8, frameon=False)


def _plot_efficiency(ax, table: pd.DataFrame, colors: dict, counts: list[int]) -> None:
    """Scaling efficiency (%) per rung against 100% and the goals at the GPU counts measured."""
    ax.axhline(100, color="#333333", lw=1, ls="--", label="100%: ideal")
    goals = {n: 100 * g for n, g in GOALS.items() if n in counts}
    if goals:
        ax.plot(list(goals), list(goals.values()), ls="none", marker="D", ms=7, mfc="none", mec="black",
                label="goal: " + ", ".join(f"{g:.0f}% on {n}" for n, g in goals.items()))
    values = table.dropna(subset=["efficiency"])
    for rung, g in table.groupby("rung", sort=False):
        if g["efficiency"].isna().all():
            continue
        # A GPU count without an efficiency (another commit) leaves a gap rather than a line across it.
        ax.plot(g["nproc"], 100 * g["efficiency"], color=colors[rung], marker="o", lw=1.6, label=rung_label(rung))
        for n, e in zip(g["nproc"], g["efficiency"]):
            if np.isfinite(e):
                ax.annotate(f"{100 * e:.1f}%", (n, 100 * e), textcoords="offset points", xytext=(0, -13),
                            ha="center", fontsize=8)
    if values.empty:
        ax.text(0.5, 0.5, "no efficiency: no 1-GPU run of the same commit\nand GPU (see summary.md's notes)",
                transform=ax.transAxes, ha="center", va="center", fontsize=10, color="#555555")
    low = min([*(100 * values["efficiency"]), *goals.values(), 100.0])
    high = max([*(100 * values["efficiency"]), 100.0])
    ax.set_ylim(low - 6, high + 4)
    ax.set_ylabel("scaling efficiency (%)")
    ax.legend(loc="lower left", fontsize=8, frameon=False)


def plot_scaling(table: pd.DataFrame, context: str, provenance: str) -> Figure:
    """Two panels for the rungs of `table` (scaling_table's frame) measured at two or more GPU counts: global
    tokens/s against the GPU count beside the ideal, and scaling efficiency against 100% and the goals."""
    rows = scaled(table)
    fig = new_figure("Scaling across GPUs (batch per GPU; higher is better)", context, 5.0, width=11.0)
    ax_tok, ax_eff = fig.subplots(1, 2, squeeze=False)[0]
    note = ("global tokens/s = GPUs × batch per GPU × seq_len / median step time (the slowest rank's, measured "
            "steps only); efficiency = tokens/s on n GPUs / (n × tokens/s on 1), given only for runs of one "
            "commit on one kind of GPU.")
    add_footnote(fig, note, provenance)
    if rows.empty:
        for ax in (ax_tok, ax_eff):
            ax.set_axis_off()
        ax_tok.text(0.5, 0.5, "no rung measured at two or more GPU counts", transform=ax_tok.transAxes,
                    ha="center", va="center", fontsize=11, color="#555555")
        return fig
    counts = sorted(set(rows["nproc"]))
    colors = rung_colors(list(dict.fromkeys(rows["rung"])))
    _plot_tokens(ax_tok, rows, colors)
    _plot_efficiency(ax_eff, rows, colors, counts)
    for ax in (ax_tok, ax_eff):
        _counts_axis(ax, counts)
    return fig
