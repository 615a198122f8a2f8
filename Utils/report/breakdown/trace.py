"""Splitting a torch.profiler Chrome trace's profiled steps into compute, memory, unknown and overhead.

Each ProfilerStep#N annotation marks one step's wall-clock window; the GPU activities that start inside it
are that step's work. The window is split four ways, so that the parts add up to the window exactly:

- compute: time when a matrix-multiply or attention kernel runs (GEMMs, flash attention);
- memory: time when only other kernels run (elementwise, normalization, softmax, the loss, the
  optimizer, copies and memsets): bandwidth-bound at GPT-2's sizes;
- unknown: time when only kernels Utils.report.breakdown.kernels cannot name run: they are listed, never
  guessed;
- overhead: time when nothing runs on the GPU (Python, launches, synchronization, data waits); each idle
  stretch is kept with the activities on either side of it, so that the report can say where it sits.

Kernels that overlap (another stream, or a trace's clock jitter) are counted once, compute first, then
memory, then unknown. A trace without GPU activity (a CPU run) gets the time inside PyTorch operators
(cpu_ops) and the rest (overhead) instead: the split is GPU-only.
"""
import bisect
import gzip
import json
import os
import re
from dataclasses import dataclass, field

from Utils.report.breakdown.kernels import (COMPUTE, CPU_CLASSES, CPU_OPS, GPU_CLASSES, MEMORY, OVERHEAD, UNKNOWN,
                                            classify)
from Utils.results.gpus import peak_bandwidth as gpu_peak_bandwidth

# Chrome-trace categories of GPU activity (Kineto's names, lower-cased).
_KERNEL_CAT = "kernel"
_COPY_CATS = {"gpu_memcpy": "memcpy", "gpu_memset": "memset"}
_STEP_NAME = re.compile(r"^ProfilerStep#\d+$")


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
class Gap:
    """GPU idle time between two activities, summed over the profiled steps: its part of overhead."""
    before: str                   # the activity that ended last before the gap, or STEP_START
    after: str                    # the activity whose start ends the gap, or STEP_END
    ms_per_step: float
    count_per_step: float


STEP_START, STEP_END = "(step start)", "(step end)"


@dataclass
class Transfer:
    """A memcpy or memset kind: the only GPU activities whose byte counts a Chrome trace records."""
    name: str                     # e.g. "Memcpy HtoD (Pinned -> Device)", "Memset (Device)"
    bytes_per_step: float
    ms_per_step: float

    @property
    def bandwidth(self) -> "float | None":
        """Achieved bytes/s, or None when its time is zero."""
        return self.bytes_per_step / (self.ms_per_step / 1e3) if self.ms_per_step > 0 else None

    @property
    def on_device(self) -> bool:
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
    gaps: list = field(default_factory=list)        # [Gap], longest first: overhead, by where it sits
    flops_per_step: "float | None" = None
    peak_flops: "float | None" = None
    peak_bandwidth: "float | None" = None
    run_id: "str | None" = None   # the trace's "run_id" metadata, when the run added it
    git_commit: "str | None" = None   # the trace's "git_commit" metadata, likewise
    started_at: "str | None" = None   # the trace's "started_at" metadata (the run's start, ISO 8601), likewise
    torch_version: "str | None" = None   # the trace's "torch_version" metadata, likewise

    @property
    def classes(self) -> tuple[str, ...]:
        return GPU_CLASSES if self.gpu else CPU_CLASSES

    @property
    def shares(self) -> dict[str, float]:
        return {c: (v / self.step_ms if self.step_ms > 0 else float("nan")) for c, v in self.ms.items()}

    @property
    def compute_flops(self) -> "float | None":
        """Achieved FLOP/s inside the compute kernels: model FLOPs per step over their time."""
        t = self.ms.get(COMPUTE, 0.0) / 1e3
        return self.flops_per_step / t if self.flops_per_step and t > 0 else None


def load_trace(path: str | os.PathLike) -> dict:
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


def _idle(spans, w_start, w_end):
    """The stretches of [w_start, w_end] that no (start, end, name) span covers, as (before, after, length):
    the name of the span that ended last before each stretch (STEP_START at the window's start) and of the
    one that ends it (STEP_END at the window's end)."""
    cur_end, cur_name = w_start, STEP_START
    for start, end, name in sorted(spans):
        if start > cur_end:
            yield cur_name, name, start - cur_end
        if end > cur_end:
            cur_end, cur_name = end, name
    if w_end > cur_end:
        yield cur_name, STEP_END, w_end - cur_end


def trace_gpu_name(trace: dict, device: "int | None" = None) -> str:
    """The name of the GPU `device` (the first listed when None or not found) in the trace's deviceProperties;
    "" when it lists none."""
    props = [p for p in trace.get("deviceProperties") or [] if isinstance(p, dict)]
    match = [p for p in props if p.get("id") == device] or props
    return str(match[0].get("name", "")) if match else ""


def split(trace: dict, flops_per_step: "float | None" = None, peak_flops: "float | None" = None,
          peak_bandwidth: "float | None" = None, device: "int | None" = None) -> Breakdown:
    """Split a loaded Chrome trace's profiled steps into compute, memory, unknown and overhead.

    Step windows are the CPU "user_annotation" events named ProfilerStep#N, which torch.profiler records
    only when it runs with a schedule. Each GPU activity (cat "kernel", "gpu_memcpy", "gpu_memset") that
    starts inside a window is that step's, cut off at the window's end. Per window: compute = the union
    of compute kernels; memory = the union of memory kernels, copies and memsets outside compute;
    unknown = unclassified kernels outside both; overhead = the window minus all GPU activity, also kept
    stretch by stretch with the activities on either side (gaps). The Breakdown holds their means over the
    windows, per-kernel totals, and the copies' bytes.

    flops_per_step (model FLOPs of one step), peak_flops (FLOP/s) and peak_bandwidth (bytes/s) are
    carried for the achieved-throughput figures; peak_bandwidth defaults to the HBM peak of the GPU whose
    activities were split (Utils.results.gpus). device picks one GPU's activities when a trace holds
    several. A trace without GPU activity gives gpu=False and cpu_ops (the union of CPU operator
    events) / overhead instead. Raises TraceError when there is no ProfilerStep window.
    """
    events = list(_complete_events(trace))
    windows = _step_windows(events)
    gpu_events, gpu_name = _gpu_activities(trace, events, device)
    gpu = bool(gpu_events)
    totals = _Totals()
    per_step = []
    activities = gpu_events if gpu else [e for e in events if e.get("cat") == "cpu_op"]
    for (w_start, w_end, name), evs in zip(windows, _by_window(windows, activities)):
        us = _split_gpu_window(evs, w_start, w_end, totals) if gpu else _split_cpu_window(evs, w_start, w_end)
        per_step.append({"step": name, "window_ms": (w_end - w_start) / 1e3, **{c: v / 1e3 for c, v in us.items()}})
    if peak_bandwidth is None:
        peak_bandwidth = gpu_peak_bandwidth(gpu_name)
    meta = {key: trace.get(key) for key in ("run_id", "git_commit", "started_at", "torch_version")}
    return _mean_breakdown(gpu, gpu_name, per_step, totals, flops_per_step=flops_per_step, peak_flops=peak_flops,
                           peak_bandwidth=peak_bandwidth,
                           **{key: str(value) if value is not None else None for key, value in meta.items()})


def _step_windows(events: list[dict]) -> list[tuple[float, float, str]]:
    """(start, end, name) of every ProfilerStep#N annotation, in time order: the steps the trace profiled."""
    windows = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                     if e.get("cat") == "user_annotation" and _STEP_NAME.match(str(e.get("name", ""))))
    if not windows:
        raise TraceError("the trace has no ProfilerStep#N annotations: profile with "
                         "torch.profiler.profile(..., schedule=torch.profiler.schedule(wait=0, warmup=1, "
                         "active=K, repeat=1)) and call prof.step() after every step")
    return windows


def _gpu_activities(trace: dict, events: list[dict], device: "int | None") -> tuple[list[dict], str]:
    """(the GPU activities of `device`, its name): every device's when None and the trace holds one only;
    ([], "cpu") for a trace without GPU activity."""
    gpu_events = [e for e in events if str(e.get("cat", "")).lower() in (_KERNEL_CAT, *_COPY_CATS)]
    devices = sorted({(e.get("args") or {}).get("device") for e in gpu_events} - {None})
    if device is None and len(devices) > 1:
        raise TraceError(f"the trace holds GPU activity of devices {devices}: pass device= to split one")
    if device is not None:
        gpu_events = [e for e in gpu_events if (e.get("args") or {}).get("device") == device]
    if not gpu_events:
        return gpu_events, "cpu"
    return gpu_events, trace_gpu_name(trace, device if device is not None else (devices[0] if devices else None))


def _by_window(windows: list[tuple[float, float, str]], events: list[dict]) -> list[list[dict]]:
    """The events that start inside each window, a list per window: an event belongs to the step it starts in."""
    starts = [w[0] for w in windows]
    by_window = [[] for _ in windows]
    for e in events:
        i = bisect.bisect_right(starts, e["ts"]) - 1
        if i >= 0 and e["ts"] < windows[i][1]:
            by_window[i].append(e)
    return by_window


@dataclass
class _Totals:
    """Sums over every window, which the Breakdown divides by the number of windows."""
    kernels: dict = field(default_factory=dict)     # name -> [cls, label, total us, calls]
    transfers: dict = field(default_factory=dict)   # name -> [bytes, total us]
    gaps: dict = field(default_factory=dict)        # (before, after) -> [total us, count]


def _split_gpu_window(evs: list[dict], w_start: float, w_end: float, totals: _Totals) -> dict[str, float]:
    """One window's GPU_CLASSES in microseconds, each activity cut off at the window's end and counted once,
    compute first; its kernels, copies and idle stretches added to `totals`."""
    spans = {COMPUTE: [], MEMORY: [], UNKNOWN: []}
    named = []   # (start, end, name) of every GPU activity: where the idle stretches sit
    for e in evs:
        start, end = e["ts"], min(e["ts"] + e["dur"], w_end)
        kname = str(e.get("name", ""))
        cat = str(e.get("cat")).lower()
        if cat in _COPY_CATS:
            cls, label = MEMORY, _COPY_CATS[cat]
            nbytes = (e.get("args") or {}).get("bytes")
            if isinstance(nbytes, (int, float)):
                t = totals.transfers.setdefault(kname, [0.0, 0.0])
                t[0] += nbytes
                t[1] += end - start
        else:
            cls, label = classify(kname)
        spans[cls or UNKNOWN].append((start, end))
        named.append((start, end, kname))
        k = totals.kernels.setdefault(kname, [cls, label, 0.0, 0])
        k[2] += end - start
        k[3] += 1
    c = _union_length(spans[COMPUTE])
    cm = _union_length(spans[COMPUTE] + spans[MEMORY])
    busy = _union_length(spans[COMPUTE] + spans[MEMORY] + spans[UNKNOWN])
    for before, after, length in _idle(named, w_start, w_end):
        g = totals.gaps.setdefault((before, after), [0.0, 0])
        g[0] += length
        g[1] += 1
    return {COMPUTE: c, MEMORY: cm - c, UNKNOWN: busy - cm, OVERHEAD: (w_end - w_start) - busy}


def _split_cpu_window(evs: list[dict], w_start: float, w_end: float) -> dict[str, float]:
    """One window of a trace without GPU activity in microseconds: the time inside PyTorch operators (cpu_ops),
    each cut off at the window's end, and the rest (overhead)."""
    busy = _union_length([(e["ts"], min(e["ts"] + e["dur"], w_end)) for e in evs])
    return {CPU_OPS: busy, OVERHEAD: (w_end - w_start) - busy}


def _mean_breakdown(gpu: bool, gpu_name: str, per_step: list[dict], totals: _Totals, **figures: object) -> Breakdown:
    """The Breakdown of the windows' mean: class times, kernels, copies and gaps per step, longest first;
    `figures` (the peaks, FLOPs per step and the trace's metadata) carried as given."""
    n = len(per_step)
    classes = GPU_CLASSES if gpu else CPU_CLASSES
    ms = {c: sum(s[c] for s in per_step) / n for c in classes}
    kernels = sorted((KernelStat(name, cls, label, total / 1e3 / n, calls / n)
                      for name, (cls, label, total, calls) in totals.kernels.items()),
                     key=lambda k: (-k.ms_per_step, k.name))
    transfers = sorted((Transfer(name, b / n, t / 1e3 / n) for name, (b, t) in totals.transfers.items()),
                       key=lambda t: (-t.ms_per_step, t.name))
    gaps = sorted((Gap(before, after, total / 1e3 / n, count / n)
                   for (before, after), (total, count) in totals.gaps.items()),
                  key=lambda g: (-g.ms_per_step, g.before, g.after))
    return Breakdown(gpu=gpu, gpu_name=gpu_name, steps=n, step_ms=sum(s["window_ms"] for s in per_step) / n,
                     ms=ms, per_step=per_step, kernels=kernels,
                     unknown=[k.name for k in kernels if k.cls is None], transfers=transfers, gaps=gaps,
                     **figures)
