"""Checks and times Utils.kernels.triton_update.TritonUpdate on a GPU, on GPT-2 124M's parameters (vocabulary
padded to 50,304): its parameters after a few steps against clip_grad_norm_ followed by torch's fused AdamW,
and the time of one update against that pair and against the least traffic an AdamW step can move.

    python3 bench/triton_update.py
"""
import copy
import os
import sys
from dataclasses import replace

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from Utils.kernels import triton_update  # noqa: E402
from Utils.ladder.apply import BETAS, EPS, GRAD_CLIP, LEARNING_RATE, VOCAB_MULTIPLE, param_groups  # noqa: E402
from Utils.model import GPT, PRESETS  # noqa: E402

STEPS = 6


def main():
    why = triton_update.unavailable(torch.device("cuda")) if torch.cuda.is_available() else "no CUDA GPU"
    if why:
        sys.exit(f"error: this benchmark needs a CUDA GPU with Triton ({why})")
    torch.manual_seed(0)
    with torch.device("cuda"):
        ours = GPT(replace(PRESETS["gpt2"], vocab_multiple=VOCAB_MULTIPLE))
    theirs = copy.deepcopy(ours)
    clipped = triton_update.TritonUpdate(param_groups(ours), lr=LEARNING_RATE, betas=BETAS, eps=EPS,
                                         max_norm=GRAD_CLIP)
    fused = torch.optim.AdamW(param_groups(theirs), lr=LEARNING_RATE, betas=BETAS, eps=EPS, fused=True)
    a, b = list(ours.parameters()), list(theirs.parameters())
    n = sum(p.numel() for p in a)

    # Gradients whose global norm is above the clip on odd steps (the clip scales them) and below on even.
    # The reference clips with a float64 norm: torch's fp32 norm is itself off by up to ~1e-7 (and by
    # ~1e-4 on a CPU), which the comparison should not charge to either side.
    worst = 0.0
    for step in range(STEPS):
        scale = 1e-2 if step % 2 else 1e-5
        for p, q in zip(a, b):
            p.grad = torch.randn_like(p) * scale
            q.grad = p.grad.clone()
        kept = [p.grad.clone() for p in a]
        clipped.step()
        norm = torch.linalg.vector_norm(torch.stack([q.grad.double().norm() for q in b]))
        factor = torch.clamp(GRAD_CLIP / (norm + 1e-6), max=1.0).float()
        torch._foreach_mul_([q.grad for q in b], factor)
        fused.step()
        untouched = all(torch.equal(p.grad, g) for p, g in zip(a, kept))
        # In learning-rate steps: AdamW moves each parameter by about lr per step.
        err = max((p - q).abs().max().item() for p, q in zip(a, b)) / LEARNING_RATE
        worst = max(worst, err)
        print(f"step {step + 1}: gradient norm {norm.item():.3g}, largest parameter difference {err:.1e} of a "
              f"learning-rate step, gradients untouched: {untouched}")
        if not untouched:
            sys.exit("error: TritonUpdate wrote the gradients")
    if worst > 1e-3:
        sys.exit(f"error: TritonUpdate's parameters differ from torch's by {worst:.1e} of a learning-rate step "
                 f"(bound 1e-3)")

    # Once the gradients stay where they are, a step queues its kernels and returns: no synchronization.
    torch.cuda.set_sync_debug_mode("error")
    clipped.step()
    torch.cuda.set_sync_debug_mode("default")
    print("a step with the gradients where they were: no host-device synchronization")

    def torch_update():
        torch.nn.utils.clip_grad_norm_(b, GRAD_CLIP)
        fused.step()

    # Least traffic of an update: read the gradients for the norm, then read parameters, gradients and both
    # moments and write parameters and moments: 8 fp32 values per parameter.
    least = 8 * 4 * n
    for name, fn in {"clip_grad_norm_ + fused AdamW": torch_update, "TritonUpdate": clipped.step}.items():
        us = do_bench(fn, warmup=10, rep=200) * 1e3
        print(f"{name:30s} {us:7.1f} us per update of {n / 1e6:.1f}M parameters "
              f"({least / us / 1e6:.2f} TB/s counting the least traffic, {least / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
