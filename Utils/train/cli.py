"""The one argument parser every rung script shares, and its validation.

Every bad value ends the program before anything is built or written, with one line that names the
value and the fix, and exit status 2.
"""
import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from Utils.model_config import PRESETS
from Utils.train.usage import EXAMPLE, Parser, UsageError, fail

DEFAULT_WARMUP = 5
PROFILE_STEPS = 3


@dataclass(frozen=True)
class RunConfig:
    steps: int
    batch_size: int
    prefix: str
    model: str
    seq_len: int
    device: str
    data: str
    warmup: int
    seed: int
    data_dir: str | None = None
    profile: bool = False
    cold: bool = False
    parallel: str = ""        # ddp or fsdp: one of several processes started by torchrun
    sdpa_backend: str = "auto"  # the kernel SDPA is held to (Utils.train.attention.BACKENDS); auto: PyTorch's choice
    micro_batch: int | None = None   # rows one forward/backward holds; None: auto (the largest that fits)
    gpu_memory_gib: float | None = None   # the most GPU memory the run may use (GPU_MEMORY_GIB); None: the card's
    allocator: str = ""   # the CUDA caching allocator's settings (PYTORCH_CUDA_ALLOC_CONF), recorded with the run

    def as_dict(self) -> dict:
        return asdict(self)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = Parser(EXAMPLE, prog=prog, description="Train GPT-2 for STEPS steps under one rung of the ladder and "
                                                "append every step's timing to PREFIX/results.csv.")
    p.add_argument("--steps", required=True, help="training steps to run and time (STEPS)")
    p.add_argument("--batch-size", required=True, help="sequences per step (BATCH_SIZE)")
    p.add_argument("--prefix", required=True, help="folder for results.csv, runs.csv and the charts (PREFIX)")
    p.add_argument("--model", default="auto", help=f"auto (gpt2 on a GPU, tiny on a CPU) or one of {', '.join(PRESETS)}")
    p.add_argument("--seq-len", default=None, help="tokens per sequence (default: the model's block size)")
    p.add_argument("--device", default="auto", help="auto, cuda or cpu")
    p.add_argument("--data", default="auto", help="auto, shakespeare, synthetic, or a path to a text file")
    p.add_argument("--warmup", default=None, help=f"steps left out of the summary (default {DEFAULT_WARMUP}, "
                                                  f"at most STEPS - 1)")
    p.add_argument("--seed", default="1337", help="seed for the model's init and synthetic data")
    p.add_argument("--data-dir", default=None, help="where tiny shakespeare and its tokens are kept "
                                                    "(default: $DATA_DIR, else ./data)")
    p.add_argument("--profile", action="store_true",
                   help=f"after the timed steps, profile {PROFILE_STEPS} more under torch.profiler into "
                        f"trace_<rung>.json.gz, which python -m Utils.report.breakdown splits into "
                        f"breakdown.csv/.md/.png and kernels.csv (make does, with PROFILE=1); the run is not added "
                        f"to results.csv")
    p.add_argument("--cold", action="store_true",
                   help="compile with an empty Inductor and Triton cache, as on a fresh machine (COLD=1); "
                        "runs.csv's compile_cache says which a run had")
    p.add_argument("--micro-batch", default="auto",
                   help="rows one forward/backward holds (MICRO_BATCH); the step accumulates BATCH_SIZE / MICRO_BATCH "
                        "of them. auto: on a GPU the largest divisor of BATCH_SIZE whose step fits, found by a "
                        "measured step; on a CPU the whole batch")
    p.add_argument("--gpu-memory-gib", default=None,
                   help="use at most this much of the GPU's memory (GPU_MEMORY_GIB), to see what a smaller card fits")
    p.add_argument("--sdpa-backend", default="auto",
                   help="auto (PyTorch's choice), flash, cudnn, efficient or math: the kernel F.scaled_dot_product_"
                        "attention is held to (SDPA_BACKEND); runs.csv's attention_kernel says what ran")
    p.add_argument("--parallel", default="", help="ddp or fsdp: this process is one of torchrun's (make ... NPROC=n "
                                                  "PARALLEL=ddp); BATCH_SIZE is per process")
    return p


def _positive_int(name, value, fix):
    try:
        n = int(str(value).strip())
    except ValueError:
        n = None
    if n is None or n <= 0:
        raise UsageError(f"{name}={value!r} is not a positive integer: {fix}")
    return n


SEED_MAX = 2**64 - 1   # torch.manual_seed takes seeds up to this


def _seed(value):
    try:
        n = int(str(value).strip())
    except ValueError:
        n = -1
    if not 0 <= n <= SEED_MAX:
        raise UsageError(f"SEED={value!r} is not an integer from 0 to {SEED_MAX}: pass e.g. SEED=1337")
    return n


def _text(name, value):
    """A path argument must be text the results can record: refuse a name with bytes that are not UTF-8."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        shown = value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        raise UsageError(f"{name}={shown} holds bytes that are not UTF-8: use a name in UTF-8") from None
    return value


def parse_args(argv: Sequence[str] | None = None, prog: str | None = None) -> RunConfig:
    """Parse and validate; raises UsageError with a one-line message. Each value is checked in the order the
    fields are listed, so that the first bad one is the one named."""
    a = build_parser(prog).parse_args(argv)
    steps, batch, warmup = _steps_batch_warmup(a.steps, a.batch_size, a.warmup)
    seed = _seed(a.seed)
    _check_paths(a.prefix, a.data, a.data_dir)
    device = resolve_device(a.device)
    model, seq_len = _model_seq_len(a.model, a.seq_len, device)
    data = _data(a.data)
    micro = _micro_batch(a.micro_batch, batch)
    gib = _gpu_memory_gib(a.gpu_memory_gib, device)
    _check_sdpa_backend(a.sdpa_backend)
    parallel = _parallel(a.parallel)
    return RunConfig(steps=steps, batch_size=batch, prefix=a.prefix, model=model, seq_len=seq_len,
                     device=device, data=data, warmup=warmup, seed=seed, data_dir=a.data_dir,
                     profile=a.profile, cold=a.cold, parallel=parallel, sdpa_backend=a.sdpa_backend,
                     micro_batch=micro, gpu_memory_gib=gib)


def _steps_batch_warmup(steps_value: str, batch_value: str, warmup_value: str | None) -> tuple[int, int, int]:
    """(STEPS, BATCH_SIZE, WARMUP): at least one measured step after the warm-up, which is DEFAULT_WARMUP
    unless given, and never all of STEPS."""
    steps = _positive_int("STEPS", steps_value, f"pass the number of steps to time, {EXAMPLE}")
    batch = _positive_int("BATCH_SIZE", batch_value, f"pass sequences per step, {EXAMPLE}")
    if steps < 2:
        raise UsageError(f"STEPS={steps} leaves no measured step after the first, which is a warm-up step "
                         f"(compilation, allocation): use STEPS >= 2, e.g. STEPS=20")
    if warmup_value is None:
        return steps, batch, min(DEFAULT_WARMUP, steps - 1)
    warmup = _positive_int("WARMUP", warmup_value, "pass a number of warm-up steps below STEPS, e.g. WARMUP=5")
    if warmup >= steps:
        raise UsageError(f"WARMUP={warmup} leaves no measured step of STEPS={steps}: "
                         f"use WARMUP < STEPS, e.g. STEPS={warmup + 20} WARMUP={warmup}")
    return steps, batch, warmup


def _check_paths(prefix: str, data: str, data_dir: str | None) -> None:
    """PREFIX, DATA and DATA_DIR as text the results can record, and neither folder given empty."""
    for name, value in (("PREFIX", prefix), ("DATA", data), ("DATA_DIR", data_dir)):
        if value is not None:
            _text(name, value)
    if not prefix.strip():
        raise UsageError(f"PREFIX is empty: name the output folder, {EXAMPLE}")
    if data_dir is not None and not data_dir.strip():   # else the default folder would be used unsaid
        raise UsageError("DATA_DIR is empty: name the folder that holds tiny shakespeare, or leave DATA_DIR out "
                         "(./data, or the environment's DATA_DIR)")


def resolve_device(value: str) -> str:
    """DEVICE as cuda or cpu: auto takes the GPU where PyTorch sees one; cuda without one is refused."""
    if value not in ("auto", "cuda", "cpu"):
        raise UsageError(f"DEVICE={value!r} is not one of auto, cuda, cpu")
    if value == "cuda" and not torch.cuda.is_available():
        raise UsageError("DEVICE=cuda but PyTorch sees no CUDA GPU here: use DEVICE=cpu or DEVICE=auto, "
                         "or install a CUDA build of PyTorch")
    return value if value != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")


def _model_seq_len(model_value: str, seq_len_value: str | None, device: str) -> tuple[str, int]:
    """(MODEL, SEQ_LEN): auto is gpt2 on a GPU and tiny on a CPU; SEQ_LEN defaults to, and stays within, the
    model's block size."""
    model = model_value if model_value != "auto" else ("gpt2" if device == "cuda" else "tiny")
    if model not in PRESETS:
        raise UsageError(f"MODEL={model!r} is not a known model: use auto or one of {', '.join(PRESETS)}")
    block = PRESETS[model].block_size
    if seq_len_value is None:
        return model, block
    seq_len = _positive_int("SEQ_LEN", seq_len_value, f"pass tokens per sequence, at most {block} for {model}")
    if seq_len > block:
        raise UsageError(f"SEQ_LEN={seq_len} is above {model}'s block size {block}: use SEQ_LEN<={block}")
    return model, seq_len


def _data(value: str) -> str:
    """DATA as one of its names or a text file that exists."""
    if value not in ("auto", "shakespeare", "synthetic") and not os.path.isfile(value):
        raise UsageError(f"DATA={value!r} is not a file: give a text file, or DATA=shakespeare, synthetic or auto")
    return value


def _check_sdpa_backend(value: str) -> None:
    """SDPA_BACKEND as one of the backends Utils.train.attention can hold SDPA to."""
    from Utils.train.attention import BACKENDS
    if value not in BACKENDS:
        raise UsageError(f"SDPA_BACKEND={value!r} is not one of {', '.join(BACKENDS)}: e.g. SDPA_BACKEND=flash")


def _parallel(value: str) -> str:
    """PARALLEL (ddp or fsdp, or empty): one this machine can run, and only in a process torchrun started."""
    if value:
        from Utils.train.distributed import launched_by_torchrun, parallel_problem
        if parallel_problem(value):
            raise UsageError(parallel_problem(value))
        if not launched_by_torchrun():
            raise UsageError(f"PARALLEL={value} runs under torchrun: use make <rung> NPROC=n PARALLEL={value} "
                             f"..., or torchrun --standalone --nproc-per-node n <script> --parallel {value} ...")
    return value


def divisors(n: int) -> list[int]:
    """n's divisors, largest first: the micro-batches a batch of n rows splits into evenly."""
    return [d for d in range(n, 0, -1) if n % d == 0]


def _micro_batch(value: str, batch: int) -> int | None:
    if str(value).strip() == "auto":
        return None
    micro = _positive_int("MICRO_BATCH", value, f"pass the rows of one forward/backward, a divisor of BATCH_SIZE={batch}, "
                                                f"or MICRO_BATCH=auto")
    if batch % micro:
        below = max(d for d in divisors(batch) if d < micro)
        above = [d for d in divisors(batch) if d > micro]
        nearest = f"{below} or {min(above)}" if above else f"{below}"
        raise UsageError(f"MICRO_BATCH={micro} does not divide BATCH_SIZE={batch}: use {nearest} (or MICRO_BATCH=auto)")
    return micro


def _gpu_memory_gib(value: str | None, device: str) -> float | None:
    if value is None:
        return None
    try:
        gib = float(str(value).strip())
    except ValueError:
        gib = float("nan")
    if device != "cuda":
        raise UsageError(f"GPU_MEMORY_GIB={value} caps a GPU's memory, and this run is on the CPU: leave it out, "
                         f"or run on a GPU")
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    if not 0 < gib <= total:   # also false for nan
        raise UsageError(f"GPU_MEMORY_GIB={value!r} is not a number of GiB from above 0 to this card's {total:.1f}: "
                         f"e.g. GPU_MEMORY_GIB=3.5 for a 4 GB card")
    return gib


def check(argv: Sequence[str]) -> int:
    """Validate a run's arguments and its PREFIX without running anything, for the targets that run several
    rungs (make all, ablation, profile) and for a run on several processes, before torchrun starts. With
    DATA=auto, print the data every rung is then to use (shakespeare, or synthetic after one warning), so that the
    warning is not repeated by every rung.
    Led by --dry-run (make -n), it changes nothing: the files of an existing PREFIX are checked, none is made,
    nothing is downloaded, and DATA=auto is left to the rungs. Led by `--processes NPROC PARALLEL DEVICE
    RUNG-OR-ADDITIONS --` (four words, the last "" for none; a run on several processes), Utils.train.distributed's
    check of those comes first, in this process: one that imports torch, not two."""
    from Utils.results.store import ResultsError, check_files, check_prefix
    from Utils.train.data import DataError, default_data_dir, shakespeare_tokens
    if list(argv[:1]) == ["--processes"] and list(argv[5:6]) == ["--"]:
        from Utils.train import distributed
        rc = distributed.main(["check", *argv[1:5]])
        if rc:
            return rc
        argv = argv[6:]
    dry_run = list(argv[:1]) == ["--dry-run"]
    try:
        cfg = parse_args(argv[1:] if dry_run else argv)
        if not dry_run:
            check_prefix(cfg.prefix)
        elif os.path.isdir(cfg.prefix):
            check_files(cfg.prefix)
    except (UsageError, ResultsError) as e:
        return fail(str(e))
    if dry_run:
        return 0
    if cfg.data == "auto":
        try:
            shakespeare_tokens(cfg.data_dir or default_data_dir())
            print("shakespeare")
        except DataError as e:
            print(f"WARNING: DATA=auto falls back to synthetic tokens for every run: {e}", file=sys.stderr)
            print("synthetic")
    return 0


if __name__ == "__main__":
    sys.exit(check(sys.argv[1:]))
