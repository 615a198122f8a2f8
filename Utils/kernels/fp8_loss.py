"""The chunked loss (Utils.kernels.chunked_loss) with the output layer's three GEMMs in FP8.

GPT-2's output layer is a third of its matmul FLOPs: at batch 64 its forward GEMM and the two of its
backward take about 26 of the max rung's 107 ms (issue 25's profile). Hopper's and Ada's tensor cores
multiply FP8 at twice the bf16 rate. Here the layer's input h and weight go to e4m3 (3 mantissa bits)
with one scale per tensor, its amax, and the logits' gradient, softmax minus one-hot, goes to e5m2
(2 mantissa bits, 5 exponent bits): the split Transformer Engine's "hybrid" recipe makes, precision
for values and range for gradients. The gradient needs no amax: it lies in [-1, 1], so a fixed scale of
2^15 fits it under e5m2's largest value (57,344) and keeps probabilities down to 2^-31.

Hopper's FP8 GEMMs take both operands with the reduced dimension contiguous, so each operand is cast
in the layout its GEMM reads: the weight twice (vocabulary-major for the logits, width-major for h's
gradient), the gradient twice (row-major for h's gradient, transposed for the weight's). The weight's
gradient is one GEMM over all the tokens at the end, which reads the transposed FP8 gradients of every
chunk (1 byte per logit: 3.3 GB at batch 64) rather than adding one fp32 product per chunk into it.

The logits and the loss stay bf16 and fp32, as in the bf16 chunked loss. Under torch.compile, Inductor
fuses each chunk's softmax, its gradient and both FP8 casts into one pass over the logits.

Reference: chunked_loss.reference, which this matches within FP8's rounding (tests/test_fp8_loss.py).
"""
import torch
from torch import Tensor

from Utils.kernels import chunked_loss, loss_kernel

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
E4M3_MAX = torch.finfo(E4M3).max            # 448
GRAD_SCALE = 2.0 ** 15                       # |softmax - one-hot| <= 1, and e5m2's largest value is 57,344
ALIGN = 16                                   # FP8 GEMMs need every dimension a multiple of 16 bytes


def unavailable(device: torch.device) -> str | None:
    """None where torch._scaled_mm runs: an Ada or Hopper GPU (compute capability 8.9 or newer), or a CPU,
    where PyTorch emulates it (slowly: what the tests run); else why not."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return "FP8 matmuls need an Ada or Hopper GPU (compute capability 8.9 or newer)"
    if device.type not in ("cuda", "cpu"):
        return f"FP8 matmuls run on a CUDA GPU or a CPU, not {device.type}"
    return None


def width_problem(width: int) -> str | None:
    """None where an output layer of `width` features can run in FP8, else why not."""
    return None if width % ALIGN == 0 else f"FP8 GEMMs need the model's width ({width}) to be a multiple of {ALIGN}"


def to_e4m3(x: Tensor) -> tuple[Tensor, Tensor]:
    """(x scaled by 448 / amax(x) and cast to e4m3, the scale's inverse as a 0-d fp32 tensor): the value
    that _scaled_mm multiplies the product by. The clamp keeps a rounding up at the amax from overflowing."""
    amax = x.detach().abs().amax().float().clamp(min=1e-12)
    scale = E4M3_MAX / amax
    return (x.detach().float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale.reciprocal()


class _Fp8CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, vocab_size):
        n, width = h.shape
        if n % ALIGN or width_problem(width):
            raise ValueError(width_problem(width) or f"FP8 GEMMs need the tokens per step ({n}) to be a multiple "
                             f"of {ALIGN}: choose BATCH_SIZE x SEQ_LEN accordingly")
        out = torch.bfloat16
        # The GEMMs' dtypes are chosen here; autocast has no rule for FP8 operands.
        with torch.autocast(h.device.type, enabled=False):
            # Padded as the loss kernel's logits are: the reduced dimension of h's gradient GEMM is the
            # vocabulary, which must be a multiple of 16; padded columns get zero gradient below.
            w = torch.nn.functional.pad(weight, (0, 0, 0, chunked_loss.kernel_logits_width(weight.size(0)) - weight.size(0)))
            w8, w_inv = to_e4m3(w)                        # [vocab, width]: read by the logits' GEMM
            w8_t = w8.t().contiguous()                    # [width, vocab]: read by h's gradient GEMM
            h8, h_inv = to_e4m3(h)                        # [tokens, width]
            g_inv = torch.full((), 1 / GRAD_SCALE, device=h.device)
            loss = torch.zeros((), dtype=torch.float32, device=h.device)
            grad_h = torch.empty(n, width, dtype=out, device=h.device)
            grad_t = []                                   # each chunk's FP8 gradient, transposed: [vocab, rows]
            for i in range(0, n, chunked_loss.CHUNK_ROWS):
                rows = slice(i, i + chunked_loss.CHUNK_ROWS)
                # Fast accumulation (Hopper's, without promoting partial sums to fp32) on the logits' GEMM
                # only, whose sums run over 768 terms; the gradients' run over the vocabulary or the tokens.
                logits = torch._scaled_mm(h8[rows], w8.t(), scale_a=h_inv, scale_b=w_inv, out_dtype=out,
                                          use_fast_accum=True)
                row_loss, grad = loss_kernel.reference(logits, targets[rows], vocab_size)
                loss = loss + row_loss.sum()
                g8 = (grad.float() * GRAD_SCALE).to(E5M2)
                grad_h[rows] = torch._scaled_mm(g8, w8_t.t(), scale_a=g_inv, scale_b=w_inv, out_dtype=out)
                grad_t.append(g8.t().contiguous())
            # One GEMM over every token: the gradients (e5m2) against h (e4m3, token-major as the GEMM reads it;
            # Hopper has no e5m2 x e5m2 GEMM), in fp32 as the optimizer's gradient is.
            grad_w = torch._scaled_mm(torch.cat(grad_t, dim=1), h8.t().contiguous().t(), scale_a=g_inv,
                                      scale_b=h_inv, out_dtype=torch.float32)
            ctx.save_for_backward(grad_h, grad_w[:weight.size(0)])
            ctx.n, ctx.h_dtype, ctx.weight_dtype = n, h.dtype, weight.dtype
            return loss / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        scale = grad_out / ctx.n
        return (grad_h * scale).to(ctx.h_dtype), (grad_w * scale).to(ctx.weight_dtype), None, None


def fp8_cross_entropy(h: Tensor, weight: Tensor, targets: Tensor, vocab_size: int) -> Tensor:
    """Mean cross-entropy of h [N, C] @ weight[:vocab_size].T against targets [N], the three GEMMs in FP8,
    without materializing the logits; weight's rows from vocab_size on get a zero gradient. N and C must
    be multiples of 16, and unavailable(device) None."""
    return _Fp8CrossEntropy.apply(h, weight, targets, vocab_size)
