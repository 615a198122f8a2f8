"""The one training loop: every step timed and recorded, the measured window's wall clock, the GPU's clocks
over it, and the profiled steps of `make profile`.

A step's time runs from the previous step's end to its own end, both marked on the device (a CUDA event
recorded on the stream after the step's last kernel; perf_counter on a CPU, where work is synchronous), as
MLPerf times a run and torch.utils.benchmark a statement: whatever the GPU waits for between two steps,
the host's reading back of a loss included, belongs to a step. The measured steps then add up to the
window's wall clock (window_wall_s), which the host takes with perf_counter after synchronizing on the last
warm-up step's end and on the last step's end.
"""
import contextlib
import functools
import os
import time
from collections.abc import Callable

import torch

from Utils.ladder.apply import Build
from Utils.results import metrics
from Utils.results.gpus import peak_bf16_flops
from Utils.train import attention, distributed, nvml
from Utils.train.cli import PROFILE_STEPS, RunConfig
from Utils.train.data import inputs_targets
from Utils.train.interrupts import Interrupts
from Utils.train.record import Run


Mark = float | torch.cuda.Event   # a step's end: perf_counter's seconds on a CPU, a recorded event on a GPU


class StepClock:
    """mark() marks a step's end without waiting for the device; ms(earlier, later) is the time between two
    marks and waits for the later one; wait(mark) waits for it and returns the host's perf_counter."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self) -> Mark:
        if not self.cuda:
            return time.perf_counter()
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        return end

    def ms(self, earlier: Mark, later: Mark) -> float:
        if self.cuda:
            later.synchronize()
            return earlier.elapsed_time(later)
        return (later - earlier) * 1e3

    def wait(self, mark: Mark) -> float:
        if self.cuda:
            mark.synchronize()
        return time.perf_counter()


class StepTimes:
    """How a step is timed, in one place. Each step runs from the previous step's end mark to its own
    (StepClock). The host reads marks and losses back only every `sync_every` steps, so that between read-backs
    the CPU queues work ahead of the GPU and no step waits for the host, and at the warm-up's and the run's last
    step: the measured window's wall clock (window_wall_s) runs from the one to the other."""

    def __init__(self, clock: StepClock, sync_every: int, warmup: int, steps: int):
        self.clock, self.sync_every, self.warmup, self.steps = clock, sync_every, warmup, steps
        self.pending: list[tuple[int, Mark, Mark, torch.Tensor]] = []   # (step, start, end, loss) not read back
        self.last_end = clock.mark()
        self.window_start: float | None = None
        self.window_wall_s: float | None = None

    def ended(self, i: int, end: Mark, loss: torch.Tensor, record: Callable[[int, float, float], None]) -> bool:
        """Step i ended at `end`; where a read-back is due, record(step, ms, loss) each pending step. True when
        the measured window has just started (every rank together, among several processes)."""
        self.pending.append((i, self.last_end, end, loss))
        self.last_end = end
        if len(self.pending) != self.sync_every and i not in (self.warmup - 1, self.steps - 1):
            return False
        synced_at = self._read_back(record)
        if i == self.steps - 1 and self.window_start is not None:
            self.window_wall_s = synced_at - self.window_start
        if i != self.warmup - 1:
            return False
        self.window_start = synced_at   # the device has finished the warm-up
        if distributed.barrier():   # every rank starts the measured window together
            self.last_end, self.window_start = self.clock.mark(), time.perf_counter()
        return True

    def _read_back(self, record: Callable[[int, float, float], None]) -> float:
        """Wait for the newest pending step's end, note the host's time, then record every pending step."""
        synced_at = self.clock.wait(self.pending[-1][2])
        for i, start, end, loss in self.pending:
            record(i, self.clock.ms(start, end), loss.item())
        self.pending.clear()
        return synced_at

    def record_unread(self, record: Callable[[int, float, float], None], recorded: set[int]) -> None:
        """A run that stops early (a signal, out of memory) keeps every step that finished, read back or not:
        each pending step not in `recorded`, until the device itself fails and nothing more can be read."""
        for i, start, end, loss in self.pending:
            if i in recorded:
                continue
            try:   # this rank's own figures: the others may be gone
                record(i, self.clock.ms(start, end), loss.item())
            except Exception:   # the device itself failed: what it holds cannot be read back
                break


def make_step(b: Build, cfg: RunConfig, clock: StepClock) -> Callable[[], tuple[Mark, torch.Tensor]]:
    """One training step of cfg.batch_size rows in micro-batches of cfg.micro_batch rows: returns (the mark of its
    end, its loss tensor) without synchronizing. Each micro-batch's loss is the mean over its rows, scaled by
    micro / batch, so that the gradients add up to the whole batch's; among several processes they are
    reduced once, in the last micro-batch's backward."""
    device, source, update, step_model, optimizer = b.device, b.source, b.update, b.step_model, b.optimizer
    micro = cfg.micro_batch or cfg.batch_size
    parts = cfg.batch_size // micro
    deferred = b.sync_every > 1
    # A gradient that a CUDA graph's backward hands to an empty .grad lives in the graph's memory pool, which the
    # next micro-batch's replay overwrites (torch's cudagraph_trees warns of gradient accumulation): with several
    # micro-batches the gradients are allocated outside the graphs once, and zeroed instead of freed.
    cudagraphs = b.cudagraphs
    keep_grads = parts > 1 and cudagraphs
    if keep_grads:
        for p in b.model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)

    def step():
        window = source.next_batch().to(device, non_blocking=True)
        x, y = inputs_targets(window, cfg.batch_size, cfg.seq_len)
        total = None
        for k, (xm, ym) in enumerate(zip(x.split(micro), y.split(micro))):
            if cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()
            with b.gradient_sync(k == parts - 1):
                with b.autocast(), attention.pinned(cfg.sdpa_backend):
                    loss = step_model(xm, ym)[1]   # logits a model returns (a peer's) are dropped at once, as a user would
                (loss if parts == 1 else loss / parts).backward()
            if parts > 1:   # a sum of its own, which the next micro-batch's replay of a CUDA graph leaves alone
                total = loss.detach().clone() if total is None else total + loss.detach()
        update()
        optimizer.zero_grad(set_to_none=not keep_grads)
        if parts > 1:
            return clock.mark(), total / parts
        # A loss read later must survive the next step (a CUDA graph replay reuses its output's memory).
        return clock.mark(), (loss.detach().clone() if deferred else loss)

    return step


def train(b: Build, cfg: RunConfig, run: Run, rows: list, interrupts: Interrupts) -> str | None:
    """Run cfg.steps timed steps of the built run `b`, appending a dict per step to rows, until they end or a
    signal (`interrupts`) stops them. With cfg.profile, then profiles a few more and returns the trace's path (on
    the main process), else None."""
    device, config = b.device, b.config
    flops_token = metrics.flops_per_token(b.model.num_params(), config.n_layer, config.n_head,
                                          config.n_embd // config.n_head, cfg.seq_len)
    run.flops_per_token = flops_token
    peak = peak_bf16_flops(run.provenance.gpu_name) if device.type == "cuda" else None
    clock = StepClock(device)
    main = run.rank == 0
    # Rank 0 records the run, so only its GPU is sampled.
    sampler = nvml.Sampler(run.provenance.gpu_uuid) if device.type == "cuda" and main else None
    step = make_step(b, cfg, clock)
    record = _step_recorder(cfg, run, rows, flops_token, peak)
    _timed_steps(b, cfg, run, rows, step, clock, record, sampler, interrupts)
    if cfg.profile and not main:   # the other ranks step with rank 0, whose profile is the run's
        for _ in range(1 + PROFILE_STEPS):
            clock.wait(step()[0])
        return None
    if cfg.profile:
        measured = [r["step_ms"] for r in rows if not r["warmup"]]
        return profile_steps(step, clock, cfg, device, run, {
            "flops_per_step": flops_token * cfg.batch_size * cfg.seq_len, "peak_flops": peak,
            "median_step_ms": metrics.median_iqr(measured)[0] if measured else None})
    return None


def _step_recorder(cfg: RunConfig, run: Run, rows: list, flops_token: float,
                   peak: float | None) -> Callable[[int, float, float], None]:
    """record(i, ms, loss): step i's row in `rows`, with its tokens/s over the global batch and its MFU per
    GPU, and on the main process its line."""
    world = run.nproc or 1
    tokens_per_step = world * cfg.batch_size * cfg.seq_len   # the global batch
    main = run.rank == 0

    def record(i: int, ms: float, loss_value: float) -> None:
        tps = tokens_per_step / (ms / 1e3)
        step_mfu = metrics.mfu(flops_token, tps / world, peak)   # per GPU
        rows.append({"run_id": run.run_id, "optimization": run.optimization, "step": i,
                     "warmup": i < cfg.warmup, "step_ms": ms, "tokens_per_s": tps, "loss": loss_value,
                     "mfu": step_mfu})
        if main:
            mfu_text = f"MFU {step_mfu:.1%}" if step_mfu is not None else "MFU n/a"
            tag = " (warm-up)" if i < cfg.warmup else ""
            print(f"step {i + 1}/{cfg.steps} | loss {loss_value:.4f} | {ms:.1f} ms | {tps:,.0f} tok/s | "
                  f"{mfu_text}{tag}", flush=True)

    return record


def _timed_steps(b: Build, cfg: RunConfig, run: Run, rows: list, step: Callable[[], tuple[Mark, torch.Tensor]],
                 clock: StepClock, record: Callable[[int, float, float], None], sampler: "nvml.Sampler | None",
                 interrupts: Interrupts) -> None:
    """The cfg.steps steps, timed by StepTimes, with the GPU's clocks sampled over the measured window and the
    attention kernel watched on one step. Among several processes a step takes as long as its slowest rank, and
    its loss is the mean over the ranks' shares of the batch: one all-reduce after the last step says so, so that
    no collective of the harness lands inside a timed step (the lines printed meanwhile are rank 0's own).

    A signal stops one process at once. Among several, a rank that stopped alone would leave the others inside
    the next step's collectives, unable to answer: so after the first step each rank notes the signal, and every
    rank stops after the step the first to note it named (distributed.stop_step); then they agree on the steps
    they all finished. Every rank must get the signal (torchrun passes it to its own; on several hosts, each
    host's torchrun must get it, as a scheduler's does)."""
    watch = attention.Watch(b.device)
    stopped, stop_after = False, None   # by a signal; the step every rank stops after
    several = run.nproc > 1
    times = StepTimes(clock, b.sync_every, cfg.warmup, cfg.steps)
    try:
        # A warm-up step followed by another says which attention kernel ran: the second step where the warm-up
        # has three (the first holds the compilation, whose time compile_s reports), else the first; under CUDA
        # graphs the first, since the second replays graphs, which run no operator the host can see.
        watched = 1 if cfg.warmup >= 3 and not b.cudagraphs else 0
        for i in range(cfg.steps):
            with watch if i == watched else contextlib.nullcontext():
                end, loss = step()
            if times.ended(i, end, loss, record) and sampler:
                sampler.start()
            if several and i == 0:
                # The first step (the compilation) is left at once, as by one process: nothing is kept before it.
                interrupts.disarm()
            if several and interrupts.requested:
                # A rank's host runs up to sync_every steps ahead of its GPU, and so of the other ranks: past
                # that, every rank has noted the same signal and none has gone beyond the step.
                stop_after = stop_after if stop_after is not None else _stop_step(run, i + b.sync_every + 1)
                if i >= stop_after:
                    raise KeyboardInterrupt("stopped with every rank")
        if times.window_wall_s is not None:
            run.window_wall_s = times.window_wall_s
        if len(rows) == cfg.steps:
            _slowest_rank(rows, run, b.device)
    except KeyboardInterrupt:
        stopped = True
        raise
    finally:
        if sampler:
            run.clocks = sampler.stop()
        run.attention_kernel = watch.kernel()
        times.record_unread(record, {row["step"] for row in rows})
        if stopped and several:
            _common_steps(rows, run)


def _slowest_rank(rows: list, run: Run, device: torch.device) -> None:
    """Every step's time as its slowest rank's, its loss as the ranks' mean, the window as the longest
    (nothing changes in a single process)."""
    _reduced(rows, run, distributed.reduce_steps([r["step_ms"] for r in rows], [r["loss"] for r in rows],
                                                 run.window_wall_s, device))


def _stop_step(run: Run, proposed: int) -> int:
    """distributed.stop_step; where the store does not answer, this rank stops now, and _common_steps decides."""
    try:
        return distributed.stop_step(run.run_id, proposed)
    except Exception as e:   # noqa: BLE001 - any failure of the store ends the run the same way
        raise KeyboardInterrupt(f"the store did not answer: {e}") from None


def _common_steps(rows: list, run: Run) -> None:
    """After a signal among several processes: rows cut to the steps every rank finished, each reduced as
    _slowest_rank does; where a rank does not answer, none (rank 0's own times and its share's loss are not the
    run's), and run.message says why."""
    agreed = distributed.common_steps([r["step_ms"] for r in rows], [r["loss"] for r in rows], run.window_wall_s)
    if agreed is None:
        run.message = (f"interrupted after {len(rows)} of rank 0's steps; another rank did not answer within "
                       f"{distributed.AGREE_TIMEOUT_S:.0f} s, so no step is kept (rank 0's alone are not the run's)")
        rows.clear()
        return
    del rows[len(agreed[0]):]
    _reduced(rows, run, agreed)


def _reduced(rows: list, run: Run, reduced: tuple[list, list, float | None]) -> None:
    """rows and the window as `reduced` (every step's slowest time, mean loss; the longest window) gives them,
    in one assignment: a signal meanwhile leaves them whole, either as they were or reduced."""
    ms, losses, window = reduced
    new = [dict(row, step_ms=step_ms, loss=loss, tokens_per_s=row["tokens_per_s"] * row["step_ms"] / step_ms,
                mfu=row["mfu"] * row["step_ms"] / step_ms if row["mfu"] is not None else None)
           for row, step_ms, loss in zip(rows, ms, losses)]
    rows[:] = new
    if window is not None:
        run.window_wall_s = window


@contextlib.contextmanager
def _host_scopes(device: torch.device):
    """On a GPU, the profiler records on the host only the ranges user code opens (ProfilerStep#N among
    them), not every operator: the breakdown reads the kernels, and recording the operators slows a step that
    the host bounds (the flash rung's AdamW makes hundreds of small calls) well past its median (BENCHMARKS.md,
    "Profiled steps against the median"). torch.profiler has no switch for this; the function it enables the
    profiler with takes the scopes to record, so it is given them here. On a CPU the operators are the
    breakdown: all are kept."""
    import torch.autograd.profiler as autograd_profiler
    from torch._C._profiler import RecordScope
    enable = autograd_profiler._enable_profiler
    # A torch whose function takes no scopes (its signature, in its docstring, names them) records everything.
    if device.type == "cuda" and "scopes" in (enable.__doc__ or ""):
        autograd_profiler._enable_profiler = functools.partial(enable, scopes={RecordScope.USER_SCOPE})
    try:
        yield
    finally:
        autograd_profiler._enable_profiler = enable


def _metadata_text(value: object) -> str:
    """value as a trace's metadata can hold it: torch.profiler escapes a quote with a backslash and Kineto then
    turns every backslash into a slash, which undoes the escape, and a control character breaks the JSON
    too; so quotes, backslashes and control characters (a DATA path may hold any) become plain ones."""
    text = "" if value is None else str(value)
    return "".join(" " if ord(c) < 32 else c for c in text).replace('"', "'").replace("\\", "/")


def profile_steps(step: Callable[[], tuple[Mark, torch.Tensor]], clock: StepClock, cfg: RunConfig, device: torch.device,
                  run: Run, figures: dict) -> str:
    """PROFILE_STEPS more steps under torch.profiler (one more before them that the schedule discards),
    exported as a gzipped Chrome trace, its path returned. The trace's metadata names the run and carries
    `figures` (flops_per_step, peak_flops, median_step_ms), all that the report's split of it into compute,
    memory and overhead needs (Utils.report.breakdown.add_traces): the loop knows nothing of that split."""
    if device.type != "cuda":
        # A CUDA build of torch profiling a CPU run: Kineto still asks for the GPUs and logs each failure
        # (gpuGetDeviceCount); its log level 5 keeps only fatal messages.
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    path = os.path.join(cfg.prefix, f"trace_{run.optimization}.json.gz")
    tmp = os.path.join(cfg.prefix, f".tmp-trace_{run.optimization}.json.gz")

    def export(prof):
        prof.export_chrome_trace(tmp)   # torch gzips a name ending in .gz
        os.replace(tmp, path)

    # ProfilerStep#N windows exist only under a schedule; run_id metadata must be added inside the context.
    with _host_scopes(device), profile(activities=activities, on_trace_ready=export,
                                       schedule=schedule(wait=0, warmup=1, active=PROFILE_STEPS, repeat=1)) as prof:
        row = run.row()
        context = (f"{row['gpu_name']} · {cfg.model} ({run.n_params / 1e6:.0f}M params) · batch {cfg.batch_size} "
                   f"× seq_len {cfg.seq_len} · data {run.data}")
        # the breakdown chart's provenance, the run's name and context, and the figures its split needs
        meta = {**{key: row[key] for key in ("run_id", "git_commit", "started_at", "torch_version")},
                "rung": run.optimization, "context": context, **figures}
        for key, value in meta.items():
            prof.add_metadata(key, _metadata_text(value))
        # While a profiler runs, Inductor wraps each Triton launch in a host-side range of its own (its runtime
        # reads this flag, which the profiler has just set). The breakdown reads the kernels, which CUPTI traces
        # either way; that host work would make the compiled rungs without CUDA graphs 13-21% slower under the
        # profiler than their median (BENCHMARKS.md, "Profiled steps against the median").
        torch.autograd.profiler._is_profiler_enabled = False
        for _ in range(1 + PROFILE_STEPS):
            end, _ = step()
            clock.wait(end)   # waits for the step, so that each profiler window holds one whole step
            prof.step()
    return path
