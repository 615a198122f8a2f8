"""The ladder: one frozen recipe per rung, and the apply_* functions that each switch one thing on.

The ladder is cumulative: every rung is the one before it plus one change, except 8bit, which is the
flash rung with bitsandbytes' AdamW8bit in place of torch's AdamW. Each apply_* function returns a
note when its change cannot take effect on this machine, so that the run record says so.
"""
import logging
import shutil
from dataclasses import dataclass, replace

import torch

from Utils import adamw_kernel, ce_kernel, cublaslt, packed_attention
from Utils.model import CHOICES, check_choices, kernel_logits_width

OPTIMIZERS = ("adamw", "adamw_fused", "adamw8bit", "adamw_triton")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


@dataclass(frozen=True)
class Recipe:
    name: str
    tf32: bool = False
    bf16: bool = False
    compile: bool = False
    attention: str = "manual"      # "manual": scores written out; "sdpa": F.scaled_dot_product_attention;
                                   # "cudnn": SDPA held to cuDNN's fused attention (Hopper kernels);
                                   # "cudnn_packed": cuDNN's kernels on the packed QKV tensor and gradient
    optimizer: str = "adamw"       # "adamw" (torch default implementation), "adamw_fused", "adamw8bit", or
                                   # "adamw_triton": the gradient clip and AdamW as two Triton kernels
    vocab_multiple: int = 1        # pad the embedding's rows to a multiple of this (128: 50257 -> 50304)
    loss: str = "full"             # "full" or "chunked" cross-entropy (Utils.model.chunked_cross_entropy), or
                                   # "chunked_kernel": chunked, its softmax-gradient pass a hand-written kernel
    prefetch: bool = False         # copy the next batch to the GPU on a side stream during the current step
    sync_every: int = 1            # steps between host-device synchronizations (loss and timing read-back)
    compile_mode: str = "default"  # torch.compile mode: default, reduce-overhead (CUDA graphs), max-autotune...
    fp8: bool = False              # the blocks' linear layers as FP8 matmuls (torchao float8 training)
    compile_update: bool = False   # torch.compile the gradient clip and the optimizer step together
    residual: str = "fp32"         # the residual stream under autocast: "fp32", or "autocast" (bf16)
    fold_clip: bool = False        # fused AdamW divides by the clip factor as it reads each gradient
    mlp: str = "modules"           # "epilogue": c_fc's bias and GELU (and GELU's derivative) in cuBLASLt GEMM epilogues
    bias_grad: str = "sum"         # "gemm": c_attn's and c_fc's bias gradients out of their weight-gradient GEMMs

    def __post_init__(self):
        check_choices(self, {**CHOICES, "optimizer": OPTIMIZERS, "compile_mode": COMPILE_MODES})
        if self.residual == "autocast" and not self.bf16:
            raise ValueError("residual='autocast' needs bf16=True: without autocast the stream is fp32 anyway")
        if self.mlp == "epilogue" and (not self.bf16 or self.fp8):
            raise ValueError("mlp='epilogue' needs bf16=True (cuBLASLt's GELU epilogues take bf16 matrices) and no "
                             "fp8 (whose layers it would bypass)")
        if self.attention == "cudnn_packed" and not self.bf16:
            raise ValueError("attention='cudnn_packed' needs bf16=True: cuDNN's fused attention takes bf16 or fp16")
        if self.bias_grad == "gemm" and self.fp8:
            raise ValueError("bias_grad='gemm' calls the linear layers' weights directly: not with fp8, whose layers "
                             "it would bypass")
        if self.fold_clip and (self.optimizer != "adamw_fused" or self.compile_update):
            raise ValueError("fold_clip needs optimizer='adamw_fused' (the only one that takes a gradient scale) "
                             "and no compile_update (which fuses the clip its own way)")
        if self.optimizer == "adamw_triton" and self.compile_update:
            raise ValueError("optimizer='adamw_triton' clips inside its own kernels: no compile_update")
        if self.vocab_multiple < 1 or self.sync_every < 1:
            raise ValueError("vocab_multiple and sync_every must be at least 1")
        if self.compile_mode != "default" and not self.compile:
            raise ValueError(f"compile_mode={self.compile_mode!r} needs compile=True")


BASELINE = Recipe("baseline")
TF32 = replace(BASELINE, name="tf32", tf32=True)
BF16 = replace(TF32, name="bf16", bf16=True)
TORCH_COMPILE = replace(BF16, name="torch_compile", compile=True)
FLASH = replace(TORCH_COMPILE, name="flash", attention="sdpa")
FUSED = replace(FLASH, name="fused", optimizer="adamw_fused")
EIGHT_BIT = replace(FLASH, name="8bit", optimizer="adamw8bit")
# Beyond the seven: every addition tried on top of the fused rung (`make ablation` runs each alone, as
# rung fused+<name>), and the max rung: the fused rung with the additions that paid on an H200
# (BENCHMARKS.md gives each one's predicted and measured effect, and why the others were left out).
ADDITIONS = {
    "vocab_multiple": {"vocab_multiple": 128},
    "loss": {"loss": "chunked"},
    "prefetch": {"prefetch": True},
    "sync_every": {"sync_every": 10},
    "cudagraphs": {"compile_mode": "reduce-overhead"},
    "cudnn_attention": {"attention": "cudnn"},
    "fp8": {"fp8": True},
    "compiled_update": {"compile_update": True},
    "loss_kernel": {"loss": "chunked_kernel"},
    "bf16_residual": {"residual": "autocast"},
    "fold_clip": {"fold_clip": True},
    "gelu_epilogue": {"mlp": "epilogue"},
    "triton_update": {"optimizer": "adamw_triton"},
    "packed_attention": {"attention": "cudnn_packed"},
    "gemm_bias_grad": {"bias_grad": "gemm"},
}
MAX_PICKS = ("vocab_multiple", "loss_kernel", "prefetch", "sync_every", "cudagraphs", "bf16_residual",
             "gelu_epilogue", "triton_update", "packed_attention", "gemm_bias_grad")
MAX_ADDITIONS = {field: value for name in MAX_PICKS for field, value in ADDITIONS[name].items()}
MAX = replace(FUSED, name="max", **MAX_ADDITIONS)

RECIPES = {r.name: r for r in (BASELINE, TF32, BF16, TORCH_COMPILE, FLASH, FUSED, EIGHT_BIT, MAX)}
LADDER = list(RECIPES)


def rung_order(rungs):
    """Rung ids in ladder order; ids the ladder does not know (ablations such as fused+loss) follow,
    alphabetically."""
    present = set(rungs)
    return [r for r in LADDER if r in present] + sorted(present - set(LADDER))

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


def apply_attention(config, recipe, device):
    """Choose the attention implementation through the model config, never a global switch.
    Returns (config, note): cuDNN attention needs a GPU whose cuDNN has it, else plain SDPA runs; the packed
    form also needs cuDNN's frontend (nvidia-cudnn-frontend), else SDPA's cuDNN backend runs."""
    attention, note = recipe.attention, None
    if attention == "cudnn_packed":
        head_dim = config.n_embd // config.n_head
        if not packed_attention.available(device, head_dim):
            attention, note = "cudnn", "packed attention needs cuDNN 9 and its frontend on an Ampere or newer GPU"
        else:
            failure = packed_attention.prepare(device, head_dim)
            attention, note = ("cudnn", failure) if failure else (attention, None)
    if attention == "cudnn" and not cudnn_attention_available(device):
        attention, note = "sdpa", "cuDNN attention is not available here"
    if attention != recipe.attention:
        note = f"{note}: {'SDPA held to cuDNN' if attention == 'cudnn' else 'plain SDPA'} instead"
    return replace(config, attention=attention), note


def cudnn_attention_available(device):
    return packed_attention.cudnn_fused_attention(device)


def apply_vocab_padding(config, recipe):
    """50257 rows leave the output layer's GEMM without aligned tiles; 50304 = 393 x 128 tiles evenly."""
    return replace(config, vocab_multiple=recipe.vocab_multiple)


def apply_loss(config, recipe, device):
    """The chunked loss never holds the B x T x vocab logits: about 1.6 GB at batch 16 in bf16. Returns
    (config, note): without a GPU with NVRTC or Triton, the kernel's loss runs as the plain chunked one."""
    if recipe.loss == "chunked_kernel":
        n_cols = kernel_logits_width(apply_vocab_padding(config, recipe).padded_vocab_size)
        note = ce_kernel.prepare(device, n_cols) if device.type == "cuda" else None
        if not ce_kernel.available(device):
            note = "the loss kernel needs a GPU with NVRTC or Triton: plain chunked loss"
            return replace(config, loss="chunked"), note
        return replace(config, loss=recipe.loss), note
    return replace(config, loss=recipe.loss), None


def apply_mlp(config, recipe, device):
    """c_fc's GEMM writes the GELU and its input; c_proj's input-gradient GEMM applies GELU's derivative:
    two passes over a tokens x 3072 tensor per layer gone. Returns (config, note): without cuBLASLt on a
    GPU, the plain MLP."""
    if recipe.mlp == "epilogue":
        if not cublaslt.available(device):
            return replace(config, mlp="modules"), "GEMM epilogues need cuBLASLt on a GPU: the plain MLP instead"
        cublaslt.prepare(device)
    return replace(config, mlp=recipe.mlp), None


def apply_bias_grad(config, recipe):
    """c_attn's and c_fc's bias gradients as one more column of their weight-gradient GEMMs: no pass of its
    own over their output gradients."""
    return replace(config, bias_grad=recipe.bias_grad)


def apply_residual(config, recipe):
    """A bf16 residual stream: each block's add, LayerNorm read and residual gradient in half the bytes."""
    return replace(config, residual=recipe.residual)


def apply_fp8(model, recipe, device):
    """Hopper and Ada tensor cores multiply FP8 (e4m3) at twice the bf16 rate. torchao swaps each block's
    nn.Linear for one that casts its input, weight and output gradient to FP8 with a per-tensor scale
    made from the tensor's absolute maximum each step, and keeps the weights and the optimizer in fp32.
    The output layer stays bf16: its weight is the tied embedding, and the chunked loss owns its matmul.
    Raises Unavailable where FP8 cannot run. torchao is not in requirements.txt: FP8 did not pay for
    GPT-2 124M on an H200 (BENCHMARKS.md), so only `make ablation` asks for it."""
    if not recipe.fp8:
        return
    if device.type != "cuda" or tuple(torch.cuda.get_device_capability(device)) < (8, 9):
        raise Unavailable("FP8 matmuls need an Ada or Hopper GPU (compute capability 8.9 or newer)")
    try:
        from torchao.float8 import convert_to_float8_training
    except Exception as e:
        raise Unavailable(f"FP8 needs torchao, which is not usable here ({type(e).__name__}: {str(e)[:200]}); "
                          f"pip install torchao") from None
    convert_to_float8_training(model, module_filter_fn=lambda module, fqn: fqn.startswith("transformer.h."))


def apply_prefetch(loader, recipe, device):
    """(batch source, note): a side-stream prefetcher on a GPU, the loader itself otherwise."""
    if not recipe.prefetch:
        return loader, None
    if device.type != "cuda":
        return loader, "prefetch has no effect on a CPU"
    from Utils.data import Prefetcher
    return Prefetcher(loader, device), None


def require_compiler(device):
    """Raise Unavailable unless torch.compile can generate code here: Triton on a GPU, C++ on a CPU."""
    if device.type == "cuda":
        from torch.utils._triton import has_triton
        if not has_triton():
            raise Unavailable("torch.compile needs Triton for this GPU, and Triton is not installed")
    elif not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        raise Unavailable("torch.compile on a CPU needs a C++ compiler (g++ or clang++) on the PATH")


def apply_compile(model, recipe, device):
    """torch.compile fuses elementwise work into few Triton (GPU) or C++ (CPU) kernels; its CUDA-graph
    modes replay a whole step's launches as one. Returns (model, note)."""
    if not recipe.compile:
        return model, None
    require_compiler(device)
    mode, note = recipe.compile_mode, None
    if device.type != "cuda" and mode in CUDAGRAPH_MODES:
        mode, note = "default", f"CUDA graphs need a GPU: compiled in the default mode, not {recipe.compile_mode}"
    return torch.compile(model, mode=None if mode == "default" else mode), note


def _param_groups(model):
    # Weight decay on matrices only (nanoGPT): biases and LayerNorm gains are not decayed.
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def apply_optimizer(model, recipe, device):
    """AdamW as torch ships it, torch's single-kernel fused AdamW, bitsandbytes' 8-bit AdamW, or AdamW with
    the gradient clip inside, as two Triton kernels (Utils.adamw_kernel). Without Triton on a GPU, the
    last is torch's fused AdamW, and make_update says so."""
    groups = _param_groups(model)
    if recipe.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=LEARNING_RATE, betas=BETAS, eps=EPS)
    if recipe.optimizer == "adamw_triton" and adamw_kernel.available(device):
        return adamw_kernel.ClippedAdamW(groups, lr=LEARNING_RATE, betas=BETAS, eps=EPS, max_norm=GRAD_CLIP)
    if recipe.optimizer in ("adamw_fused", "adamw_triton"):
        return torch.optim.AdamW(groups, lr=LEARNING_RATE, betas=BETAS, eps=EPS, fused=True)
    # On CPUs with AVX512-BF16, bitsandbytes warns at import that a 4-bit matmul kernel is missing:
    # 4-bit matmuls are not used here, so that warning would only be noise in every 8bit run.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    try:
        import bitsandbytes as bnb
    except Exception as e:  # ImportError, or a broken native library raising something else
        raise Unavailable(f"bitsandbytes is not usable here ({type(e).__name__}: {e}); "
                          f"pip install bitsandbytes") from None
    try:
        return bnb.optim.AdamW8bit(groups, lr=LEARNING_RATE, betas=BETAS, eps=EPS)
    except Exception as e:
        raise Unavailable(f"bitsandbytes AdamW8bit does not run on this device ({e})") from None


def make_update(model, optimizer, recipe, device):
    """(update, note): one call that clips the gradients' global norm to GRAD_CLIP and steps the optimizer.
    With compile_update, torch.compile traces both, so that the clip's scaling is fused into the
    optimizer's own kernels instead of being a pass over every gradient of its own; with fold_clip, fused
    AdamW applies the clip factor itself; ClippedAdamW clips inside its own step."""
    params = [p for p in model.parameters() if p.requires_grad]

    def update():
        torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        optimizer.step()

    def folded_update():
        # clip_grad_norm_ multiplies every gradient by min(1, GRAD_CLIP / (norm + 1e-6)) in a pass of its
        # own. Fused AdamW divides each gradient by `grad_scale` as it reads it (the hook GradScaler uses to
        # unscale), so dividing by the inverse of that factor there saves that pass's read; not its write,
        # since fused AdamW writes the unscaled gradient back to .grad.
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        optimizer.grad_scale = torch.clamp((norm + 1e-6) / GRAD_CLIP, min=1.0)
        optimizer.step()

    if isinstance(optimizer, adamw_kernel.ClippedAdamW):
        return optimizer.step, None
    if recipe.optimizer == "adamw_triton":
        return update, ("the Triton clip-and-AdamW kernels need a GPU and Triton: clip_grad_norm_ and torch's "
                        "fused AdamW instead")
    if recipe.fold_clip:
        return folded_update, None
    if not recipe.compile_update:
        return update, None
    if recipe.optimizer == "adamw8bit":
        return update, "bitsandbytes' AdamW8bit is not traceable by torch.compile: its step runs eagerly"
    require_compiler(device)
    return torch.compile(update), None
