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
mathematics in PyTorch operations (cublaslt's references). `reference` is the plain MLP; the MLP around the
two ops is Utils.ladder.linear.gelu_mlp.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from Utils.kernels import cublaslt


def unavailable(device: torch.device) -> str | None:
    """None where the epilogue GEMMs run on this device, else why not (elsewhere the ops run their PyTorch
    definitions)."""
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


def reference(x: Tensor, fc: nn.Linear, proj: nn.Linear) -> Tensor:
    """What the MLP around the two ops computes (Utils.ladder.linear.gelu_mlp): the plain MLP,
    proj(gelu(fc(x))) with GELU's tanh approximation."""
    return F.linear(F.gelu(F.linear(x, fc.weight, fc.bias), approximate="tanh"), proj.weight, proj.bias)
