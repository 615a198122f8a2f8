"""The chunked loss's softmax-gradient pass as one hand-written Triton kernel.

For each row of a chunk's logits, the kernel finds the log-sum-exp in one read (a running maximum and a
running sum rescaled to it, "online softmax"), writes the row's loss, then reads the row again and
overwrites it with its gradient, softmax minus one-hot: two reads and one write of bf16 logits, in place.
Inductor's fusion of the same expression (Utils.model._ChunkedCrossEntropy) reads each row three times.

Triton is optional: `available()` says whether the kernel can run here. With TRITON_INTERPRET=1 set
before this module is imported, Triton's interpreter runs the kernel on CPU tensors (the tests do).
"""
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:   # a CPU machine without Triton: the loss falls back to the compiled expression
    triton = None

BLOCK = 2048   # columns per load; with 4 warps, the fastest of 1024..8192 x 4..16 warps on an H200
NUM_WARPS = 4


def interpreted():
    return os.environ.get("TRITON_INTERPRET") == "1"


def available(device):
    """Whether the kernel runs on this device: a CUDA GPU with Triton, or any device under the interpreter."""
    return triton is not None and (device.type == "cuda" or interpreted())


if triton is not None:
    @triton.jit
    def _cross_entropy_grad_kernel(logits_ptr, targets_ptr, row_loss_ptr, n_cols, vocab_size, row_stride,
                                   BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * row_stride
        offsets = tl.arange(0, BLOCK)
        # Per-lane running maximum and sum of exp(x - maximum); -1e30 rather than -inf, so that a lane that
        # has seen only masked columns rescales by exp(0) instead of computing inf - inf.
        m = tl.full([BLOCK], -1e30, tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + offsets
            x = tl.load(base + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
            m = m_new
        m_row = tl.max(m, 0)
        lse = m_row + tl.log(tl.sum(s * tl.exp(m - m_row), 0))
        target = tl.load(targets_ptr + row)
        tl.store(row_loss_ptr + row, lse - tl.load(base + target).to(tl.float32))
        for start in range(0, n_cols, BLOCK):
            cols = start + offsets
            x = tl.load(base + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
            p = tl.where(cols < vocab_size, tl.exp(x - lse), 0.0)   # padded columns: exactly zero gradient
            g = p - tl.where(cols == target, 1.0, 0.0)
            tl.store(base + cols, g.to(logits_ptr.dtype.element_ty), mask=cols < n_cols)

    @torch.library.triton_op("gpt_suite::cross_entropy_grad_", mutates_args={"logits"})
    def cross_entropy_grad_(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> torch.Tensor:
        rows, cols = logits.shape
        row_loss = torch.empty(rows, device=logits.device, dtype=torch.float32)
        torch.library.wrap_triton(_cross_entropy_grad_kernel)[(rows,)](
            logits, targets, row_loss, cols, vocab_size, logits.stride(0), BLOCK=BLOCK, num_warps=NUM_WARPS)
        return row_loss


def cross_entropy_grad(logits, targets, vocab_size):
    """Overwrite logits (rows x padded vocabulary, each row contiguous) with softmax(logits[:, :vocab_size])
    minus one-hot(targets), zero in the padded columns, and return each row's loss, lse - logit[target],
    in fp32."""
    if triton is None:
        raise RuntimeError("the cross-entropy kernel needs Triton (pip install triton)")
    if logits.stride(1) != 1:
        raise ValueError("the cross-entropy kernel needs rows of contiguous logits")
    return torch.ops.gpt_suite.cross_entropy_grad_(logits, targets.contiguous(), vocab_size)
