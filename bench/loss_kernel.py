"""Checks and times the loss kernels of Utils.ce_kernel on a GPU, the CUDA one and its Triton fallback, on one
chunk of the chunked loss (4,096 rows of GPT-2's padded 50,304-column bf16 logits): their losses and
gradients against float64, and their times against a copy of the chunk (one read and one write, the
least any in-place pass can move) and against Inductor's fusion of the same pass
(Utils.model.softmax_grad, the `loss="chunked"` path).

    python3 bench/loss_kernel.py
"""
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from Utils import ce_kernel  # noqa: E402
from Utils.model import CHUNK_ROWS, softmax_grad  # noqa: E402

VOCAB, PADDED = 50257, 50304


def main():
    if not torch.cuda.is_available() or not ce_kernel.available(torch.device("cuda")):
        sys.exit("error: this benchmark needs a CUDA GPU with NVRTC and Triton")
    torch.manual_seed(0)
    logits = (torch.randn(CHUNK_ROWS, PADDED, device="cuda") * 3).bfloat16()
    targets = torch.randint(0, VOCAB, (CHUNK_ROWS,), device="cuda")

    x = logits.double()[:, :VOCAB]
    lse = torch.logsumexp(x, 1)
    want_loss = lse - x.gather(1, targets[:, None]).squeeze(1)
    want_grad = torch.exp(x - lse[:, None])
    want_grad[torch.arange(CHUNK_ROWS), targets] -= 1
    failed = False
    for use_cuda in (True, False):
        ce_kernel.USE_CUDA = use_cuda
        if use_cuda and not ce_kernel._cuda_takes(logits, targets):
            sys.exit("error: the CUDA loss kernel cannot run here (no NVRTC, or too little shared memory)")
        grad = logits.clone()
        loss = ce_kernel.cross_entropy_grad(grad, targets, VOCAB)
        loss_error = (loss.double() - want_loss).abs().max().item()
        grad_error = (grad[:, :VOCAB].double() - want_grad).abs().max().item()
        padded = grad[:, VOCAB:].abs().max().item()
        # Gradients lie in (-1, 1): one rounding to bf16 is off by at most half its spacing below 1, 2^-9.
        print(f"check, {'CUDA' if use_cuda else 'Triton'}: largest |loss error| {loss_error:.1e} (bound 1e-4), "
              f"largest |gradient error| {grad_error:.2e} (bound 2^-9 = 1.95e-03, one bf16 rounding), padded "
              f"columns' largest |gradient| {padded}")
        failed |= not (loss_error < 1e-4 and grad_error <= 2 ** -9 * 1.01 and padded == 0)
    if failed:
        sys.exit("error: a loss kernel's results are outside those bounds")

    chunk_bytes = logits.numel() * logits.element_size()
    buf = logits.clone()
    compiled = torch.compile(softmax_grad)
    timings = {
        "copy of the chunk": lambda: buf.copy_(logits),
        "CUDA kernel": lambda: ce_kernel.cross_entropy_grad(buf, targets, VOCAB),
        "Triton kernel": lambda: ce_kernel.cross_entropy_grad(buf, targets, VOCAB),
        "Inductor's fusion": lambda: compiled(logits, targets, VOCAB),
    }
    for name, fn in timings.items():
        ce_kernel.USE_CUDA = name != "Triton kernel"
        us = do_bench(fn, warmup=30, rep=300) * 1e3
        print(f"{name:18s} {us:6.1f} us per chunk  ({2 * chunk_bytes / us / 1e6:.2f} TB/s counting one read and "
              f"one write of {chunk_bytes / 1e6:.0f} MB)")


if __name__ == "__main__":
    main()
