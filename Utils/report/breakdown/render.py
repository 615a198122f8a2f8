"""breakdown.md: per rung, the split of its profiled step, its kernels' time by kind, its top kernels, its unknown
kernels and the copies' bandwidth, with how each figure was made."""
from collections.abc import Sequence

import numpy as np
import pandas as pd

from Utils.ladder.registry import ADDITIONS, additions_of, rung_order
from Utils.report import markdown
from Utils.report.breakdown.kernels import COMPUTE, CPU_OPS, MEMORY, OVERHEAD, UNKNOWN, short_name
from Utils.report.breakdown.trace import STEP_END, STEP_START

# A profiled step may differ from the unprofiled median by this much before the
# report says so (the profiler adds a little launch overhead of its own).
MATCH_TOLERANCE = 0.10
TOP_KERNELS = 10
TOP_GAPS = 5


def off_median(profiled: float, median: float) -> "float | None":
    """How far the profiled step is from the unprofiled median, as a fraction; None when unknown."""
    return profiled / median - 1 if np.isfinite(profiled) and np.isfinite(median) and median > 0 else None


def _off_median_text(profiled, median):
    off = off_median(profiled, median)
    if off is None:
        return "-"
    return f"{off:+.0%}" + (f" (over {MATCH_TOLERANCE:.0%})" if abs(off) > MATCH_TOLERANCE else "")


def _summary_table(df):
    rows = []
    for rung in rung_order(df["rung"]):
        g = df[df["rung"] == rung].set_index("class")
        first = g.iloc[0]

        def cell(c):
            return markdown.cell(g.at[c, "ms_per_step"], ".2f") if c in g.index else "-"

        def share(c):
            return markdown.cell(100 * g.at[c, "share"], ".0f", "%") if c in g.index else "-"

        tflops, peak = first["compute_tflops"], first["peak_tflops"]
        rows.append([rung, cell(COMPUTE), cell(MEMORY), cell(UNKNOWN), cell(CPU_OPS), cell(OVERHEAD),
                     f"{share(COMPUTE)} / {share(MEMORY)} / {share(OVERHEAD)}",
                     markdown.cell(first["profiled_step_ms"], ".1f"), markdown.cell(first["median_step_ms"], ".1f"),
                     _off_median_text(first["profiled_step_ms"], first["median_step_ms"]),
                     markdown.cell(tflops, ".0f"),
                     markdown.cell(100 * tflops / peak if np.isfinite(tflops) and np.isfinite(peak) and peak else None,
                          ".1f", "%")])
    header = ["rung", "compute ms", "memory ms", "unknown ms", "cpu_ops ms", "overhead ms",
              "compute / memory / overhead", "profiled ms", "median ms", "vs median", "compute TFLOP/s",
              "of peak"]
    if CPU_OPS not in set(df["class"]):          # a GPU-only table needs no cpu_ops column
        header.pop(4)
        rows = [r[:4] + r[5:] for r in rows]
    return markdown.table([header] + rows)


def _kind_section(bd):
    """The kernels' time summed by kind (GEMM (cuBLAS), attention (cuDNN), ...), longest first: which work a class's
    time is, e.g. how much of compute is attention."""
    kinds = {}
    for k in bd.kernels:
        kind = kinds.setdefault((k.cls or UNKNOWN, k.label or "-"), [0, 0.0, 0.0])
        kind[0] += 1
        kind[1] += k.calls_per_step
        kind[2] += k.ms_per_step
    rows = [[cls, label, str(n), markdown.cell(calls, ".1f"), markdown.cell(ms, ".3f"),
             markdown.cell(100 * ms / bd.step_ms, ".1f", "%")]
            for (cls, label), (n, calls, ms) in sorted(kinds.items(), key=lambda item: -item[1][2])]
    return ["The kernels' time by kind, copies and memsets included: each kernel's time inside the step windows "
            "summed, so kernels that overlap each count whole (the split above counts overlapping time once):", "",
            markdown.table([["class", "kind", "kernels", "calls/step", "ms/step", "of step"]] + rows, left=(0, 1)),
            ""]


def _kernel_section(bd, rung, top=TOP_KERNELS):
    lines = []
    if not bd.gpu:
        lines += ["No GPU kernels: this trace is from a CPU run. The compute / memory / overhead split is "
                  "GPU-only; the time is shown as PyTorch operators (cpu_ops) and the rest (overhead).", ""]
        return lines
    lines += _kind_section(bd)
    rows = [[str(i + 1), k.cls or "unknown", k.label or "-", markdown.cell(k.calls_per_step, ".1f"),
             markdown.cell(k.ms_per_step, ".3f"), markdown.cell(100 * k.ms_per_step / bd.step_ms, ".1f", "%"),
             f"`{short_name(k.name)}`"] for i, k in enumerate(bd.kernels[:top])]
    lines += [f"Top {min(top, len(bd.kernels))} of {len(bd.kernels)} kernels by time per step (all of them in "
              "kernels.csv):", "",
              markdown.table([["#", "class", "kind", "calls/step", "ms/step", "of step", "kernel"]] + rows,
                             left=(1, 2, 6)),
              ""]
    lines += _gap_section(bd, rung)
    if bd.unknown:
        unknown = [k for k in bd.kernels if k.cls is None]
        lines += [f"Unknown kernels ({len(unknown)}; add them to KERNEL_CLASSES in "
                  f"Utils/report/breakdown/kernels.py once their kind is known):", ""]
        lines += [f"- `{short_name(k.name, 160)}`: {k.ms_per_step:.3f} ms/step, {k.calls_per_step:.1f} calls/step"
                  for k in unknown]
        lines.append("")
    else:
        lines += ["Unknown kernels: none.", ""]
    if bd.transfers:
        rows = []
        for t in bd.transfers:
            bw = t.bandwidth
            ceiling = bd.peak_bandwidth if t.on_device else None
            rows.append([t.name, markdown.cell(t.bytes_per_step / 2 ** 20, ",.2f"), markdown.cell(t.ms_per_step, ".3f"),
                         markdown.cell(bw / 1e9 if bw else None, ",.1f"),
                         markdown.cell(100 * bw / ceiling if bw and ceiling else None, ".1f", "%") if t.on_device
                         else "host link"])
        lines += ["Copies and memsets, the GPU activities whose bytes the trace records:", "",
                  markdown.table([["transfer", "MiB/step", "ms/step", "GB/s", "of HBM peak"]] + rows), ""]
    return lines


def _activity(name, labels):
    """A gap's neighbour for a table: its kind (labels: the split's, by name) and short name, or the step's edge."""
    if name in (STEP_START, STEP_END):
        return name
    return f"{labels.get(name) or 'unknown'}: `{short_name(name, 60)}`"


def _gap_section(bd, rung, top=TOP_GAPS):
    """Where the overhead sits: its longest stretches a step, by the GPU activities on either side, and why the
    stretches at a profiled step's edges are longer than in the run's own steps."""
    idle = bd.ms[OVERHEAD]   # the gaps' sum (split keeps them so)
    if not bd.gaps or idle <= 0:
        return []
    labels = {k.name: k.label for k in bd.kernels}
    rows = [[str(i + 1), markdown.cell(g.ms_per_step, ".3f"), markdown.cell(g.count_per_step, ".1f"),
             _activity(g.before, labels), _activity(g.after, labels)] for i, g in enumerate(bd.gaps[:top])]
    shown = sum(g.ms_per_step for g in bd.gaps[:top])
    # profile_steps (Utils/train/loop.py) waits for each profiled step's end before it launches the next; a run
    # that reads back every few steps (Addition.readback_deferred) queues the steps between ahead of the GPU.
    deferring = next((a for a in additions_of(rung) or () if ADDITIONS[a].readback_deferred), None)
    hidden = (f"which `{deferring}` hides in every unprofiled step but the first after each read-back" if deferring
              else "which this rung, reading its loss back every step, pays in its own steps too")
    return [f"Where the GPU waits: the overhead's {min(top, len(bd.gaps))} largest parts, each the idle time "
            f"between the same two activities, summed over a step ({shown:.3f} of its {idle:.3f} ms). The "
            f"activities on either side say where a gap sits, not what causes it. The profiler's loop waits for "
            f"each step to end before it launches the next, so the gaps before a step's first kernels (after "
            f"(step start), and after the batch's copy to the GPU) are the host's time to launch them, {hidden}; "
            f"the gap before (step end) is the host waking from that wait.", "",
            markdown.table([["#", "ms/step", "gaps/step", "idle after", "until"]] + rows, left=(3, 4)), ""]


def render_report(df: pd.DataFrame, breakdowns: dict, context: str = "", notes: Sequence[str] = (),
                  trace_files: "dict | None" = None) -> str:
    """breakdown.md's text from load_breakdown()'s frame, {rung: Breakdown or None} for the kernel tables,
    and {rung: trace file name} where it is not trace_<rung>.json.gz."""
    lines = [f"# Step-time breakdown{': ' + context if context else ''}", ""]
    lines += [_summary_table(df), ""]
    peak_bw = next((bd.peak_bandwidth for bd in breakdowns.values() if bd and bd.peak_bandwidth), None)
    lines += [
        "Each rung ran a few steps after warm-up under torch.profiler; the times are the mean over those "
        "profiled steps, each step's window split so that the parts add up to it: **compute** is time "
        "when a GEMM or attention kernel runs; **memory** is time when only other kernels run "
        "(elementwise, layer norm, softmax, the loss, the optimizer, copies), bandwidth-bound at these "
        "sizes; **unknown** is time when only kernels that KERNEL_CLASSES in Utils/report/breakdown/kernels.py "
        "does not name run; **overhead** is time when no kernel runs (Python, launches, synchronization, data waits). "
        "Overlapping kernels count once, as compute first. *median ms* is the median step time of the "
        "run's unprofiled measured steps; *vs median* says how far the profiled step is from it (the "
        f"profiler adds some launch cost of its own; beyond {MATCH_TOLERANCE:.0%} it is flagged).",
        "",
        "*compute TFLOP/s* = the model's FLOPs per step (6N + 12·L·H·d·T per token, as for MFU) over the "
        "compute time: how fast the matmuls and attention run while they run. *of peak* divides by the "
        "GPU's dense bf16 peak, the suite's one denominator; the fp32 rung's GEMMs run on the CUDA cores "
        "and the TF32 rung's at TF32 rate, whose ceilings are lower.",
        "",
        "Memory kernels' bandwidth is not measured: a Chrome trace records no bytes per kernel (CUPTI's "
        "kernel records carry none; Nsight Compute would be needed). Bytes are recorded for copies and "
        "memsets only, shown per rung below"
        + (f" against the HBM peak of {peak_bw / 1e12:.2f} TB/s." if peak_bw else "."),
        "",
    ]
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    for rung in rung_order(df["rung"]):
        g = df[df["rung"] == rung]
        first = g.iloc[0]
        steps = int(first["profiled_steps"]) if np.isfinite(first["profiled_steps"]) else "?"
        trace_file = (trace_files or {}).get(rung, f"trace_{rung}.json")
        lines += [f"## {rung}", "",
                  f"Run {first['run_id']}, {steps} profiled steps; trace: {trace_file} (opens in Perfetto, "
                  f"ui.perfetto.dev, or chrome://tracing).", ""]
        rows = [[r["class"], markdown.cell(r["ms_per_step"], ".3f"), markdown.cell(100 * r["share"], ".1f", "%")]
                for _, r in g.iterrows()]
        rows.append(["total (profiled step)", markdown.cell(first["profiled_step_ms"], ".3f"), "100.0%"])
        lines += [markdown.table([["class", "ms/step", "share"]] + rows), ""]
        if np.isfinite(first["compute_tflops"]):
            peak = first["peak_tflops"]
            lines += [f"Inside the compute kernels: {first['compute_tflops']:.1f} TFLOP/s"
                      + (f", {100 * first['compute_tflops'] / peak:.1f}% of the {peak:.0f} TFLOP/s dense bf16 peak."
                         if np.isfinite(peak) and peak else " (peak unknown for this GPU)."), ""]
        bd = breakdowns.get(rung)
        if bd is None:
            lines += [f"No readable trace_{rung}.json in PREFIX: the kernel tables are left out.", ""]
        else:
            lines += _kernel_section(bd, rung)
    return "\n".join(lines).rstrip("\n") + "\n"
