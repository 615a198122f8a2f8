"""MICRO_BATCH=auto: the largest divisor of BATCH_SIZE whose whole step fits on this GPU, found by running real
steps, and GPU_MEMORY_GIB, the cap that lets a large card show what a small one fits.

A formula for a step's memory misses what the allocator, the compiler and the kernels' workspaces add, so each
candidate is tried for real: the rung built as it will run (compiled rungs compiled, CUDA graphs recorded),
PROBE_STEPS steps of two micro-batches taken so that the optimizer's states and the accumulated gradients exist,
the whole batch first. Each try is built from scratch and thrown away, so the measured run starts from the same
weights and data as a run given MICRO_BATCH outright; only its compilation finds the graphs the search compiled in
Inductor's cache (compile_cache says warm; COLD=1 gives the run an empty cache of its own).
"""
import gc
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from Utils.train.cli import divisors
from Utils.train.failures import allocation

# Three steps: the optimizer's states appear in the first, and a CUDA graph is recorded in the second and
# replayed from the third, each holding memory of its own.
PROBE_STEPS = 3


@dataclass(frozen=True)
class Fit:
    micro_batch: int               # the largest candidate that fitted
    too_large: tuple[int, ...]     # the candidates that ran out of memory, largest first
    probe_s: float                 # what the search took, kept out of the measured window


class NothingFits(Exception):
    """Not even one row a micro-batch fits; the message says what was measured and what to change."""


# Fixed-size segments of the caching allocator strand free memory between them, and CUDA graphs' private pools
# strand more; expandable segments grow one mapping instead, and under GPU_MEMORY_GIB=3.5 fit max's micro-batch
# of 8 rows where fixed ones fit 4 (BENCHMARKS.md, "What one try shows: fragmentation, and the allocator's
# expandable segments"). A user's own PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF is left as it is.
ALLOCATOR = "expandable_segments:True"


def allocator_settings() -> str:
    """The CUDA caching allocator's settings for this process: the user's, else ALLOCATOR. Takes effect only
    before CUDA's first use, so it is called first thing."""
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        if os.environ.get(name):
            return os.environ[name]
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATOR
    return ALLOCATOR


def cap_memory(device: torch.device, gib: float | None) -> None:
    """The process may allocate at most `gib` GiB of the GPU (PyTorch's per-process memory fraction)."""
    if gib is not None and device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index   # it takes no bare "cuda"
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total), index)


def free(device: torch.device) -> None:
    """Give back what a try held: compiled graphs and their CUDA-graph pools, then the allocator's cache."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def attempt(what: str, try_fn: Callable[[], None], is_oom: Callable[[BaseException], bool], device: torch.device,
            say: Callable[[str], None]) -> bool:
    """True if try_fn() runs without running out of memory (any other error is raised); says how it ended and
    its peak memory in a line, and frees what it held."""
    fitted, why, began = True, "", time.perf_counter()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    try:
        try_fn()
    except Exception as e:   # noqa: BLE001 - anything but running out of memory is raised again
        if not is_oom(e):
            raise
        fitted, why = False, allocation(e)
    peak = (f", peak {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB allocated, "
            f"{torch.cuda.max_memory_reserved(device) / 2**30:.2f} reserved") if cuda else ""
    free(device)   # outside the handler: the exception's frames no longer hold the try's tensors
    say(f"  {what}: {'fits' if fitted else 'out of memory' + why}{peak} ({time.perf_counter() - began:.1f} s)")
    return fitted


def search(batch: int, try_step: Callable[[int], None], is_oom: Callable[[BaseException], bool],
           device: torch.device, say: Callable[[str], None] = lambda line: None) -> Fit:
    """The largest divisor m of `batch` for which try_step(m) runs without running out of memory: the whole batch
    first (it fits on most cards), then a binary search over the smaller divisors, since what fits at m rows
    fits at fewer. Each try of a compiled rung compiles, so fewer tries is minutes less on a small card. Each
    try's outcome and peak memory go to `say`, a line each."""
    start, too_large = time.perf_counter(), []

    def fits(micro: int) -> bool:
        fitted = attempt(f"MICRO_BATCH={micro}", lambda: try_step(micro), is_oom, device, say)
        if not fitted:
            too_large.append(micro)
        return fitted

    candidates = divisors(batch)
    if fits(candidates[0]):
        best = 0
    else:   # the first (largest) of the rest that fits
        best, low, high = None, 1, len(candidates) - 1
        while low <= high:
            mid = (low + high) // 2
            if fits(candidates[mid]):
                best, high = mid, mid - 1
            else:
                low = mid + 1
    if best is None:
        raise NothingFits(f"not even MICRO_BATCH=1 fits (tried {', '.join(map(str, sorted(too_large, reverse=True)))})")
    return Fit(candidates[best], tuple(sorted(too_large, reverse=True)), time.perf_counter() - start)
