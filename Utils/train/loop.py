"""The one training loop: a step timed whole, every step recorded, and the profiled steps of `make profile`.

A step is timed whole: the batch's copy to the device, forward, backward, gradient clipping and the
optimizer step, between two CUDA events (or perf_counter on a CPU, where work is synchronous).
"""
import os
import time

import torch

from Utils.ladder.apply import Build
from Utils.results import metrics
from Utils.results.gpus import peak_bandwidth, peak_bf16_flops
from Utils.train.cli import PROFILE_STEPS, RunConfig
from Utils.train.data import inputs_targets


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


def train(b: Build, cfg: RunConfig, run: dict, rows: list):
    """Run cfg.steps timed steps of the built run `b`, appending a dict per step to rows. Returns the profiled
    breakdown with cfg.profile, else None."""
    device, source, optimizer, update, step_model, config = b.device, b.source, b.optimizer, b.update, b.step_model, b.config
    flops_token = metrics.flops_per_token(b.model.num_params(), config.n_layer, config.n_head,
                                          config.n_embd // config.n_head, cfg.seq_len)
    peak = peak_bf16_flops(run["gpu_name"]) if device.type == "cuda" else None
    timer = StepTimer(device)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    cudagraphs, deferred = b.cudagraphs, b.sync_every > 1

    def step():
        """One training step, timed whole; returns (timing mark, loss tensor) without synchronizing."""
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        mark = timer.start()
        window = source.next_batch().to(device, non_blocking=True)
        x, y = inputs_targets(window, cfg.batch_size, cfg.seq_len)
        with b.autocast():
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
        rows.append({"run_id": run["run_id"], "optimization": run["optimization"], "step": i,
                     "warmup": i < cfg.warmup, "step_ms": ms, "tokens_per_s": tps, "loss": loss_value,
                     "mfu": step_mfu})
        mfu_text = f"MFU {step_mfu:.1%}" if step_mfu is not None else "MFU n/a"
        tag = " (warm-up)" if i < cfg.warmup else ""
        print(f"step {i + 1}/{cfg.steps} | loss {loss_value:.4f} | {ms:.1f} ms | {tps:,.0f} tok/s | "
              f"{mfu_text}{tag}", flush=True)

    # The host reads timings and losses back every sync_every steps, so between read-backs the CPU queues
    # work ahead of the GPU and no step waits for the host.
    pending = []
    try:
        for i in range(cfg.steps):
            pending.append((i, *step()))
            if len(pending) == b.sync_every or i == cfg.steps - 1:
                for entry in pending:
                    record(*entry)
                pending.clear()
    finally:
        # A run that stops early (a signal, out of memory) keeps every step that finished, read back or not.
        recorded = {row["step"] for row in rows}
        for entry in pending:
            if entry[0] in recorded:
                continue
            try:
                record(*entry)
            except Exception:   # the device itself failed: what it holds cannot be read back
                break
    if cfg.profile:
        return profile_steps(step, timer, cfg, device, run, flops_token * tokens_per_step, peak)
    return None


def profile_steps(step, timer, cfg, device, run, flops_per_step, peak):
    """PROFILE_STEPS more steps under torch.profiler (one more before them that the schedule discards),
    exported as a gzipped Chrome trace and split into compute, memory and overhead."""
    if device.type != "cuda":
        # A CUDA build of torch profiling a CPU run: Kineto still asks for the GPUs and logs each failure
        # (gpuGetDeviceCount); its log level 5 keeps only fatal messages.
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    from torch.profiler import ProfilerActivity, profile, schedule

    from Utils.report import breakdown
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    path = os.path.join(cfg.prefix, f"trace_{run['optimization']}.json.gz")
    tmp = os.path.join(cfg.prefix, f".tmp-trace_{run['optimization']}.json.gz")

    def export(prof):
        prof.export_chrome_trace(tmp)   # torch gzips a name ending in .gz
        os.replace(tmp, path)

    # ProfilerStep#N windows exist only under a schedule; run_id metadata must be added inside the context.
    with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=PROFILE_STEPS, repeat=1),
                 on_trace_ready=export) as prof:
        for key in ("run_id", "git_commit", "started_at", "torch_version"):   # the breakdown chart's provenance
            prof.add_metadata(key, str(run.get(key) or ""))
        for _ in range(1 + PROFILE_STEPS):
            mark, _ = step()
            timer.elapsed_ms(mark)   # waits for the step, so that each profiler window holds one whole step
            prof.step()
    return breakdown.split(breakdown.load_trace(path), flops_per_step=flops_per_step, peak_flops=peak,
                           peak_bandwidth=peak_bandwidth(run["gpu_name"]))
