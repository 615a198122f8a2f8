"""Linear layers whose bias gradient comes out of their weight-gradient GEMM.

A linear layer's bias gradient is its output gradient summed over the tokens: one more pass over a
tokens x out_features tensor (0.3 GB for c_attn and 0.4 GB for c_fc per layer at batch 64) after the two
GEMMs that read it for the input and weight gradients. With a column of ones stored beside the input X,
that sum is one more column of the weight-gradient GEMM: dY^T [X 1] = [dY^T X, dY^T 1]. The GEMM is eight
columns wider (eight ones, so that rows stay 16-byte aligned), which costs far less than the sum's pass;
the forward GEMM reads X as the first columns of [X 1]. Compiled, the kernel that makes X (LayerNorm)
writes it straight into the wider buffer. The sum is the GEMM's fp32 accumulation of the same bf16
values, rounded to bf16 as autograd's bf16 bias gradient is: the same sums, to bf16 rounding (a split-K
GEMM adds its partial sums in another order than a reduction kernel, and PyTorch lets cuBLAS round those
partial sums to bf16). `reference` is the plain linear layer.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from Utils.kernels import fp8_linear, norm_fold

ONES = 8   # columns of ones: 16 bytes of bf16, so that the rows of [X 1] stay 16-byte aligned


def unavailable(device: torch.device) -> str | None:
    """None: these are PyTorch operations and run on any device."""
    return None


def with_ones(x: Tensor) -> Tensor:
    """[x, 1, ..., 1]: x [N, K] with ONES columns of ones after it."""
    return torch.cat([x, x.new_ones(()).expand(x.size(0), ONES)], dim=1)


def weight_and_bias_grad(grad: Tensor, x_ones: Tensor) -> tuple[Tensor, Tensor]:
    """(dY^T X, dY^T 1) from one GEMM, for grad = dY [N, out] and x_ones = [X 1] [N, K + ONES]."""
    k = x_ones.size(1) - ONES
    both = grad.t() @ x_ones
    return both[:, :k], both[:, k]


# --- Bias gradient from the weight-gradient GEMM: fuses the bias gradient's sum over the tokens into the
# GEMM dY^T [X 1] as its last column, so that no pass of its own reads dY.
# Without `ones`, autograd's sum makes the bias gradient. With a LayerNorm's weights, x is that LayerNorm's
# output and the forward GEMM runs in FP8 (Utils.kernels.fp8_linear); the backward stays bf16. With fold
# weights, x is a LayerNorm's x̂ alone, and this layer applies that LayerNorm's γ and β (Utils.kernels.norm_fold).
class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, ones, norm_weight, norm_bias, gamma, beta):
        saved = with_ones(x) if ones else x
        w, b = (weight, bias) if gamma is None else norm_fold.folded(weight, bias, gamma, beta)
        ctx.save_for_backward(saved, w, weight, gamma, beta)
        ctx.ones = ones
        # The forward GEMM reads [x 1]'s columns, not x, in FP8 too: then [x 1] is made in the forward pass and
        # saved. Read from x, the compiled graph saves only the LayerNorm's statistics and rebuilds [x 1] in a
        # backward pass of its own (BENCHMARKS.md, "[x 1] saved again").
        x = saved[:, :x.size(1)]
        if norm_weight is not None and fp8_linear.fits(x):
            if gamma is not None:   # x is x̂: its bound needs no weights
                norm_weight = norm_bias = None
            return fp8_linear.linear_normed(x, norm_weight, norm_bias, w, b)
        return torch.addmm(b, x, w.t())

    @staticmethod
    def backward(ctx, grad):
        saved, w, weight, gamma, beta = ctx.saved_tensors
        grad_w, grad_b = weight_and_bias_grad(grad, saved) if ctx.ones else (grad.t() @ saved, grad.sum(0))
        if gamma is None:
            return grad @ w, grad_w, grad_b, None, None, None, None, None
        grad_w, grad_b, grad_gamma, grad_beta = norm_fold.unfolded_grads(grad_w, grad_b, weight, gamma, beta)
        return grad @ w, grad_w, grad_b, None, None, None, grad_gamma, grad_beta


def apply_in_autocast_dtype(function: type[torch.autograd.Function], x: Tensor, params: tuple[Tensor, ...],
                            *args) -> Tensor:
    """function.apply(x as a [tokens, features] matrix, *params, *args) with the tensors in the autocast dtype
    (x's where autocast is off) and autocast off inside: the dtype that plain nn.Linear layers would compute
    in. The result keeps x's leading dimensions."""
    device_type = x.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
    with torch.autocast(device_type, enabled=False):
        y = function.apply(x.reshape(-1, x.size(-1)).to(dtype).contiguous(), *(p.to(dtype) for p in params), *args)
    return y.view(*x.shape[:-1], y.size(-1))


def linear(x: Tensor, layer: nn.Linear, norm: nn.LayerNorm | None = None, ones: bool = True,
           fold: nn.LayerNorm | None = None) -> Tensor:
    """layer(x) for an nn.Linear with a bias, x [..., in_features], its bias gradient made by its weight-gradient
    GEMM (by a sum where not `ones`). Under autocast, in the autocast dtype, as layer(x) would be. With `norm`,
    the LayerNorm whose output x is, the forward GEMM runs in FP8 where fp8_linear fits x
    (Utils.kernels.fp8_linear). With `fold`, a LayerNorm that only normalized x, this layer applies its weight
    and bias (Utils.kernels.norm_fold) and returns their gradients: layer(fold's affine(x))."""
    return apply_in_autocast_dtype(_Linear, x, (layer.weight, layer.bias), ones, *fp8_linear.norm_weights(norm),
                                   *fp8_linear.norm_weights(fold))


def reference(x: Tensor, layer: nn.Linear) -> Tensor:
    """What linear computes: the plain linear layer, its bias gradient autograd's sum."""
    return F.linear(x, layer.weight, layer.bias)
