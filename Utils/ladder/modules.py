"""The modules that additions swap into a built model, each over one op of Utils.kernels or a layer of
Utils.ladder.linear.

gpt-fast's quantize.py swaps its Linear layers the same way: the model is built as nanoGPT writes it,
then a module is replaced by one that computes the same function faster, keeping the same parameters
(so the weights drawn at initialization, and their tying, are untouched). Every swap here happens
before torch.compile and before the optimizer is built.
"""
from dataclasses import replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from Utils.kernels import chunked_loss, fp8, fp8_loss, packed_attention
from Utils.ladder import linear
from Utils.ladder.linear import LinearPlan
from Utils.model import GPT, CausalSelfAttention, OutputLoss


class PlannedLinear(nn.Linear):
    """nn.Linear with the features its `plan` names (Utils.ladder.linear), which the additions set: gemm_bias_grad's
    bias gradient, fp8_qkv_fc's FP8 forward GEMM and fold_norm's folded LayerNorm; `norm` is the LayerNorm whose
    output it reads, for the last two."""
    plan: LinearPlan = LinearPlan()
    norm: nn.LayerNorm | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear.linear(x, self, self.plan, self.norm)


def planned(parent: nn.Module, name: str) -> PlannedLinear:
    """parent.<name>, an nn.Linear, made a PlannedLinear holding the same Parameters where it is not one yet."""
    if not isinstance(getattr(parent, name), PlannedLinear):
        swap_linear(parent, name, PlannedLinear)
    return getattr(parent, name)


def add_feature(layer: PlannedLinear, norm: nn.LayerNorm | None = None, **feature: bool) -> None:
    """Give `layer` a feature of LinearPlan (bias_grad=True, ...), and `norm` as the LayerNorm whose output it reads
    where given. A reference, not a submodule: norm's parameters stay registered once, where the model has them,
    and the state dict is unchanged."""
    layer.plan = replace(layer.plan, **feature)
    if norm is not None:
        object.__setattr__(layer, "norm", norm)


class EpilogueMLP(nn.Module):
    """The block's MLP with c_fc's bias and GELU, and GELU's derivative, in GEMM epilogues (kernels.gelu_epilogue),
    c_fc with the other features its plan names."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.c_fc, self.c_proj = planned(mlp, "c_fc"), mlp.c_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear.gelu_mlp(x, self.c_fc, self.c_proj, self.c_fc.plan, self.c_fc.norm)


class NormalizeOnly(nn.LayerNorm):
    """A LayerNorm that only normalizes: its weight and bias stay registered here (the state dict is unchanged)
    and are applied by the layer that reads its output (kernels.norm_fold), so that its backward has no sums
    over the tokens."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, None, None, self.eps)


def fold_norm(parent: nn.Module, name: str, reader: PlannedLinear) -> None:
    """Make parent.<name>, the LayerNorm whose output `reader` alone reads, a NormalizeOnly holding the same
    Parameters, and give `reader` the fold feature with it."""
    old = getattr(parent, name)
    new = NormalizeOnly(old.normalized_shape, eps=old.eps, device="meta")
    new.weight, new.bias = old.weight, old.bias
    setattr(parent, name, new)
    add_feature(reader, new, fold=True)


class CudnnAttention(CausalSelfAttention):
    """The model's SDPA attention, held to cuDNN's fused attention kernels."""

    def __init__(self, attn: CausalSelfAttention):
        nn.Module.__init__(self)
        self.n_head, self.flash, self.c_attn, self.c_proj = attn.n_head, True, attn.c_attn, attn.c_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return super().forward(x)


class PackedAttention(nn.Module):
    """Attention on the QKV projection's packed output, its gradient written packed
    (kernels.packed_attention)."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        self.n_head, self.c_attn, self.c_proj = attn.n_head, attn.c_attn, attn.c_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(packed_attention.packed_attention(self.c_attn(x), self.n_head))


class ChunkedLoss(OutputLoss):
    """The output layer's cross-entropy without the whole logits (kernels.chunked_loss), its GEMMs in FP8
    with `fp8` (kernels.fp8_loss) wherever the step's tokens are a multiple of 16, as FP8 GEMMs need; with
    `recompute` too, each chunk's logits computed twice and never stored (kernels.recompute_logits)."""

    def __init__(self, vocab_size: int, kernel: bool, fp8: bool = False):
        super().__init__(vocab_size)
        self.kernel, self.fp8, self.recompute = kernel, fp8, False

    def forward(self, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h, targets = h.reshape(-1, h.size(-1)), targets.reshape(-1)
        if self.fp8 and h.size(0) % fp8.ALIGN == 0:
            return fp8_loss.fp8_cross_entropy(h, weight, targets, self.vocab_size, recompute=self.recompute)
        return chunked_loss.chunked_cross_entropy(h, weight, targets, self.vocab_size, kernel=self.kernel)


def swap_linear(parent: nn.Module, name: str, cls: type) -> None:
    """Replace parent.<name>, an nn.Linear, with a `cls` holding the same weight and bias Parameters."""
    old = getattr(parent, name)
    new = cls(old.in_features, old.out_features, bias=old.bias is not None, device="meta")
    new.weight, new.bias = old.weight, old.bias
    new.__dict__.update({k: v for k, v in old.__dict__.items() if k == "residual_scale"})
    setattr(parent, name, new)


def blocks(model: GPT) -> nn.ModuleList:
    return model.transformer.h


def cast_residual_to_bf16(model: GPT) -> None:
    """Cast the residual stream to bf16 where it enters the first block, under bf16 autocast.

    Autocast leaves the residual stream in the embeddings' fp32, since adding a bf16 block output to it
    promotes; cast once, and every add, LayerNorm read and their gradients move half the bytes. The
    blocks' outputs are bf16 already: only the sum's rounding changes. bf16 only: fp16's range could
    overflow a residual stream that has no loss scaling."""

    def cast(module, args):
        x = args[0]
        if torch.is_autocast_enabled(x.device.type) and torch.get_autocast_dtype(x.device.type) == torch.bfloat16:
            return (x.to(torch.bfloat16),)
        return None

    blocks(model)[0].register_forward_pre_hook(cast)


def store_in_bf16(model: GPT) -> None:
    """Store the model's linear and embedding parameters in bf16, and keep its embeddings' sum in fp32 as autocast
    leaves it with fp32 weights, so that the residual stream's dtype stays bf16_residual's to change (the lookup
    is no autocast operation: its output has its weight's dtype). The LayerNorms keep fp32 weights, as autocast
    computes LayerNorm in fp32; they are under 0.1% of the parameters."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.to(torch.bfloat16)

    def fp32(module, args, out):
        return out.float() if torch.is_autocast_enabled(out.device.type) else None

    model.transformer.wte.register_forward_hook(fp32)
    model.transformer.wpe.register_forward_hook(fp32)
