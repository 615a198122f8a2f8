"""breakdown.png: a stacked bar per rung of where its profiled step's time goes."""
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from Utils.ladder.registry import rung_order
from Utils.report.breakdown.kernels import COMPUTE, CPU_OPS, MEMORY, OVERHEAD, UNKNOWN
from Utils.report.charts import rung_label
from Utils.report.figures import add_footnote, new_figure

COLORS = {COMPUTE: "#4c72b0", MEMORY: "#dd8452", UNKNOWN: "#c44e52", OVERHEAD: "#c7c7c7", CPU_OPS: "#55a868"}
LABELS = {COMPUTE: "compute (GEMM, attention)", MEMORY: "memory (other kernels, copies)",
          UNKNOWN: "unknown kernels", OVERHEAD: "overhead (GPU idle)", CPU_OPS: "CPU operators (no GPU)"}


def _class_order(df):
    """The classes to draw, bottom of the stack first; a class that is zero for every rung is left out."""
    present = set(df.loc[df["ms_per_step"] > 0, "class"])
    return [c for c in (COMPUTE, MEMORY, UNKNOWN, CPU_OPS, OVERHEAD) if c in present]


def plot_breakdown(df: pd.DataFrame, context: str = "", provenance: str = "") -> Figure:
    """Stacked bars per rung in ladder order: ms per step (left) and shares (right), with each rung's
    unprofiled median step time marked so the totals can be checked against it. df: load_breakdown();
    context (GPU, model, batch) goes under the title, provenance (torch, commits, dates) at the foot."""
    rungs = rung_order(df["rung"])
    classes = _class_order(df)
    gpu_only = CPU_OPS not in classes
    fig = new_figure("Where a step's time goes (torch.profiler, mean of the profiled steps)"
                     + ("" if gpu_only else " · CPU: the compute/memory split is GPU-only"),
                     context, 1.7 + 0.55 * max(len(rungs), 1), width=11)
    ax_ms, ax_share = fig.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [3, 2]})
    tops = []
    for y, rung in enumerate(rungs):
        g = df[df["rung"] == rung].set_index("class")
        left_ms = left_share = 0.0
        for c in classes:
            if c not in g.index:
                continue
            ms, share = g.at[c, "ms_per_step"], g.at[c, "share"]
            hatch = "///" if c == UNKNOWN else None
            ax_ms.barh(y, ms, left=left_ms, color=COLORS[c], height=0.62, hatch=hatch)
            ax_share.barh(y, 100 * share, left=100 * left_share, color=COLORS[c], height=0.62, hatch=hatch)
            if share >= 0.08:
                ax_share.text(100 * (left_share + share / 2), y, f"{100 * share:.0f}%", ha="center",
                              va="center", fontsize=8, color="white" if c != OVERHEAD else "black")
            left_ms += ms
            left_share += share
        median = g["median_step_ms"].iloc[0]
        profiled = g["profiled_step_ms"].iloc[0]
        tops.append(max(left_ms, median if np.isfinite(median) else 0.0))
        if np.isfinite(median) and median > 0:
            ax_ms.plot([median, median], [y - 0.42, y + 0.42], color="black", lw=2.2, zorder=3)
            off = profiled / median - 1
            text = f"  {profiled:.1f} ms (median {median:.1f}, {off:+.0%})"
        else:
            text = f"  {profiled:.1f} ms (no median)"
        ax_ms.text(max(left_ms, median if np.isfinite(median) else 0), y, text, va="center", fontsize=8)
    ax_ms.set_xlim(0, (max(tops) if tops else 1) * 1.45)
    ax_share.set_xlim(0, 100)
    ax_ms.set_yticks(range(len(rungs)), [rung_label(r) for r in rungs])
    ax_ms.invert_yaxis()
    ax_ms.set_xlabel("ms per step (profiled); black line: median step time of the unprofiled steps", fontsize=9)
    ax_share.set_xlabel("share of the profiled step (%)", fontsize=9)
    for ax in (ax_ms, ax_share):
        ax.grid(axis="x", alpha=0.3)
    handles = [Patch(facecolor=COLORS[c], hatch="///" if c == UNKNOWN else None, label=LABELS[c]) for c in classes]
    # Above the bars rather than at the foot, which holds the provenance.
    ax_ms.legend(handles=handles, loc="lower left", bbox_to_anchor=(0, 1.0), ncol=len(handles), fontsize=8,
                 frameon=False, borderaxespad=0.2)
    add_footnote(fig, provenance)
    return fig
