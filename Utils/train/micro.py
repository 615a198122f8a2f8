"""MICRO_BATCH=auto: the largest divisor of BATCH_SIZE whose whole step fits on this GPU, found by running real
steps, and GPU_MEMORY_GIB, the cap that lets a large card show what a small one fits.

A formula for a step's memory misses what the allocator, the compiler and the kernels' workspaces add, so each
candidate is tried for real: the rung built as it will run (compiled rungs compiled, CUDA graphs recorded),
PROBE_STEPS steps of two micro-batches taken so that the optimizer's states and the accumulated gradients exist,
the whole batch first. Each try is built from scratch and thrown away, so the measured run starts from the same
weights and data as a run given MICRO_BATCH outright; only its compilation finds the graphs the search compiled in
Inductor's cache (compile_cache says warm; COLD=1 gives the run an empty cache of its own).

`search` is the search itself, over any try; `choose_micro_batch` runs it for a run, with the tries built as the
run will be, and settles the micro-batch on every rank. Where not even one row fits, the error says why and what
would fit (`_nothing_fits`); a run whose chosen micro-batch runs out of memory after all starts again at the next
divisor (`smaller_micro_batch`).
"""
import gc
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch.nn import Module

from Utils.ladder.apply import build
from Utils.ladder.registry import ADDITIONS
from Utils.model_config import PRESETS, GPTConfig
from Utils.train import distributed
from Utils.train.cli import RunConfig, divisors
from Utils.train.data import TokenLoader
from Utils.train.failures import allocation, out_of_memory
from Utils.train.loop import StepClock, make_step
from Utils.train.record import Run

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


def choose_micro_batch(additions: tuple, cfg: RunConfig, device: torch.device, tokens: np.ndarray,
                       dist: distributed.Dist, make_model: Callable[[GPTConfig], Module] | None,
                       run: Run) -> RunConfig:
    """cfg with its micro-batch settled: MICRO_BATCH as given; auto: the whole batch on a CPU (and under FSDP,
    whose memory a probe without the other ranks would not show), else the largest that fits (`search`), on every
    rank; each try builds a peer's model where make_model is given. Recorded in `run`."""
    micro = cfg.micro_batch
    if micro is None and (device.type != "cuda" or cfg.parallel == "fsdp"):
        micro = cfg.batch_size
    elif micro is None:
        seen = {}
        say = lambda line: dist.main and print(line, flush=True)   # noqa: E731
        say(f"micro-batch search (MICRO_BATCH=auto): the largest divisor of BATCH_SIZE={cfg.batch_size} whose step "
            f"fits" + (f" in GPU_MEMORY_GIB={cfg.gpu_memory_gib:g}" if cfg.gpu_memory_gib else ""))
        try:
            fit = search(cfg.batch_size, lambda m: _probe(additions, cfg, m, device, tokens, dist, make_model, seen),
                         out_of_memory, device, say)
        except NothingFits:
            fit = None
        # Every rank takes part, a rank where nothing fits too (its 0 is the smallest), so that none waits alone.
        micro = distributed.smallest(fit.micro_batch if fit else 0, device)
        if micro == 0:
            if fit:
                raise NothingFits("not even MICRO_BATCH=1 fits on another rank's GPU")
            raise NothingFits(_nothing_fits(additions, cfg, device, seen, lambda c: _probe(
                additions, c, 1, device, tokens, dist, make_model, {}), say))
        if dist.main:
            left = f"; {', '.join(map(str, fit.too_large))} did not fit" if fit.too_large else ""
            print(f"micro-batch: {micro} rows, {cfg.batch_size // micro} a step (auto{left}; the search took "
                  f"{fit.probe_s:.1f} s, outside the measured steps)", flush=True)
    run.micro_batch, run.accumulation_steps = micro, cfg.batch_size // micro
    return replace(cfg, micro_batch=micro)


def _probe(additions, cfg, micro, device, tokens, dist, make_model, seen) -> None:
    """PROBE_STEPS steps at `micro` rows a micro-batch, of the run built as it will run (its own copy, thrown
    away after). Each step holds two micro-batches, not BATCH_SIZE / micro: the gradients accumulate in place, so
    the second micro-batch already reaches the peak of any later one, and a try at 1 row of 256 takes seconds, not
    minutes. Under DDP without the other ranks: their gradient buckets add little. Notes in `seen` the memory of
    the weights, and of the weights and optimizer states after a step."""
    cuda = device.type == "cuda"
    cfg = replace(cfg, batch_size=min(cfg.batch_size, 2 * micro), micro_batch=micro)
    loader = TokenLoader(tokens, cfg.batch_size, cfg.seq_len, pin_memory=cuda, rank=dist.rank, world=dist.world_size)
    b = build(additions, device, PRESETS[cfg.model], cfg.seed, loader,
              **({"make_model": make_model} if make_model else {}))
    if cuda:
        seen.setdefault("weights", torch.cuda.memory_allocated(device))
    clock = StepClock(device)
    step = make_step(b, cfg, clock)
    for i in range(PROBE_STEPS):
        clock.wait(step()[0])
        if i == 0 and cuda:
            seen.setdefault("after_step", torch.cuda.memory_allocated(device))
            # kept between steps (accumulating under CUDA graphs), the gradients are in after_step already
            seen.setdefault("grads_kept", any(p.grad is not None for p in b.model.parameters()))


# The fraction of the memory that the fixed part may take and leave room for activations.
ROOM = 0.75


def _nothing_fits(additions: tuple, cfg: RunConfig, device: torch.device, seen: dict,
                  try_row: Callable[[RunConfig], None], say: Callable[[str], None]) -> str:
    """Why not even one row fits, from what the probe measured (the memory that does not grow with the batch:
    weights, their gradients, the optimizer's states), and a setting that fits: shorter sequences, each tried
    (try_row runs one row a micro-batch under a config), where the fixed part leaves room; else the 8bit rung or
    a smaller MODEL, their fixed part computed from the one measured here."""
    cap = cfg.gpu_memory_gib or torch.cuda.get_device_properties(device).total_memory / 2**30
    # Bytes a parameter: 4 for a weight in fp32, 2 under master_weights (bf16, with an fp32 master in the
    # optimizer). Weights, gradients and AdamW's states come to 16 either way: 4 + 4 + 8, or 2 + 2 + 4 + 8; to 8
    # without masters and with bf16 states (stochastic_rounding).
    kinds = {ADDITIONS[a].optimizer for a in additions}
    weight_bytes = 2 if kinds & {"master", "stochastic"} else 4
    held = 8 if "stochastic" in kinds else 16
    if "weights" in seen:
        weights = seen["weights"] / 2**30
    else:   # the model itself did not fit: its weights, counted
        weights = weight_bytes * _parameters(cfg.model) / 2**30
    params = weights / weight_bytes   # in 2**30 parameters
    if "after_step" in seen:   # weights and states measured; the gradients are as large as the weights
        fixed, how = seen["after_step"] / 2**30 + (0 if seen.get("grads_kept") else weights), "measured"
    else:                      # no step finished: weights, gradients and AdamW's two fp32 states, counted
        fixed, how = held * params, "estimated from the weights"
    start = (f"out of memory at MICRO_BATCH=1: of {cap:.1f} GiB, the weights ({weights:.2f} GiB), their gradients "
             f"and the optimizer's states take {fixed:.2f} GiB ({how}) before any activation")
    if fixed < ROOM * cap:
        seq_len = cfg.seq_len // 2
        while seq_len >= 64:
            if attempt(f"SEQ_LEN={seq_len}, MICRO_BATCH=1", lambda: try_row(replace(cfg, seq_len=seq_len)),
                       out_of_memory, device, say):
                return (start + f", leaving {cap - fixed:.2f} GiB, less than one row's activations at "
                        f"SEQ_LEN={cfg.seq_len}; one row at SEQ_LEN={seq_len} fits (tried): run with SEQ_LEN={seq_len}")
            seq_len //= 2
        start += f"; not even one row at SEQ_LEN={seq_len * 2} fits (tried)"
    # AdamW keeps two fp32 states a parameter (8 bytes); bitsandbytes' AdamW8bit one byte each (2). The 8bit rung
    # keeps fp32 weights and gradients: against master_weights' bf16 ones and fp32 master, as many bytes (+4 - 4);
    # 10 bytes in all, against stochastic_rounding's 8.
    eight_bit = fixed - (held - 10) * params
    if all(ADDITIONS[a].optimizer != "8bit" for a in additions) and eight_bit < min(fixed, ROOM * cap):
        return start + (f"; the 8bit rung's optimizer states take a quarter of AdamW's, {eight_bit:.2f} GiB "
                        f"in all: try it (make 8bit)")
    sizes = {m: _parameters(m) for m in PRESETS}
    smaller = [m for m in PRESETS if sizes[m] < sizes[cfg.model] and fixed * sizes[m] / sizes[cfg.model] < ROOM * cap]
    if smaller:
        best = max(smaller, key=sizes.get)
        return start + (f"; MODEL={best} ({sizes[best] / 1e6:.0f}M parameters) would take about "
                        f"{fixed * sizes[best] / sizes[cfg.model]:.2f} GiB before any activation: try it")
    return start + "; no MODEL preset leaves room on this card"


def _parameters(model: str) -> int:
    """The parameter count of a MODEL preset, from a model built on the meta device (no memory)."""
    from Utils.model import GPT
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(PRESETS[model]).parameters())


# How many times a run starts again smaller. One step down covers a search whose fit had no margin left; an
# out-of-memory that fewer rows do not cure (memory that grows step by step) ends the run instead of costing a
# rebuild and a compile at every divisor.
MAX_RESTARTS = 2


def smaller_micro_batch(error: BaseException, cfg: RunConfig, auto: bool, dist, restarts: int) -> int | None:
    """The next divisor below cfg's micro-batch, at which a run whose micro-batch MICRO_BATCH=auto chose starts
    again when it runs out of memory after all (at most MAX_RESTARTS times), else None. The search's steps leave
    the allocator in another state than the run's, so a fit without margin can still run out (BENCHMARKS.md,
    "Small cards"): the run itself is the last try. Not under several processes: the other ranks are inside a
    collective, and one rank cannot start again alone."""
    if not auto or dist.active or restarts >= MAX_RESTARTS or not out_of_memory(error):
        return None
    return next_divisor_below(cfg.batch_size, cfg.micro_batch)


def next_divisor_below(batch: int, micro: int) -> int | None:
    """The largest divisor of `batch` under `micro`: where a run that ran out of memory goes next; None at 1."""
    return next((d for d in divisors(batch) if d < micro), None)
