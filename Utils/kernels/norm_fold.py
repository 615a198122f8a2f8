"""A LayerNorm's γ and β folded into the linear layer that reads its output, for training.

The LayerNorm's backward must sum over the tokens for its weight and bias gradients: Σ dy ⊙ x̂ and Σ dy over
65,536 rows at batch 64. Inductor compiles those column sums into the row-wise backward kernel as partial sums,
then finishes each with an eager ATen sum that needs a memset first: 48 sums and memsets a step for GPT-2's 24
block LayerNorms, each followed by an idle GPU inside the CUDA graph (BENCHMARKS.md, "LayerNorm's weight
gradients"). Folded, the LayerNorm only normalizes, and the layer computes the same function from x̂:

    (x̂ γ + β) Wᵀ + b  =  x̂ W'ᵀ + b',   W' = W diag(γ),  b' = b + W β.

The chain rule gives every gradient from the two that the layer's GEMMs already make, dW' = gᵀ x̂ and db' = gᵀ 1
(one GEMM with x̂ beside a column of ones, Utils.kernels.gemm_bias_grad), as sums over the layer's output
features (2,304 or 3,072), not over the tokens:

    dW = dW' diag(γ) + db' βᵀ,   db = db',   dγ = Σ_k dW'_k ⊙ W_k,   dβ = Wᵀ db',   dx̂ = g W'.

The same mathematics as the unfolded layer (`reference`); the roundings differ (W' is rounded to bf16 where W
was).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


def unavailable(device: torch.device) -> str | None:
    """None: these are PyTorch operations and run on any device."""
    return None


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)   # fp32 for bf16 weights, float64 for float64 ones


def folded(weight: Tensor, bias: Tensor, gamma: Tensor, beta: Tensor) -> tuple[Tensor, Tensor]:
    """(W', b') = (W diag(γ), b + W β) in the dtypes of weight and bias, computed in fp32 or wider; weight
    [out, in], bias [out], gamma and beta [in]."""
    acc = _acc(weight.dtype)
    w = weight.to(acc)
    return (w * gamma.to(acc)).to(weight.dtype), (bias.to(acc) + (w * beta.to(acc)).sum(1)).to(bias.dtype)


def unfolded_grads(grad_w: Tensor, grad_b: Tensor, weight: Tensor, gamma: Tensor,
                   beta: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dW, db, dγ, dβ) from the folded layer's dW' [out, in] and db' [out]: dW and db in the dtypes of grad_w
    and grad_b, dγ and dβ in gamma's and beta's; the sums in fp32 or wider."""
    acc = _acc(grad_w.dtype)
    gw, gb, w = grad_w.to(acc), grad_b.to(acc), weight.to(acc)
    grad_weight = (gw * gamma.to(acc) + gb[:, None] * beta.to(acc)).to(grad_w.dtype)
    return grad_weight, grad_b, (gw * w).sum(0).to(gamma.dtype), (gb[:, None] * w).sum(0).to(beta.dtype)


def reference(xhat: Tensor, layer: nn.Linear, norm: nn.LayerNorm) -> Tensor:
    """What the folded layer computes from x̂: layer(x̂ γ + β), the LayerNorm's affine then the layer."""
    return F.linear(xhat * norm.weight + norm.bias, layer.weight, layer.bias)
