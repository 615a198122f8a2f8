"""The MLP block, c_proj(gelu(c_fc(x))), with c_fc's bias and the GELU done in GEMM epilogues.

Compiled, the plain MLP is a cuBLAS GEMM, then a Triton kernel that reads its output and writes the GELU;
going backward, a GEMM, then a kernel that reads its output and the GELU's input to apply GELU's
derivative: two passes over a tokens x 3072 bf16 tensor (0.1 GB per layer at batch 16) of reads and
writes each. Here c_fc's GEMM writes both the GELU and its input (cuBLASLt's GELU_AUX_BIAS epilogue), and
c_proj's input-gradient GEMM multiplies by GELU's derivative as it stores its tiles (DGELU): the same
mathematics, without those passes. GELU is computed from the fp32 accumulator rather than from the
pre-activation rounded to bf16, a difference of bf16 rounding only.

The two GEMMs are PyTorch operators (gpt_suite::linear_gelu and ::linear_dgelu), so torch.compile and
CUDA graphs see them as opaque calls. On a GPU they run Utils.kernels.cublaslt; elsewhere, the same
mathematics in PyTorch operations (cublaslt's references). `reference` is the plain MLP.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from Utils.kernels import cublaslt, fp8_linear, gemm_bias_grad, norm_fold


def unavailable(device: torch.device) -> str | None:
    """None where the epilogue GEMMs run on this device, else why not (elsewhere gelu_mlp runs their
    PyTorch definitions)."""
    return cublaslt.unavailable(device)


@torch.library.custom_op("gpt_suite::linear_gelu", mutates_args=())
def linear_gelu(x: Tensor, weight: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """(gelu(h), h) with h = x @ weight.T + bias; GELU's tanh approximation, as GPT-2's."""
    return cublaslt.reference_linear_gelu(x, weight, bias)


@linear_gelu.register_kernel("cuda")
def _(x, weight, bias):
    return cublaslt.linear_gelu(x, weight, bias)


@linear_gelu.register_fake
def _(x, weight, bias):
    h = x.new_empty(x.size(0), weight.size(0))
    return torch.empty_like(h), h


@torch.library.custom_op("gpt_suite::linear_dgelu", mutates_args=())
def linear_dgelu(grad: Tensor, weight: Tensor, h: Tensor) -> Tensor:
    """grad_h through y = gelu(h) @ weight.T: (grad @ weight) * gelu'(h)."""
    return cublaslt.reference_linear_dgelu(grad, weight, h)


@linear_dgelu.register_kernel("cuda")
def _(grad, weight, h):
    return cublaslt.linear_dgelu(grad, weight, h)


@linear_dgelu.register_fake
def _(grad, weight, h):
    return torch.empty_like(h)


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
        x = saved[:, :x.size(1)]   # [x 1]'s columns, so that [x 1] is saved (gemm_bias_grad._Linear says why)
        w, b = (fc_weight, fc_bias) if gamma is None else norm_fold.folded(fc_weight, fc_bias, gamma, beta)
        if norm_weight is not None and fp8_linear.fits(x):
            if gamma is not None:   # x is x̂: its bound needs no weights
                norm_weight = norm_bias = None
            a, h = fp8_linear.linear_gelu_normed(x, norm_weight, norm_bias, w, b)
        else:
            a, h = linear_gelu(x, w, b)
        ctx.save_for_backward(saved, w, fc_weight, proj_weight, a, h, gamma, beta)
        ctx.ones = ones
        return torch.addmm(proj_bias, a, proj_weight.t())

    @staticmethod
    def backward(ctx, grad):
        saved, w, fc_weight, proj_weight, a, h, gamma, beta = ctx.saved_tensors
        grad = grad.contiguous()
        grad_h = linear_dgelu(grad, proj_weight, h)
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
    forward GEMM runs in FP8 where fp8_linear fits x (Utils.kernels.fp8_linear). With `fold`, a LayerNorm that
    only normalized x, fc applies its weight and bias (Utils.kernels.norm_fold): the MLP of fold's affine(x)."""
    return gemm_bias_grad.apply_in_autocast_dtype(_GeluMLP, x, (fc.weight, fc.bias, proj.weight, proj.bias), ones,
                                                  *fp8_linear.norm_weights(norm), *fp8_linear.norm_weights(fold))


def reference(x: Tensor, fc: nn.Linear, proj: nn.Linear) -> Tensor:
    """What gelu_mlp computes: the plain MLP, proj(gelu(fc(x))) with GELU's tanh approximation."""
    return F.linear(F.gelu(F.linear(x, fc.weight, fc.bias), approximate="tanh"), proj.weight, proj.bias)
