"""Where a step's time goes: compute, memory traffic and overhead, measured from torch.profiler traces.

A rung's profiled steps are read from the Chrome trace that torch.profiler exports. Each ProfilerStep#N
annotation marks one step's wall-clock window; the GPU activities that start inside it are that step's
work. The window is split four ways, so that the parts add up to the window exactly:

- compute: time when a matrix-multiply or attention kernel runs (GEMMs, flash attention);
- memory: time when only other kernels run (elementwise, normalization, softmax, the loss, the
  optimizer, copies and memsets): bandwidth-bound at GPT-2's sizes;
- unknown: time when only kernels this module cannot name run: they are listed, never guessed;
- overhead: time when nothing runs on the GPU (Python, launches, synchronization, data waits).

Kernels that overlap (another stream, or a trace's clock jitter) are counted once, compute first, then
memory, then unknown. A trace without GPU activity (a CPU run) gets the time inside PyTorch operators
(cpu_ops) and the rest (overhead) instead: the split is GPU-only.

Outputs in PREFIX: breakdown.csv (rows appended per profiled run), and breakdown.md and breakdown.png,
redrawn from the latest run of each rung in breakdown.csv and from its trace_<rung>.json.gz.
"""
import bisect
import contextlib
import functools
import gzip
import json
import os
import re
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from Utils.report import markdown
from Utils.results.files import write_atomic
from Utils.ladder.registry import rung_order
from Utils.results.store import RUN_COLUMNS, RUNS_FILE, ResultsError, append_rows, check_file

# pyplot is never imported: the figure is a plain Figure rendered by Agg on savefig (as in plot_results.py).

COMPUTE, MEMORY, UNKNOWN, OVERHEAD, CPU_OPS = "compute", "memory", "unknown", "overhead", "cpu_ops"
GPU_CLASSES = (COMPUTE, MEMORY, UNKNOWN, OVERHEAD)
CPU_CLASSES = (CPU_OPS, OVERHEAD)

BREAKDOWN_FILE = "breakdown.csv"
REPORT_FILE = "breakdown.md"
CHART_FILE = "breakdown.png"
BREAKDOWN_COLUMNS = ["run_id", "rung", "class", "ms_per_step", "share", "profiled_step_ms", "median_step_ms",
                     "profiled_steps", "compute_tflops", "peak_tflops"]
NUMERIC_COLUMNS = BREAKDOWN_COLUMNS[3:]

# A profiled step may differ from the unprofiled median by this much before the
# report says so (the profiler adds a little launch overhead of its own).
MATCH_TOLERANCE = 0.10
TOP_KERNELS = 10
DPI = 120

# ---------------------------------------------------------------------------------------------
# Kernel classes
#
# (pattern, class, label), tried in order; the first match wins. A pattern is searched in the kernel's
# own name, the part before its template arguments and parameters, so that a functor named in the
# template arguments (FillFunctor, a softmax lambda) does not decide the class; a pattern may run on
# into the template arguments where they are what tells kernels apart (fused AdamW is a
# multi_tensor_apply_kernel whose functor is FusedAdamMathFunctor). Case is ignored.
# Names are as CUPTI reports them, demangled, e.g. "void at::native::(anonymous namespace)::
# cunn_SoftMaxForward<4, float, float, float, ...>(float*, float const*, int)".

KERNEL_CLASSES = [
    # Inductor's kernels first: their names list the fused ATen ops, which may mention attention or mm.
    (r"^triton_tem_", COMPUTE, "GEMM (Triton template)"),             # max-autotune's mm/bmm/addmm templates
    (r"^triton_(poi|red|per|for)_", MEMORY, "Triton fused (Inductor)"),  # pointwise, reduction, persistent, foreach
    # Compute: matrix multiplies and attention, the tensor cores' work. The fp32 rung's GEMMs run on the
    # CUDA cores (SIMT) instead, but they are the step's matmuls all the same, so they count here too.
    (r"splitKreduce", COMPUTE, "GEMM (split-K reduce)"),              # cuBLAS finishing a split-K GEMM
    (r"^nvjet_", COMPUTE, "GEMM (cuBLAS)"),                           # cuBLAS 12.8+ on Hopper/Blackwell
    (r"cutlass::Kernel2?<\w*gemm|cutlass::device_kernel<.*gemm", COMPUTE, "GEMM (CUTLASS)"),
    (r"gemm|gemv", COMPUTE, "GEMM (cuBLAS)"),                         # sm90_xmma_gemm_*, ampere_sgemm_*, gemmSN_*
    (r"flash_fwd|flash_bwd|flash::|FlashAttn", COMPUTE, "flash attention"),  # pytorch_flash:: (FA2 in PyTorch)
    (r"^fmha_cutlass", COMPUTE, "attention (memory-efficient)"),      # xformers' kernels inside PyTorch SDPA
    (r"sdpa|^cudnn::fusion", COMPUTE, "attention (cuDNN)"),           # cudnn_generated_fort_native_sdpa_*
    # Memory: the rest, bandwidth-bound at these sizes.
    (r"multi_tensor_apply_kernel<.*FusedAdam", MEMORY, "fused AdamW"),
    (r"multi_tensor_apply_kernel<.*LpNorm|lpnorm_cleanup", MEMORY, "gradient norm (clip)"),
    (r"multi_tensor_apply_kernel", MEMORY, "foreach (multi-tensor)"),  # AdamW's default foreach implementation
    (r"^kOptimizer|^kPreconditionOptimizer", MEMORY, "8-bit AdamW (bitsandbytes)"),
    (r"^_adamw_kernel$", MEMORY, "AdamW (Triton, the clip applied)"),   # Utils.adamw_kernel
    (r"^_square_sum_kernel$", MEMORY, "gradient norm (clip)"),
    (r"SoftMax\w*<.*LogSoftMax", MEMORY, "log-softmax (loss)"),       # cross-entropy = log_softmax + nll_loss
    (r"softmax", MEMORY, "softmax"),                                  # cunn_SoftMax*, softmax_warp_*
    (r"layer_norm|LayerNorm|GammaBeta|RowwiseMoments", MEMORY, "layer norm"),
    (r"nll_loss|cross_entropy", MEMORY, "cross-entropy loss"),          # and Utils.ce_kernel's kernels
    (r"indexSelect|index_select", MEMORY, "embedding (index select)"),
    (r"embedding_backward|compute_grad_weight|sum_and_scatter|krn_partial|compute_num_of_partial_segments|renorm",
     MEMORY, "embedding backward"),
    (r"index_elementwise|index_put|scatter|gather", MEMORY, "index / scatter / gather"),
    (r"cub::|DeviceRadixSort|radixSort|sort|DeviceScan|DeviceSelect|DeviceCompact|tensor_kernel_scan",
     MEMORY, "sort / scan"),                                          # the embedding backward's sort by token
    (r"CatArrayBatchedCopy", MEMORY, "cat"),
    (r"triu_tril", MEMORY, "tril / triu"),
    (r"elementwise", MEMORY, "elementwise"),                          # vectorized_/unrolled_elementwise_kernel
    (r"reduce_kernel", MEMORY, "reduction"),                          # at::native::reduce_kernel (sum, mean)
]
_COMPILED = [(re.compile(r"^[^<(]*?(?:" + p + ")", re.IGNORECASE), c, label) for p, c, label in KERNEL_CLASSES]

# Chrome-trace categories of GPU activity (Kineto's names, lower-cased).
_KERNEL_CAT = "kernel"
_COPY_CATS = {"gpu_memcpy": "memcpy", "gpu_memset": "memset"}
_STEP_NAME = re.compile(r"^ProfilerStep#\d+$")


def kernel_id(name):
    """A kernel's name without the noise: no leading "void ", no "(anonymous namespace)::"."""
    name = name.strip()
    if name.startswith("void "):
        name = name[5:]
    return name.replace("(anonymous namespace)::", "")


@functools.lru_cache(maxsize=4096)
def classify(name):
    """(class, label) of a kernel name, class in {"compute", "memory"}; (None, None) when unknown."""
    ident = kernel_id(name)
    for pattern, cls, label in _COMPILED:
        if pattern.search(ident):
            return cls, label
    return None, None


def short_name(name, width=100):
    """A kernel name for a table: kernel_id without the parameter list, cut to `width` characters."""
    ident = kernel_id(name)
    if name.lstrip().startswith("void ") and ident.endswith(")"):     # a demangled kernel's parameter list
        depth = 0
        for i in range(len(ident) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(ident[i], 0)
            if depth == 0:
                ident = ident[:i] if i else ident
                break
    return ident if len(ident) <= width else ident[:width - 1] + "…"


# ---------------------------------------------------------------------------------------------
# Peak memory bandwidth

# HBM bandwidth in bytes/s, from each vendor datasheet; checked in order, first name fragment found wins.
# GH200 comes first because its name contains "H200", and its bandwidth depends on the memory fitted
# (HBM3 4 TB/s or HBM3e 4.9 TB/s), which the name does not say: None, so nothing is claimed.
PEAK_HBM_BANDWIDTH = [
    ("GH200", None),
    ("H200", 4.8e12),             # H200 SXM and NVL: 4.8 TB/s HBM3e
    ("H100 PCIe", 2.0e12),
    ("H100 NVL", 3.9e12),
    ("H100", 3.35e12),            # H100 SXM
    ("B200", 8.0e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),           # the 40 GB A100s
    ("L40", 864e9),               # L40 and L40S
    ("L4", 300e9),
    ("A10", 600e9),               # A10 and A10G
    ("RTX 4090", 1008e9),
]


def peak_hbm_bandwidth(gpu_name):
    """The GPU's peak memory bandwidth in bytes/s by its name, or None when unknown."""
    for fragment, bandwidth in PEAK_HBM_BANDWIDTH:
        if fragment in (gpu_name or ""):
            return bandwidth
    return None


# ---------------------------------------------------------------------------------------------
# Splitting a trace


class TraceError(ValueError):
    """A trace that cannot be split; the message is one line and names the fix."""


@dataclass
class KernelStat:
    name: str
    cls: "str | None"             # "compute", "memory", or None when unknown
    label: "str | None"
    ms_per_step: float            # summed duration (clipped to the step windows) / profiled steps
    calls_per_step: float


@dataclass
class Transfer:
    """A memcpy or memset kind: the only GPU activities whose byte counts a Chrome trace records."""
    name: str                     # e.g. "Memcpy HtoD (Pinned -> Device)", "Memset (Device)"
    bytes_per_step: float
    ms_per_step: float

    @property
    def bandwidth(self):
        """Achieved bytes/s, or None when its time is zero."""
        return self.bytes_per_step / (self.ms_per_step / 1e3) if self.ms_per_step > 0 else None

    @property
    def on_device(self):
        """True when both ends are in the GPU's memory, so that its ceiling is the HBM peak; a host
        copy is bounded by the host link instead."""
        return "DtoD" in self.name or self.name.startswith("Memset")


@dataclass
class Breakdown:
    """A trace's mean profiled step, split by class. Times in ms per step."""
    gpu: bool                     # False: no GPU activity in the trace, the split is cpu_ops / overhead
    gpu_name: str
    steps: int                    # profiled step windows
    step_ms: float                # mean window length
    ms: dict                      # class -> mean ms per step, GPU_CLASSES or CPU_CLASSES; sums to step_ms
    per_step: list                # a dict per window: step name, window_ms and the class times
    kernels: list = field(default_factory=list)     # [KernelStat], longest first
    unknown: list = field(default_factory=list)     # names of unclassified kernels, longest first
    transfers: list = field(default_factory=list)   # [Transfer] with bytes, longest first
    flops_per_step: "float | None" = None
    peak_flops: "float | None" = None
    peak_bandwidth: "float | None" = None
    run_id: "str | None" = None   # the trace's "run_id" metadata, when the runner added it

    @property
    def classes(self):
        return GPU_CLASSES if self.gpu else CPU_CLASSES

    @property
    def shares(self):
        return {c: (v / self.step_ms if self.step_ms > 0 else float("nan")) for c, v in self.ms.items()}

    @property
    def compute_flops(self):
        """Achieved FLOP/s inside the compute kernels: model FLOPs per step over their time."""
        t = self.ms.get(COMPUTE, 0.0) / 1e3
        return self.flops_per_step / t if self.flops_per_step and t > 0 else None

    @property
    def compute_fraction_of_peak(self):
        achieved = self.compute_flops
        return achieved / self.peak_flops if achieved and self.peak_flops else None


def load_trace(path):
    """A Chrome trace file (JSON, or gzipped JSON as export_chrome_trace writes for a .gz path) as a dict."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        trace = json.loads(raw)
    except (OSError, EOFError, ValueError) as e:       # EOFError: a gzip file cut short
        raise TraceError(f"{path} is not a Chrome trace ({str(e).splitlines()[0]}): export it again with "
                         f"prof.export_chrome_trace") from None
    if isinstance(trace, list):        # the Trace Event Format also allows a bare array of events
        trace = {"traceEvents": trace}
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise TraceError(f"{path} has no traceEvents list: it is not a torch.profiler Chrome trace")
    return trace


def _complete_events(trace):
    for e in trace.get("traceEvents", []):
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        ts, dur = e.get("ts"), e.get("dur")
        if isinstance(ts, (int, float)) and isinstance(dur, (int, float)) and dur >= 0:
            yield e


def _union_length(intervals):
    """Total length covered by (start, end) intervals, overlaps counted once."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def _gpu_name(trace, device):
    props = [p for p in trace.get("deviceProperties") or [] if isinstance(p, dict)]
    match = [p for p in props if p.get("id") == device] or props
    return str(match[0].get("name", "")) if match else ""


def split(trace, flops_per_step=None, peak_flops=None, peak_bandwidth=None, device=None):
    """Split a loaded Chrome trace's profiled steps into compute, memory, unknown and overhead.

    Step windows are the CPU "user_annotation" events named ProfilerStep#N, which torch.profiler records
    only when it runs with a schedule. Each GPU activity (cat "kernel", "gpu_memcpy", "gpu_memset") that
    starts inside a window is that step's, cut off at the window's end. Per window: compute = the union
    of compute kernels; memory = the union of memory kernels, copies and memsets outside compute;
    unknown = unclassified kernels outside both; overhead = the window minus all GPU activity. The
    Breakdown holds their means over the windows, per-kernel totals, and the copies' bytes.

    flops_per_step (model FLOPs of one step), peak_flops (FLOP/s) and peak_bandwidth (bytes/s) are
    carried for the achieved-throughput figures. device picks one GPU's activities when a trace holds
    several. A trace without GPU activity gives gpu=False and cpu_ops (the union of CPU operator
    events) / overhead instead. Raises TraceError when there is no ProfilerStep window.
    """
    events = list(_complete_events(trace))
    windows = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                     if e.get("cat") == "user_annotation" and _STEP_NAME.match(str(e.get("name", ""))))
    if not windows:
        raise TraceError("the trace has no ProfilerStep#N annotations: profile with "
                         "torch.profiler.profile(..., schedule=torch.profiler.schedule(wait=0, warmup=1, "
                         "active=K, repeat=1)) and call prof.step() after every step")

    gpu_events = [e for e in events if str(e.get("cat", "")).lower() in (_KERNEL_CAT, *_COPY_CATS)]
    devices = sorted({(e.get("args") or {}).get("device") for e in gpu_events} - {None})
    if device is None and len(devices) > 1:
        raise TraceError(f"the trace holds GPU activity of devices {devices}: pass device= to split one")
    if device is not None:
        gpu_events = [e for e in gpu_events if (e.get("args") or {}).get("device") == device]
    gpu = bool(gpu_events)
    gpu_name = _gpu_name(trace, device if device is not None else (devices[0] if devices else None)) \
        if gpu else "cpu"

    starts = [w[0] for w in windows]
    by_window = [[] for _ in windows]

    def place(e):
        i = bisect.bisect_right(starts, e["ts"]) - 1
        if i >= 0 and e["ts"] < windows[i][1]:
            by_window[i].append(e)

    for e in (gpu_events if gpu else [e for e in events if e.get("cat") == "cpu_op"]):
        place(e)

    per_step, kernel_totals, transfer_totals = [], {}, {}
    for (w_start, w_end, name), evs in zip(windows, by_window):
        window = w_end - w_start
        spans = {COMPUTE: [], MEMORY: [], UNKNOWN: [], CPU_OPS: []}
        for e in evs:
            start, end = e["ts"], min(e["ts"] + e["dur"], w_end)
            kname = str(e.get("name", ""))
            if not gpu:
                spans[CPU_OPS].append((start, end))
                continue
            cat = str(e.get("cat")).lower()
            if cat in _COPY_CATS:
                cls, label = MEMORY, _COPY_CATS[cat]
                nbytes = (e.get("args") or {}).get("bytes")
                if isinstance(nbytes, (int, float)):
                    t = transfer_totals.setdefault(kname, [0.0, 0.0])
                    t[0] += nbytes
                    t[1] += end - start
            else:
                cls, label = classify(kname)
            spans[cls or UNKNOWN].append((start, end))
            k = kernel_totals.setdefault(kname, [cls, label, 0.0, 0])
            k[2] += end - start
            k[3] += 1
        if gpu:
            c = _union_length(spans[COMPUTE])
            cm = _union_length(spans[COMPUTE] + spans[MEMORY])
            busy = _union_length(spans[COMPUTE] + spans[MEMORY] + spans[UNKNOWN])
            us = {COMPUTE: c, MEMORY: cm - c, UNKNOWN: busy - cm, OVERHEAD: window - busy}
        else:
            busy = _union_length(spans[CPU_OPS])
            us = {CPU_OPS: busy, OVERHEAD: window - busy}
        per_step.append({"step": name, "window_ms": window / 1e3, **{c: v / 1e3 for c, v in us.items()}})

    n = len(windows)
    classes = GPU_CLASSES if gpu else CPU_CLASSES
    ms = {c: sum(s[c] for s in per_step) / n for c in classes}
    kernels = sorted((KernelStat(name, cls, label, total / 1e3 / n, calls / n)
                      for name, (cls, label, total, calls) in kernel_totals.items()),
                     key=lambda k: (-k.ms_per_step, k.name))
    transfers = sorted((Transfer(name, b / n, t / 1e3 / n) for name, (b, t) in transfer_totals.items()),
                       key=lambda t: (-t.ms_per_step, t.name))
    run_id = trace.get("run_id")
    return Breakdown(gpu=gpu, gpu_name=gpu_name, steps=n, step_ms=sum(s["window_ms"] for s in per_step) / n,
                     ms=ms, per_step=per_step, kernels=kernels,
                     unknown=[k.name for k in kernels if k.cls is None], transfers=transfers,
                     flops_per_step=flops_per_step, peak_flops=peak_flops, peak_bandwidth=peak_bandwidth,
                     run_id=str(run_id) if run_id is not None else None)


# ---------------------------------------------------------------------------------------------
# breakdown.csv


def trace_path(prefix, rung):
    """PREFIX/trace_<rung>.json.gz, or its .json.gz when only that exists."""
    path = os.path.join(prefix, f"trace_{rung}.json")
    return path + ".gz" if not os.path.exists(path) and os.path.exists(path + ".gz") else path


def append_breakdown_csv(prefix, rung, run_id, breakdown, median_step_ms):
    """Append one row per class of `breakdown` to PREFIX/breakdown.csv: whole or absent, under the results
    lock, refusing a file whose header is not BREAKDOWN_COLUMNS (ResultsError). median_step_ms is the
    run's median over its unprofiled measured steps (None when it has none)."""
    flops = breakdown.compute_flops
    common = {"run_id": run_id, "rung": rung, "profiled_step_ms": breakdown.step_ms,
              "median_step_ms": median_step_ms, "profiled_steps": breakdown.steps,
              "compute_tflops": flops / 1e12 if flops else None,
              "peak_tflops": breakdown.peak_flops / 1e12 if breakdown.peak_flops else None}
    shares = breakdown.shares
    rows = [{**common, "class": c, "ms_per_step": breakdown.ms[c], "share": shares[c]} for c in breakdown.classes]
    append_rows(prefix, BREAKDOWN_FILE, BREAKDOWN_COLUMNS, rows)


def load_breakdown(prefix):
    """PREFIX/breakdown.csv's rows of the latest run of each rung (the last run_id appended for it), in
    ladder order, numeric columns as floats. Raises ResultsError when the file is missing, foreign or
    empty."""
    path = os.path.join(prefix, BREAKDOWN_FILE)
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        raise ResultsError(f"{path} not found or empty: profile a rung first, "
                           f"e.g. make profile STEPS=20 BATCH_SIZE=8 PREFIX={prefix}")
    check_file(path, BREAKDOWN_COLUMNS)
    df = pd.read_csv(path, dtype=str, keep_default_na=False, na_filter=False)
    if df.empty:
        raise ResultsError(f"{path} records no profiled run: profile a rung first")
    for col in NUMERIC_COLUMNS:
        df[col] = pd.to_numeric(df[col].str.strip(), errors="coerce").astype(float)
    latest = {rung: g["run_id"].iloc[-1] for rung, g in df.groupby("rung", sort=False)}
    frames = [df[(df["rung"] == r) & (df["run_id"] == latest[r])] for r in rung_order(latest)]
    return pd.concat(frames, ignore_index=True)


# ---------------------------------------------------------------------------------------------
# breakdown.png

COLORS = {COMPUTE: "#4c72b0", MEMORY: "#dd8452", UNKNOWN: "#c44e52", OVERHEAD: "#c7c7c7", CPU_OPS: "#55a868"}
LABELS = {COMPUTE: "compute (GEMM, attention)", MEMORY: "memory (other kernels, copies)",
          UNKNOWN: "unknown kernels", OVERHEAD: "overhead (GPU idle)", CPU_OPS: "CPU operators (no GPU)"}


def _class_order(df):
    """The classes to draw, bottom of the stack first; a class that is zero for every rung is left out."""
    present = set(df.loc[df["ms_per_step"] > 0, "class"])
    return [c for c in (COMPUTE, MEMORY, UNKNOWN, CPU_OPS, OVERHEAD) if c in present]


def plot_breakdown(df, context=""):
    """Stacked bars per rung in ladder order: ms per step (left) and shares (right), with each rung's
    unprofiled median step time marked so the totals can be checked against it. df: load_breakdown()."""
    rungs = rung_order(df["rung"])
    classes = _class_order(df)
    fig = Figure(figsize=(11, 1.4 + 0.55 * max(len(rungs), 1)), dpi=DPI, layout="constrained")
    ax_ms, ax_share = fig.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [3, 2]})
    gpu_only = CPU_OPS not in classes
    fig.suptitle("Where a step's time goes (torch.profiler, mean of the profiled steps)"
                 + ("" if gpu_only else " · CPU: the compute/memory split is GPU-only")
                 + (f"\n{context}" if context else ""), fontsize=11)
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
    ax_ms.set_yticks(range(len(rungs)), rungs)
    ax_ms.invert_yaxis()
    ax_ms.set_xlabel("ms per step (profiled); black line: median step time of the unprofiled steps", fontsize=9)
    ax_share.set_xlabel("share of the profiled step (%)", fontsize=9)
    for ax in (ax_ms, ax_share):
        ax.grid(axis="x", alpha=0.3)
    handles = [Patch(facecolor=COLORS[c], hatch="///" if c == UNKNOWN else None, label=LABELS[c]) for c in classes]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8, frameon=False)
    return fig


# ---------------------------------------------------------------------------------------------
# breakdown.md


def _off_median(profiled, median):
    """How far the profiled step is from the unprofiled median, as a fraction; None when unknown."""
    return profiled / median - 1 if np.isfinite(profiled) and np.isfinite(median) and median > 0 else None


def _off_median_text(profiled, median):
    off = _off_median(profiled, median)
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


def _kernel_section(bd, top=TOP_KERNELS):
    lines = []
    if not bd.gpu:
        lines += ["No GPU kernels: this trace is from a CPU run. The compute / memory / overhead split is "
                  "GPU-only; the time is shown as PyTorch operators (cpu_ops) and the rest (overhead).", ""]
        return lines
    rows = [[str(i + 1), k.cls or "unknown", k.label or "-", markdown.cell(k.calls_per_step, ".1f"),
             markdown.cell(k.ms_per_step, ".3f"), markdown.cell(100 * k.ms_per_step / bd.step_ms, ".1f", "%"),
             f"`{short_name(k.name)}`"] for i, k in enumerate(bd.kernels[:top])]
    lines += [f"Top {min(top, len(bd.kernels))} of {len(bd.kernels)} kernels by time per step:", "",
              markdown.table([["#", "class", "kind", "calls/step", "ms/step", "of step", "kernel"]] + rows,
                             left=(1, 2, 6)),
              ""]
    if bd.unknown:
        unknown = [k for k in bd.kernels if k.cls is None]
        lines += [f"Unknown kernels ({len(unknown)}; add them to KERNEL_CLASSES in Utils/breakdown.py "
                  f"once their kind is known):", ""]
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


def render_report(df, breakdowns, context="", notes=(), trace_files=None):
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
        "sizes; **unknown** is time when only kernels that the table in Utils/breakdown.py does not name "
        "run; **overhead** is time when no kernel runs (Python, launches, synchronization, data waits). "
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
            lines += _kernel_section(bd)
    return "\n".join(lines).rstrip("\n") + "\n"


def _context(prefix, df, breakdowns):
    """"GPU · model (N params) · batch B × seq_len T" from runs.csv's rows of the shown runs."""
    runs = None
    path = os.path.join(prefix, RUNS_FILE)
    with contextlib.suppress(ResultsError, OSError, ValueError, pd.errors.ParserError, pd.errors.EmptyDataError):
        check_file(path, RUN_COLUMNS)
        runs = pd.read_csv(path, dtype=str, keep_default_na=False, na_filter=False)
        runs = runs[runs["run_id"].isin(set(df["run_id"]))]
    gpus = sorted({bd.gpu_name for bd in breakdowns.values() if bd and bd.gpu_name})
    if runs is None or runs.empty:
        return " / ".join(gpus)

    def values(col):
        return " / ".join(dict.fromkeys(v for v in runs[col] if v)) or "?"

    device = "CPU" if set(runs["device"]) == {"cpu"} else values("gpu_name")
    model = values("model")
    with contextlib.suppress(ValueError):
        n = {float(v) for v in runs["n_params"] if v}
        if len(n) == 1:
            model += f" ({n.pop() / 1e6:.0f}M params)"
    return f"{device} · {model} · batch {values('batch_size')} × seq_len {values('seq_len')}"


def write_report(prefix, context=None):
    """Write PREFIX/breakdown.md and PREFIX/breakdown.png from the latest run of each rung in
    breakdown.csv and the rungs' trace_<rung>.json.gz; return the written paths. context (GPU, model,
    batch, seq_len) defaults to what runs.csv records for those runs. Raises ResultsError when
    breakdown.csv is missing, foreign or empty."""
    df = load_breakdown(prefix)
    breakdowns, notes, trace_files = {}, [], {}
    for rung in rung_order(df["rung"]):
        path = trace_path(prefix, rung)
        trace_files[rung] = os.path.basename(path)
        run_id = df.loc[df["rung"] == rung, "run_id"].iloc[0]
        if not os.path.exists(path):
            breakdowns[rung] = None
            continue
        try:
            trace = load_trace(path)
            device_name = _gpu_name(trace, None)
            bd = split(trace, peak_bandwidth=peak_hbm_bandwidth(device_name))
        except TraceError as e:
            breakdowns[rung] = None
            notes.append(f"{rung}: {e}")
            continue
        if bd.run_id and bd.run_id != run_id:
            notes.append(f"{rung}: {os.path.basename(path)} is from run {bd.run_id}, not {run_id}: "
                         f"its kernel tables belong to that run")
        breakdowns[rung] = bd
    for rung in rung_order(df["rung"]):
        first = df[df["rung"] == rung].iloc[0]
        off = _off_median(first["profiled_step_ms"], first["median_step_ms"])
        if off is not None and abs(off) > MATCH_TOLERANCE:
            notes.append(f"{rung}: the profiled step ({first['profiled_step_ms']:.1f} ms) is more than "
                         f"{MATCH_TOLERANCE:.0%} from the median step time ({first['median_step_ms']:.1f} ms): "
                         f"the profiler's own cost, or a run that did not settle")
    if context is None:
        context = _context(prefix, df, breakdowns)
    text = render_report(df, breakdowns, context, notes, trace_files)
    md_path, png_path = os.path.join(prefix, REPORT_FILE), os.path.join(prefix, CHART_FILE)
    write_atomic(md_path, lambda f: f.write(text.encode("utf-8")))
    fig = plot_breakdown(df, context)
    write_atomic(png_path, lambda f: fig.savefig(f, format="png", dpi=DPI))
    return [md_path, png_path]
