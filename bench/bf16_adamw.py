"""Times one AdamW step over GPT-2's parameters on a GPU, the gradients given: torch's fused AdamW on fp32
parameters (max's), MasterAdamW with fp32 masters (`master_weights`) and without (`stochastic_rounding`), and
torchao's AdamW with bf16 stochastic rounding (the library's form of the last, where torchao imports). For each:
the first step's wall time (its compile), the median device time of a step (CUDA events), the host's time to issue
one, and the rate at the bytes each must move (Utils.report.roofline's counts).

    python3 bench/bf16_adamw.py [MODEL ...]     (default: gpt2 gpt2-xl)
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from Utils.kernels.master_adamw import MasterAdamW  # noqa: E402
from Utils.ladder import modules  # noqa: E402
from Utils.ladder.apply import BETAS, EPS, LEARNING_RATE, param_groups  # noqa: E402
from Utils.model import GPT  # noqa: E402
from Utils.model_config import PRESETS  # noqa: E402
from Utils.report.roofline import FUSED_ADAMW_BYTES, MASTER_ADAMW_BYTES, STOCHASTIC_ADAMW_BYTES  # noqa: E402

STEPS, WARMUP = 20, 3


def torchao_adamw(groups: list) -> torch.optim.Optimizer:
    try:
        from torchao.optim import AdamW
    except ImportError:   # torchao 0.18 keeps it only as _AdamW, for its own quantized training
        from torchao.optim import _AdamW as AdamW
    return AdamW(groups, lr=LEARNING_RATE, betas=BETAS, eps=EPS, bf16_stochastic_round=True)


OPTIMIZERS = {   # name -> (parameters in bf16, the optimizer over the groups, bytes a parameter)
    "fused AdamW, fp32": (False, lambda g: torch.optim.AdamW(g, lr=LEARNING_RATE, betas=BETAS, eps=EPS, fused=True),
                          FUSED_ADAMW_BYTES),
    "MasterAdamW, masters": (True, lambda g: MasterAdamW(g, lr=LEARNING_RATE, betas=BETAS, eps=EPS),
                             MASTER_ADAMW_BYTES),
    "MasterAdamW, no masters": (True, lambda g: MasterAdamW(g, lr=LEARNING_RATE, betas=BETAS, eps=EPS,
                                                            masters=False), STOCHASTIC_ADAMW_BYTES),
    "torchao AdamW, bf16 SR": (True, torchao_adamw, STOCHASTIC_ADAMW_BYTES),
}


def time_one(model_name: str, name: str) -> None:
    bf16, make, nbytes = OPTIMIZERS[name]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(PRESETS[model_name])
    if bf16:
        modules.store_in_bf16(model)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    try:
        opt = make(param_groups(model))
    except ImportError as e:
        print(f"{model_name:8} {name:26} skipped: {e}")
        return
    start = time.perf_counter()
    opt.step()
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    device_ms, host_ms = [], []
    for i in range(WARMUP + STEPS):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        t = time.perf_counter()
        opt.step()
        host = time.perf_counter() - t
        end.record()
        torch.cuda.synchronize()
        if i >= WARMUP:
            device_ms.append(begin.elapsed_time(end))
            host_ms.append(host * 1e3)
    n = sum(p.numel() for p in params)
    ms = statistics.median(device_ms)
    peak = torch.cuda.max_memory_allocated() / 2**30
    print(f"{model_name:8} {name:26} first step {first:6.1f} s  step {ms:7.2f} ms  "
          f"host {statistics.median(host_ms):6.2f} ms  {nbytes} B/param: {n * nbytes / ms / 1e9:5.2f} TB/s  "
          f"peak {peak:5.1f} GiB")
    del opt, model, params
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("error: this benchmark needs a CUDA GPU")
    models = sys.argv[1:] or ["gpt2", "gpt2-xl"]
    unknown = [m for m in models if m not in PRESETS]
    if unknown:
        sys.exit(f"error: no model '{unknown[0]}': use some of {', '.join(PRESETS)}")
    print(torch.__version__, torch.cuda.get_device_name())
    for model_name in models:
        for name in OPTIMIZERS:
            time_one(model_name, name)


if __name__ == "__main__":
    main()
