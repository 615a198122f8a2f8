"""One apply function per addition of the registry, and `build`, which applies a run's additions in order.

As torchtitan's parallelize.py composes apply_tp, apply_compile and apply_fsdp, `build` makes the
settings, then the model, swaps modules into it, compiles it, makes the optimizer and the update, then
the batch source; within each stage the additions apply in the registry's order (Utils.ladder.registry).
An apply function returns None, or a note when its change cannot take effect on this machine and what
runs instead (the run records it), or raises Unavailable when the run would mean nothing without it.
"""
import logging
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.nn as nn

from Utils.kernels import (cublaslt, fp8, fp8_linear, fp8_loss, gelu_epilogue, loss_kernel, packed_attention,
                           recompute_logits)
from Utils.kernels.master_adamw import MasterAdamW
from Utils.ladder import modules
from Utils.ladder.parallel import gradient_sync, wrap
from Utils.ladder.registry import ADDITIONS, STAGES, check_parallel, resolve
from Utils.model import GPT
from Utils.model_config import GPTConfig

# Identical on every rung (nanoGPT's GPT-2 124M settings), so that only the additions differ.
LEARNING_RATE = 6e-4
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
VOCAB_MULTIPLE = 128   # 50,257 rows leave the output GEMM without aligned tiles; 50,304 = 393 x 128
SYNC_EVERY = 10        # steps between read-backs of losses and step times


# addition name -> its apply function, registered by @applies where the function is defined; build() calls
# these, and the tests check there is exactly one for each addition of the registry.
APPLY: dict[str, Callable[["Build"], str | None]] = {}


def applies(name: str) -> Callable:
    """Register the decorated function as addition `name`'s apply function (one per addition)."""
    def register(function: Callable) -> Callable:
        if name not in ADDITIONS:
            raise ValueError(f"@applies({name!r}): the registry (Utils.ladder.registry) has no addition {name}")
        if name in APPLY:
            raise ValueError(f"@applies({name!r}): {APPLY[name].__name__} is already its apply function")
        APPLY[name] = function
        return function
    return register


class Unavailable(Exception):
    """The run's change cannot run on this machine; the message says why (the run is 'skipped')."""


@dataclass
class Build:
    """What a run trains with; each stage of `build` fills in its part."""
    device: torch.device
    config: GPTConfig
    additions: tuple = ()
    autocast_dtype: torch.dtype | None = None     # bf16: the autocast dtype; None: autocast off
    model: GPT | None = None
    parallel: str = ""                            # ddp or fsdp through torchrun (Utils.ladder.parallel), or ''
    module: nn.Module | None = None               # the model as the step runs it, before compilation (DDP's
                                                  # wrapper, or the model itself)
    step_model: nn.Module | None = None           # the model the step calls (compiled, or `module`)
    compile_options: dict = field(default_factory=dict)   # the step model's Inductor options, each compile
                                                          # addition's merged (compile_with)
    optimizer: torch.optim.Optimizer | None = None
    masters: bool = True                          # bf16 parameters get fp32 master weights (stochastic_rounding: no)
    update: Callable[[], None] | None = None       # clips the gradients and steps the optimizer
    source: object = None                          # where batches come from: next_batch() -> token window
    sync_every: int = 1
    noted: dict = field(default_factory=dict)     # addition -> its apply function's note of what runs instead

    @property
    def cudagraphs(self) -> bool:
        """The step model replays CUDA graphs (the loop then marks where each step begins)."""
        return self.compile_options.get("triton.cudagraphs", False)

    @property
    def notes(self) -> list[str]:
        return list(self.noted.values())

    @property
    def fell_back(self) -> list[str]:
        """The additions that could not take effect here as they are (their apply function noted what runs)."""
        return list(self.noted)

    def gradient_sync(self, sync: bool):
        """The context of a micro-batch's forward and backward: gradients reduced over the ranks or not."""
        return gradient_sync(self.module, self.parallel, sync)

    def autocast(self) -> torch.autocast:
        if self.autocast_dtype is None:
            return torch.autocast(self.device.type, enabled=False)
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)


def build(additions: Iterable[str], device: torch.device, config: GPTConfig, seed: int, loader: object,
          parallel: str = "", make_model: Callable[[GPTConfig], nn.Module] = GPT) -> Build:
    """Apply `additions` (names; checked by registry.resolve) to a plain GPT-2 of `config` trained with AdamW as
    torch ships it, fed by `loader`, spread over the processes as `parallel` says (ddp, fsdp; '' for one).
    make_model makes the model (a peer's GPT-2 instead of the suite's: Utils.peers), which takes the step's
    forward(idx, targets) -> (logits or None, loss) and num_params(). Raises Unavailable where a change cannot
    run here at all."""
    additions = resolve(additions)
    check_parallel(additions, parallel)
    b = Build(device=device, config=config, additions=additions, parallel=parallel)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

    def stage(name):
        for a in additions:
            if ADDITIONS[a].stage == name:
                note = APPLY[a](b)
                if note:
                    b.noted[a] = note

    stage("settings")
    torch.manual_seed(seed)
    with device:   # initialized where it trains: no 124M-parameter init on the host, no copy
        b.model = make_model(b.config)
    stage("model")
    b.module = wrap(b.model, parallel, device) if parallel else b.model   # before compile, as torchtitan does
    b.step_model = b.module
    stage("compile")
    b.optimizer = adamw(b.model, masters=b.masters)
    b.update = _clip_and_step(b)
    stage("optimizer")
    b.source = loader
    stage("loop")
    return b


assert STAGES == ("settings", "model", "compile", "optimizer", "loop"), "build() applies exactly these stages"


# --- settings -----------------------------------------------------------------------------------------

@applies("tf32")
def apply_tf32(b: Build) -> str | None:
    """TF32 lets fp32 matmuls and convolutions use the tensor cores with a 10-bit mantissa."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if b.device.type != "cuda":
        return "TF32 has no effect on a CPU"
    if torch.cuda.get_device_capability(b.device)[0] < 8:
        return "TF32 needs an Ampere or newer GPU: no effect here"
    return None


@applies("bf16")
def apply_bf16(b: Build) -> None:
    """bf16 autocast: matmuls and attention in bf16, reductions such as softmax and the loss in fp32."""
    if b.device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise Unavailable(f"{torch.cuda.get_device_name(b.device)} has no bf16 support")
    b.autocast_dtype = torch.bfloat16


@applies("flash")
def apply_flash(b: Build) -> None:
    """The model's SDPA branch: FlashAttention's algorithm never writes the T x T scores to memory."""
    b.config = replace(b.config, flash=True)


@applies("vocab_multiple")
def apply_vocab_multiple(b: Build) -> None:
    """Pad the embedding's rows so that the output layer's GEMM tiles evenly; the padding is masked out."""
    b.config = replace(b.config, vocab_multiple=VOCAB_MULTIPLE)


# --- model: modules swapped in (Utils.ladder.modules) ------------------------------------------------------

@applies("bf16_residual")
def apply_bf16_residual(b: Build) -> None:
    """A bf16 residual stream: each block's add, LayerNorm read and residual gradient in half the bytes."""
    modules.cast_residual_to_bf16(b.model)


@applies("gemm_bias_grad")
def apply_gemm_bias_grad(b: Build) -> None:
    """c_attn's and c_fc's bias gradients as more columns of their weight-gradient GEMMs: no pass of their own
    over the output gradients."""
    for block in modules.blocks(b.model):
        modules.add_feature(modules.planned(block.attn, "c_attn"), bias_grad=True)
        modules.add_feature(modules.planned(block.mlp, "c_fc"), bias_grad=True)


@applies("gelu_epilogue")
def apply_gelu_epilogue(b: Build) -> str | None:
    """c_fc's GEMM writes the GELU and its input; c_proj's input-gradient GEMM applies GELU's derivative: two
    passes over a tokens x 3072 tensor per layer gone."""
    why = gelu_epilogue.unavailable(b.device)
    if why:
        return f"{why}: the plain MLP instead"
    cublaslt.prepare(b.device)
    for block in modules.blocks(b.model):
        block.mlp = modules.EpilogueMLP(block.mlp)
    return None


@applies("cudnn_attention")
def apply_cudnn_attention(b: Build) -> str | None:
    """SDPA held to cuDNN's fused attention (PyTorch 2.11 already prefers it on Hopper)."""
    why = packed_attention.cudnn_unavailable(b.device)
    if why:
        return f"{why}: plain SDPA instead"
    _hold_sdpa_to_cudnn(b)
    return None


def _hold_sdpa_to_cudnn(b: Build) -> None:
    for block in modules.blocks(b.model):
        block.attn = modules.CudnnAttention(block.attn)


@applies("packed_attention")
def apply_packed_attention(b: Build) -> str | None:
    """cuDNN's attention kernels read q, k and v in the packed QKV output and write one packed gradient. Without
    the frontend, SDPA held to cuDNN; without cuDNN's fused attention, plain SDPA."""
    head_dim = b.config.n_embd // b.config.n_head
    why = packed_attention.unavailable(b.device, head_dim) or packed_attention.prepare(b.device, head_dim)
    if not why:
        for block in modules.blocks(b.model):
            block.attn = modules.PackedAttention(block.attn)
        return None
    for block in modules.blocks(b.model):
        block.attn.flash = True   # the model's SDPA branch, whether or not the run has `flash`
    if packed_attention.cudnn_unavailable(b.device):
        return f"{why}: plain SDPA instead"
    _hold_sdpa_to_cudnn(b)
    return f"{why}: SDPA held to cuDNN instead"


@applies("loss")
def apply_loss(b: Build) -> None:
    """The chunked loss never holds the B x T x vocab logits: 1.6 GB at batch 16 in bf16."""
    b.model.loss = modules.ChunkedLoss(b.config.vocab_size, kernel=False)


@applies("loss_kernel")
def apply_loss_kernel(b: Build) -> str | None:
    """The chunked loss, each chunk's softmax and gradient one kernel that reads the logits once. Without NVRTC
    or Triton on a GPU, the plain chunked loss."""
    return _kernel_chunked_loss(b)


def _kernel_chunked_loss(b: Build) -> str | None:
    """apply_loss_kernel's swap, which fp8_head makes too."""
    why = loss_kernel.unavailable(b.device)
    note = None if why else loss_kernel.prepare(b.device, loss_kernel.kernel_logits_width(b.config.padded_vocab_size))
    b.model.loss = modules.ChunkedLoss(b.config.vocab_size, kernel=not why)
    return f"{why}: the plain chunked loss instead" if why else note


@applies("fp8_head")
def apply_fp8_head(b: Build) -> str | None:
    """The chunked loss with the output layer's GEMMs in FP8: a third of the model's matmul FLOPs at twice
    the bf16 rate. Under it, and alone where FP8 cannot run, the loss kernel's chunked loss in bf16
    (apply_loss_kernel): the max rung on an older GPU keeps the loss it had before FP8, and a step whose
    tokens are not a multiple of 16 (which FP8 GEMMs need) runs in bf16."""
    note = _kernel_chunked_loss(b)
    why = fp8_loss.unavailable(b.device) or fp8.width_problem(b.config.n_embd)
    if why:
        return f"{why}: the output layer in bf16 instead" + (f"; {note}" if note else ", through the loss kernel")
    b.model.loss.fp8 = True
    return None


# The widest model recompute_logits goes into: its second GEMM's cost grows with the width and the bytes it saves do
# not; the prediction in BENCHMARKS.md ("The output layer's logits recomputed, not stored") has it 0.8 to 2.8%
# faster at GPT-2 124M's 768, about even at gpt2-medium's 1,024 and slower beyond.
RECOMPUTE_LOGITS_WIDEST = 768


@applies("recompute_logits")
def apply_recompute_logits(b: Build) -> str | None:
    """fp8_head's output layer with each chunk's logits computed twice by Triton GEMMs and never stored: one
    GEMM more a chunk for 5 bytes a logit fewer, in models no wider than RECOMPUTE_LOGITS_WIDEST. Where fp8_head
    fell back to bf16, nothing changes."""
    why = recompute_logits.unavailable(b.device)
    if why or not b.model.loss.fp8:
        return f"{why or 'the output layer is not in FP8'}: its logits stored and read back"
    if b.config.n_embd > RECOMPUTE_LOGITS_WIDEST:
        return (f"recomputing the logits pays only up to a width of {RECOMPUTE_LOGITS_WIDEST} (this model's is "
                f"{b.config.n_embd}): its logits stored and read back")
    b.model.loss.recompute = True
    return None


@applies("fp8_qkv_fc")
def apply_fp8_qkv_fc(b: Build) -> str | None:
    """c_attn's and c_fc's forward GEMMs in FP8: the two GEMMs that read a LayerNorm's output, which casts to
    e4m3 in the LayerNorm's own kernel with a scale bounded by its weights (no amax pass). Backward in bf16.
    Into the modules gemm_bias_grad and gelu_epilogue swapped in where they did, else into the plain layers."""
    why = fp8_linear.unavailable(b.device) or fp8.width_problem(b.config.n_embd)
    if why:
        return f"{why}: c_attn and c_fc in bf16 instead"
    for block in modules.blocks(b.model):
        modules.add_feature(modules.planned(block.attn, "c_attn"), block.ln_1, fp8_forward=True)
        modules.add_feature(modules.planned(block.mlp, "c_fc"), block.ln_2, fp8_forward=True)
    return None


@applies("fp8_dgrad")
def apply_fp8_dgrad(b: Build) -> str | None:
    """c_attn's and c_fc's input-gradient GEMMs in FP8 (fp8_linear.input_grad: each row of the output gradient in
    e4m3 with its own power-of-two scale, the weight with one), in the layers wide enough for it to pay (the
    registry's layers_wider_than). Into the layers the other additions planned, else into the plain ones."""
    why = fp8.unavailable(b.device) or fp8.width_problem(b.config.n_embd)
    if why:
        return f"{why}: c_attn's and c_fc's input gradients in bf16 instead"
    addition = ADDITIONS["fp8_dgrad"]
    wide = [(parent, name) for block in modules.blocks(b.model) for parent, name in ((block.attn, "c_attn"),
            (block.mlp, "c_fc")) if addition.takes_layer(*getattr(parent, name).weight.shape)]
    if not wide:
        return (f"FP8 input gradients pay only at a width over {addition.layers_wider_than[1]} (this model's is "
                f"{b.config.n_embd}): c_attn's and c_fc's input gradients in bf16")
    for parent, name in wide:
        modules.add_feature(modules.planned(parent, name), fp8_dgrad=True)
    return None


@applies("fp8")
def apply_fp8(b: Build) -> None:
    """Hopper and Ada tensor cores multiply FP8 (e4m3) at twice the bf16 rate. torchao swaps each block's
    nn.Linear for one that casts its input, weight and output gradient to FP8 with a per-tensor scale, and
    keeps the weights and the optimizer in fp32. The output layer stays bf16: its weight is the tied
    embedding. torchao is not in requirements.txt: FP8 did not pay for GPT-2 124M on an H200 (BENCHMARKS.md)."""
    if b.device.type != "cuda" or tuple(torch.cuda.get_device_capability(b.device)) < (8, 9):
        raise Unavailable("FP8 matmuls need an Ada or Hopper GPU (compute capability 8.9 or newer)")
    try:
        from torchao.float8 import convert_to_float8_training
    except Exception as e:
        raise Unavailable(f"FP8 needs torchao, which is not usable here ({type(e).__name__}: {str(e)[:200]}); "
                          f"pip install torchao") from None
    convert_to_float8_training(b.model, module_filter_fn=lambda module, fqn: fqn.startswith("transformer.h."))


@applies("fold_norm")
def apply_fold_norm(b: Build) -> None:
    """Each block's LayerNorms only normalize, and c_attn and c_fc apply their weights and biases (W diag(γ),
    b + Wβ), whose gradients come from those layers' weight and bias gradients: the LayerNorms' backward sums
    over the tokens, and the memsets before them, go (Utils.kernels.norm_fold)."""
    for block in modules.blocks(b.model):
        modules.fold_norm(block, "ln_1", modules.planned(block.attn, "c_attn"))
        modules.fold_norm(block, "ln_2", modules.planned(block.mlp, "c_fc"))


@applies("master_weights")
def apply_master_weights(b: Build) -> None:
    """The parameters in bf16, before any wrapper sees them: the GEMMs read them as they are, their gradients stay
    bf16, and AdamW keeps the fp32 master weights (`adamw` picks MasterAdamW for them)."""
    modules.store_in_bf16(b.model)


@applies("stochastic_rounding")
def apply_stochastic_rounding(b: Build) -> None:
    """The parameters in bf16 as under master_weights, and AdamW without fp32 masters: bf16 m and v, and each
    parameter rounded stochastically (`adamw` with b.masters off)."""
    modules.store_in_bf16(b.model)
    b.masters = False


# --- compile ---------------------------------------------------------------------------------------------

def require_compiler(device: torch.device) -> None:
    """Raise Unavailable unless torch.compile can generate code here: Triton on a GPU, C++ on a CPU."""
    if device.type == "cuda":
        from torch.utils._triton import has_triton
        if not has_triton():
            raise Unavailable("torch.compile needs Triton for this GPU, and Triton is not installed")
    elif not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        raise Unavailable("torch.compile on a CPU needs a C++ compiler (g++ or clang++) on the PATH")


def compile_with(b: Build, mode: str = "default", **options: object) -> None:
    """Wrap the model in torch.compile with the options of `mode` and `options` added to those of the compile
    additions applied before, replacing the wrapper they made. torch.compile takes a mode or options, not both,
    and a mode is only a set of options (torch._inductor.list_mode_options), so each addition adds its own.
    Compilation is lazy: the wrapper replaced has compiled nothing yet."""
    from torch._inductor import list_mode_options   # imports Dynamo: 1.3 s, only for runs that compile
    b.compile_options = {**b.compile_options, **list_mode_options(mode), **options}
    b.step_model = torch.compile(b.module, options=b.compile_options or None)


@applies("torch_compile")
def apply_torch_compile(b: Build) -> None:
    """torch.compile fuses elementwise work into few Triton (GPU) or C++ (CPU) kernels."""
    require_compiler(b.device)
    compile_with(b)


@applies("cudagraphs")
def apply_cudagraphs(b: Build) -> str | None:
    """torch.compile's reduce-overhead mode replays a whole step's launches as one CUDA graph."""
    if b.device.type != "cuda":
        return "CUDA graphs need a GPU: compiled in the default mode"
    compile_with(b, "reduce-overhead")
    return None


@applies("autotune")
def apply_autotune(b: Build) -> str | None:
    """max-autotune times Inductor's Triton GEMM templates against cuBLAS for each GEMM shape and keeps the
    faster: GPT-2 124M's 768-wide GEMMs are small for cuBLAS's large-tile kernels. Compiling takes minutes
    longer: every shape is timed once."""
    if b.device.type != "cuda":
        return "max-autotune tunes GPU GEMMs: compiled in the default mode"
    # This mode's options turn nothing off: after cudagraphs the merged set is the max-autotune mode's.
    compile_with(b, "max-autotune-no-cudagraphs")
    return None


def inductor_has(option: str) -> bool:
    """Whether this PyTorch's Inductor has the configuration option `option`."""
    from torch._inductor import config
    return hasattr(config, option)


@applies("combo_kernels")
def apply_combo_kernels(b: Build) -> str | None:
    """Inductor launches up to eight data-independent generated kernels as one (combo kernels): max's step
    at batch 64 had 318 Inductor kernels under 10 µs (the weights' casts and amaxes), and
    inside a CUDA graph each launch still leaves the GPU a gap of a microsecond or two (BENCHMARKS.md)."""
    if b.device.type != "cuda":
        return "combo kernels group Triton kernels on a GPU: compiled without them"
    # Each sub-kernel tuned to its own block shape: with one shape for all, a sum over the tokens paired with
    # a per-token reduction made max without bf16_residual 38.1 ms a step instead of 27.1 (batch 16,
    # BENCHMARKS.md, "Is it the combo kernels?"). A PyTorch without the option shares one shape, and says so.
    own_blocks = "combo_kernel_per_subkernel_blocks"
    if not inductor_has(own_blocks):
        compile_with(b, combo_kernels=True)
        return f"this PyTorch's Inductor has no {own_blocks}: combo kernels whose sub-kernels share one block shape"
    compile_with(b, combo_kernels=True, **{own_blocks: True})
    return None


# --- optimizer -------------------------------------------------------------------------------------------

def param_groups(model: nn.Module) -> list:
    """AdamW's two parameter groups, the same for every optimizer."""
    # Weight decay on matrices only (nanoGPT): biases and LayerNorm gains are not decayed.
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _clip_and_step(b: Build) -> Callable[[], None]:
    params = [p for p in b.model.parameters() if p.requires_grad]

    def update():
        torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        b.optimizer.step()
    return update


def adamw(model: nn.Module, fused: bool = False, masters: bool = True) -> torch.optim.Optimizer:
    """AdamW over the model's parameters: torch's (foreach, or fused), or MasterAdamW, one Triton kernel, where the
    parameters are stored in bf16 (master_weights; without fp32 masters under stochastic_rounding)."""
    groups = param_groups(model)
    if any(p.dtype == torch.bfloat16 for group in groups for p in group["params"]):
        return MasterAdamW(groups, lr=LEARNING_RATE, betas=BETAS, eps=EPS, masters=masters)
    return torch.optim.AdamW(groups, lr=LEARNING_RATE, betas=BETAS, eps=EPS, **({"fused": True} if fused else {}))


@applies("fused")
def apply_fused(b: Build) -> None:
    """torch's fused AdamW: one pass over parameters, gradients and states instead of a dozen multi-tensor ones."""
    b.optimizer = adamw(b.model, fused=True, masters=b.masters)


@applies("8bit")
def apply_8bit(b: Build) -> None:
    """bitsandbytes' AdamW8bit: optimizer states in 8 bits, a quarter of AdamW's state memory."""
    # On CPUs with AVX512-BF16, bitsandbytes warns at import that a 4-bit matmul kernel is missing:
    # 4-bit matmuls are not used here, so that warning would only be noise in every 8bit run.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    try:
        import bitsandbytes as bnb
    except Exception as e:  # ImportError, or a broken native library raising something else
        raise Unavailable(f"bitsandbytes is not usable here ({type(e).__name__}: {e}); pip install bitsandbytes") from None
    try:
        b.optimizer = bnb.optim.AdamW8bit(param_groups(b.model), lr=LEARNING_RATE, betas=BETAS, eps=EPS)
    except Exception as e:
        raise Unavailable(f"bitsandbytes AdamW8bit does not run on this device ({e})") from None


@applies("fold_clip")
def apply_fold_clip(b: Build) -> None:
    """Fused AdamW divides each gradient by `grad_scale` as it reads it (the hook GradScaler uses to unscale):
    dividing by the inverse of clip_grad_norm_'s factor there saves the clip pass's read, not its write."""
    params = [p for p in b.model.parameters() if p.requires_grad]

    def update():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        b.optimizer.grad_scale = torch.clamp((norm + 1e-6) / GRAD_CLIP, min=1.0)
        b.optimizer.step()
    b.update = update


@applies("compiled_update")
def apply_compiled_update(b: Build) -> str | None:
    """torch.compile traces the clip and the optimizer step together, fusing the clip's scaling into the
    optimizer's own kernels."""
    if any(ADDITIONS[a].optimizer == "8bit" for a in b.additions):
        return "bitsandbytes' AdamW8bit is not traceable by torch.compile: its step runs eagerly"
    require_compiler(b.device)
    b.update = torch.compile(b.update)
    return None


# --- loop ------------------------------------------------------------------------------------------------

@applies("prefetch")
def apply_prefetch(b: Build) -> str | None:
    """The next batch is copied from pinned memory to the GPU on a side stream while the current step runs."""
    if b.device.type != "cuda":
        return "prefetch has no effect on a CPU"
    b.source = Prefetcher(b.source, b.device)
    return None


@applies("sync_every")
def apply_sync_every(b: Build) -> str | None:
    """The host reads losses and step times back every SYNC_EVERY steps, so the CPU queues work ahead."""
    b.sync_every = SYNC_EVERY
    if b.device.type != "cuda":
        return "deferred synchronization has no effect on a CPU, where every operation is synchronous"
    return None


class Prefetcher:
    """Copies the next batch from pinned memory to the GPU on a side stream while the current step runs,
    so that no step waits for its input. Same batches, same order as the loader it wraps."""

    def __init__(self, loader: object, device: torch.device):
        self.loader, self.device = loader, device
        self.stream = torch.cuda.Stream(device)
        self.ready = self._issue()

    def _issue(self):
        with torch.cuda.stream(self.stream):
            return self.loader.next_batch().to(self.device, non_blocking=True)

    def next_batch(self) -> torch.Tensor:
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self.stream)
        batch = self.ready
        batch.record_stream(current)   # its memory must outlive the copy stream's view of it
        self.ready = self._issue()
        return batch
