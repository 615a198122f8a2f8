"""The one training loop: builds data, model and optimizer from a recipe, times every step, records it.

A step is timed whole: the batch's copy to the device, forward, backward, gradient clipping and the
optimizer step, between two CUDA events (or perf_counter on a CPU, where work is synchronous).
"""
import functools
import gc
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import traceback
import uuid
from dataclasses import asdict
from datetime import datetime, timezone

import torch

from Utils import metrics
from Utils.cli import PROFILE_STEPS, UsageError, fail, parse_args
from Utils.data import DataError, TokenLoader, inputs_targets, load_tokens
from Utils.model import GPT, PRESETS
from Utils.recipes import (CUDAGRAPH_MODES, Unavailable, apply_attention, apply_bias_grad, apply_compile, apply_fp8,
                           apply_loss, apply_mlp, apply_optimizer, apply_prefetch, apply_residual, apply_tf32,
                           apply_vocab_padding, autocast_context, make_update)
from Utils.results import ResultsError, append_run, check_prefix

EXIT_FAILED, EXIT_USAGE, EXIT_OOM, EXIT_SKIPPED, EXIT_INTERRUPTED = 1, 2, 3, 4, 130
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(recipe, argv=None):
    """Entry point of every rung script: parse, check PREFIX, run, record. Returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        cfg = parse_args(argv, prog=os.path.basename(sys.argv[0]))
        check_prefix(cfg.prefix)
    except (UsageError, ResultsError) as e:
        return fail(str(e))
    command = " ".join(shlex.quote(a) for a in [os.path.basename(sys.argv[0])] + argv)
    return run(recipe, cfg, command)


def environment(device):
    cuda = device.type == "cuda"
    return {
        "device": device.type,
        "gpu_name": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda if cuda else "",
        "git_commit": git_commit(),
    }


def git_commit():
    """The commit the code ran from; GIT_COMMIT wins for copies of the tree that carry no .git."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return f"{sha}-dirty" if sha and dirty else sha


class StepTimer:
    """start() and stop() bracket a step without waiting for the device; elapsed_ms() waits for that
    step only. On a CPU, work is synchronous and the host clock is the step's clock."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def start(self):
        if not self.cuda:
            return [time.perf_counter()]
        begin = torch.cuda.Event(enable_timing=True)
        begin.record()
        return [begin]

    def stop(self, mark):
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            mark.append(end)
        else:
            mark.append(time.perf_counter())
        return mark

    def elapsed_ms(self, mark):
        if self.cuda:
            mark[1].synchronize()
            return mark[0].elapsed_time(mark[1])
        return (mark[1] - mark[0]) * 1e3


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def train(recipe, cfg, device, tokens, run, rows, held):
    """Build everything from the recipe and run cfg.steps timed steps, appending a dict per step to rows.
    Objects that hold device memory go into `held` so the caller can release them on any exit."""
    notes = [n for n in [apply_tf32(recipe, device)] if n]
    config = PRESETS[cfg.model]
    for apply in (apply_attention, apply_loss, apply_mlp):   # model-config changes that may not apply here
        config, note = apply(config, recipe, device)
        notes += [note] if note else []
    for apply in (apply_vocab_padding, apply_residual, apply_bias_grad):   # the other model-config changes of a rung
        config = apply(config, recipe)
    torch.manual_seed(cfg.seed)
    with device:   # initialized where it trains: no 124M-parameter init on the host, no copy
        model = held["model"] = GPT(config)
    run["n_params"] = model.num_params(exclude_position_embedding=False)
    flops_token = metrics.flops_per_token(model.num_params(), config.n_layer, config.n_head,
                                          config.n_embd // config.n_head, cfg.seq_len)
    peak = metrics.peak_bf16_flops(run["gpu_name"]) if device.type == "cuda" else None
    autocast = functools.partial(autocast_context, recipe, device)
    autocast()   # a GPU without bf16 raises Unavailable here, before any step
    apply_fp8(model, recipe, device)   # before compiling, so that the FP8 casts are compiled with the model
    step_model, compile_note = apply_compile(model, recipe, device)
    held["compiled"] = step_model
    optimizer = held["optimizer"] = apply_optimizer(model, recipe, device)
    update, update_note = make_update(model, optimizer, recipe, device)
    loader = TokenLoader(tokens, cfg.batch_size, cfg.seq_len, pin_memory=device.type == "cuda")
    source, prefetch_note = apply_prefetch(loader, recipe, device)
    notes += [n for n in (compile_note, update_note, prefetch_note) if n]
    if recipe.sync_every > 1 and device.type != "cuda":
        notes.append("deferred synchronization has no effect on a CPU, where every operation is synchronous")
    run["notes"] = "; ".join(notes)
    for n in notes:
        print(f"note: {n}")

    timer = StepTimer(device)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    cudagraphs = recipe.compile and recipe.compile_mode in CUDAGRAPH_MODES and device.type == "cuda"
    deferred = recipe.sync_every > 1

    def step():
        """One training step, timed whole; returns (timing mark, loss tensor) without synchronizing."""
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        mark = timer.start()
        window = source.next_batch().to(device, non_blocking=True)
        x, y = inputs_targets(window, cfg.batch_size, cfg.seq_len)
        with autocast():
            _, loss = step_model(x, y)
        loss.backward()
        update()
        optimizer.zero_grad(set_to_none=True)
        # A loss read later must survive the next step (a CUDA graph replay reuses its output's memory).
        return timer.stop(mark), (loss.detach().clone() if deferred else loss)

    def record(i, mark, loss):
        ms, loss_value = timer.elapsed_ms(mark), loss.item()
        tps = tokens_per_step / (ms / 1e3)
        step_mfu = metrics.mfu(flops_token, tps, peak)
        rows.append({"run_id": run["run_id"], "optimization": recipe.name, "step": i,
                     "warmup": i < cfg.warmup, "step_ms": ms, "tokens_per_s": tps, "loss": loss_value,
                     "mfu": step_mfu})
        mfu_text = f"MFU {step_mfu:.1%}" if step_mfu is not None else "MFU n/a"
        tag = " (warm-up)" if i < cfg.warmup else ""
        print(f"step {i + 1}/{cfg.steps} | loss {loss_value:.4f} | {ms:.1f} ms | {tps:,.0f} tok/s | "
              f"{mfu_text}{tag}", flush=True)

    # The host reads timings and losses back every sync_every steps, so between read-backs the CPU queues
    # work ahead of the GPU and no step waits for the host.
    pending = []
    for i in range(cfg.steps):
        pending.append((i, *step()))
        if len(pending) == recipe.sync_every or i == cfg.steps - 1:
            for entry in pending:
                record(*entry)
            pending.clear()
    if cfg.profile:
        return profile_steps(step, timer, recipe, cfg, device, run, flops_token * tokens_per_step, peak)
    return None


def profile_steps(step, timer, recipe, cfg, device, run, flops_per_step, peak):
    """PROFILE_STEPS more steps under torch.profiler (one more before them that the schedule discards),
    exported as a gzipped Chrome trace and split into compute, memory and overhead."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from Utils import breakdown
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    path = os.path.join(cfg.prefix, f"trace_{recipe.name}.json.gz")
    tmp = os.path.join(cfg.prefix, f".tmp-trace_{recipe.name}.json.gz")

    def export(prof):
        prof.export_chrome_trace(tmp)   # torch gzips a name ending in .gz
        os.replace(tmp, path)

    # ProfilerStep#N windows exist only under a schedule; run_id metadata must be added inside the context.
    with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=PROFILE_STEPS, repeat=1),
                 on_trace_ready=export) as prof:
        prof.add_metadata("run_id", run["run_id"])
        for _ in range(1 + PROFILE_STEPS):
            mark, _ = step()
            timer.elapsed_ms(mark)   # waits for the step, so that each profiler window holds one whole step
            prof.step()
    return breakdown.split(breakdown.load_trace(path), flops_per_step=flops_per_step, peak_flops=peak,
                           peak_bandwidth=breakdown.peak_hbm_bandwidth(run["gpu_name"]))


def summarize(recipe, cfg, run, rows):
    measured = [r for r in rows if not r["warmup"]]
    if measured:
        med, iqr = metrics.median_iqr([r["step_ms"] for r in measured])
        run.update(median_step_ms=med, iqr_step_ms=iqr,
                   median_tokens_per_s=cfg.batch_size * cfg.seq_len / (med / 1e3))
        mfus = [r["mfu"] for r in measured if r["mfu"] is not None]
        run["mfu"] = metrics.median_iqr(mfus)[0] if mfus else None
        if recipe.compile and rows:
            # The first step holds the compilation; what it took beyond a normal step is compile time.
            run["compile_s"] = max(0.0, (rows[0]["step_ms"] - med) / 1e3)
    if rows:
        run["final_loss"] = rows[-1]["loss"]


def summary_line(run):
    def num(key, fmt, unit=""):
        v = run.get(key)
        return f"{v:{fmt}}{unit}" if isinstance(v, (int, float)) else "n/a"
    parts = [f"{run['optimization']}: {run['status']}",
             f"median {num('median_step_ms', '.1f', ' ms')} (IQR {num('iqr_step_ms', '.1f', ' ms')})",
             f"{num('median_tokens_per_s', ',.0f', ' tok/s')}",
             f"MFU {num('mfu', '.1%')}",
             f"peak mem {num('peak_mem_allocated_gib', '.2f', ' GiB')} alloc / "
             f"{num('peak_mem_reserved_gib', '.2f', ' GiB')} reserved",
             f"compile {num('compile_s', '.1f', ' s')}",
             f"final loss {num('final_loss', '.4f')}"]
    return "summary | " + " | ".join(parts)


def write_breakdown(cfg, recipe, run, profiled):
    from Utils import breakdown   # pandas and matplotlib: only profiled runs pay their import
    breakdown.append_breakdown_csv(cfg.prefix, recipe.name, run["run_id"], profiled, run.get("median_step_ms"))
    context = (f"{run['gpu_name']} · {cfg.model} ({run['n_params'] / 1e6:.0f}M params) · batch {cfg.batch_size} "
               f"× seq_len {cfg.seq_len} · data {run['data']}")
    breakdown.write_report(cfg.prefix, context=context)
    split = ", ".join(f"{name} {ms:.1f} ms" for name, ms in profiled.ms.items())
    print(f"profile | {recipe.name}: {split} per profiled step of {profiled.step_ms:.1f} ms"
          + ("" if profiled.gpu else " (CPU run: the compute/memory split is GPU-only)"))


def _compile_failure(e):
    return type(e).__module__.startswith(("torch._dynamo", "torch._inductor"))


def run(recipe, cfg, command):
    device = torch.device(cfg.device)
    try:
        tokens, data_name = load_tokens(cfg.data, PRESETS[cfg.model].vocab_size, cfg.seed, cfg.data_dir)
    except DataError as e:
        return fail(str(e))
    if len(tokens) < cfg.batch_size * cfg.seq_len + 1:
        return fail(f"DATA={data_name} has {len(tokens):,} tokens, fewer than one batch needs "
                    f"(BATCH_SIZE={cfg.batch_size} x SEQ_LEN={cfg.seq_len} + 1): use a smaller BATCH_SIZE or "
                    f"SEQ_LEN, or more text")
    run = {"run_id": f"{datetime.now():%Y%m%d-%H%M%S}-{recipe.name}-{uuid.uuid4().hex[:6]}",
           "optimization": recipe.name, "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "steps": cfg.steps, "warmup_steps": cfg.warmup, "batch_size": cfg.batch_size, "seq_len": cfg.seq_len,
           "model": cfg.model, "data": data_name, "command": command,
           "config": json.dumps({"run": cfg.as_dict(), "recipe": asdict(recipe)}, sort_keys=True),
           **environment(device)}
    changes = ", ".join(f"{k} {v}" for k, v in asdict(recipe).items() if k != "name")
    print(f"{recipe.name} | {cfg.model} | B={cfg.batch_size} T={cfg.seq_len} | data {data_name} | "
          f"{device.type} {run['gpu_name']} | {changes} | steps {cfg.steps} (warm-up {cfg.warmup}) "
          f"| seed {cfg.seed}", flush=True)

    rows, held = [], {}
    status, message, code = "ok", "", 0
    metrics.reset_peak_memory(device)
    # Both signals end the run the same way, even where SIGINT was inherited as ignored (a background job).
    previous = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    profiled = None
    try:
        profiled = train(recipe, cfg, device, tokens, run, rows, held)
    except Unavailable as e:
        status, message, code = "skipped", str(e), EXIT_SKIPPED
    except torch.OutOfMemoryError:
        peak = metrics.peak_memory_gib(device)[0] or 0.0
        status, code = "oom", EXIT_OOM
        message = (f"out of memory at BATCH_SIZE={cfg.batch_size} after {len(rows)} steps "
                   f"(peak {peak:.1f} GiB allocated): try a smaller BATCH_SIZE, e.g. {max(1, cfg.batch_size // 2)}")
    except KeyboardInterrupt:
        status, code = "interrupted", EXIT_INTERRUPTED
        message = f"interrupted after {len(rows)} of {cfg.steps} steps; the measured steps are kept"
    except Exception as e:
        if _compile_failure(e) and not rows:
            status, code = "skipped", EXIT_SKIPPED
            message = f"torch.compile cannot compile here: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
        else:
            traceback.print_exc()
            status, code = "failed", EXIT_FAILED
            message = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    run["peak_mem_allocated_gib"], run["peak_mem_reserved_gib"] = metrics.peak_memory_gib(device)
    held.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    run.update(status=status, message=message)
    summarize(recipe, cfg, run, rows)
    try:
        if profiled is not None:
            write_breakdown(cfg, recipe, run, profiled)
        elif not cfg.profile:
            append_run(cfg.prefix, run, rows)
    except (ResultsError, OSError) as e:
        return fail(f"results not written: {e}")
    print(summary_line(run))
    if status != "ok":
        print(f"error: {recipe.name} {status}: {message}", file=sys.stderr)
    return code
