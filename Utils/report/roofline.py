"""The roofline of one training step: the least time its compute and its memory traffic allow, and which of
the two bounds a measured step sits against.

A step spends its time in three ways: compute (the matmuls' FLOPs at the rate of the units that run them),
memory (the bytes between HBM and the chip, at the memory bandwidth) and overhead (the GPU waiting for the
host). The first two give floors: FLOPs / peak rate, bytes / bandwidth (Williams, Waterman and Patterson,
"Roofline", CACM 2009; He, "Making Deep Learning Go Brrrr From First Principles", 2022). A step is no faster
than the larger floor; what it takes beyond is kernels below their peak rate, and overhead.

Everything here is arithmetic on the model's shape, the run's batch and the one GPU table
(Utils.results.gpus), so it runs wherever the report does, torch or not. The few figures that come from
PyTorch's own operations (the written-out attention's passes over its scores, foreach AdamW's and the
gradient clip's passes over the parameters, the operations of one eager step) are recorded below as counted
under a TorchDispatchMode, which sees every ATen operation forward and backward; tests/test_roofline.py
counts them again on the installed torch, so a torch that changes them fails a test instead of skewing a
floor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from Utils.ladder.registry import ADDITIONS, additions_of
from Utils.model_config import PRESETS
from Utils.results.gpus import GPU, gpu_spec
from Utils.results.metrics import flops_per_token

PRECISIONS = ("fp32", "tf32", "bf16")
GB = 1e9

# --- the model's shape, without torch ---------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a GPT-2 of Utils.model (the fields of its GPTConfig that set its parameters and FLOPs)."""
    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int
    block_size: int

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def parameters(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every parameter in Utils.model.GPT's order, the tied output weight once (as
        GPT.parameters() yields them): what the optimizer updates."""
        C = self.n_embd
        block = [("ln_1.weight", (C,)), ("ln_1.bias", (C,)),
                 ("attn.c_attn.weight", (3 * C, C)), ("attn.c_attn.bias", (3 * C,)),
                 ("attn.c_proj.weight", (C, C)), ("attn.c_proj.bias", (C,)),
                 ("ln_2.weight", (C,)), ("ln_2.bias", (C,)),
                 ("mlp.c_fc.weight", (4 * C, C)), ("mlp.c_fc.bias", (4 * C,)),
                 ("mlp.c_proj.weight", (C, 4 * C)), ("mlp.c_proj.bias", (C,))]
        return ([("transformer.wte.weight", (self.vocab_size, C)), ("transformer.wpe.weight", (self.block_size, C))]
                + [(f"transformer.h.{i}.{name}", shape) for i in range(self.n_layer) for name, shape in block]
                + [("transformer.ln_f.weight", (C,)), ("transformer.ln_f.bias", (C,))])

    def param_sizes(self) -> list[int]:
        """Values in each parameter tensor, in parameters() order."""
        return [math.prod(shape) for _, shape in self.parameters()]

    def n_params(self, exclude_position_embedding: bool = True) -> int:
        """Parameters counted as GPT.num_params counts them: without the position embedding for the FLOPs
        formula (it is a lookup, not a matmul), with it for everything the optimizer updates."""
        n = sum(self.param_sizes())
        return n - self.block_size * self.n_embd if exclude_position_embedding else n


def presets() -> dict[str, ModelShape]:
    """Utils.model_config.PRESETS as the roofline's shapes."""
    return {name: ModelShape(c.n_layer, c.n_head, c.n_embd, c.vocab_size, c.block_size) for name, c in PRESETS.items()}


def model_shape(name: str) -> ModelShape | None:
    """The shape of the model preset `name` (runs.csv's model column); None for a name Utils.model_config lacks."""
    return presets().get(name)


def matmul_precision(additions: Iterable[str]) -> str:
    """The format the matmuls run in: bf16 under autocast, else tf32 where allowed, else fp32 (Addition.matmuls)."""
    formats = {ADDITIONS[a].matmuls for a in additions if a in ADDITIONS}
    return "bf16" if "bf16" in formats else "tf32" if "tf32" in formats else "fp32"


# --- the machine ------------------------------------------------------------------------------------------


def peak_rate(gpu: GPU | None, precision: str) -> float | None:
    """The GPU's dense matmul rate in FLOP/s for `precision` (fp32, tf32 or bf16); None when the table has no
    figure for it or no row for the GPU: a floor that needs it is left out, never guessed."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
    return getattr(gpu, precision) if gpu is not None else None


def machine_lines(gpu_name: str) -> list[str]:
    """One line per figure the floors use (the three matmul rates, the FP8 rate where the GPU has FP8 units,
    and the bandwidth), each with its source; 'unknown' where the GPU table has none."""
    gpu = gpu_spec(gpu_name)
    lines = []
    for key in PRECISIONS + (("fp8",) if gpu is not None and gpu.fp8 else ()) + ("bandwidth",):
        value = getattr(gpu, key) if gpu is not None else None
        unit = "TB/s" if key == "bandwidth" else "TFLOP/s dense"
        lines.append(f"{gpu_name} {key:9s} " + (f"{value / 1e12:7.1f} {unit} ({gpu.source})" if value else "unknown"))
    return lines


def missing_figures(gpu_name: str) -> list[str]:
    """The figures of machine_lines that the GPU table lacks for this GPU."""
    gpu = gpu_spec(gpu_name)
    return [k for k in PRECISIONS + ("bandwidth",) if not (getattr(gpu, k) if gpu is not None else None)]


# --- the memory traffic's ingredients -----------------------------------------------------------------------

# Per layer and token, the values backward reads (in units of the width C), and why each is kept.
ACTIVATIONS = {
    "block input (LayerNorm 1's input)": 1,
    "LayerNorm 1 output (c_attn's input)": 1,
    "q, k, v": 3,
    "attention output (c_proj's input)": 1,
    "residual after attention (LayerNorm 2's input)": 1,
    "LayerNorm 2 output (c_fc's input)": 1,
    "c_fc output (GELU's input)": 4,
    "GELU output (the second c_proj's input)": 4,
}
ACTIVATION_ACCESSES = 4   # written in forward, read in backward; its gradient written once and read once

# The written-out attention's operations that touch the B x H x T x T scores, forward then backward, with the
# whole score tensors each reads and writes (views move no data and are left out). Counted with a
# TorchDispatchMode on Utils.model.CausalSelfAttention (flash=False); eager mode on a GPU runs the same
# operations, one kernel each.
EAGER_SCORE_OPS = (
    ("bmm.default", 0, 1),                      # q @ k^T writes the scores
    ("mul.Tensor", 1, 1),                       # the 1/sqrt(d) scale
    ("masked_fill.Scalar", 1, 1),               # the causal mask
    ("_softmax.default", 1, 1),
    ("bmm.default", 1, 0),                      # att @ v
    ("bmm.default", 1, 0),                      # backward: v's gradient reads the probabilities
    ("bmm.default", 0, 1),                      # the probabilities' gradient
    ("_softmax_backward_data.default", 2, 1),   # reads the probabilities and their gradient
    ("masked_fill.Scalar", 1, 1),
    ("mul.Tensor", 1, 1),
    ("bmm.default", 1, 0),                      # q's gradient
    ("bmm.default", 1, 0),                      # k's gradient
)
EAGER_SCORE_PASSES = sum(r + w for _, r, w in EAGER_SCORE_OPS)
# With torch.compile the matmuls stay, and Inductor fuses scale, mask and softmax into one kernel and their
# backward into another. An assumption, not a count (compiling needs a toolchain and far more time): forward,
# QK^T writes the scores, one fused kernel reads them and writes the probabilities, AV reads those (4);
# backward, a matmul writes the probabilities' gradient, V's gradient reads the probabilities, one fused kernel
# reads both and writes the scores' gradient, and Q's and K's gradients read that (7).
COMPILED_SCORE_PASSES = 4 + 7
# SDPA (FlashAttention's algorithm) and cuDNN's attention keep each tile of scores on the chip.
ATTENTION_WITHOUT_SCORES = frozenset(a for a in ADDITIONS if ADDITIONS[a].scores_on_chip)
# torch.compile of the model (Inductor fuses scale, mask and softmax; an eager step's operations do not apply).
COMPILED = frozenset(a for a in ADDITIONS if ADDITIONS[a].compiled)

# fp32 parameters (every rung but max, which stores them in bf16: MASTER_WEIGHT_BYTES below): forward reads
# each weight, backward reads it again and writes its gradient, 4 bytes each.
WEIGHT_BYTES = 4 + 4 + 4
# clip_grad_norm_ on fp32 gradients, as counted: a foreach norm reads them (4 bytes a parameter), a handful
# of scalar operations combine the norms, and a foreach multiply reads and rewrites them (8).
CLIP_OPS = ("_foreach_norm.Scalar", "stack.default", "linalg_vector_norm.default", "add.Tensor",
            "reciprocal.default", "mul.Tensor", "clamp.default", "_foreach_mul_.Tensor")
CLIP_BYTES = 4 + 8
# A folded clip (Addition.clip_folded): fused AdamW divides each gradient by the clip's factor as it reads it, and
# writes it back divided (GradScaler's contract: gradients are unscaled after the step), so of the clip the norm's
# read and a write are left.
FOLDED_CLIP_BYTES = 4 + 4
# torch.optim.AdamW's default on a GPU is foreach: per parameter group, these multi-tensor operations in this
# order, each a pass over the group, with the bytes it moves per fp32 parameter (reads + writes, 4 bytes a
# value). The weight decay's multiply runs only in the decayed group (matrices; nanoGPT decays no vector).
FOREACH_ADAMW_OPS = (
    ("_foreach_add_.Tensor", 0),           # the step counters: a scalar per parameter tensor
    ("_foreach_mul_.Scalar", 8),           # p *= 1 - lr * weight_decay
    ("_foreach_lerp_.Scalar", 12),         # m = lerp(m, g, 1 - beta1)
    ("_foreach_mul_.Scalar", 8),           # v *= beta2
    ("_foreach_addcmul_.Scalar", 16),      # v += (1 - beta2) g * g
    ("_foreach_sqrt.default", 8),          # s = sqrt(v)
    ("_foreach_div_.ScalarList", 8),       # s /= sqrt(1 - beta2^t)
    ("_foreach_add_.Scalar", 8),           # s += eps
    ("_foreach_addcdiv_.ScalarList", 16),  # p -= lr / (1 - beta1^t) * m / s
)
DECAY_OP = 1
# Fused AdamW: one pass reads p, g, m, v and writes p, m, v, 4 bytes each.
FUSED_ADAMW_BYTES = 7 * 4
# bitsandbytes' AdamW8bit keeps m and v in one byte each (with a scale per block of values) for tensors of at
# least min_8bit_size = 4096 values: p read and written, g read, m and v read and written in a byte each.
BNB_MIN_8BIT_SIZE = 4096
EIGHT_BIT_BYTES = 4 + 4 + 4 + 1 + 1 + 1 + 1
# Parameters stored in bf16 with fp32 master weights (Addition.optimizer "master", Utils.kernels.master_adamw):
# forward and backward read each weight and backward writes its gradient in 2 bytes; the clip's norm reads the
# gradient (and an unfolded clip's multiply reads and rewrites it); one pass reads the gradient, the master
# weight, m and v, and writes the last three and the bf16 parameter. With the folded clip, 36 bytes a parameter
# against fp32 parameters' 48 here; Utils.kernels.master_adamw counts 48 against 30, autocast's casts in place of
# the GEMMs' reads and writes, which this floor counts as fp32 (WEIGHT_BYTES).
MASTER_WEIGHT_BYTES = 2 + 2 + 2
MASTER_CLIP_BYTES, MASTER_FOLDED_CLIP_BYTES = 2 + 4, 2
MASTER_ADAMW_BYTES = 2 + 3 * 4 + 3 * 4 + 2
# Without masters (Addition.optimizer "stochastic"): the bf16 gradient, parameter, m and v read, the last three
# written.
STOCHASTIC_ADAMW_BYTES = 2 + 3 * 2 + 3 * 2
MASTER_OPTIMIZERS = frozenset(a for a in ADDITIONS if ADDITIONS[a].optimizer in ("master", "stochastic"))
STOCHASTIC_OPTIMIZERS = frozenset(a for a in ADDITIONS if ADDITIONS[a].optimizer == "stochastic")
FUSED_OPTIMIZERS = frozenset(a for a in ADDITIONS if ADDITIONS[a].optimizer == "fused")
EIGHT_BIT_OPTIMIZERS = frozenset(a for a in ADDITIONS if ADDITIONS[a].optimizer == "8bit")
FOLDED_CLIPS = frozenset(a for a in ADDITIONS if ADDITIONS[a].clip_folded)

# Operations on tensors in one eager forward and backward of Utils.model.GPT (views apart), as counted: a fixed
# part (embeddings, final LayerNorm, output layer, loss) and a part per layer, by attention.
EAGER_OPS_FIXED = 18
EAGER_OPS_PER_LAYER = {"written out": 43, "flash": 29}
# A rule of thumb for eager PyTorch's CPU cost per operation (Python, dispatcher, launch), not a measurement.
CPU_US_PER_OP = 10


def foreach_adamw_ops(decayed: bool = True) -> list[str]:
    """The multi-tensor operations of one foreach AdamW step over one parameter group."""
    return [op for i, (op, _) in enumerate(FOREACH_ADAMW_OPS) if decayed or i != DECAY_OP]


def eager_ops_per_step(n_layer: int, flash: bool) -> int:
    """Operations on tensors in one eager forward and backward of a GPT-2 of n_layer layers."""
    return EAGER_OPS_FIXED + n_layer * EAGER_OPS_PER_LAYER["flash" if flash else "written out"]


def optimizer_ops_per_step() -> int:
    """Operations of the eager gradient clip and foreach AdamW over the two parameter groups."""
    return len(CLIP_OPS) + len(foreach_adamw_ops(True)) + len(foreach_adamw_ops(False))


# --- one configuration's floors ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Roofline:
    """The floors of one configuration: a model shape trained at batch x seq_len tokens a step on one GPU."""
    shape: ModelShape
    batch_size: int
    seq_len: int
    gpu_name: str

    @classmethod
    def from_run(cls, run: Mapping) -> Roofline | None:
        """The configuration of a runs.csv row (model, batch_size, seq_len, gpu_name); None when the model is not
        one of Utils.model_config's presets or the batch or sequence length is missing."""
        shape = model_shape(str(run["model"]))
        try:
            batch, seq = int(run["batch_size"]), int(run["seq_len"])
        except (TypeError, ValueError):
            return None
        return None if shape is None else cls(shape, batch, seq, str(run["gpu_name"]))

    @property
    def gpu(self) -> GPU | None:
        return gpu_spec(self.gpu_name)

    @property
    def tokens(self) -> int:
        """Tokens per step."""
        return self.batch_size * self.seq_len

    @property
    def flops_per_token(self) -> int:
        s = self.shape
        return flops_per_token(s.n_params(), s.n_layer, s.n_head, s.head_dim, self.seq_len)

    @property
    def flops_per_step(self) -> int:
        return self.flops_per_token * self.tokens

    @property
    def scores(self) -> int:
        """Values in one layer's attention scores: B x H x T x T."""
        return self.batch_size * self.shape.n_head * self.seq_len ** 2

    @property
    def activations_per_token_layer(self) -> int:
        """Values backward reads per layer and token (ACTIVATIONS, in units of the width)."""
        return sum(ACTIVATIONS.values()) * self.shape.n_embd

    def fp8_flops_per_token(self, additions: Iterable[str]) -> int:
        """The FLOPs per token that these additions run in FP8 (a share of flops_per_token), by their
        Addition.fp8_gemms: the output layer's three GEMMs (head), c_attn's and c_fc's forward GEMMs (qkv_fc) and
        input-gradient GEMMs (qkv_fc_dgrad), every block's linear layers forward and backward (blocks); of
        c_attn's and c_fc's, only the layers the addition takes (Addition.layers_wider_than)."""
        s = self.shape
        C = s.n_embd

        def flops(a: str) -> int:
            # c_attn's and c_fc's weights, [3C, C] and [4C, C]: 2 FLOPs a value and token forward, as many again
            # for the input gradient's GEMM
            qkv_fc = s.n_layer * 2 * sum(n * C for n in (3 * C, 4 * C) if ADDITIONS[a].takes_layer(n, C))
            return {"head": 6 * s.vocab_size * C,                   # 2 forward + 4 backward, the tied weight's rows
                    "qkv_fc": qkv_fc, "qkv_fc_dgrad": qkv_fc,
                    "blocks": s.n_layer * 6 * (3 + 1 + 4 + 4) * C * C,  # c_attn, attn.c_proj, c_fc, mlp.c_proj
                    }[ADDITIONS[a].fp8_gemms]
        return sum(flops(a) for a in set(additions) if a in ADDITIONS and ADDITIONS[a].fp8_gemms)

    def uses_fp8(self, additions: Iterable[str]) -> bool:
        """Whether these additions run GEMMs in FP8 on this GPU: it has an FP8 rate, which a GPU without FP8
        units (where the additions fall back to bf16) has not."""
        return bool(self.gpu is not None and self.gpu.fp8 and self.fp8_flops_per_token(additions))

    def compute_floor_ms(self, precision: str, additions: Iterable[str] = ()) -> float | None:
        """FLOPs per step / the GPU's dense rate for `precision`, in ms, with the share that `additions` run in
        FP8 at the FP8 rate (uses_fp8); None when a rate is unknown."""
        rate = peak_rate(self.gpu, precision)
        if not rate:
            return None
        fp8 = self.fp8_flops_per_token(additions) * self.tokens if self.uses_fp8(additions) else 0
        return ((self.flops_per_step - fp8) / rate + (fp8 / self.gpu.fp8 if fp8 else 0)) * 1e3

    def params_in_8bit_tensors(self) -> int:
        """Parameters in tensors large enough for bitsandbytes' 8-bit states."""
        return sum(n for n in self.shape.param_sizes() if n >= BNB_MIN_8BIT_SIZE)

    def foreach_adamw_bytes_per_param(self) -> float:
        """foreach AdamW's bytes per parameter, over the decayed (matrices) and undecayed groups."""
        decay = FOREACH_ADAMW_OPS[DECAY_OP][1]
        per_pass = sum(b for _, b in FOREACH_ADAMW_OPS)
        undecayed = sum(n for (_, shape), n in zip(self.shape.parameters(), self.shape.param_sizes()) if len(shape) < 2)
        return per_pass - decay * undecayed / self.shape.n_params(exclude_position_embedding=False)

    def eight_bit_bytes_per_param(self) -> float:
        """AdamW8bit's bytes per parameter: 8-bit states in large tensors, 32-bit ones in the rest."""
        n_all, n_8bit = self.shape.n_params(exclude_position_embedding=False), self.params_in_8bit_tensors()
        return (n_8bit * EIGHT_BIT_BYTES + (n_all - n_8bit) * FUSED_ADAMW_BYTES) / n_all

    def optimizer_bytes_per_param(self, additions: Iterable[str]) -> float:
        """The optimizer step's bytes per parameter under these additions (the clip apart)."""
        chosen = set(additions)
        if chosen & STOCHASTIC_OPTIMIZERS:
            return STOCHASTIC_ADAMW_BYTES
        if chosen & MASTER_OPTIMIZERS:
            return MASTER_ADAMW_BYTES
        if chosen & EIGHT_BIT_OPTIMIZERS:
            return self.eight_bit_bytes_per_param()
        return FUSED_ADAMW_BYTES if chosen & FUSED_OPTIMIZERS else self.foreach_adamw_bytes_per_param()

    def score_passes(self, additions: Iterable[str]) -> int:
        """Passes over the B x H x T x T scores per layer and step under these additions."""
        chosen = set(additions)
        if chosen & ATTENTION_WITHOUT_SCORES:
            return 0
        return COMPILED_SCORE_PASSES if chosen & COMPILED else EAGER_SCORE_PASSES

    def traffic(self, additions: Iterable[str]) -> dict[str, float]:
        """Bytes a step under these additions must move between HBM and the chip, by part. A floor, under the
        notebook's assumptions: every access goes to HBM (no cache reuse, no recomputation), activations are 2
        bytes under bf16 autocast (it keeps LayerNorm, softmax and the loss in fp32, which only adds bytes)."""
        chosen = set(additions)
        act = 2 if matmul_precision(chosen) == "bf16" else 4
        n_all = self.shape.n_params(exclude_position_embedding=False)
        folded = bool(chosen & FOLDED_CLIPS)
        if chosen & MASTER_OPTIMIZERS:
            weights = MASTER_WEIGHT_BYTES + (MASTER_FOLDED_CLIP_BYTES if folded else MASTER_CLIP_BYTES)
        else:
            weights = WEIGHT_BYTES + (FOLDED_CLIP_BYTES if folded else CLIP_BYTES)
        L = self.shape.n_layer
        return {
            "weights+grads+clip": n_all * weights,
            "optimizer": n_all * self.optimizer_bytes_per_param(chosen),
            "activations": self.tokens * L * self.activations_per_token_layer * ACTIVATION_ACCESSES * act,
            "logits": self.tokens * self.shape.vocab_size * ACTIVATION_ACCESSES * act,
            "scores": self.scores * L * self.score_passes(chosen) * act,
        }

    def memory_floor_ms(self, additions: Iterable[str]) -> float | None:
        """traffic / the GPU's memory bandwidth, in ms; None when the bandwidth is unknown."""
        bandwidth = self.gpu.bandwidth if self.gpu is not None else None
        return sum(self.traffic(additions).values()) / bandwidth * 1e3 if bandwidth else None

    def floors(self, measured_ms: Mapping[str, float],
               recorded: Mapping[str, Iterable[str]] | None = None) -> pd.DataFrame:
        """A row per run name of `measured_ms` (name -> median step ms) whose additions are known: those the run
        recorded (`recorded`, name -> additions), else the registry's for that name. The row: the traffic by
        part in GB, its total, the memory floor, the matmuls' precision (bf16+fp8 where some run in FP8), the
        compute floor and the measured median, all ms. An unknown floor is NaN."""
        rows = {}
        for name, ms in measured_ms.items():
            additions = (recorded or {}).get(name) or additions_of(name)
            if additions is None:
                continue
            gb = {f"{part} GB": v / GB for part, v in self.traffic(additions).items()}
            precision = matmul_precision(additions)
            rows[name] = {**gb, "total GB": sum(gb.values()),
                          "memory floor ms": _nan(self.memory_floor_ms(additions)),
                          "matmuls": precision + ("+fp8" if self.uses_fp8(additions) else ""),
                          "compute floor ms": _nan(self.compute_floor_ms(precision, additions)), "measured ms": ms}
        return pd.DataFrame.from_dict(rows, orient="index", columns=FLOOR_COLUMNS)


FLOOR_COLUMNS = ["weights+grads+clip GB", "optimizer GB", "activations GB", "logits GB", "scores GB", "total GB",
                 "memory floor ms", "matmuls", "compute floor ms", "measured ms"]


def _nan(value: float | None) -> float:
    return np.nan if value is None else float(value)


# --- what the floors say ----------------------------------------------------------------------------------


def bound(row: Mapping) -> str | None:
    """'compute' or 'memory': the larger of a floors() row's two floors; None unless both are known."""
    cf, mf = row["compute floor ms"], row["memory floor ms"]
    if not (np.isfinite(cf) and np.isfinite(mf)):
        return None
    return "compute" if cf >= mf else "memory"


def verdict(name: str, row: Mapping, gpu_name: str, status: str = "") -> str:
    """One sentence on a floors() row: its floors, the one it sits against and how far above it it runs."""
    cf, mf, m = (float(row[k]) for k in ("compute floor ms", "memory floor ms", "measured ms"))
    if not np.isfinite(m):
        return f"{name}: no measured step time ({status or 'no run'})."
    known = {k: v for k, v in (("compute", cf), ("memory", mf)) if np.isfinite(v)}
    if not known:
        return f"{name}: {m:.1f} ms measured; no floor known for {gpu_name}."
    against = max(known, key=known.get)

    def ms(v: float) -> str:
        return f"{v:.1f} ms" if np.isfinite(v) else "unknown"
    text = (f"{name}: {m:.1f} ms measured; compute floor {ms(cf)} ({row['matmuls']}), memory floor {ms(mf)}. ")
    if m < known[against]:
        return text + f"It runs below the {against} floor: the estimate overcounts this run."
    text += f"It sits against the {against} floor, at {m / known[against]:.1f}× it"
    if len(known) == 2:
        other = "memory" if against == "compute" else "compute"
        text += f" (and {m / known[other]:.1f}× the {other} floor)"
    return text + (f"; {m - known[against]:.1f} ms are kernels below their peak rate and overhead."
                   if m > 1.5 * known[against] else ": close to what this GPU can do for this run.")


def eager_launches(roof: Roofline, measured_ms: Mapping[str, float]) -> pd.DataFrame:
    """For each run of `measured_ms` that is not compiled: the operations of one eager step (model and update),
    its median step time and the GPU time each operation carries on average."""
    rows = {}
    for name, ms in measured_ms.items():
        additions = additions_of(name)
        if additions is None or set(additions) & COMPILED or not np.isfinite(ms):
            continue
        flash = bool(set(additions) & ATTENTION_WITHOUT_SCORES)
        ops = eager_ops_per_step(roof.shape.n_layer, flash) + optimizer_ops_per_step()
        rows[name] = {"operations": ops, "ms": ms, "µs of GPU work per operation": 1e3 * ms / ops}
    return pd.DataFrame.from_dict(rows, orient="index", columns=["operations", "ms", "µs of GPU work per operation"])


def overhead_verdict(launches: pd.DataFrame) -> str:
    """Whether the CPU's cost of issuing eager operations could bound the runs of eager_launches()."""
    if launches.empty:
        return "No eager run was measured: nothing to weigh against the cost of a launch."
    per_op = launches["µs of GPU work per operation"]
    issue_ms = launches["operations"].max() * CPU_US_PER_OP / 1e3
    if per_op.min() <= CPU_US_PER_OP:
        return (f"Some eager operations carry only {per_op.min():.0f} µs of GPU work, no more than the CPU's cost of "
                f"issuing one (about {CPU_US_PER_OP} µs): the GPU waits on the host, and overhead bounds those runs.")
    return (f"Each eager operation carries {per_op.min():.0f} to {per_op.max():.0f} µs of GPU work, "
            f"{per_op.min() / CPU_US_PER_OP:.0f}x or more the CPU's cost of issuing it: the CPU keeps ahead, and "
            f"overhead does not bound the eager runs at this size. It would if the same operations took less than "
            f"about {issue_ms:.0f} ms of GPU time in all, some {launches['ms'].min() / issue_ms:.0f} times less work "
            f"per operation than here: a much smaller model or batch. The compiled rungs launch fewer, larger kernels "
            f"for the model, but the optimizer still steps eagerly.")


def against_breakdown(floors: pd.DataFrame, split: pd.DataFrame) -> pd.DataFrame:
    """The measured split (Utils.report.breakdown's load_breakdown frame: rung, class, ms_per_step) as ms per
    class and rung, with each floor over the time of its class: near 1, that class of kernels runs near the rate
    the floor assumes."""
    table = split.pivot(index="rung", columns="class", values="ms_per_step")
    order = [r for r in floors.index if r in table.index] + [r for r in table.index if r not in floors.index]
    table = table.reindex(order)
    table.columns.name = None
    for cls, floor in (("compute", "compute floor ms"), ("memory", "memory floor ms")):
        if cls in table.columns:
            table[f"{floor} / {cls} ms"] = floors[floor].reindex(table.index) / table[cls]
    return table


def plot_floors(floors: pd.DataFrame, colors: Mapping[str, str], title: str) -> Figure | None:
    """Each measured run's median step as a bar, its compute and memory floors as marks, on a log scale; None
    when no run has a measured step."""
    names = [r for r in floors.index if np.isfinite(floors.at[r, "measured ms"])]
    if not names:
        return None
    fig = Figure(figsize=(9, 1.4 + 0.5 * len(names)), dpi=100, layout="constrained")
    ax = fig.subplots()
    y = np.arange(len(names))
    ax.barh(y, floors.loc[names, "measured ms"], color=[colors.get(r, "#777777") for r in names], alpha=0.45,
            height=0.6, label="measured median")
    ax.scatter(floors.loc[names, "compute floor ms"], y, marker="|", s=500, lw=3, color="black", label="compute floor",
               zorder=3)
    ax.scatter(floors.loc[names, "memory floor ms"], y, marker="D", s=45, color="#1a1a8c", label="memory floor",
               zorder=3)
    lowest = np.nanmin(floors.loc[names, ["compute floor ms", "memory floor ms", "measured ms"]].to_numpy(dtype=float))
    ax.set_xlim(lowest / 1.5, floors.loc[names, "measured ms"].max() * 1.3)
    ax.set_yticks(y, names)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("ms per step (log scale)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3, which="both")
    ax.legend(loc="lower right", fontsize=8)
    return fig
