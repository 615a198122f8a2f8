"""A linear layer composed from the features its plan names, each applied by its own kernel module's pieces.

y = x Wᵀ + b runs in stages: the input kept for backward, the weights the GEMM multiplies by, the forward GEMM;
then backward, the weight-gradient GEMM, the gradients of the parameters the weights came from, the
input-gradient GEMM. A feature replaces the plain layer's piece at the stages it changes and no other:

  feature       kernel module    its pieces
  bias_grad     gemm_bias_grad   x kept beside ones (with_ones); dW and db from one GEMM (weight_and_bias_grad)
  fold          norm_fold        W' = W diag(γ), b' = b + Wβ (folded); dW, db, dγ, dβ from dW', db' (unfolded_grads)
  fp8_forward   fp8_linear       the forward GEMM in FP8, x's scale bounded by its LayerNorm (linear_normed)
  fp8_dgrad     fp8_linear       the input-gradient GEMM in FP8, a scale for each row of the gradient (input_grad)
  gelu          gelu_epilogue    the GEMM writes gelu(h) and h (linear_gelu); the next layer's input-gradient
                                 GEMM applies GELU's derivative (linear_dgelu, in `_AfterGelu`)

Two features meet at one stage only where fp8_forward and gelu both change the forward GEMM, which
fp8_linear provides whole (linear_gelu_normed).
"""
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
from torch import Tensor

from Utils.kernels import fp8, fp8_linear, gelu_epilogue, gemm_bias_grad, norm_fold


@dataclass(frozen=True)
class LinearPlan:
    """The features one linear layer gets; the plain layer has none. fold and fp8_forward need the LayerNorm
    whose output x is (`norm` of `linear`)."""
    bias_grad: bool = False     # its bias gradient made by its weight-gradient GEMM
    fold: bool = False          # x is a LayerNorm's x̂ alone, and this layer applies that LayerNorm's γ and β
    fp8_forward: bool = False   # its forward GEMM in FP8 wherever fp8.fits(x)
    fp8_dgrad: bool = False     # its input-gradient GEMM in FP8 wherever fp8.fits(grad) and fp8.fits(weight)
    gelu: bool = False          # its GEMM writes gelu(h) and h: an MLP's c_fc, as `gelu_mlp` runs it


class _Linear(torch.autograd.Function):
    """x Wᵀ + b, or (gelu(h), h) with h = x Wᵀ + b under plan.gelu, for x [tokens, features]; gamma and beta
    are the weight and bias of the LayerNorm whose output x is (None without one)."""

    @staticmethod
    def forward(ctx, x, weight, bias, gamma, beta, plan):
        kept = gemm_bias_grad.with_ones(x) if plan.bias_grad else x
        w, b = norm_fold.folded(weight, bias, gamma, beta) if plan.fold else (weight, bias)
        ctx.save_for_backward(kept, w, weight, *((gamma, beta) if plan.fold else (None, None)))
        ctx.plan = plan
        # The forward GEMM reads [x 1]'s columns, not x, in FP8 too: then [x 1] is made in the forward pass and
        # saved. Read from x, the compiled graph saves only the LayerNorm's statistics and rebuilds [x 1] in a
        # backward pass of its own (BENCHMARKS.md, "[x 1] saved again").
        x = kept[:, :x.size(1)]
        if plan.fp8_forward and fp8.fits(x):
            bound = (None, None) if plan.fold else (gamma, beta)   # x̂'s bound needs no weights
            gemm = fp8_linear.linear_gelu_normed if plan.gelu else fp8_linear.linear_normed
            out = gemm(x, *bound, w, b)
        else:
            out = gelu_epilogue.linear_gelu(x, w, b) if plan.gelu else torch.addmm(b, x, w.t())
        if plan.gelu:
            ctx.mark_non_differentiable(out[0])   # gelu(h)'s gradient reaches h through _AfterGelu
        return out

    @staticmethod
    def backward(ctx, *grads):
        grad = grads[-1]   # y's, or h's under plan.gelu
        kept, w, weight, gamma, beta = ctx.saved_tensors
        plan = ctx.plan
        grad_w, grad_b = (gemm_bias_grad.weight_and_bias_grad(grad, kept) if plan.bias_grad
                          else (grad.t() @ kept, grad.sum(0)))
        grad_gamma = grad_beta = None
        if plan.fold:
            grad_w, grad_b, grad_gamma, grad_beta = norm_fold.unfolded_grads(grad_w, grad_b, weight, gamma, beta)
        grad_x = fp8_linear.input_grad(grad, w) if plan.fp8_dgrad and fp8.fits(grad) and fp8.fits(w) else grad @ w
        return grad_x, grad_w, grad_b, grad_gamma, grad_beta, None


class _AfterGelu(torch.autograd.Function):
    """a Wᵀ + b for a = gelu(h) made by a plan.gelu layer: its input-gradient GEMM applies GELU's derivative as
    it stores its tiles, so the gradient goes to h and no pass of its own reads the tokens x 3072 activations."""

    @staticmethod
    def forward(ctx, a, h, weight, bias):
        ctx.save_for_backward(a, h, weight)
        return torch.addmm(bias, a, weight.t())

    @staticmethod
    def backward(ctx, grad):
        a, h, weight = ctx.saved_tensors
        grad = grad.contiguous()
        return None, gelu_epilogue.linear_dgelu(grad, weight, h), grad.t() @ a, grad.sum(0)


def _norm_weights(plan: LinearPlan, norm: nn.LayerNorm | None) -> tuple[Tensor | None, Tensor | None]:
    """(γ, β) of `norm`, which fold and fp8_forward need, as they are (in the norm's dtype); (None, None) else."""
    if not (plan.fold or plan.fp8_forward):
        return None, None
    if norm is None:
        raise ValueError(f"{plan} needs the LayerNorm whose output the layer reads")
    return norm.weight, norm.bias


def _compute_dtype(x: Tensor) -> torch.dtype:
    """The autocast dtype where autocast is on (x's where it is off): the dtype plain nn.Linear layers compute in."""
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype


def linear(x: Tensor, layer: nn.Linear, plan: LinearPlan = LinearPlan(), norm: nn.LayerNorm | None = None) -> Tensor:
    """layer(x), x [..., in_features], with the features of `plan` (not gelu: `gelu_mlp` runs that), for an
    nn.Linear with a bias; `norm` the LayerNorm whose output x is, for fold and fp8_forward. Under autocast, in
    the autocast dtype, as layer(x) would be, with autocast off inside."""
    dtype = _compute_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        y = _Linear.apply(x.reshape(-1, x.size(-1)).to(dtype).contiguous(), layer.weight.to(dtype),
                          layer.bias.to(dtype), *_norm_weights(plan, norm), plan)
    return y.view(*x.shape[:-1], y.size(-1))


def gelu_mlp(x: Tensor, fc: nn.Linear, proj: nn.Linear, plan: LinearPlan = LinearPlan(),
             norm: nn.LayerNorm | None = None) -> Tensor:
    """proj(gelu(fc(x))) for nn.Linear layers fc and proj, x [..., fc.in_features], GELU's tanh approximation:
    fc with the features of `plan` and gelu, proj after it (_AfterGelu). Under autocast, in the autocast
    dtype, as the plain MLP's matmuls would be."""
    dtype, plan = _compute_dtype(x), replace(plan, gelu=True)
    with torch.autocast(x.device.type, enabled=False):
        a, h = _Linear.apply(x.reshape(-1, x.size(-1)).to(dtype).contiguous(), fc.weight.to(dtype),
                             fc.bias.to(dtype), *_norm_weights(plan, norm), plan)
        y = _AfterGelu.apply(a, h, proj.weight.to(dtype), proj.bias.to(dtype))
    return y.view(*x.shape[:-1], y.size(-1))
