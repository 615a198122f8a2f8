"""A run from start to record: parse the arguments, build the run's additions, train, and append the
result with its status (ok, oom, skipped, failed, interrupted) whatever happened.
"""
import contextlib
import gc
import json
import math
import os
import shlex
import sys
import traceback
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Callable, NamedTuple

import torch
from torch.nn import Module

from Utils.ladder.apply import Unavailable, build
from Utils.ladder.registry import ADDITIONS, RegistryError, additions_named, check_parallel, run_name
from Utils.model_config import PRESETS, GPTConfig
from Utils.results import metrics
from Utils.results.store import ResultsError, append_run, check_prefix
from Utils.train.attention import cannot_run
from Utils.train.cli import RunConfig, UsageError, parse_args
from Utils.train.compile_caches import autograd_cache_unless, cold_caches, compile_cache, compile_counts
from Utils.train.data import DataError, TokenLoader, check_enough_tokens, load_tokens
from Utils.train.failures import compile_failure, first_line, out_of_memory
from Utils.train.interrupts import Interrupts
from Utils.train import distributed
from Utils.train.loop import train
from Utils.train.micro import (NothingFits, allocator_settings, cap_memory, choose_micro_batch, free,
                               next_divisor_below, smaller_micro_batch)
from Utils.train.provenance import provenance
from Utils.train.record import Run
from Utils.train.usage import fail

EXIT_FAILED, EXIT_OOM, EXIT_SKIPPED = 1, 3, 4   # 2: bad input, or results that cannot be written (fail)


def main(additions: str | Iterable[str], argv: Iterable[str] | None = None, command: str | None = None,
         peer: "Peer | None" = None, not_started: dict | None = None) -> int:
    """Entry point of every rung script, of `make custom` and of a peer: `additions` is a rung's name or a list
    of addition names; `command` is what the record says repeats the run (the script and argv by default);
    not_started: the driver's word for a run whose processes never started (Utils.train.handoff.NOT_STARTED).
    Parse, check PREFIX, run (or record the run that never started), record; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    allocator = allocator_settings()
    try:
        additions = additions_named(additions)
        cfg = parse_args(argv, prog=os.path.basename(sys.argv[0]))
        check_parallel(additions, cfg.parallel)
        check_sdpa_backend(additions, cfg, peer)
        check_prefix(cfg.prefix)
    except (UsageError, ResultsError, RegistryError) as e:
        return fail(str(e))
    if command is None:
        command = " ".join(shlex.quote(a) for a in [os.path.basename(sys.argv[0])] + argv)
    if not_started:
        return _record_not_started(additions, cfg, command, peer, not_started)
    return run(additions, replace(cfg, allocator=allocator), command, peer)


def pins_sdpa(additions: tuple, cfg: RunConfig, peer: "Peer | None" = None) -> bool:
    """True where SDPA_BACKEND holds the run's attention: it names a backend and the attention goes through SDPA."""
    # Attention that keeps the scores on the chip is SDPA's, or packed_attention's, which falls back to it.
    return cfg.sdpa_backend != "auto" and (any(ADDITIONS[a].scores_on_chip for a in additions) or bool(peer))


def check_sdpa_backend(additions: tuple, cfg: RunConfig, peer: "Peer | None" = None) -> None:
    """SDPA_BACKEND refused, with the fix, where the run's attention goes through SDPA and the backend cannot run
    it on this device at the run's dtype and head size. Rungs whose attention is written out ignore it."""
    if not pins_sdpa(additions, cfg, peer):
        return
    dtype = torch.bfloat16 if any(ADDITIONS[a].matmuls == "bf16" for a in additions) else torch.float32
    preset = PRESETS[cfg.model]
    head_dim = preset.n_embd // preset.n_head
    # torchrun's LOCAL_RANK: each process checks its own GPU, not every one the first
    device = torch.device(cfg.device, int(os.environ.get("LOCAL_RANK", 0))) if cfg.device == "cuda" else torch.device("cpu")
    why = cannot_run(cfg.sdpa_backend, device, dtype, head_dim)
    if why:
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else "this CPU"
        raise UsageError(f"SDPA_BACKEND={cfg.sdpa_backend} cannot run this run's attention ({str(dtype)[6:]}, head "
                         f"size {head_dim}) on {where}: {why}; use SDPA_BACKEND=auto, or another backend")


def add_run_figures(additions: tuple, cfg: RunConfig, run: Run, rows: list,
                    counts_before: tuple[int, int] = (0, 0)) -> None:
    """runs.csv's figures of a run from its step rows, into `run`: the measured steps' median and IQR, tokens/s,
    MFU, compile time and cache, the final loss."""
    measured = [r for r in rows if not r["warmup"]]
    if measured:
        med, iqr = metrics.median_iqr([r["step_ms"] for r in measured])
        world = run.nproc or 1
        tokens_per_s = world * cfg.batch_size * cfg.seq_len / (med / 1e3)
        run.median_step_ms, run.iqr_step_ms = med, iqr
        run.median_tokens_per_s = run.global_tokens_per_s = tokens_per_s
        run.tokens_per_s_per_gpu = tokens_per_s / world
        mfus = [r["mfu"] for r in measured if r["mfu"] is not None]
        run.mfu = metrics.median_iqr(mfus)[0] if mfus else None
        if any(ADDITIONS[a].compiled for a in additions) and rows:
            # The first step holds the compilation; what it took beyond a normal step is compile time.
            run.compile_s = max(0.0, (rows[0]["step_ms"] - med) / 1e3)
    run.compile_cache = compile_cache(counts_before)
    if rows:
        run.final_loss = rows[-1]["loss"]


def summary_line(run: Run) -> str:
    """The line a run ends with: its status and figures, n/a where it has none."""
    def num(key: str, fmt: str, unit: str = "") -> str:
        v = getattr(run, key)
        return f"{v:{fmt}}{unit}" if isinstance(v, (int, float)) else "n/a"
    parts = [f"{run.optimization}: {run.status}",
             f"median {num('median_step_ms', '.1f', ' ms')} (IQR {num('iqr_step_ms', '.1f', ' ms')})",
             f"{num('median_tokens_per_s', ',.0f', ' tok/s')}",
             f"MFU {num('mfu', '.1%')}",
             f"peak mem {num('peak_mem_allocated_gib', '.2f', ' GiB')} alloc / "
             f"{num('peak_mem_reserved_gib', '.2f', ' GiB')} reserved",
             f"compile {num('compile_s', '.1f', ' s')}",
             f"final loss {num('final_loss', '.4f')}"]
    return "summary | " + " | ".join(parts)


def _write_error_log(prefix, run_id, rank=0):
    """The whole traceback of the exception being handled, beside the results; its path, or None. Each rank of
    a run on several processes writes its own."""
    path = os.path.join(prefix, f"{run_id}.error.log" if not rank else f"{run_id}.rank{rank}.error.log")
    try:
        with open(path, "w", encoding="utf-8", errors="backslashreplace") as f:
            traceback.print_exc(file=f)
    except OSError:
        return None
    return path


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> tuple[float | None, float | None]:
    """(max allocated, max reserved) in GiB since the last reset; None on a CPU."""
    if device.type != "cuda":
        return None, None
    return torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30


class Peer(NamedTuple):
    """A model other than the suite's, trained by the same loop (Utils.peers)."""
    name: str                                  # its run name: peer-<name>
    make_model: Callable[[GPTConfig], Module]  # its model, of the preset's shape
    about: Callable[[], str]                   # what it is, with its version, for the run's notes


def _build_and_train(additions: tuple, cfg: RunConfig, device: torch.device, tokens, dist, peer: Peer | None,
                     run: Run, rows: list, held: dict, config: dict, interrupts: Interrupts) -> str | None:
    """Build the run as cfg says (held["build"]), note what the build says in `run`, and train; train's return."""
    loader = TokenLoader(tokens, cfg.batch_size, cfg.seq_len, pin_memory=device.type == "cuda",
                         rank=dist.rank, world=dist.world_size)
    held["build"] = build(additions, device, PRESETS[cfg.model], cfg.seed, loader, cfg.parallel,
                          **({"make_model": peer.make_model} if peer else {}))
    distributed.barrier()   # every rank built: the first step's collectives wait for no set-up
    run.n_params = held["build"].model.num_params(exclude_position_embedding=False)
    run.notes = "; ".join(([peer.about()] if peer else []) + held["build"].notes)
    run.config = json.dumps({**config, "fell_back": held["build"].fell_back}, sort_keys=True)
    for note in held["build"].notes if dist.main else ():
        print(f"note: {note}")
    return train(held["build"], cfg, run, rows, interrupts)


def run(additions: tuple, cfg: RunConfig, command: str, peer: Peer | None = None) -> int:
    """Run and record `additions`; a peer trains its own model under the same additions and loop. Returns the
    exit status."""
    dist = distributed.from_env(cfg.parallel)
    try:
        tokens, data_name = load_tokens(cfg.data, PRESETS[cfg.model].vocab_size, cfg.seed, cfg.data_dir)
        check_enough_tokens(len(tokens), cfg.batch_size, cfg.seq_len, dist.world_size, data_name)
    except DataError as e:
        return fail(str(e))
    device = torch.device(cfg.device)
    if dist.active:
        try:
            device = distributed.init(dist, cfg.device)
        except Exception as e:
            return fail(f"rank {dist.rank} cannot join the other processes: {first_line(e)}")
    config = {"run": cfg.as_dict(), "additions": list(additions)}
    run = _new_record(_display_name(additions, cfg, peer), cfg, command, dist, device, data_name, config)
    if dist.main:
        print(_start_line(run, additions, cfg, dist, device), flush=True)
    tries = Tries(cfg, auto=cfg.micro_batch is None)   # MICRO_BATCH=auto, before choose_micro_batch settles it
    reset_peak_memory(device)
    tries.counts_before = compile_counts()
    with Interrupts() as interrupts, cold_caches(cfg.cold) as renew_cold_caches, \
            autograd_cache_unless(pins_sdpa(additions, cfg, peer)):
        try:
            _train_until_it_fits(additions, tries, device, tokens, dist, peer, run, config, interrupts,
                                 renew_cold_caches)
            outcome = ("ok", "", 0)
        except KeyboardInterrupt:
            outcome = ("ok", "", 0)   # recorded below, with a signal that came after training
        except Exception as e:
            outcome = _failure(e, tries, device, run.run_id, dist.rank)
        interrupts.disarm()
        _release_and_measure(additions, tries, device, run)
        run.status, run.message, code = _final_status(outcome, interrupts, tries, dist, run)
        return _close(tries, dist, run, code)


def _record_not_started(additions: tuple, cfg: RunConfig, command: str, peer: Peer | None, word: dict) -> int:
    """Record as failed, with the driver's message, a run whose processes never started: what it would have run,
    on how many hosts and processes, on this host's device; no step."""
    cfg = replace(cfg, parallel=word["parallel"])
    config = {"run": cfg.as_dict(), "additions": list(additions)}
    run = _new_record(_display_name(additions, cfg, peer), cfg, command, distributed.Dist(), torch.device(cfg.device),
                      cfg.data, config)
    run.nnodes, run.nproc, run.status, run.message = word["nnodes"], word["nproc"], "failed", word["message"]
    return record(cfg, run, [], EXIT_FAILED)


def _display_name(additions: tuple, cfg: RunConfig, peer: Peer | None) -> str:
    """The run's name in the results: the rung's or the peer's, with the SDPA backend where it is pinned."""
    name = peer.name if peer else run_name(additions)
    if pins_sdpa(additions, cfg, peer):
        name += f"@{cfg.sdpa_backend}"   # another kernel than PyTorch's choice: another row of the report
    return name


def _new_record(name: str, cfg: RunConfig, command: str, dist: distributed.Dist, device: torch.device,
                data_name: str, config: dict) -> Run:
    """The run's record as it starts: its id (rank 0's, on every rank), what it runs and on what; the figures
    and the status are added as the run goes."""
    run_id = f"{datetime.now():%Y%m%d-%H%M%S}-{name}-{uuid.uuid4().hex[:6]}"
    hosts = distributed.hosts(dist, device)
    return Run(run_id=distributed.broadcast_text(run_id, device), nnodes=len(hosts), hosts=" ".join(hosts),
               optimization=name, started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
               steps=cfg.steps, warmup_steps=cfg.warmup, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
               model=cfg.model, data=data_name, command=command, nproc=dist.world_size,
               parallel=cfg.parallel, rank=dist.rank,
               gpu_memory_gib=cfg.gpu_memory_gib,   # a run where nothing fits is compared too
               config=json.dumps(config, sort_keys=True),
               provenance=provenance(device))


def _start_line(run: Run, additions: tuple, cfg: RunConfig, dist: distributed.Dist, device: torch.device) -> str:
    """The line a run starts with: what it trains, on what, with which additions, for how many steps."""
    world = dist.world_size
    changes = " ".join(additions) or "none"
    spread = f" | {world} process{'es' if world > 1 else ''}, {cfg.parallel}" if dist.active else ""
    return (f"{run.optimization} | {cfg.model} | B={cfg.batch_size} T={cfg.seq_len} | data {run.data} | "
            f"{device.type} {run.provenance.gpu_name} | additions: {changes} | steps {cfg.steps} (warm-up {cfg.warmup}) "
            f"| seed {cfg.seed}{spread}")


@dataclass
class Tries:
    """What the run's tries share: the config as settled so far (the micro-batch MICRO_BATCH=auto chose, then
    each restart's), the step rows and the build of the current try, and what the finished one left."""
    cfg: RunConfig
    auto: bool                     # MICRO_BATCH=auto: the run may start again smaller
    rows: list = field(default_factory=list)
    held: dict = field(default_factory=dict)   # the build, dropped before the run is measured and recorded
    restarts: list[int] = field(default_factory=list)   # the micro-batches the run itself ran out of memory at
    trace: str | None = None       # the profiled steps' trace (PROFILE=1)
    counts_before: tuple[int, int] = (0, 0)   # compile_counts() as the last try started


def _train_until_it_fits(additions: tuple, tries: Tries, device: torch.device, tokens, dist: distributed.Dist,
                         peer: Peer | None, run: Run, config: dict, interrupts: Interrupts,
                         renew_cold_caches: Callable[[], None]) -> None:
    """Settle the micro-batch and train, starting again one divisor smaller where the run itself runs out of
    memory (smaller_micro_batch). The only place a signal raises: every handler after it runs disarmed."""
    try:
        interrupts.arm()
        cap_memory(device, tries.cfg.gpu_memory_gib)
        tries.cfg = choose_micro_batch(additions, tries.cfg, device, tokens, dist,
                                       peer.make_model if peer else None, run)
        while True:
            if interrupts.requested:   # a signal whose exception a finalizer swallowed while freeing
                raise KeyboardInterrupt
            renew_cold_caches()   # what the search compiled is not the run's compilation, nor its cache
            tries.counts_before = compile_counts()
            reset_peak_memory(device)
            try:
                tries.trace = _build_and_train(additions, tries.cfg, device, tokens, dist, peer, run, tries.rows,
                                               tries.held, config, interrupts)
                break
            except Exception as e:   # noqa: BLE001 - raised again unless the run may start again smaller
                smaller = smaller_micro_batch(e, tries.cfg, tries.auto, dist, len(tries.restarts))
                if smaller is None:
                    raise
            # outside the handler: the exception's frames no longer hold the run's tensors
            _start_again(tries, smaller, device, dist, run)
        if tries.restarts:
            run.notes = "; ".join(filter(None, [run.notes, (
                f"MICRO_BATCH=auto chose {tries.restarts[0]}; the run ran out of memory at "
                f"{', '.join(map(str, tries.restarts))} and was measured at {tries.cfg.micro_batch}")]))
    finally:
        interrupts.disarm()


def _start_again(tries: Tries, smaller: int, device: torch.device, dist: distributed.Dist, run: Run) -> None:
    """Drop the try that ran out of memory, its steps and its build, and set the run to `smaller` rows."""
    cfg = tries.cfg
    if dist.main:
        chose = " too" if tries.restarts else ", which MICRO_BATCH=auto chose,"
        print(f"micro-batch: {cfg.micro_batch} rows{chose} ran out of memory in the run's step "
              f"{len(tries.rows) + 1}: the run starts again at {smaller}", flush=True)
    tries.restarts.append(cfg.micro_batch)
    tries.rows.clear()
    tries.held.clear()
    free(device)
    tries.cfg = replace(cfg, micro_batch=smaller)
    run.micro_batch, run.accumulation_steps = smaller, cfg.batch_size // smaller


def _failure(error: Exception, tries: Tries, device: torch.device, run_id: str, rank: int) -> tuple[str, str, int]:
    """(status, message, exit status) of a run that raised `error`: skipped where the rung cannot run here (or
    torch.compile cannot compile before any step), oom where it ran out of memory, else failed, with the whole
    traceback written beside the results."""
    if isinstance(error, Unavailable):
        return "skipped", str(error), EXIT_SKIPPED
    if isinstance(error, NothingFits):
        return "oom", str(error), EXIT_OOM
    if out_of_memory(error):
        return "oom", _oom_message(tries, peak_memory_gib(device)[0]), EXIT_OOM
    log = _write_error_log(tries.cfg.prefix, run_id, rank)
    where = f" (the whole error: {log})" if log else ""
    if compile_failure(error) and not tries.rows:
        return "skipped", f"torch.compile cannot compile here: {first_line(error)}{where}", EXIT_SKIPPED
    return "failed", f"{first_line(error)}{where}", EXIT_FAILED


def _oom_message(tries: Tries, peak: float | None) -> str:
    """What ran out of memory after how many steps, at what peak, after which restarts, and what to try next."""
    cfg, restarts = tries.cfg, tries.restarts
    micro = cfg.micro_batch or cfg.batch_size
    smaller = next_divisor_below(cfg.batch_size, micro)
    return (f"out of memory at MICRO_BATCH={micro} (BATCH_SIZE={cfg.batch_size}) after {len(tries.rows)} steps"
            + (f" (peak {peak:.1f} GiB allocated)" if peak is not None else "")
            + (f", the run having run out at {', '.join(map(str, restarts))} before (MICRO_BATCH=auto "
               f"chose {restarts[0]})" if restarts else "")
            + (f": try MICRO_BATCH={smaller}" + ("" if tries.auto else
                                                  ", or MICRO_BATCH=auto, which finds the largest that fits")
               if smaller else f": one row does not fit; try SEQ_LEN={max(1, cfg.seq_len // 2)}, a "
                               f"smaller MODEL, or a rung that saves memory (flash, 8bit)"))


def _release_and_measure(additions: tuple, tries: Tries, device: torch.device, run: Run) -> None:
    """The run's peak memory, then its build released (the memory back to the device), then its figures from
    the steps it kept."""
    run.peak_mem_allocated_gib, run.peak_mem_reserved_gib = peak_memory_gib(device)
    tries.held.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    add_run_figures(additions, tries.cfg, run, tries.rows, tries.counts_before)


def _final_status(outcome: tuple[str, str, int], interrupts: Interrupts, tries: Tries, dist: distributed.Dist,
                  run: Run) -> tuple[str, str, int]:
    """(status, message, exit status) the run is recorded with: `outcome`, unless a signal came at any moment
    until now, whatever else its arrival made of the run, or another rank's failure ended this one."""
    status, message, code = outcome
    cfg = tries.cfg
    if interrupts.requested:
        status, code = "interrupted", interrupts.exit_status
        message = (run.message   # the ranks of several could not agree on their steps (Utils.train.loop)
                   or f"interrupted after {len(tries.rows)} of {cfg.steps} steps; the measured steps are kept")
    if dist.active and dist.main and status != "ok":
        # Another rank's failure ends every rank: torchrun stops them, or their collectives break. Its
        # report names the cause.
        other = distributed.other_failure(cfg.prefix, run.run_id, dist.world_size)
        if other:
            status, message = other
            code = EXIT_OOM if status == "oom" else EXIT_FAILED
        elif status == "failed" and run.nnodes > 1:
            # No rank said why: a node whose processes all stopped at once (its host gone, or killed) cannot, and
            # another node's report lies in its own PREFIX unless the folder is shared. This error is the broken
            # collective.
            message = f"{distributed.lost_node(run.hosts.split())}: {message}"
    return status, message, code


def _close(tries: Tries, dist: distributed.Dist, run: Run, code: int) -> int:
    """Rank 0 records the run; another rank records nothing and reports its own failure for rank 0 to name.
    Either leaves the process group; the exit status."""
    if not dist.main:
        if run.status in ("failed", "oom"):
            distributed.report_failure(tries.cfg.prefix, run.run_id, dist.rank, run.status, run.message)
            print(f"error: rank {dist.rank}: {run.optimization} {run.status}: {run.message}",
                  file=sys.stderr)
        distributed.close()
        return code
    code = record(tries.cfg, run, tries.rows, code, tries.trace)
    distributed.close()
    return code


def first_non_finite_loss(rows: list) -> str | None:
    """Why a run whose loss became nan or inf is not a result (its steps are still recorded), else None: a speed
    measured on a loss that no longer means anything is no speed of training."""
    bad = next((r for r in rows if not math.isfinite(r["loss"])), None)
    if bad is None:
        return None
    return (f"the loss is {bad['loss']} from step {bad['step']}: the run diverged, or one of its kernels computes "
            f"wrongly; its steps are recorded, its speed is not a result")


def record(cfg: RunConfig, run: Run, rows: list, code: int, trace: str | None = None) -> int:
    """Append the run (signals are held off meanwhile: Utils.results.store) and say how it ended; the exit
    status: `code`, or fail's where the results cannot be written. A run whose loss turned nan or inf is
    recorded failed, a rung's or a peer's alike. A profiled run leaves results.csv and runs.csv alone: its
    record is its trace, which the report splits (Utils.report.breakdown)."""
    if run.status == "ok" and (diverged := first_non_finite_loss(rows)):
        run.status, run.message = "failed", diverged
        code = EXIT_FAILED
    status, message = run.status, run.message
    if trace is not None and status != "ok":
        # a run that did not end well is not recorded, and its trace would be split as if it had
        with contextlib.suppress(OSError):
            os.remove(trace)
        trace = None
    try:
        if not cfg.profile:
            append_run(cfg.prefix, run.row(), rows)
    except (ResultsError, OSError) as e:
        return fail(f"results not written: {e}")
    print(summary_line(run))
    if trace is not None:
        print(f"trace | {run.optimization}: the profiled steps are in {trace}; python -m Utils.report.breakdown "
              f"--prefix {shlex.quote(cfg.prefix)} splits them into breakdown.md (make does, after PROFILE=1)")
    if status != "ok":
        print(f"error: {run.optimization} {status}: {message}", file=sys.stderr)
    return code
