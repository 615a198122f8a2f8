"""The ladder: one frozen recipe per rung, and the apply_* functions that each switch one thing on.

The ladder is cumulative: every rung is the one before it plus one change, except 8bit, which is the
flash rung with bitsandbytes' AdamW8bit in place of torch's AdamW. Each apply_* function returns a
note when its change cannot take effect on this machine, so that the run record says so.
"""
import shutil
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Recipe:
    name: str
    tf32: bool = False
    bf16: bool = False
    compile: bool = False
    attention: str = "manual"      # "manual": scores written out; "sdpa": F.scaled_dot_product_attention
    optimizer: str = "adamw"       # "adamw" (torch default implementation), "adamw_fused", "adamw8bit"

    def __post_init__(self):
        if self.attention not in ("manual", "sdpa"):
            raise ValueError(f"attention must be 'manual' or 'sdpa', got {self.attention!r}")
        if self.optimizer not in ("adamw", "adamw_fused", "adamw8bit"):
            raise ValueError(f"optimizer must be adamw, adamw_fused or adamw8bit, got {self.optimizer!r}")


BASELINE = Recipe("baseline")
TF32 = replace(BASELINE, name="tf32", tf32=True)
BF16 = replace(TF32, name="bf16", bf16=True)
TORCH_COMPILE = replace(BF16, name="torch_compile", compile=True)
FLASH = replace(TORCH_COMPILE, name="flash", attention="sdpa")
FUSED = replace(FLASH, name="fused", optimizer="adamw_fused")
EIGHT_BIT = replace(FLASH, name="8bit", optimizer="adamw8bit")

RECIPES = {r.name: r for r in (BASELINE, TF32, BF16, TORCH_COMPILE, FLASH, FUSED, EIGHT_BIT)}
LADDER = list(RECIPES)

# Identical on every rung (nanoGPT's GPT-2 124M settings), so that only the recipe differs.
LEARNING_RATE = 6e-4
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0


class Unavailable(Exception):
    """This rung's change cannot run on this machine; the message says why (the run is 'skipped')."""


def apply_tf32(recipe, device):
    """TF32 lets fp32 matmuls and convolutions use the tensor cores with a 10-bit mantissa."""
    torch.backends.cuda.matmul.allow_tf32 = recipe.tf32
    torch.backends.cudnn.allow_tf32 = recipe.tf32
    if recipe.tf32 and device.type != "cuda":
        return "TF32 has no effect on a CPU"
    if recipe.tf32 and torch.cuda.get_device_capability(device)[0] < 8:
        return "TF32 needs an Ampere or newer GPU: no effect here"
    return None


def autocast_context(recipe, device):
    """bf16 autocast: matmuls and attention in bf16, reductions such as softmax and the loss in fp32."""
    if not recipe.bf16:
        return torch.autocast(device.type, enabled=False)
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise Unavailable(f"{torch.cuda.get_device_name(device)} has no bf16 support")
    return torch.autocast(device.type, dtype=torch.bfloat16)


def apply_attention(config, recipe):
    """Choose the attention implementation through the model config, never a global switch."""
    return replace(config, attention=recipe.attention)


def apply_compile(model, recipe, device):
    """torch.compile fuses elementwise work into few Triton (GPU) or C++ (CPU) kernels."""
    if not recipe.compile:
        return model
    if device.type == "cuda":
        from torch.utils._triton import has_triton
        if not has_triton():
            raise Unavailable("torch.compile needs Triton for this GPU, and Triton is not installed")
    elif not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        raise Unavailable("torch.compile on a CPU needs a C++ compiler (g++ or clang++) on the PATH")
    return torch.compile(model)


def _param_groups(model):
    # Weight decay on matrices only (nanoGPT): biases and LayerNorm gains are not decayed.
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def apply_optimizer(model, recipe, device):
    """AdamW as torch ships it, torch's single-kernel fused AdamW, or bitsandbytes' 8-bit AdamW."""
    groups = _param_groups(model)
    if recipe.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=LEARNING_RATE, betas=BETAS, eps=EPS)
    if recipe.optimizer == "adamw_fused":
        return torch.optim.AdamW(groups, lr=LEARNING_RATE, betas=BETAS, eps=EPS, fused=True)
    try:
        import bitsandbytes as bnb
    except Exception as e:  # ImportError, or a broken native library raising something else
        raise Unavailable(f"bitsandbytes is not usable here ({type(e).__name__}: {e}); "
                          f"pip install bitsandbytes") from None
    try:
        return bnb.optim.AdamW8bit(groups, lr=LEARNING_RATE, betas=BETAS, eps=EPS)
    except Exception as e:
        raise Unavailable(f"bitsandbytes AdamW8bit does not run on this device ({e})") from None
