"""This machine's peaks, measured once: the rate of a large square bf16 matmul and of a device-to-device copy.

MFU's first denominator is the datasheet's dense bf16 peak (Utils.results.gpus), which no card reaches in
practice: its clocks fall under the power limit and cuBLAS's best kernel loses a little to the tile edges and
the pipeline. These two rates are what this card, in this machine, under this driver and PyTorch, does on
the friendliest work there is; a step's MFU against them says how far the model is from this machine's
own ceiling, not from a figure printed in a datasheet. Each measurement is appended as one row to
PREFIX/peak.csv (Utils.results.schema.PEAK_SCHEMA), so that a later one on another driver or card adds to it.

    python -m Utils.peak --prefix DIR [--device auto|cuda|cpu] [--matmul-n N] [--copy-gib G]
    (make peak PREFIX=dir [DEVICE=...] [MATMUL_N=n] [COPY_GIB=g])
"""
import argparse
import contextlib
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone

import torch

from Utils.results.gpus import gpu_spec
from Utils.results.schema import PEAK_COLUMNS, PEAK_FILE
from Utils.results.store import ResultsError, append_rows, check_file, check_prefix
from Utils.train.cli import resolve_device
from Utils.train.failures import out_of_memory
from Utils.train.provenance import provenance
from Utils.train.usage import Parser, UsageError, fail

EXAMPLE = "e.g. make peak PREFIX=./out"
GIB = 2**30

# device type -> (matmul side n, copy buffer in GiB).
# On a GPU, n = 8192, chosen by arithmetic intensity: a square GEMM does 2n^3 FLOPs on 3n^2 bf16 values (6n^2
# bytes at the least), n/3 FLOPs per byte, about 2,700 at n = 8192: six times or more the ridge point (peak
# FLOP/s over bandwidth) of every card in Utils.results.gpus (the highest, an L40S's, is about 420; an H200's
# about 206), so memory cannot be what limits it. Its output is 4,096 tiles of 128 x 128, enough to fill
# every multiprocessor many times over so that the last, partly empty wave costs little, and a power of two
# leaves no partial tile at the edges of power-of-two tiles. Its three operands take 384 MiB.
# The copy moves 2 GiB each way, tens of times a Hopper's L2 cache (50-60 MB), so it times device memory, not
# the cache.
# On a CPU (the tests) the sizes are small enough to take well under a second; the rates mean nothing there.
DEFAULTS = {"cuda": (8192, 2.0), "cpu": (256, 4 / 1024)}
WARMUP_ITERS = 5    # cuBLAS picks its kernel and the clocks rise during the first calls: those are not timed
TIMED_ITERS = 20    # the median of these is the figure: one slow iteration (a clock dip) moves it little


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = Parser(EXAMPLE, prog=prog, description="Measure this machine's bf16 matmul rate and copy bandwidth and "
                                                "append them to PREFIX/peak.csv, MFU's second denominator.")
    p.add_argument("--prefix", required=True, help="results folder; the row goes to PREFIX/peak.csv (PREFIX)")
    p.add_argument("--device", default="auto", help="auto, cuda or cpu (DEVICE)")
    p.add_argument("--matmul-n", default=None, help="side of the square bf16 matmul (MATMUL_N; default "
                                                    f"{DEFAULTS['cuda'][0]} on a GPU, {DEFAULTS['cpu'][0]} on a CPU)")
    p.add_argument("--copy-gib", default=None, help="GiB copied device to device (COPY_GIB; default "
                                                    f"{DEFAULTS['cuda'][1]:g} on a GPU, 4 MiB on a CPU)")
    return p


# Upper bounds that no device reaches, so that a typo is refused in one line instead of overflowing a size.
MAX_MATMUL_N = 65536
MAX_COPY_GIB = 1024


def _matmul_n(value: str) -> int:
    try:
        n = int(str(value).strip())
    except ValueError:
        n = 0
    if n <= 0:
        raise UsageError(f"MATMUL_N={value!r} is not a positive integer: pass the matmul's side, e.g. MATMUL_N=8192")
    if n > MAX_MATMUL_N:
        raise UsageError(f"MATMUL_N={n} is larger than {MAX_MATMUL_N:,} (three bf16 matrices of that side take 24 GiB): "
                         f"pass a smaller side, e.g. MATMUL_N=8192")
    return n


def _copy_gib(value: str) -> float:
    try:
        gib = float(str(value).strip())
    except ValueError:
        gib = math.nan
    if not (math.isfinite(gib) and gib * GIB >= 1):
        raise UsageError(f"COPY_GIB={value!r} is not a positive number of GiB (one byte at least): "
                         f"pass the buffer's size, e.g. COPY_GIB=2")
    if gib > MAX_COPY_GIB:
        raise UsageError(f"COPY_GIB={value} is larger than {MAX_COPY_GIB:,} GiB (two such buffers fit on no device): "
                         f"pass the buffer's size, e.g. COPY_GIB=2")
    return gib


def parse_args(argv: Sequence[str] | None = None, prog: str | None = None) -> argparse.Namespace:
    """Parse and validate, sizes defaulted by device; raises UsageError with a one-line message."""
    a = build_parser(prog or "python -m Utils.peak").parse_args(argv)
    if not a.prefix.strip():
        raise UsageError(f"PREFIX is empty: name the results folder, {EXAMPLE}")
    a.device = resolve_device(a.device)
    default_n, default_gib = DEFAULTS[a.device]
    a.matmul_n = default_n if a.matmul_n is None else _matmul_n(a.matmul_n)
    a.copy_gib = default_gib if a.copy_gib is None else _copy_gib(a.copy_gib)
    return a


def _median_seconds(fn: Callable[[], object], device: torch.device) -> float:
    """The median time of TIMED_ITERS calls of fn after WARMUP_ITERS untimed ones. On a GPU each call sits
    between two CUDA events, all queued back to back, so the GPU never waits on the host between them and
    each interval is the kernel's own time; on a CPU, perf_counter around each call."""
    for _ in range(WARMUP_ITERS):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(TIMED_ITERS):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    torch.cuda.synchronize(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(TIMED_ITERS)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(end) / 1e3 for start, end in events)


def _matmul(device: torch.device, n: int) -> Callable[[], object]:
    """c = a @ b in bf16 into a preallocated c, on random values: zeros would draw less power and so run at a
    higher clock than any real weights and activations allow."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    return lambda: torch.matmul(a, b, out=c)


def _copy(device: torch.device, nbytes: int) -> Callable[[], object]:
    """dst.copy_(src) of nbytes: contiguous tensors of one dtype on one device, which PyTorch copies as a plain
    device-to-device memcpy."""
    src = torch.ones(nbytes, device=device, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def measure(device: torch.device, matmul_n: int, copy_gib: float) -> dict:
    """{matmul_n, matmul_tflops, copy_gib, copy_gb_s} measured on `device`: an n x n @ n x n bf16 matmul's rate,
    2 n^3 FLOPs / median time, and the bandwidth of copying copy_gib GiB, bytes read plus bytes written /
    median time. The matmul's tensors are freed before the copy's buffers are made."""
    nbytes = int(copy_gib * GIB)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        matmul_s = _median_seconds(_matmul(device, matmul_n), device)
        copy_s = _median_seconds(_copy(device, nbytes), device)
    return {"matmul_n": matmul_n, "matmul_tflops": 2 * matmul_n**3 / matmul_s / 1e12,
            "copy_gib": copy_gib, "copy_gb_s": 2 * nbytes / copy_s / 1e9}


def _share(rate: float, peak: float | None) -> str:
    return f" ({rate / peak:.0%} of the datasheet's {peak:,.0f})" if peak else ""


def _size(gib: float) -> str:
    return f"{gib:g} GiB" if gib >= 1 else f"{gib * 1024:g} MiB"


def summary_line(row: dict, path: str) -> str:
    """One line: both rates and, for a card in Utils.results.gpus, the share of its datasheet figures."""
    spec = gpu_spec(row["gpu_name"])
    tflops, gb_s = row["matmul_tflops"], row["copy_gb_s"]
    return (f"{row['gpu_name']}: bf16 matmul {row['matmul_n']}^3 {tflops:,.1f} TFLOP/s"
            f"{_share(tflops, spec.bf16 / 1e12 if spec and spec.bf16 else None)}, "
            f"copy of {_size(row['copy_gib'])} {gb_s:,.0f} GB/s"
            f"{_share(gb_s, spec.bandwidth / 1e9 if spec and spec.bandwidth else None)} -> {path}")


def peak_row(device: torch.device, rates: dict) -> dict:
    """peak.csv's row for `rates` measured on `device` (the store fills schema_version)."""
    known = provenance(device).columns()
    return {"measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            **{k: known[k] for k in ("device", "gpu_name", "gpu_uuid", "torch_version", "git_commit")}, **rates}


def main(argv: Sequence[str] | None = None) -> int:
    """Validate, measure, append a row to PREFIX/peak.csv and print it. Returns the exit status: 0, or 2 for a
    bad argument, a PREFIX that cannot be written or holds a foreign peak.csv, or sizes that do not fit."""
    try:
        args = parse_args(argv)
        check_prefix(args.prefix)
        check_file(os.path.join(args.prefix, PEAK_FILE), PEAK_COLUMNS)
    except (UsageError, ResultsError) as e:
        return fail(str(e))
    device = torch.device(args.device)
    try:
        rates = measure(device, args.matmul_n, args.copy_gib)
    except (RuntimeError, MemoryError) as e:
        if not out_of_memory(e):
            raise
        return fail(f"out of memory measuring MATMUL_N={args.matmul_n} COPY_GIB={args.copy_gib:g} on "
                    f"{device.type}: pass smaller sizes")
    row = peak_row(device, rates)
    path = os.path.join(args.prefix, PEAK_FILE)
    try:
        append_rows(args.prefix, PEAK_FILE, PEAK_COLUMNS, [row])
    except (ResultsError, OSError) as e:
        return fail(f"peak not written: {e}")
    print(summary_line(row, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
