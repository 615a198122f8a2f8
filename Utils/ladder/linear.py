"""The linear layers that combine several kernel modules' features (gemm_bias_grad, gelu_epilogue, fp8_linear,
norm_fold) in one autograd Function each: composed here, above Utils.kernels, so that each kernel module keeps
only its own op.
"""
import torch
import torch.nn as nn
from torch import Tensor

from Utils.kernels import fp8, fp8_linear, gelu_epilogue, gemm_bias_grad, norm_fold


def norm_weights(norm: nn.LayerNorm | None) -> tuple[Tensor | None, Tensor | None]:
    """(weight, bias) of `norm`, (None, None) without one: the arguments that select the FP8 forward GEMM."""
    return (None, None) if norm is None else (norm.weight, norm.bias)


# --- Bias gradient from the weight-gradient GEMM: fuses the bias gradient's sum over the tokens into the
# GEMM dY^T [X 1] as its last column, so that no pass of its own reads dY.
# Without `ones`, autograd's sum makes the bias gradient. With a LayerNorm's weights, x is that LayerNorm's
# output and the forward GEMM runs in FP8 (Utils.kernels.fp8_linear); the backward stays bf16. With fold
# weights, x is a LayerNorm's x̂ alone, and this layer applies that LayerNorm's γ and β (Utils.kernels.norm_fold).
class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, ones, norm_weight, norm_bias, gamma, beta):
        saved = gemm_bias_grad.with_ones(x) if ones else x
        w, b = (weight, bias) if gamma is None else norm_fold.folded(weight, bias, gamma, beta)
        ctx.save_for_backward(saved, w, weight, gamma, beta)
        ctx.ones = ones
        # The forward GEMM reads [x 1]'s columns, not x, in FP8 too: then [x 1] is made in the forward pass and
        # saved. Read from x, the compiled graph saves only the LayerNorm's statistics and rebuilds [x 1] in a
        # backward pass of its own (BENCHMARKS.md, "[x 1] saved again").
        x = saved[:, :x.size(1)]
        if norm_weight is not None and fp8.fits(x):
            if gamma is not None:   # x is x̂: its bound needs no weights
                norm_weight = norm_bias = None
            return fp8_linear.linear_normed(x, norm_weight, norm_bias, w, b)
        return torch.addmm(b, x, w.t())

    @staticmethod
    def backward(ctx, grad):
        saved, w, weight, gamma, beta = ctx.saved_tensors
        grad_w, grad_b = (gemm_bias_grad.weight_and_bias_grad(grad, saved) if ctx.ones
                          else (grad.t() @ saved, grad.sum(0)))
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
    the LayerNorm whose output x is, the forward GEMM runs in FP8 where fp8.fits(x)
    (Utils.kernels.fp8_linear). With `fold`, a LayerNorm that only normalized x, this layer applies its weight
    and bias (Utils.kernels.norm_fold) and returns their gradients: layer(fold's affine(x))."""
    return apply_in_autocast_dtype(_Linear, x, (layer.weight, layer.bias), ones, *norm_weights(norm),
                                   *norm_weights(fold))


# --- The MLP around the two epilogue GEMMs: c_fc's bias and GELU fused into c_fc's GEMM, GELU's
# derivative into c_proj's input-gradient GEMM, so that neither the GELU nor its backward is a pass of
# its own over the tokens x 3072 activations. With a LayerNorm's weights, x is that LayerNorm's output and
# c_fc's forward GEMM runs in FP8 (Utils.kernels.fp8_linear); the backward stays bf16. With fold weights, x is
# a LayerNorm's x̂ alone, and c_fc applies that LayerNorm's γ and β (Utils.kernels.norm_fold).
class _GeluMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fc_weight, fc_bias, proj_weight, proj_bias, ones, norm_weight, norm_bias, gamma, beta):
        # With `ones`, x is kept beside a column of ones, and c_fc's bias gradient comes out of its
        # weight-gradient GEMM (Utils.kernels.gemm_bias_grad).
        saved = gemm_bias_grad.with_ones(x) if ones else x
        x = saved[:, :x.size(1)]   # [x 1]'s columns, so that [x 1] is saved (_Linear says why)
        w, b = (fc_weight, fc_bias) if gamma is None else norm_fold.folded(fc_weight, fc_bias, gamma, beta)
        if norm_weight is not None and fp8.fits(x):
            if gamma is not None:   # x is x̂: its bound needs no weights
                norm_weight = norm_bias = None
            a, h = fp8_linear.linear_gelu_normed(x, norm_weight, norm_bias, w, b)
        else:
            a, h = gelu_epilogue.linear_gelu(x, w, b)
        ctx.save_for_backward(saved, w, fc_weight, proj_weight, a, h, gamma, beta)
        ctx.ones = ones
        return torch.addmm(proj_bias, a, proj_weight.t())

    @staticmethod
    def backward(ctx, grad):
        saved, w, fc_weight, proj_weight, a, h, gamma, beta = ctx.saved_tensors
        grad = grad.contiguous()
        grad_h = gelu_epilogue.linear_dgelu(grad, proj_weight, h)
        if ctx.ones:
            fc_w, fc_b = gemm_bias_grad.weight_and_bias_grad(grad_h, saved)
        else:
            fc_w, fc_b = grad_h.t() @ saved, grad_h.sum(0)
        grad_gamma = grad_beta = None
        if gamma is not None:
            fc_w, fc_b, grad_gamma, grad_beta = norm_fold.unfolded_grads(fc_w, fc_b, fc_weight, gamma, beta)
        return grad_h @ w, fc_w, fc_b, grad.t() @ a, grad.sum(0), None, None, None, grad_gamma, grad_beta


def gelu_mlp(x: Tensor, fc: nn.Linear, proj: nn.Linear, ones: bool = False, norm: nn.LayerNorm | None = None,
             fold: nn.LayerNorm | None = None) -> Tensor:
    """proj(gelu(fc(x))) for nn.Linear layers fc and proj, x [..., fc.in_features]. Under autocast, in the
    autocast dtype, as the plain MLP's matmuls would be. With ones, fc's bias gradient comes out of its
    weight-gradient GEMM (Utils.kernels.gemm_bias_grad). With `norm`, the LayerNorm whose output x is, fc's
    forward GEMM runs in FP8 where fp8.fits(x) (Utils.kernels.fp8_linear). With `fold`, a LayerNorm that
    only normalized x, fc applies its weight and bias (Utils.kernels.norm_fold): the MLP of fold's affine(x)."""
    return apply_in_autocast_dtype(_GeluMLP, x, (fc.weight, fc.bias, proj.weight, proj.bias), ones,
                                   *norm_weights(norm), *norm_weights(fold))
