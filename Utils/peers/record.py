"""Recording a peer that trains in its own program (llm.c) as the rungs are recorded: the same arguments and
checks, the same runs.csv and results.csv rows, the same summary line; its steps are the times it reports."""
import json
import os
import uuid
from datetime import datetime, timezone
from typing import Callable

import torch

from Utils.ladder.apply import Unavailable
from Utils.model import GPT
from Utils.model_config import PRESETS
from Utils.results import metrics
from Utils.results.gpus import peak_bf16_flops
from Utils.results.store import ResultsError, check_prefix
from Utils.train import nvml
from Utils.train.cli import UsageError, parse_args
from Utils.train.data import DataError, check_enough_tokens, load_tokens
from Utils.train.provenance import gpu_uuid, provenance
from Utils.train.record import Run
from Utils.train.run import EXIT_FAILED, EXIT_SKIPPED, add_run_figures, record
from Utils.train.usage import fail

# train(cfg, tokens, run, log path, start_sampling) -> ([(step from 0, loss, ms)], peak memory GiB or None), calling
# start_sampling() when its warm-up steps end; raises Unavailable where the peer cannot run here, any other exception
# where it failed.
Trainer = Callable[..., tuple[list[tuple[int, float, float]], "float | None"]]


def run_external(name: str, argv: list[str], command: str, train: Trainer) -> int:
    """Parse the rung scripts' arguments, run `train`, and record it as `name`; the exit status."""
    try:
        cfg = parse_args(argv, prog=f"python -m Utils.peers {name.split('-', 1)[1]}")
        if cfg.parallel or cfg.profile:
            raise UsageError(f"{name} runs as one process, unprofiled: leave out PARALLEL, NPROC and PROFILE")
        check_prefix(cfg.prefix)
        tokens, data_name = load_tokens(cfg.data, PRESETS[cfg.model].vocab_size, cfg.seed, cfg.data_dir)
        check_enough_tokens(len(tokens), cfg.batch_size, cfg.seq_len, data_name=data_name)
    except (UsageError, ResultsError, DataError) as e:
        return fail(str(e))
    run_id = f"{datetime.now():%Y%m%d-%H%M%S}-{name}-{uuid.uuid4().hex[:6]}"
    # MICRO_BATCH=auto searches in PyTorch's allocator, which a program of its own does not use: the whole batch
    micro = cfg.micro_batch or cfg.batch_size
    run = Run(run_id=run_id, optimization=name, started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
              steps=cfg.steps, warmup_steps=cfg.warmup, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
              model=cfg.model, data=data_name, command=command, nproc=1, parallel="",
              config=json.dumps({"run": cfg.as_dict(), "peer": name}, sort_keys=True),
              micro_batch=micro, accumulation_steps=cfg.batch_size // micro, gpu_memory_gib=cfg.gpu_memory_gib)
    print(f"{name} | {cfg.model} | B={cfg.batch_size} T={cfg.seq_len} | data {data_name} | {cfg.device} | "
          f"steps {cfg.steps} (warm-up {cfg.warmup})", flush=True)
    device = torch.device(cfg.device)
    # The GPU is sampled from the end of the peer's warm-up steps (where its output shows them as they come)
    # to the end of its program, never over its build or start-up.
    sampler = nvml.Sampler(gpu_uuid(device)) if device.type == "cuda" else None
    steps, status, message, code, memory = [], "ok", "", 0, None
    log = os.path.join(cfg.prefix, f"{run_id}.log")
    try:
        if cfg.gpu_memory_gib:
            raise Unavailable(f"{name} allocates its GPU memory itself, outside PyTorch's allocator, which "
                              f"GPU_MEMORY_GIB caps: run it without GPU_MEMORY_GIB")
        steps, memory = train(cfg, tokens, run, log, sampler.start if sampler else lambda: None)
    except Unavailable as e:
        status, message, code = "skipped", str(e), EXIT_SKIPPED
    except Exception as e:   # the peer's own failure: recorded, with where its whole output is
        status, message, code = "failed", str(e).splitlines()[0][:400] if str(e) else type(e).__name__, EXIT_FAILED
    finally:
        if sampler:
            run.clocks = sampler.stop()
    run.provenance = provenance(device)   # after the peer: no CUDA context of ours beside it while it ran
    n_params, flops = _counts(cfg.model, cfg.seq_len)
    peak = peak_bf16_flops(run.provenance.gpu_name) if device.type == "cuda" else None
    rows = _rows(name, run_id, cfg, steps, flops, peak)
    run.status, run.message, run.n_params, run.flops_per_token = status, message, n_params, flops
    run.peak_mem_reserved_gib = memory
    add_run_figures((), cfg, run, rows)
    return record(cfg, run, rows, code)


def _counts(model: str, seq_len: int) -> tuple[int, int]:
    """(parameters, FLOPs per token) of the suite's GPT of this preset: the same shape the peer trains."""
    c = PRESETS[model]
    with torch.device("meta"):
        gpt = GPT(c)
    return (gpt.num_params(exclude_position_embedding=False),
            metrics.flops_per_token(gpt.num_params(), c.n_layer, c.n_head, c.n_embd // c.n_head, seq_len))


def _rows(name, run_id, cfg, steps, flops, peak) -> list[dict]:
    """results.csv's rows of the peer's steps [(step from 0, loss, ms)], MFU from `flops` per token against
    `peak` FLOP/s."""
    rows = []
    for step, loss, ms in steps:
        tps = cfg.batch_size * cfg.seq_len / (ms / 1e3)
        rows.append({"run_id": run_id, "optimization": name, "step": step, "warmup": int(step < cfg.warmup),
                     "step_ms": ms, "tokens_per_s": tps, "loss": loss, "mfu": metrics.mfu(flops, tps, peak)})
    return rows
