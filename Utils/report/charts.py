"""The ladder's charts: each plot_* takes a Report and returns a Figure; nothing is written here.

Every chart is titled with what was measured (GPU, model, batch, sequence length, data) and footed with
where the figures come from (torch, commits, dates), both wrapped to the chart's width so that neither is
cut off.
"""
from collections.abc import Iterable

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter

from Utils.ladder.registry import LADDER
from Utils.report.figures import add_footnote, new_figure
from Utils.report.selection import BASELINE, measured
from Utils.report.stats import BOOTSTRAP_RESAMPLES, NO_BASELINE_NOTE, Report
from Utils.results.schema import PEER_PREFIX, is_peer

LOG_SCALE_SPAN = 10.0
# A run named by its additions (fused+gelu_epilogue+packed_attention+...) is broken after a "+" past this many
# characters on an axis or in a legend, so that its label does not squeeze the plot out of the figure.
RUNG_LABEL_WIDTH = 24
PALETTE = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3",
           "#8c8c8c", "#ccb974", "#64b5cd"]


def rung_colors(rungs: Iterable[str]) -> dict[str, str]:
    """One color per rung, fixed by its place in the ladder so every chart agrees; names the ladder does not
    know (fused+loss, custom runs) take the colors after it, alphabetically."""
    unknown = sorted(set(rungs) - set(LADDER))
    return {r: PALETTE[(LADDER.index(r) if r in LADDER else len(LADDER) + unknown.index(r)) % len(PALETTE)]
            for r in rungs}


def rung_label(name: str) -> str:
    """A run's name for an axis or a legend: broken after a "+" where a line would pass RUNG_LABEL_WIDTH."""
    lines, line = [], ""
    for part in name.split("+"):
        if line and len(line) + 1 + len(part) > RUNG_LABEL_WIDTH:
            lines.append(line + "+")
            line = part
        else:
            line = f"{line}+{part}" if line else part
    lines.append(line)
    return "\n".join(lines)


def _figure(title, report, height, width=9.0, ncols=1, sharey=False, note=""):
    fig = new_figure(title, report.context, height, width)
    axes = fig.subplots(1, ncols, sharey=sharey, squeeze=False)[0]
    add_footnote(fig, note, report.provenance)
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


def _peer_style(rung) -> dict:
    """A peer's bars are outlined in dashes, so that they read as another trainer beside the ladder."""
    return {"edgecolor": "black", "linestyle": "--", "linewidth": 1.0} if is_peer(rung) else {}


def _rung_axis(ax, rungs):
    ax.set_yticks(range(len(rungs)), [f"{r.removeprefix(PEER_PREFIX)} (peer)" if is_peer(r) else rung_label(r)
                                      for r in rungs])
    for tick, rung in zip(ax.get_yticklabels(), rungs):
        if is_peer(rung):
            tick.set_fontstyle("italic")
    ax.set_ylim(len(rungs) - 0.5, -0.5)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)


def plot_speedup(report: Report) -> Figure:
    """Horizontal bars of the median speedup over the baseline, with 95% bootstrap whiskers."""
    t = report.table
    rungs = list(t.index)
    note = (f"Whiskers: 95% bootstrap interval of the ratio of medians ({BOOTSTRAP_RESAMPLES} resamples of each "
            f"run's measured step times): the spread within one run, not between runs, which is larger.")
    fig, (ax,) = _figure("Speedup over the baseline (higher is better)", report, _bar_height(len(rungs)) + 0.6,
                         note=note if report.has_baseline else "")
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
        ax.barh(y, s, color=colors[rung], height=0.62, **_peer_style(rung),
                xerr=[[max(s - lo, 0)], [max(hi - s, 0)]], error_kw={"capsize": 3, "lw": 1})
        ax.text(max(hi, s), y, f"  {s:.2f}x", va="center", fontsize=9, fontweight="bold")
        x_max = max(x_max, hi, s)
    ax.axvline(1.0, color="black", lw=1, ls="--")
    # Above the plot, where no tick label can fall on it.
    ax.text(1.0, 1.0, "1x", transform=ax.get_xaxis_transform(), ha="center", va="bottom", fontsize=8)
    ax.set_xlim(0, x_max * 1.18)
    _rung_axis(ax, rungs)
    ax.set_xlabel("median baseline step time / median rung step time, measured steps only", fontsize=9)
    return fig


def _warmup_spans(steps):
    spans = set()
    for _, g in steps[steps["warmup"] == 1].groupby("run_id"):
        spans.add((g["step"].min() - 0.5, g["step"].max() + 0.5))
    return sorted(spans)


def _fmt_ms(ms):
    return f"{ms / 1000:.1f} s" if ms >= 1000 else f"{ms:.0f} ms"


def plot_step_time(report: Report) -> Figure:
    """Step time against step for every compared rung; warm-up shaded; log scale past a 10x spread."""
    fig, (ax,) = _figure("Step time over the run (lower is better)", report, 5.4)
    rungs = report.rungs_with_steps()
    if not rungs:
        _empty(ax, "no run with usable step times to plot")
        return fig
    colors = rung_colors(report.table.index)
    steps = report.steps
    measured_ms = measured(steps)["step_ms"]
    medians = report.table.loc[rungs, "median_step_ms"]
    log = medians.max() / medians.min() > LOG_SCALE_SPAN
    # A compile step can be a thousand times a measured one; the axis follows the measured steps and
    # the warm-up points above it are listed instead, so the lines that matter keep their height.
    top = measured_ms.max() * (1.6 if log else 1.15)
    bottom = measured_ms.min() / 1.6 if log else 0
    for i, (lo, hi) in enumerate(_warmup_spans(steps)):
        ax.axvspan(lo, hi, color="#999999", alpha=0.15, lw=0,
                   label="warm-up (left out of the summary)" if i == 0 else None)
    off_chart = []
    for rung in rungs:
        g = steps[steps["optimization"] == rung]
        ax.plot(g["step"], g["step_ms"], color=colors[rung], lw=1.3, label=rung_label(rung))
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


def plot_throughput(report: Report) -> Figure:
    """Tokens per second and MFU per rung, side by side."""
    t = report.table
    rungs = list(t.index)
    fig, (ax_tok, ax_mfu) = _figure("Throughput (higher is better)", report, _bar_height(len(rungs)) + 0.2,
                                    width=10, ncols=2, sharey=True)
    colors = rung_colors(rungs)
    for ax, col, label, fmt in ((ax_tok, "tokens_per_s", "tokens / s (global batch × seq_len / median step time)",
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
            ax.barh(y, v * scale, color=colors[rung], height=0.62, **_peer_style(rung))
            ax.text(v * scale, y, fmt(v), va="center", fontsize=9)
        ax.set_xlim(0, np.nanmax(values) * scale * 1.25)
        if col == "tokens_per_s":
            ax.xaxis.set_major_formatter(FuncFormatter(_si))
        _rung_axis(ax, rungs)
        ax.set_xlabel(label, fontsize=9)
    return fig


def plot_memory(report: Report) -> Figure:
    """Peak allocated and reserved GPU memory per rung; where a rung accumulated, every rung's micro-batch, and
    the GPU_MEMORY_GIB cap the runs fitted under."""
    t = report.table
    rungs = list(t.index)
    fig, (ax,) = _figure("Peak GPU memory (lower is better)", report, _bar_height(len(rungs)) + 0.5)
    alloc, reserved = t["peak_mem_allocated_gib"], t["peak_mem_reserved_gib"]
    if not (np.isfinite(alloc).any() or np.isfinite(reserved).any()):
        _empty(ax, "no GPU memory recorded for these runs (CPU runs record none)")
        return fig
    colors = rung_colors(rungs)
    h = 0.36
    accumulated = (t["accumulation_steps"] > 1).any()   # then every rung's micro-batch, the whole batch's too
    for y, rung in enumerate(rungs):
        a, r = alloc[rung], reserved[rung]
        if not (np.isfinite(a) or np.isfinite(r)):
            _no_bar_label(ax, y, t.loc[rung])
            continue
        for value, dy, style in ((a, -h / 2, {"alpha": 1.0, **_peer_style(rung)}),
                                 (r, h / 2, {"alpha": 0.4, "hatch": "///", "edgecolor": colors[rung]})):
            if np.isfinite(value):
                ax.barh(y + dy, value, height=h, color=colors[rung], **style)
                # A peer's own program reports the GPU's memory in use, not a caching allocator's reserve.
                in_use = " in use on the GPU" if is_peer(rung) and not np.isfinite(a) else ""
                micro = t.loc[rung, "micro_batch"]
                fitted = f", micro-batch {micro:.0f}" if dy < 0 and np.isfinite(micro) and accumulated else ""
                ax.text(value, y + dy, f" {value:.1f}{in_use}{fitted}", va="center", fontsize=8)
    handles = [Patch(facecolor="#777777", label="allocated by tensors"),
               Patch(facecolor="#777777", alpha=0.4, hatch="///", edgecolor="#777777",
                     label="reserved by the caching allocator")]
    # Under GPU_MEMORY_GIB every rung fills the same cap: what a memory saving buys is a larger micro-batch.
    caps = t["gpu_memory_gib"].dropna().unique()
    right = np.nanmax(np.concatenate([alloc.to_numpy(), reserved.to_numpy(), caps]))
    for cap in caps:
        handles.append(ax.axvline(cap, color="#333333", linestyle="--", linewidth=1,
                                  label=f"GPU_MEMORY_GIB={cap:g}"))
    ax.set_xlim(0, right * 1.15)
    _rung_axis(ax, rungs)
    ax.set_xlabel("peak memory (GiB), as recorded in runs.csv", fontsize=9)
    ax.legend(handles=handles, loc="best", fontsize=8)
    return fig


def plot_loss(report: Report) -> Figure:
    """Training loss against step for every compared rung on one axis, and beside it each rung's loss
    minus the baseline's at the same step, where curves that overlap can be told apart."""
    fig, (ax, gap_ax) = _figure("Training loss (the same learning on every rung should overlap)", report, 5.4,
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
        ax.plot(g["step"], g["loss"], color=colors[rung], lw=1.3, label=rung_label(rung), alpha=0.9)
    ax.set_xlabel("step (warm-up steps included)")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if BASELINE in rungs:
        base = steps[steps["optimization"] == BASELINE].set_index("step")["loss"]
        for rung in rungs:
            if rung == BASELINE:
                continue
            g = steps[steps["optimization"] == rung].set_index("step")["loss"]
            gap = (g - base).dropna()
            gap_ax.plot(gap.index, gap.values, color=colors[rung], lw=1.0, alpha=0.9, label=rung_label(rung))
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
