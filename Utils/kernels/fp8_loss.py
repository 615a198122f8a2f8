"""The chunked loss (Utils.kernels.chunked_loss) with the output layer's three GEMMs in FP8.

GPT-2's output layer is a third of its matmul FLOPs: at batch 16 its forward GEMM and the two of its
backward take 4.9 ms of the max rung's 29 ms (results/logs/fp8-head-first-profile-ba4cc87.log). Hopper's and
Ada's tensor cores multiply FP8 at twice the bf16 rate. Here the layer's input h and weight go to e4m3
(3 mantissa bits) with one scale per tensor, from its amax, and the logits' gradient, softmax minus
one-hot, goes to e5m2 (2 mantissa bits, 5 exponent bits): the split Transformer Engine's "hybrid" recipe
makes, precision for values and range for gradients. The gradient needs no amax: it lies in [-1, 1], so
a fixed scale of 2^15 fits it under e5m2's largest value (57,344) and keeps probabilities down to 2^-31.

Hopper's FP8 GEMMs read both operands along the summed dimension, so each operand is cast in the layout
its GEMM reads: the weight twice (vocabulary-major for the logits, width-major for h's gradient), the
gradient twice (row-major for h's gradient, transposed for the weight's). The transposed gradient goes
straight into the columns of a buffer for all tokens (1 byte per logit: 3.3 GB at batch 64), which the
weight's gradient then reads in one GEMM. On an Ada or Hopper GPU, the loss kernel's CUDA pass
(Utils.kernels.loss_kernel.grad_e5m2) reads each chunk's bf16 logits once, staged in shared memory, and
writes each row's loss and its FP8 gradient row-major; a Triton kernel copies that into the transposed
buffer, 1 byte a logit each way. Where that pass cannot run, two Triton kernels read the logits twice: one
finds each row's log-sum-exp and loss, the other writes the FP8 gradient in both layouts. With `recompute` (addition
`recompute_logits`, on Hopper), no logits are stored: Utils.kernels.recompute_logits computes each chunk's logits
twice, in two Triton GEMMs whose epilogues make the loss and the FP8 gradient.

The whole forward pass is one operator, so that torch.compile and CUDA graphs see one opaque call; the
casts around it are Inductor's. On a CPU the gradient is PyTorch operations; under Triton's interpreter
(TRITON_INTERPRET=1) the kernels run instead, for their tests only: the interpreter's cast to FP8 rounds
wrongly where rounding carries into the exponent (1.99 becomes 1.0).

Reference: `reference`, the plain cross-entropy, which this matches within FP8's rounding (tests/test_fp8_loss.py).
"""
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from Utils.kernels import fp8, loss_kernel, recompute_logits

try:
    import triton
    import triton.language as tl
except Exception:   # absent, or broken: PyTorch operations instead
    triton = None

GRAD_SCALE = 2.0 ** 15                       # |softmax - one-hot| <= 1, and e5m2's largest value is 57,344
# The launch shapes, timed on an H200 by bench/fp8_kernels.py (BENCHMARKS.md): the log-sum-exp pass's
# columns per load and warps, the loss kernel's (151 us a 4,096-row chunk, within 5% for every shape tried,
# 2-4 rows a program among them); the gradient pass's tile (rows, columns) and warps: 32 x 128 with 4 warps
# took 329 us a chunk where 128 x 128 with 8 took 616, whose transpose through shared memory bounds it.
LSE_BLOCK, LSE_WARPS = loss_kernel.BLOCK, loss_kernel.NUM_WARPS
TILE_R, TILE_C, TILE_WARPS = 32, 128, 4
# The transpose's tile (rows, columns of the row-major gradient) and warps: 128 bytes each way, whole lines
# of 128 bytes read and written. Timed against other shapes by bench/fp8_kernels.py.
T_ROWS, T_COLS, T_WARPS = 128, 128, 8
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Tokens per chunk: 16,384, four times the bf16 way's (chunked_loss.CHUNK_ROWS). Larger FP8 GEMMs and fewer
# launches outweigh the bytes: the loss alone took 18.1, 17.3 and 17.2 ms at batch 64 with 4,096, 8,192 and
# 16,384 tokens a chunk, for 5.5, 6.1 and 7.2 GiB (bench/fp8_loss.py, BENCHMARKS.md "Chunks larger than 4,096").
CHUNK_ROWS = 16384


def unavailable(device: torch.device) -> str | None:
    """None on an Ada or Hopper GPU (compute capability 8.9 or newer), where FP8 GEMMs run at twice bf16's
    rate; else why not. A CPU runs fp8_cross_entropy too, emulating torch._scaled_mm (what the tests run),
    but far more slowly than bf16: the training loop is not given it there."""
    if device.type == "cpu":
        return "FP8 matmuls are fast on an Ada or Hopper GPU only (a CPU emulates them, slowly)"
    if device.type != "cuda":
        return f"FP8 matmuls run on a CUDA GPU, not {device.type}"
    return fp8.unavailable(device)


def _define_triton():
    # --- Each row's log-sum-exp (the loss kernel's pass, Utils.kernels.loss_kernel.row_logsumexp) and loss,
    # one row per program.
    @triton.jit
    def _row_lse_kernel(logits_ptr, targets_ptr, lse_ptr, loss_ptr, vocab_size, row_stride, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * row_stride
        lse = loss_kernel.row_logsumexp(base, vocab_size, BLOCK)
        tl.store(lse_ptr + row, lse)
        tl.store(loss_ptr + row, lse - tl.load(base + tl.load(targets_ptr + row)).to(tl.float32))

    # --- softmax minus one-hot over a TILE_R x TILE_C block of logits, scaled and cast to e5m2, written
    # row-major into grad and transposed into grad_t: the tile goes through shared memory (tl.trans), so
    # that both stores write whole rows of the tile.
    @triton.jit
    def _grad_fp8_kernel(logits_ptr, lse_ptr, targets_ptr, grad_ptr, grad_t_ptr, n_rows, n_cols, vocab_size,
                         row_stride, grad_t_stride, scale, TILE_R: tl.constexpr, TILE_C: tl.constexpr):
        rows = tl.program_id(0) * TILE_R + tl.arange(0, TILE_R)
        cols = tl.program_id(1) * TILE_C + tl.arange(0, TILE_C)
        in_rows, in_cols = rows < n_rows, cols < n_cols
        mask = in_rows[:, None] & in_cols[None, :]
        rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
        x = tl.load(logits_ptr + rows64[:, None] * row_stride + cols64[None, :], mask=mask, other=0.0).to(tl.float32)
        lse = tl.load(lse_ptr + rows, mask=in_rows, other=0.0)
        target = tl.load(targets_ptr + rows, mask=in_rows, other=-1)
        p = tl.where(cols[None, :] < vocab_size, tl.exp(x - lse[:, None]), 0.0)   # padded columns: zero
        g = ((p - tl.where(cols[None, :] == target[:, None], 1.0, 0.0)) * scale).to(grad_ptr.dtype.element_ty)
        tl.store(grad_ptr + rows64[:, None] * n_cols + cols64[None, :], g, mask=mask)
        tl.store(grad_t_ptr + cols64[:, None] * grad_t_stride + rows64[None, :], tl.trans(g), mask=tl.trans(mask))

    # --- A TILE_R x TILE_C block of src [n_rows, n_cols] (contiguous) copied transposed into dst [n_cols, n_rows]
    # (its rows strided): bytes, whatever they encode.
    @triton.jit
    def _transpose_kernel(src_ptr, dst_ptr, n_rows, n_cols, dst_stride, TILE_R: tl.constexpr, TILE_C: tl.constexpr):
        rows = tl.program_id(0) * TILE_R + tl.arange(0, TILE_R)
        cols = tl.program_id(1) * TILE_C + tl.arange(0, TILE_C)
        mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
        rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
        x = tl.load(src_ptr + rows64[:, None] * n_cols + cols64[None, :], mask=mask)
        tl.store(dst_ptr + cols64[:, None] * dst_stride + rows64[None, :], tl.trans(x), mask=tl.trans(mask))

    return _row_lse_kernel, _grad_fp8_kernel, _transpose_kernel


_kernels = None
if triton is not None and loss_kernel.row_logsumexp is not None:
    try:
        _kernels = _define_triton()
    except Exception:   # a broken Triton: as if it were absent
        pass


def _softmax_grad_fp8(logits: Tensor, targets: Tensor, vocab_size: int, row_loss: Tensor, lse: Tensor,
                      grad: Tensor, grad_t: Tensor) -> None:
    """Write (softmax - one-hot) * GRAD_SCALE of logits [rows, cols] over the first vocab_size columns, in
    e5m2, into grad [rows, cols] and grad_t [cols, rows] (its rows may be strided), and each row's loss
    into row_loss [rows]; lse [rows] is room for each row's log-sum-exp."""
    rows, cols = logits.shape
    if _kernels is not None and logits.is_cuda and loss_kernel.grad_e5m2(logits, targets, vocab_size, row_loss,
                                                                        grad, GRAD_SCALE):
        transpose(grad, grad_t)
        return
    if _kernels is not None and (logits.is_cuda or INTERPRETED):
        row_lse, grad_fp8, _ = _kernels
        row_lse[(rows,)](logits, targets, lse, row_loss, vocab_size, logits.stride(0), BLOCK=LSE_BLOCK,
                         num_warps=LSE_WARPS)
        grid = (triton.cdiv(rows, TILE_R), triton.cdiv(cols, TILE_C))
        grad_fp8[grid](logits, lse, targets, grad, grad_t, rows, cols, vocab_size, logits.stride(0),
                       grad_t.stride(0), GRAD_SCALE, TILE_R=TILE_R, TILE_C=TILE_C, num_warps=TILE_WARPS)
        return
    loss, g = loss_kernel.reference(logits, targets, vocab_size)
    row_loss.copy_(loss)
    grad.copy_((g.float() * GRAD_SCALE).to(fp8.E5M2))
    grad_t.copy_(grad.t())


def transpose(src: Tensor, dst: Tensor) -> None:
    """Copy src [rows, cols] (contiguous) transposed into dst [cols, rows] (rows may be strided), byte for byte.
    Needs the Triton kernels (a GPU, or Triton's interpreter)."""
    rows, cols = src.shape
    grid = (triton.cdiv(rows, T_ROWS), triton.cdiv(cols, T_COLS))
    _kernels[2][grid](src.view(torch.uint8), dst.view(torch.uint8), rows, cols, dst.stride(0), TILE_R=T_ROWS,
                      TILE_C=T_COLS, num_warps=T_WARPS)


# One operator, so that torch.compile and CUDA graphs see one opaque call: inside it, buffers are written in
# place chunk by chunk, which a traced graph would have to copy.
@torch.library.custom_op("gpt_suite::fp8_output_layer", mutates_args=())
def _output_layer(h8: Tensor, h8_t: Tensor, h_inv: Tensor, w8: Tensor, w8_t: Tensor, w_inv: Tensor,
                  targets: Tensor, vocab_size: int, chunk_rows: int, recompute: bool) -> tuple[Tensor, Tensor, Tensor]:
    n, width = h8.shape
    n_cols = w8.size(0)
    g_inv = torch.full((), 1 / GRAD_SCALE, dtype=torch.float32, device=h8.device)
    row_loss = torch.empty(n, dtype=torch.float32, device=h8.device)
    lse = torch.empty(min(n, chunk_rows), dtype=torch.float32, device=h8.device)
    grad_h = torch.empty(n, width, dtype=torch.bfloat16, device=h8.device)
    # With recompute (Utils.kernels.recompute_logits), no logits at all; else one buffer for every chunk: a GEMM
    # allocating its own output would hold two chunks' logits (1.6 GB at 16,384 rows) while the next is written
    # and the last not yet freed.
    recompute = recompute and (INTERPRETED or recompute_logits.unavailable(h8.device) is None)
    logits = None if recompute else torch.empty(min(n, chunk_rows), n_cols, dtype=torch.bfloat16, device=h8.device)
    grad = torch.empty(min(n, chunk_rows), n_cols, dtype=fp8.E5M2, device=h8.device)
    grad_t = torch.empty(n_cols, n, dtype=fp8.E5M2, device=h8.device)   # every chunk's gradient, transposed
    for i in range(0, n, chunk_rows):
        size = min(chunk_rows, n - i)
        rows = slice(i, i + size)
        # Fast accumulation (Hopper's, which never promotes its partial sums to fp32, losing precision as a
        # sum grows) on the logits' GEMM only, whose sums run over the 768 features; the gradients' GEMMs sum
        # over the 50,304 words or the tokens. recompute_logits' Triton GEMMs accumulate so too: Triton's
        # default on sm_90 (max_num_imprecise_acc, triton/backends/nvidia/compiler.py).
        g = grad[:size]
        if recompute:
            recompute_logits.loss_and_grad(h8[rows], h_inv, w8, w_inv, targets[rows], vocab_size, GRAD_SCALE,
                                           row_loss[rows], g, grad_t[:, rows], lse[:size])
        else:
            torch._scaled_mm(h8[rows], w8.t(), scale_a=h_inv, scale_b=w_inv, out_dtype=torch.bfloat16,
                             use_fast_accum=True, out=logits[:size])
            _softmax_grad_fp8(logits[:size], targets[rows], vocab_size, row_loss[rows], lse[:size], g,
                              grad_t[:, rows])
        torch._scaled_mm(g, w8_t.t(), scale_a=g_inv, scale_b=w_inv, out_dtype=torch.bfloat16, out=grad_h[rows])
    # One GEMM over every token: the gradients (e5m2) against h (e4m3, token-major as the GEMM reads it;
    # Hopper has no e5m2 x e5m2 GEMM), in fp32 as the optimizer's gradient is.
    grad_w = torch._scaled_mm(grad_t, h8_t.t(), scale_a=g_inv, scale_b=h_inv, out_dtype=torch.float32)
    return row_loss, grad_h, grad_w


@_output_layer.register_fake
def _(h8, h8_t, h_inv, w8, w8_t, w_inv, targets, vocab_size, chunk_rows, recompute):
    n, width = h8.shape
    return (h8.new_empty(n, dtype=torch.float32), h8.new_empty(n, width, dtype=torch.bfloat16),
            h8.new_empty(w8.shape, dtype=torch.float32))


class _Fp8CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, vocab_size, recompute):
        n, width = h.shape
        if n % fp8.ALIGN or fp8.width_problem(width):
            raise ValueError(fp8.width_problem(width) or f"FP8 GEMMs need the tokens per step ({n}) to be a "
                             f"multiple of {fp8.ALIGN}: choose BATCH_SIZE x SEQ_LEN accordingly")
        # The GEMMs' dtypes are chosen here; autocast has no rule for FP8 operands.
        with torch.autocast(h.device.type, enabled=False):
            # Padded as the loss kernel's logits are: h's gradient GEMM sums over the vocabulary, which must
            # be a multiple of 16; the padded columns get zero gradient.
            pad = loss_kernel.kernel_logits_width(weight.size(0)) - weight.size(0)
            w8, w_inv = fp8.to_e4m3(F.pad(weight, (0, 0, 0, pad)))   # [vocab, width]
            h8, h_inv = fp8.to_e4m3(h)                                # [tokens, width]
            # Each operand in the layout its GEMMs read, transposed where Inductor fuses it into the cast.
            row_loss, grad_h, grad_w = _output_layer(h8, h8.t().contiguous(), h_inv, w8, w8.t().contiguous(),
                                                     w_inv, targets.contiguous(), vocab_size, CHUNK_ROWS,
                                                     recompute)
        ctx.save_for_backward(grad_h, grad_w[:weight.size(0)])
        ctx.n, ctx.h_dtype, ctx.weight_dtype = n, h.dtype, weight.dtype
        return row_loss.sum() / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        scale = grad_out / ctx.n
        return (grad_h * scale).to(ctx.h_dtype), (grad_w * scale).to(ctx.weight_dtype), None, None, None


def fp8_cross_entropy(h: Tensor, weight: Tensor, targets: Tensor, vocab_size: int, recompute: bool = False) -> Tensor:
    """Mean cross-entropy of h [N, C] @ weight[:vocab_size].T against targets [N], the three GEMMs in FP8,
    without materializing the logits; weight's rows from vocab_size on get a zero gradient. N and C must
    be multiples of 16, and unavailable(device) None. Targets must lie in [0, vocab_size): the kernels read
    each row's target logit unchecked, as the loss kernel does (a check would read the targets back).
    recompute: each chunk's logits computed twice and never stored (Utils.kernels.recompute_logits), on a GPU
    where recompute_logits.unavailable is None."""
    if h.dim() != 2 or weight.dim() != 2 or weight.size(1) != h.size(1):
        raise ValueError(f"h must be [tokens, width] and weight [rows, width], got {tuple(h.shape)} and "
                         f"{tuple(weight.shape)}")
    loss_kernel.check_targets(targets, h, "h", vocab_size, weight.size(0), "the weight's rows")
    return _Fp8CrossEntropy.apply(h, weight, targets, vocab_size, recompute)


def reference(h: Tensor, weight: Tensor, targets: Tensor, vocab_size: int) -> Tensor:
    """What fp8_cross_entropy computes, in the operands' precision and with the logits made whole."""
    return F.cross_entropy(h @ weight[:vocab_size].t(), targets)
