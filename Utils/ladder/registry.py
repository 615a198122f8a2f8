"""The registry: every addition the suite knows, and the rungs as named combinations of them.

An addition is one change to the training loop, applied by the function registered for it in
`Utils.ladder.apply.APPLY`. The rung scripts, the Makefile (`make additions`, `make custom WITH=...`), ablation,
the report, the README's table and the tests all read this file; it imports nothing, so `make help` and
`make plots` do not load torch.

Additions apply in STAGES order, and within a stage in the order they are listed here:
  settings   switches read when the model and the step are built (precision, attention, padding)
  model      modules swapped into the built model, before anything is compiled
  compile    torch.compile of the model
  optimizer  the optimizer and the update step (gradient clip + optimizer step)
  loop       the step loop itself (where batches come from, how often the host reads results back)
"""
from collections.abc import Iterable
from dataclasses import dataclass

PILLARS = ("compute", "memory", "overhead")
# Why a hand-written kernel's addition cannot run under PARALLEL=fsdp (Addition.fsdp; PARALLEL_EXCLUDES says more)
_WHOLE_TENSORS = "its kernel takes whole tensors, not FSDP's DTensor shards"
STAGES = ("settings", "model", "compile", "optimizer", "loop")


@dataclass(frozen=True)
class Addition:
    name: str
    stage: str
    pillar: str                    # the part of a step's time it targets: compute, memory or overhead
    changes: str                   # what it changes, in one line
    needs: str = ""                # what the machine must have; without it the run says what ran instead
    requires: tuple = ()           # additions it builds on
    excludes: tuple = ()           # additions it cannot run with
    in_max: bool = False           # the max rung takes it beyond the fused rung's: it measured faster on an H200
                                   # and kept the loss (BENCHMARKS.md gives each one's gain, and why others did not)
    fsdp: str = ""                 # why it cannot run under PARALLEL=fsdp; "" where it can
    # What the roofline (Utils.report.roofline) counts differently under it; its numbers stay there:
    matmuls: str = ""              # the format it runs the matmuls in: "tf32" or "bf16" (bf16 also halves activations)
    scores_on_chip: bool = False   # attention keeps each tile of the T x T scores on the chip: no passes over them
    compiled: bool = False         # torch.compile of the model: Inductor fuses the elementwise work into few kernels
    optimizer: str = ""            # the optimizer step it runs: "fused" (one pass of AdamW) or "8bit" (AdamW8bit)
    clip_folded: bool = False      # the optimizer divides by the clip factor as it reads each gradient
    fp8_gemms: str = ""            # which GEMMs it runs in FP8: "head" (output layer), "qkv_fc" (c_attn's and
                                   # c_fc's forward) or "blocks" (every block's linear layers)
    # What the breakdown (Utils.report.breakdown) reads differently under it:
    readback_deferred: bool = False  # the host reads results back every few steps, so the launches of the steps
                                     # between run ahead of the GPU

    @property
    def fp8(self) -> bool:
        """It runs some GEMMs in FP8, whose peak is twice bf16's (MFU divides by bf16's)."""
        return bool(self.fp8_gemms)

    def __post_init__(self):
        if self.stage not in STAGES or self.pillar not in PILLARS:
            raise ValueError(f"{self.name}: stage must be one of {STAGES} and pillar one of {PILLARS}")
        if self.matmuls not in ("", "tf32", "bf16") or self.optimizer not in ("", "fused", "8bit") \
                or self.fp8_gemms not in ("", "head", "qkv_fc", "blocks"):
            raise ValueError(f"{self.name}: matmuls is '', tf32 or bf16; optimizer '', fused or 8bit; fp8_gemms '', "
                             f"head, qkv_fc or blocks")


_ADDITIONS = [
    # settings
    Addition("tf32", "settings", "compute", "fp32 matmuls on the tensor cores in TF32 (10-bit mantissa)",
             needs="an Ampere or newer GPU", matmuls="tf32"),
    Addition("bf16", "settings", "compute", "bf16 autocast: matmuls and attention in bf16, softmax and loss in fp32",
             needs="a GPU with bf16, or a CPU", matmuls="bf16"),
    Addition("flash", "settings", "memory", "F.scaled_dot_product_attention: the T x T scores never reach memory; "
             "PyTorch picks the kernel (cuDNN's on Hopper, FlashAttention-2 on Ampere and Ada)", scores_on_chip=True),
    Addition("vocab_multiple", "settings", "compute",
             "embedding padded to 50,304 rows, so the output layer's GEMM tiles evenly", in_max=True),
    # model
    Addition("bf16_residual", "model", "memory", "the residual stream in bf16 instead of autocast's fp32",
             requires=("bf16",), in_max=True),
    Addition("gemm_bias_grad", "model", "memory",
             "c_attn's and c_fc's bias gradients out of their weight-gradient GEMMs (input beside columns of ones)",
             excludes=("fp8",), in_max=True, fsdp=_WHOLE_TENSORS),
    Addition("gelu_epilogue", "model", "memory",
             "c_fc's bias and GELU, and GELU's derivative, in cuBLASLt GEMM epilogues", needs="cuBLASLt on a GPU",
             requires=("bf16",), excludes=("fp8",), in_max=True, fsdp=_WHOLE_TENSORS),
    # cuDNN's fused attention takes bf16 or fp16 only: without autocast there is no kernel to hold SDPA to.
    Addition("cudnn_attention", "model", "compute", "SDPA held to cuDNN's fused attention", needs="cuDNN on a GPU",
             requires=("flash", "bf16"), excludes=("packed_attention",), scores_on_chip=True),
    Addition("packed_attention", "model", "memory",
             "cuDNN attention reading q, k, v in the packed QKV tensor and writing one packed gradient",
             needs="nvidia-cudnn-frontend and cuDNN 9 on a GPU", requires=("bf16",), in_max=True, fsdp=_WHOLE_TENSORS,
             scores_on_chip=True),
    Addition("loss", "model", "memory", "cross-entropy 4,096 tokens at a time: the logits never exist whole",
             excludes=("loss_kernel",)),
    Addition("loss_kernel", "model", "memory",
             "the chunked loss with each chunk's softmax and gradient as one hand-written kernel",
             needs="NVRTC or Triton on a GPU", fsdp=_WHOLE_TENSORS),
    Addition("fp8_head", "model", "compute",
             "the output layer's three GEMMs in FP8 inside the chunked loss (e4m3 inputs, e5m2 gradient)",
             needs="an Ada or Hopper GPU", requires=("bf16",), excludes=("loss", "loss_kernel"),
             fp8_gemms="head", in_max=True, fsdp=_WHOLE_TENSORS),
    Addition("fp8_qkv_fc", "model", "compute",
             "c_attn's and c_fc's forward GEMMs in FP8, their LayerNorm's output cast with a scale bounded in advance",
             needs="an Ada or Hopper GPU", requires=("bf16",), excludes=("fp8",), fp8_gemms="qkv_fc",
             in_max=True, fsdp=_WHOLE_TENSORS),
    Addition("fp8", "model", "compute", "the blocks' linear layers as FP8 matmuls with per-tensor scales",
             needs="torchao and an Ada or Hopper GPU", requires=("bf16",), fp8_gemms="blocks",
             fsdp="its scaled matmuls have not been tried on FSDP's shards"),
    Addition("fold_norm", "model", "memory",
             "each block LayerNorm's weight and bias applied by the layer reading it: no sums over the tokens",
             excludes=("fp8",),
             in_max=True, fsdp="its folded weights have not been tried on FSDP's DTensor shards on a GPU"),
    # compile
    Addition("torch_compile", "compile", "overhead",
             "torch.compile: elementwise work fused into few kernels, far fewer launches",
             needs="Triton on a GPU, a C++ compiler on a CPU", compiled=True),
    Addition("cudagraphs", "compile", "overhead", "torch.compile with CUDA graphs: a step's launches replayed as one",
             needs="a GPU", requires=("torch_compile",),
             in_max=True, fsdp="a CUDA graph cannot hold FSDP's all-gathers and reduce-scatters"),
    Addition("autotune", "compile", "compute",
             "torch.compile's max-autotune: Inductor times its Triton GEMM templates against cuBLAS, shape by shape",
             needs="Triton on a GPU", requires=("torch_compile",)),
    Addition("combo_kernels", "compile", "overhead",
             "Inductor's combo kernels: up to eight data-independent generated kernels launched as one, "
             "each with its own block sizes",
             needs="Triton on a GPU", requires=("torch_compile",), in_max=True),
    # optimizer
    Addition("fused", "optimizer", "overhead", "AdamW(fused=True): one kernel over all parameters per step",
             excludes=("8bit",), optimizer="fused"),
    Addition("8bit", "optimizer", "memory", "bitsandbytes' AdamW8bit: optimizer states in 8 bits",
             needs="bitsandbytes", optimizer="8bit",
             fsdp="bitsandbytes' optimizer takes whole tensors, not FSDP's DTensor shards"),
    Addition("fold_clip", "optimizer", "memory",
             "fused AdamW divides by the clip factor as it reads each gradient", requires=("fused",),
             excludes=("compiled_update",), optimizer="fused", clip_folded=True,
             in_max=True, fsdp="its grad_scale from the gradients' norm has not been tried on FSDP's DTensor shards"),
    Addition("compiled_update", "optimizer", "overhead", "torch.compile of the gradient clip and optimizer step",
             requires=("torch_compile",)),
    # loop
    Addition("prefetch", "loop", "overhead", "the next batch copied to the GPU on a side stream", needs="a GPU",
             in_max=True),
    Addition("sync_every", "loop", "overhead", "the host reads losses and step times back every 10 steps",
             needs="a GPU", in_max=True, readback_deferred=True),
]
ADDITIONS = {a.name: a for a in _ADDITIONS}


@dataclass(frozen=True)
class Rung:
    name: str
    script: str
    additions: tuple


_FLASH = ("tf32", "bf16", "torch_compile", "flash")
_FUSED = _FLASH + ("fused",)
# The fused rung plus every addition that measured faster on an H200 and kept the loss (Addition.in_max), in
# the registry's order.
MAX_ADDITIONS = tuple(name for name, a in ADDITIONS.items() if a.in_max)
RUNGS = {r.name: r for r in [
    Rung("baseline", "no_optimization.py", ()),
    Rung("tf32", "tensorFloat32.py", ("tf32",)),
    Rung("bf16", "brainFloat16.py", ("tf32", "bf16")),
    Rung("torch_compile", "torch_compile.py", ("tf32", "bf16", "torch_compile")),
    Rung("flash", "flash_attention.py", _FLASH),
    Rung("fused", "fused_optimizer.py", _FUSED),
    Rung("8bit", "8-bit_optimizer.py", _FLASH + ("8bit",)),
    Rung("max", "max_throughput.py", _FUSED + MAX_ADDITIONS),
]}
LADDER = list(RUNGS)
# `make ablation` tries each of these alone on top of the fused rung: every addition beyond the seven rungs.
ABLATION = tuple(name for name in ADDITIONS if not any(name in RUNGS[r].additions for r in LADDER if r != "max"))
# `make ablation FROM=max` runs the max rung without each of these in turn: what each one adds among the others.
LEAVE_ONE_OUT = tuple(name for name in ADDITIONS if name in MAX_ADDITIONS)
# make ablation's base rungs (FROM=) and what each tries
ABLATION_TRIES = {"fused": ABLATION, "max": LEAVE_ONE_OUT}
# base rung -> what joins it to the additions in an ablation run's name (run_name): fused+loss, max-fp8_head
ABLATION_SEPARATOR = {"fused": "+", "max": "-"}


class RegistryError(ValueError):
    """An unknown addition or an impossible combination; the message is one line and names the fix."""


def resolve(names: Iterable[str]) -> tuple:
    """The additions `names` (an iterable of names, in any order, repeats ignored) in the order they apply.
    Raises RegistryError for an unknown name or an impossible combination, naming the fix."""
    chosen = set(names)
    unknown = sorted(chosen - set(ADDITIONS))
    if unknown:
        raise RegistryError(f"unknown addition{'s' * (len(unknown) > 1)} {', '.join(unknown)}: use names from "
                            f"`make additions` ({', '.join(ADDITIONS)})")
    for name in sorted(chosen, key=list(ADDITIONS).index):
        addition = ADDITIONS[name]
        missing = [r for r in addition.requires if r not in chosen]
        if missing:
            raise RegistryError(f"{name} needs {' and '.join(missing)}: add {' '.join(missing)} to WITH")
        clash = [x for x in addition.excludes if x in chosen]
        if clash:
            raise RegistryError(f"{name} cannot run with {' or '.join(clash)}: keep one of {name}, {', '.join(clash)}")
    return tuple(name for name in ADDITIONS if name in chosen)


# What cannot run when fully_shard spreads the model over the processes (PARALLEL=fsdp): its parameters and
# gradients are then DTensor shards, which the hand-written kernels (raw pointers, cuBLASLt, cuDNN's
# frontend), bitsandbytes' optimizer and a CUDA graph around the step's collectives do not take.
# DistributedDataParallel keeps whole tensors on every rank, and every addition runs under it.
PARALLEL_EXCLUDES = {
    "ddp": {},
    "fsdp": {name: a.fsdp for name, a in ADDITIONS.items() if a.fsdp},   # in the registry's order
}


def check_parallel(additions: tuple, parallel: str) -> None:
    """Raise RegistryError, naming the fix, where `additions` cannot run under PARALLEL=`parallel`."""
    if not parallel:
        return
    refused = {a: why for a, why in PARALLEL_EXCLUDES[parallel].items() if a in additions}
    if refused:
        name, why = next(iter(refused.items()))
        others = [a for a in refused if a != name]
        raise RegistryError(f"{name}{' (and ' + ', '.join(others) + ')' if others else ''} cannot run with "
                            f"PARALLEL={parallel}: {why}; use PARALLEL=ddp, or a run without it")


def run_name(additions: Iterable[str]) -> str:
    """The name a run of these additions is recorded under: the rung's name where a rung has exactly these, else
    the largest rung they contain, then the rest in the order they apply: fused+loss, baseline+bf16+flash; or,
    where that takes more parts, a rung less the additions it lacks, in the order they apply: max-prefetch,
    max-bf16_residual-combo_kernels (the rung that lacks the fewest). Distinct sets get distinct names, since a
    name gives back its set (additions_of)."""
    chosen = resolve(additions)
    for rung in RUNGS.values():
        if set(rung.additions) == set(chosen):
            return rung.name
    base = max((r for r in RUNGS.values() if set(r.additions) <= set(chosen)), key=lambda r: len(r.additions))
    name = "+".join([base.name] + [a for a in chosen if a not in base.additions])
    fewest = None   # (rung, what it lacks): the rung less the fewest additions, where that takes fewer parts
    for rung in RUNGS.values():
        lacks = [a for a in ADDITIONS if a in rung.additions and a not in chosen]
        if set(chosen) < set(rung.additions) and len(lacks) < min(name.count("+"), len(fewest[1]) if fewest else 99):
            fewest = (rung.name, lacks)
    return "-".join([fewest[0]] + fewest[1]) if fewest else name


def additions_of(name: str) -> tuple | None:
    """The additions of a run recorded under `name`: run_name's inverse. None for a name run_name cannot have
    built (a part that is neither the leading rung nor an addition). A run with SDPA_BACKEND pinned, flash@cudnn,
    has the additions of its name before the @."""
    name = name.split("@")[0]
    if name in RUNGS:
        return RUNGS[name].additions
    if "-" in name:
        rung, *lacks = name.split("-")
        if rung not in RUNGS or not all(a in RUNGS[rung].additions for a in lacks) or len(set(lacks)) < len(lacks):
            return None
        return tuple(a for a in RUNGS[rung].additions if a not in lacks)
    first, *rest = name.split("+")
    if first not in RUNGS or not all(a in ADDITIONS for a in rest):
        return None
    return RUNGS[first].additions + tuple(rest)


def check_ablation_base(base: str) -> None:
    """Raise RegistryError, naming the fix, where `make ablation` has no base `base`."""
    if base not in ABLATION_TRIES:
        raise RegistryError(f"FROM='{base}': use FROM=fused (each addition alone on the fused rung, the default) or "
                            f"FROM=max (max without each addition)")


def ablation_additions(base: str, item: str) -> tuple:
    """The additions of one run of `make ablation FROM=<base>`: the fused rung with `item`'s additions added, or
    the max rung without them, where `item` names one addition or several joined by '+' (bf16_residual+combo_kernels:
    what two additions do together). Raises RegistryError, naming the fix, for a base other than fused or max, an
    addition that base does not try, one named twice, or so many that the run would be named after the other
    base."""
    check_ablation_base(base)
    tries = ABLATION_TRIES[base]
    parts = item.split("+")
    if "" in parts:
        raise RegistryError(f"'{item}' has an empty name between '+' signs: remove the extra '+'")
    unknown = [p for p in parts if p not in tries]
    if unknown:
        raise RegistryError(f"make ablation FROM={base} does not try '{unknown[0]}': use some of {', '.join(tries)}, "
                            f"or several joined by '+' to try them together")
    if len(set(parts)) < len(parts):
        raise RegistryError(f"'{item}' names an addition twice: name each once")
    if base == "fused":
        additions = resolve(RUNGS["fused"].additions + tuple(parts))
    else:
        additions = resolve(a for a in RUNGS["max"].additions if a not in parts)
    # So many together that the run is named after the other base (max-..., or fused+...) would be compared
    # against that base, or counted as it.
    name = run_name(additions)
    if not name.startswith(base + ABLATION_SEPARATOR[base]):
        raise RegistryError(f"'{item}' names so many additions that the run would be recorded as {name}: "
                            f"try fewer together, or run them with make custom WITH=...")
    return additions


def rung_order(names: Iterable[str]) -> list:
    """Run names in ladder order; names the ladder does not know (fused+loss, custom runs) follow,
    alphabetically."""
    present = set(names)
    return [r for r in LADDER if r in present] + sorted(present - set(LADDER))
