"""The forward GEMMs that read a LayerNorm's output (c_attn's, and c_fc's with its GELU epilogue) in FP8; and
the same layers' input-gradient GEMMs in FP8.

Hopper's tensor cores multiply e4m3 at twice bf16's rate, but a cast to FP8 needs a scale, and a scale
from the tensor's amax costs a reduction over it before the cast can start: at GPT-2's width that pass
is as long as the GEMM's saving (torchao's casts made the fused rung 9% slower, BENCHMARKS.md). A
LayerNorm's output needs no amax. Each normalized row x̂ has mean 0 and mean square at most 1, so no
entry exceeds sqrt(C - 1) for C features (the largest entry of such a row is sqrt(C - 1) when the other
C - 1 are equal), and y = γ x̂ + β is bounded by max|γ| sqrt(C - 1) + max|β|: a bound from the weights
alone; folded into its reader (Utils.kernels.norm_fold), the LayerNorm outputs x̂ alone, bounded by
sqrt(C - 1). The cast then needs nothing from the tensor: one pass, which Inductor fuses into the LayerNorm's
kernel on the plain layers, and runs after it where the input is kept beside its columns of ones
(gemm_bias_grad). The bound costs range, not precision: e4m3 keeps 3 mantissa bits for every
normal value, and at C = 768 the bound (27.7 max|γ|) lies some three binades above a typical row's
largest entry, so only entries below about 2^-9 of the bound lose bits as subnormals.

The weights' scales come from their amax (fp8.to_e4m3): 2.4M elements, a few microseconds a step.
The backward reads the saved bf16 input and weight. Accumulation is Hopper's fast FP8 mode, as for the output
layer's logits: the sums run over the model's width, 768 features at 124M.

The input-gradient GEMM, grad @ W, sums over the layer's outputs (3C for c_attn, 4C for c_fc), along which the
output gradient [tokens, 3C or 4C] is already laid out: it needs no copy of an activation in the other layout, only
W transposed (3C x C or 4C x C values). The gradient has no bound known in advance. One scale for the whole gradient
needs its amax before the cast can start: a second pass over it, 5 bytes a value moved where the GEMM saves about 2.
A scale for each row needs only that row, which the cast's kernel reads once: 3 bytes a value. So each row of the
gradient gets its own power-of-two scale, in e4m3 (torchao's rowwise recipe for this GEMM,
`Float8LinearRecipeName.ROWWISE_WITH_GW_HP`, scales the gradient so). The weight gets one scale, as in the forward:
a row of W transposed is a column of W, and Inductor's kernels for those columns' scales and casts moved their bytes
at 0.8 to 1.4 TB/s in the step (BENCHMARKS.md). The GEMM then runs with one scale an operand, the fast form: the
rowwise GEMM, which applies a vector of scales in its epilogue, was 2 to 28% slower at GPT-2's shapes. Each row's
scale is applied to its output row after the GEMM, a multiplication by a power of two (exact), which Inductor fuses
into the kernel that reads the gradient next (the LayerNorm's backward). The sums run over thousands of products, so
the GEMM accumulates without Hopper's fast FP8 mode, as Transformer Engine's backward GEMMs do. The weight-gradient
GEMM stays bf16: it sums over the tokens, along which neither of its operands is laid out.

Reference: `reference`, the same GEMMs on the dequantized FP8 operands in fp32 (tests/test_fp8_linear.py).
"""
import torch
import torch.nn.functional as F
from torch import Tensor

from Utils.kernels import cublaslt, fp8, fp8_rows


def unavailable(device: torch.device) -> str | None:
    """None on an Ada or Hopper GPU with cuBLASLt, else why not."""
    return fp8.unavailable(device) or cublaslt.unavailable(device)


def _operands(x: Tensor, norm_weight: Tensor | None, norm_bias: Tensor | None, weight: Tensor):
    """(x8, x_inv, w8, w_inv): x, a LayerNorm's output, and weight in e4m3 with their inverse scales."""
    return *fp8.normed_to_e4m3(x, norm_weight, norm_bias), *fp8.to_e4m3(weight)


def linear_normed(x: Tensor, norm_weight: Tensor | None, norm_bias: Tensor | None, weight: Tensor,
                  bias: Tensor) -> Tensor:
    """x @ weight.T + bias, x being the output of a LayerNorm with norm_weight and norm_bias (x̂ alone without
    them), the GEMM in FP8."""
    return linear(*_operands(x, norm_weight, norm_bias, weight), bias)


def linear_gelu_normed(x: Tensor, norm_weight: Tensor | None, norm_bias: Tensor | None, weight: Tensor,
                       bias: Tensor) -> tuple[Tensor, Tensor]:
    """(gelu(h), h) with h = x @ weight.T + bias, x being a LayerNorm's output as for linear_normed, in FP8."""
    return linear_gelu(*_operands(x, norm_weight, norm_bias, weight), bias)


def linear(x8: Tensor, x_inv: Tensor, w8: Tensor, w_inv: Tensor, bias: Tensor) -> Tensor:
    """x @ w.T + bias in bf16 from e4m3 x8 [M, K] and w8 [N, K] with their inverse scales, bias [N] bf16."""
    return torch._scaled_mm(x8, w8.t(), scale_a=x_inv, scale_b=w_inv, bias=bias, out_dtype=torch.bfloat16,
                            use_fast_accum=True)


@torch.library.custom_op("gpt_suite::fp8_linear_gelu", mutates_args=())
def linear_gelu(x8: Tensor, x_inv: Tensor, w8: Tensor, w_inv: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """(gelu(h), h) with h = x @ w.T + bias, from e4m3 x8 [M, K] and w8 [N, K] with their inverse scales, in
    bias's dtype; GELU's tanh approximation, as GPT-2's. On a GPU, one cuBLASLt GEMM with the GELU_AUX_BIAS
    epilogue (cublaslt.linear_gelu); elsewhere, `reference`."""
    return reference_gelu(x8, x_inv, w8, w_inv, bias)


@linear_gelu.register_kernel("cuda")
def _(x8, x_inv, w8, w_inv, bias):
    return cublaslt.linear_gelu(x8, w8, bias, scales=(x_inv, w_inv))


@linear_gelu.register_fake
def _(x8, x_inv, w8, w_inv, bias):
    h = bias.new_empty(x8.size(0), w8.size(0))
    return torch.empty_like(h), h


def reference(x8: Tensor, x_inv: Tensor, w8: Tensor, w_inv: Tensor, bias: Tensor) -> Tensor:
    """What `linear` computes: the product of the dequantized operands in fp32, plus bias, in bias's dtype."""
    return (x8.float() @ w8.float().t() * (x_inv * w_inv) + bias.float()).to(bias.dtype)


def reference_gelu(x8: Tensor, x_inv: Tensor, w8: Tensor, w_inv: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """What `linear_gelu` computes, GELU applied to the fp32 sum as the epilogue applies it."""
    h = x8.float() @ w8.float().t() * (x_inv * w_inv) + bias.float()
    return F.gelu(h, approximate="tanh").to(bias.dtype), h.to(bias.dtype)


def input_grad(grad: Tensor, weight: Tensor) -> Tensor:
    """grad @ weight, the input gradient of a linear layer with weight [N, K] from its output gradient grad [M, N],
    in grad's dtype (bf16), the GEMM in FP8: each row of grad cast to e4m3 with its own power-of-two scale, the
    weight with one scale. The GEMM applies the weight's scale; each row's is applied to its output row after it,
    exactly (a power of two), in an elementwise pass that Inductor fuses into the gradient's reader."""
    return input_grad_gemm(*input_grad_casts(grad, weight), grad.dtype)


def input_grad_casts(grad: Tensor, weight: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """input_grad's operands: (grad's rows in e4m3 [M, N] and their inverse scales [M, 1], the weight in e4m3 with N
    contiguous, the layout the GEMM reads, and its inverse scale, 0-d)."""
    # the Triton kernel reads each row once where it runs, Inductor's code twice
    g8, g_inv = fp8_rows.rows_to_e4m3(grad) if fp8_rows.takes(grad) else fp8.rows_to_fp8(grad, fp8.E4M3)
    w8, w_inv = fp8.to_e4m3(weight)
    return g8, g_inv, w8.t().contiguous().t(), w_inv


def input_grad_gemm(g8: Tensor, g_inv: Tensor, w8: Tensor, w_inv: Tensor, dtype: torch.dtype) -> Tensor:
    """input_grad's GEMM on the operands of input_grad_casts, in dtype."""
    out = torch._scaled_mm(g8, w8, scale_a=w_inv.new_ones(()), scale_b=w_inv, out_dtype=dtype)
    return (out.float() * g_inv).to(dtype)
