"""Checks and times Utils.kernels.loss_kernel on a GPU, the CUDA kernel and its Triton fallback, on one chunk
of the chunked loss (4,096 rows of GPT-2's padded 50,304-column bf16 logits): their losses and gradients
against the kernel's reference in float64, then their times against a copy of the chunk (one read and
one write, the least any in-place pass can move) and against Inductor's fusion of the reference (the
plain chunked loss's pass, Utils.kernels.chunked_loss.softmax_grad). Exits non-zero if a check fails.

    python3 bench/loss_kernel.py
"""
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from Utils.kernels import loss_kernel  # noqa: E402
from Utils.kernels.chunked_loss import CHUNK_ROWS, softmax_grad  # noqa: E402

VOCAB, PADDED = 50257, 50304


def main():
    device = torch.device("cuda")
    why = loss_kernel.unavailable(device) if torch.cuda.is_available() else "no CUDA GPU"
    if why:
        sys.exit(f"error: this benchmark needs a CUDA GPU with NVRTC and Triton ({why})")
    note = loss_kernel.prepare(device, PADDED)
    if note:
        sys.exit(f"error: {note}")
    print(torch.__version__, torch.cuda.get_device_name())
    torch.manual_seed(0)
    logits = (torch.randn(CHUNK_ROWS, PADDED, device="cuda") * 3).bfloat16()
    targets = torch.randint(0, VOCAB, (CHUNK_ROWS,), device="cuda")
    want_loss, want_grad = loss_kernel.reference(logits.double(), targets, VOCAB, torch.float64)

    failed = False
    for use_cuda in (True, False):
        loss_kernel.USE_CUDA = use_cuda
        if use_cuda and not loss_kernel._cuda_takes(logits, targets):
            sys.exit("error: the CUDA loss kernel cannot take this chunk here (too little shared memory?)")
        grad = logits.clone()
        loss = loss_kernel.cross_entropy_grad(grad, targets, VOCAB)
        loss_error = (loss.double() - want_loss).abs().max().item()
        grad_error = (grad.double() - want_grad).abs().max().item()
        padded = grad[:, VOCAB:].abs().max().item()
        # Gradients lie in (-1, 1): one rounding to bf16 is off by at most half its spacing below 1, 2^-9.
        ok = loss_error < 1e-4 and grad_error <= 2 ** -9 * 1.01 and padded == 0
        print(f"check, {'CUDA' if use_cuda else 'Triton'}: {'ok' if ok else 'FAILED'}: largest |loss error| "
              f"{loss_error:.1e} (bound 1e-4), largest |gradient error| {grad_error:.2e} (bound 2^-9 = 1.95e-03, "
              f"one bf16 rounding), padded columns' largest |gradient| {padded} (must be 0)")
        failed |= not ok

    chunk_bytes = logits.numel() * logits.element_size()
    buf = logits.clone()
    compiled = torch.compile(softmax_grad)
    timings = {
        "copy of the chunk": lambda: buf.copy_(logits),
        "CUDA kernel": lambda: loss_kernel.cross_entropy_grad(buf, targets, VOCAB),
        "Triton kernel": lambda: loss_kernel.cross_entropy_grad(buf, targets, VOCAB),
        "Inductor's fusion": lambda: compiled(logits, targets, VOCAB),
    }
    for name, fn in timings.items():
        loss_kernel.USE_CUDA = name != "Triton kernel"
        us = do_bench(fn, warmup=30, rep=300) * 1e3
        print(f"{name:18s} {us:6.1f} us per chunk  ({2 * chunk_bytes / us / 1e6:.2f} TB/s counting one read and "
              f"one write of {chunk_bytes / 1e6:.0f} MB)")
    if failed:
        sys.exit("error: a loss kernel's results are outside those bounds")


if __name__ == "__main__":
    main()
