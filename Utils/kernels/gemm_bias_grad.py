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
partial sums to bf16). `reference` is the plain linear layer; the layer built on these two functions is
Utils.ladder.linear.linear.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

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


def reference(x: Tensor, layer: nn.Linear) -> Tensor:
    """What the layer computes (Utils.ladder.linear.linear): the plain linear layer, its bias gradient autograd's
    sum."""
    return F.linear(x, layer.weight, layer.bias)
