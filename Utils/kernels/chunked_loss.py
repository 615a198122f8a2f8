"""The output layer's cross-entropy, CHUNK_ROWS tokens at a time: the B x T x vocab logits never exist whole.

Each chunk's logits are made, reduced and turned into their gradient (softmax minus one-hot) at once,
and the gradients with respect to h and W are accumulated in the forward pass; backward only scales
them. At batch 16 the whole logits would take 1.6 GB in bf16 (5.5 GiB with autocast's fp32 copies).
The GEMMs use all of W's rows, padding included, so that a padded vocabulary keeps its aligned tiles;
padded columns are masked out of the softmax, so their gradient is exactly zero. With `kernel`, each
chunk's softmax-gradient pass is Utils.kernels.loss_kernel, which writes the gradient over the logits.

Reference: F.cross_entropy(h @ weight[:vocab_size].T, targets) (`reference` below).
"""
import torch
import torch.nn.functional as F
from torch import Tensor

from Utils.kernels import loss_kernel

CHUNK_ROWS = 4096


def unavailable(device: torch.device) -> str | None:
    """None: the chunked loss is PyTorch operations and runs on any device."""
    return None


# --- Cross-entropy by chunks of rows: fuses the loss's backward into its forward (each chunk's logits are
# made, reduced and turned into their gradient at once, and the gradients with respect to h and W
# accumulated), so that the B x T x vocab logits never exist whole.
class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, vocab_size, kernel):
        device_type = h.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else h.dtype
        acc = torch.promote_types(h.dtype, torch.float32)   # the softmax and the sums: fp32 at least
        w = weight.to(dtype)
        if kernel:
            # Logits rows a multiple of 128 wide keep the GEMMs that write and read them aligned and evenly
            # tiled where the vocabulary is not padded (Inductor pads the plain path's GEMM by itself, but
            # not a kernel's input); the extra columns are masked like the padding, their zero gradient
            # rows cut off below.
            w = F.pad(w, (0, 0, 0, loss_kernel.kernel_logits_width(w.size(0)) - w.size(0)))
        n = h.size(0)
        loss = h.new_zeros((), dtype=acc)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(w.shape, dtype=acc, device=h.device)
        with torch.autocast(device_type, enabled=False):
            for i in range(0, n, CHUNK_ROWS):
                hc, tc = h[i:i + CHUNK_ROWS].to(dtype), targets[i:i + CHUNK_ROWS]
                if kernel:
                    grad = hc @ w.t()   # overwritten in place with its own gradient
                    loss = loss + loss_kernel.cross_entropy_grad(grad, tc, vocab_size).sum().to(acc)
                else:
                    chunk_loss, grad = softmax_grad(hc @ w.t(), tc, vocab_size, acc)
                    loss = loss + chunk_loss
                grad_h[i:i + CHUNK_ROWS] = (grad @ w).to(h.dtype)
                grad_w += (grad.t() @ hc).to(acc)
        ctx.save_for_backward(grad_h, grad_w[:weight.size(0)])
        ctx.n, ctx.weight_dtype = n, weight.dtype
        return loss / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        scale = grad_out / ctx.n
        return grad_h * scale, (grad_w * scale).to(ctx.weight_dtype), None, None, None


def softmax_grad(logits: Tensor, targets: Tensor, vocab_size: int,
                 acc: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """(sum of the rows' cross-entropy losses, softmax minus one-hot in logits' dtype) over the first
    vocab_size columns, later columns with a zero gradient: the loss kernel's reference, which Inductor
    fuses into one kernel over the bf16 logits."""
    row_loss, grad = loss_kernel.reference(logits, targets, vocab_size, acc)
    return row_loss.sum(), grad


def chunked_cross_entropy(h: Tensor, weight: Tensor, targets: Tensor, vocab_size: int,
                          kernel: bool = False) -> Tensor:
    """Mean cross-entropy of h [N, C] @ weight[:vocab_size].T against targets [N], without materializing the
    logits; weight's rows from vocab_size on get a zero gradient. kernel=True needs
    loss_kernel.unavailable(device) to be None."""
    return _ChunkedCrossEntropy.apply(h, weight, targets, vocab_size, kernel)


def reference(h: Tensor, weight: Tensor, targets: Tensor, vocab_size: int) -> Tensor:
    """What chunked_cross_entropy computes, with the logits made whole."""
    return F.cross_entropy(h @ weight[:vocab_size].t(), targets)
