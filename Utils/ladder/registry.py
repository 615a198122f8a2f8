"""The registry: every addition the suite knows, and the rungs as named combinations of them.

An addition is one change to the training loop, applied by the function registered for it in
`Utils.ladder.apply.APPLY`. The rung scripts, the Makefile (`make additions`, `make custom WITH=...`), ablation,
the report, the notebook, the README's table and the tests all read this file; it imports nothing, so `make help`
and `make plots` do not load torch.

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
STAGES = ("settings", "model", "compile", "optimizer", "loop")
# Why a hand-written kernel's addition cannot run under PARALLEL=fsdp (Addition.fsdp; PARALLEL_EXCLUDES says more)
_WHOLE_TENSORS = "its kernel takes whole tensors, not FSDP's DTensor shards"
# Reasons (Addition.why) that several additions share
_CHUNKED_LOSS = ("the chunked loss removes the logits' memory footprint (1.6 GB at batch 16), and its kernel stages "
                 "each row of logits in shared memory, so it reads them once where the compiled version reads them "
                 "three times")
_HOST_WAIT = "prefetch, deferred read-back and CUDA graphs remove the time the GPU waits on the host"


@dataclass(frozen=True)
class Addition:
    name: str
    stage: str
    pillar: str                    # the part of a step's time it targets: compute, memory or overhead
    changes: str                   # what it changes, in one line
    needs: str = ""                # what the machine must have; without it the run says what ran instead
    requires: tuple = ()           # additions it builds on
    excludes: tuple = ()           # additions it cannot run with
    in_max: bool = False           # the max rung takes it beyond the fused rung's: it measured faster on an H100 or
                                   # H200 and kept the loss (BENCHMARKS.md gives each one's gain, and why others not)
    fsdp: str = ""                 # why it cannot run under PARALLEL=fsdp; "" where it can
    # What the roofline (Utils.report.roofline) counts differently under it; its numbers stay there:
    matmuls: str = ""              # the format it runs the matmuls in: "tf32" or "bf16" (bf16 also halves activations)
    scores_on_chip: bool = False   # attention keeps each tile of the T x T scores on the chip: no passes over them
    compiled: bool = False         # torch.compile of the model: Inductor fuses the elementwise work into few kernels
    optimizer: str = ""            # the optimizer step it runs: "fused" (one pass of AdamW), "8bit" (AdamW8bit),
                                   # "stochastic" (bf16 parameters and states rounded stochastically, no masters) or
                                   # "master" (one pass over bf16 parameters and their fp32 master weights)
    clip_folded: bool = False      # the optimizer divides by the clip factor as it reads each gradient
    fp8_gemms: str = ""            # which GEMMs it runs in FP8: "head" (output layer), "qkv_fc" (c_attn's and
                                   # c_fc's forward), "qkv_fc_dgrad" (their input gradients) or "blocks" (every
                                   # block's linear layers)
    layers_wider_than: tuple = ()  # (N, K): it goes only into linear layers whose weight [N, K] is wider than both,
                                   # where what it saves outgrows what it costs; () where it goes into every one
    # What the breakdown (Utils.report.breakdown) reads differently under it:
    readback_deferred: bool = False  # the host reads results back every few steps, so the launches of the steps
                                     # between run ahead of the GPU
    # Its text in the notebook (notebooks/build_notebook.py, through Utils.report.notebook_prose), in markdown:
    title: str = ""                # its section's heading, where a rung of the ladder adds it alone
    notebook: tuple = ()           # that section's paragraphs: what changes, why it is faster, what it costs
    phrase: str = ""               # what it changes, as the max rung's section lists it, naming it in backticks
    why: str = ""                  # why it can help, as a clause of the max rung's section; additions that share
                                   # a reason share its string, and the section gives it once

    @property
    def fp8(self) -> bool:
        """It runs some GEMMs in FP8, whose peak is twice bf16's (MFU divides by bf16's)."""
        return bool(self.fp8_gemms)

    def __post_init__(self):
        if self.stage not in STAGES or self.pillar not in PILLARS:
            raise ValueError(f"{self.name}: stage must be one of {STAGES} and pillar one of {PILLARS}")
        if self.matmuls not in ("", "tf32", "bf16") \
                or self.fp8_gemms not in ("", "head", "qkv_fc", "qkv_fc_dgrad", "blocks") \
                or self.optimizer not in ("", "fused", "8bit", "master", "stochastic"):
            raise ValueError(f"{self.name}: matmuls is '', tf32 or bf16; optimizer '', fused, 8bit, master or "
                             f"stochastic; fp8_gemms '', head, qkv_fc, qkv_fc_dgrad or blocks")
        if self.layers_wider_than and (len(self.layers_wider_than) != 2
                                       or not all(isinstance(d, int) for d in self.layers_wider_than)):
            raise ValueError(f"{self.name}: layers_wider_than is () or (N, K), two ints")

    def takes_layer(self, n_out: int, n_in: int) -> bool:
        """Whether it goes into a linear layer of weight [n_out, n_in] (layers_wider_than)."""
        return not self.layers_wider_than or (n_out > self.layers_wider_than[0] and n_in > self.layers_wider_than[1])


_ADDITIONS = [
    # settings
    Addition("tf32", "settings", "compute", "fp32 matmuls on the tensor cores in TF32 (10-bit mantissa)",
             needs="an Ampere or newer GPU", matmuls="tf32",
             title="TensorFloat-32 matrix multiplications",
             notebook=("**What changes.** One flag: FP32 matrix multiplications may run on the tensor cores in TF32.",
                       "**Why it is faster.** TF32 keeps FP32's 8-bit exponent (its range) but rounds the inputs of "
                       "each multiplication to a 10-bit mantissa, accumulating in FP32. The tensor cores multiply "
                       "such inputs at many times the rate of the FP32 units, so the compute floor drops by that "
                       "factor; nothing else changes: tensors stay FP32 in memory, so every memory-bound kernel runs "
                       "exactly as before.",
                       "**What it costs.** Precision of the products: about three significant decimal digits instead "
                       "of seven. Training is normally insensitive to it, since gradient noise is far larger. No "
                       "memory change. No effect on GPUs older than Ampere.")),
    Addition("bf16", "settings", "compute", "bf16 autocast: matmuls and attention in bf16, softmax and loss in fp32",
             needs="a GPU with bf16, or a CPU", matmuls="bf16",
             title="BF16 autocast",
             notebook=("**What changes.** The forward pass runs under `torch.autocast(dtype=torch.bfloat16)`: matrix "
                       "multiplications (and so their outputs, the activations) are BF16; the weights stay FP32 and "
                       "are cast on the fly, and autocast keeps numerically sensitive operations (softmax, "
                       "LayerNorm, the loss) in FP32.",
                       "**Why it is faster.** Two reasons. The tensor cores multiply BF16 at twice their TF32 rate, "
                       "halving the compute floor again. And an activation in BF16 is 2 bytes instead of 4, so "
                       "memory-bound kernels move half the bytes and the saved activations take half the memory.",
                       "**What it costs.** BF16 has FP32's range but only an 8-bit mantissa; keeping master weights, "
                       "the optimizer and reductions in FP32 is what makes this safe without loss scaling (FP16, "
                       "with its smaller range, needs a gradient scaler). GPUs without BF16 (before Ampere) skip "
                       "this rung.")),
    Addition("flash", "settings", "memory", "F.scaled_dot_product_attention: the T x T scores never reach memory; "
             "PyTorch picks the kernel (cuDNN's on Hopper, FlashAttention-2 on Ampere and Ada)", scores_on_chip=True,
             title="`F.scaled_dot_product_attention` (FlashAttention)",
             notebook=("**What changes.** The attention layer calls `F.scaled_dot_product_attention(q, k, v, "
                       "is_causal=True)` instead of writing out the scores, and PyTorch picks a fused kernel for it: "
                       "on an H100 or H200 with PyTorch 2.11 and cuDNN 9.19, cuDNN's fused attention (PyTorch "
                       "prefers it on Hopper from cuDNN 9.15 on); on an A100 or an RTX card, FlashAttention-2. Both "
                       "run the FlashAttention algorithm below. Each run records the kernel a warm-up step ran "
                       "(runs.csv's `attention_kernel`), and `SDPA_BACKEND=flash` holds the rung to FlashAttention-2 "
                       "([BENCHMARKS.md](../BENCHMARKS.md) compares them on an H200). The `flash` addition sets it "
                       "through the model's config (`GPTConfig.flash`), and the model's attention branches on it "
                       "(printed below).",
                       "**Why it is faster.** FlashAttention never materializes the T×T scores. It walks over K and "
                       "V in tiles that fit in the chip's on-chip memory, computing each tile's scores, its part of "
                       "the softmax (an online softmax that rescales the running sum as new maxima appear) and its "
                       "contribution to the output, all in one kernel. Backward recomputes the scores tile by tile "
                       "from Q, K, V and the per-row softmax statistics instead of reading them back. The "
                       "attention's FLOPs change little (backward recomputes the scores; the causal mask lets it "
                       "skip the tiles above the diagonal), but the passes over B·H·T·T values counted above all "
                       "disappear, and with them the memory those tensors held.",
                       "**What it costs.** Nothing in accuracy (the result is exact up to rounding order). It needs "
                       "a supported GPU, dtype and head size, or PyTorch falls back to a slower kernel.")),
    Addition("vocab_multiple", "settings", "compute",
             "embedding padded to 50,304 rows, so the output layer's GEMM tiles evenly", in_max=True,
             phrase="the vocabulary padded to 50,304 rows (`vocab_multiple`)",
             why="the padded vocabulary gives the largest GEMM aligned tiles"),
    # model
    Addition("bf16_residual", "model", "memory", "the residual stream in bf16 instead of autocast's fp32",
             requires=("bf16",), in_max=True,
             phrase="a residual stream kept in bf16 (`bf16_residual`)",
             why="the bf16 residual stream halves the bytes of every residual add and LayerNorm"),
    Addition("gemm_bias_grad", "model", "memory",
             "c_attn's and c_fc's bias gradients out of their weight-gradient GEMMs (input beside columns of ones)",
             excludes=("fp8",), in_max=True, fsdp=_WHOLE_TENSORS,
             phrase="c_attn's and c_fc's bias gradients taken from their weight-gradient GEMMs (`gemm_bias_grad`)",
             why="a column of ones stored beside c_attn's and c_fc's inputs makes their bias gradients one more column "
                 "of the weight-gradient GEMMs (dY^T [X 1]), so no pass sums the output gradients over the tokens"),
    Addition("gelu_epilogue", "model", "memory",
             "c_fc's bias and GELU, and GELU's derivative, in cuBLASLt GEMM epilogues", needs="cuBLASLt on a GPU",
             requires=("bf16",), excludes=("fp8",), in_max=True, fsdp=_WHOLE_TENSORS,
             phrase="the MLP's bias and GELU applied by cuBLASLt as its GEMMs store their outputs (`gelu_epilogue`: "
                    "forward, and GELU's derivative backward)",
             why="the GEMM epilogues remove two passes over the MLP's tokens × 3072 activations per layer (GELU "
                 "forward, and its derivative backward)"),
    # cuDNN's fused attention takes bf16 or fp16 only: without autocast there is no kernel to hold SDPA to.
    Addition("cudnn_attention", "model", "compute", "SDPA held to cuDNN's fused attention", needs="cuDNN on a GPU",
             requires=("flash", "bf16"), excludes=("packed_attention",), scores_on_chip=True,
             phrase="cuDNN attention (`cudnn_attention`)"),
    Addition("packed_attention", "model", "memory",
             "cuDNN attention reading q, k, v in the packed QKV tensor and writing one packed gradient",
             needs="nvidia-cudnn-frontend and cuDNN 9 on a GPU", requires=("bf16",), in_max=True, fsdp=_WHOLE_TENSORS,
             scores_on_chip=True,
             phrase="attention called through cuDNN's graph API on the packed QKV tensor (`packed_attention`)",
             why="cuDNN writes the attention's q, k and v gradients straight into the QKV projection's packed "
                 "gradient, where SDPA's three tensors had to be copied into it"),
    Addition("loss", "model", "memory", "cross-entropy 4,096 tokens at a time: the logits never exist whole",
             excludes=("loss_kernel",),
             phrase="the chunked loss as Inductor compiles it (`loss`)"),
    Addition("loss_kernel", "model", "memory",
             "the chunked loss with each chunk's softmax and gradient as one hand-written kernel",
             needs="NVRTC or Triton on a GPU", fsdp=_WHOLE_TENSORS,
             phrase="the chunked loss in bf16 with its kernel (`loss_kernel`)", why=_CHUNKED_LOSS),
    Addition("fp8_head", "model", "compute",
             "the output layer's three GEMMs in FP8 inside the chunked loss (e4m3 inputs, e5m2 gradient)",
             needs="an Ada or Hopper GPU", requires=("bf16",), excludes=("loss", "loss_kernel"),
             fp8_gemms="head", in_max=True, fsdp=_WHOLE_TENSORS,
             phrase="a cross-entropy that never holds the whole B×T×vocab logits and computes the output layer's "
                    "three GEMMs in FP8 on an Ada or Hopper GPU (`fp8_head`: e4m3 inputs, an e5m2 gradient written by "
                    "the loss kernel in one read of the logits; elsewhere the softmax gradient as the same "
                    "hand-written kernel in bf16, `loss_kernel`)",
             why=_CHUNKED_LOSS),
    Addition("recompute_logits", "model", "memory",
             "the FP8 output layer's logits computed twice by Triton GEMMs and never stored: one keeps each row's "
             "log-sum-exp, the other writes the e5m2 gradient in both layouts", needs="a Hopper GPU and Triton",
             requires=("fp8_head",), fsdp=_WHOLE_TENSORS,
             phrase="the output layer's logits computed twice and never stored (`recompute_logits`): one FP8 GEMM "
                    "keeps each row's log-sum-exp, the next writes the e5m2 gradient from its accumulator",
             why="storing the logits in bf16, reading them back and transposing the gradient moves 7 bytes a logit; "
                 "a second GEMM over the same FP8 operands moves 2, in models narrow enough that the GEMM costs "
                 "less than the bytes"),
    Addition("fp8_qkv_fc", "model", "compute",
             "c_attn's and c_fc's forward GEMMs in FP8, their LayerNorm's output cast with a scale bounded in advance",
             needs="an Ada or Hopper GPU", requires=("bf16",), excludes=("fp8",), fp8_gemms="qkv_fc",
             in_max=True, fsdp=_WHOLE_TENSORS,
             phrase="the forward GEMMs of c_attn and c_fc in FP8 (`fp8_qkv_fc`), their input cast to e4m3 by the "
                    "LayerNorm that makes it",
             why="the FP8 GEMMs do half the tensor-core work, and their input needs no pass to find its scale, since "
                 "a LayerNorm's output is bounded by its weights (max|γ|·sqrt(C − 1) + max|β|), so the cast is a byte "
                 "more out of the LayerNorm's own kernel (at batch 64 every run sits at the card's power cap, where "
                 "less work is a shorter step)"),
    Addition("fp8_dgrad", "model", "compute",
             "c_attn's and c_fc's input-gradient GEMMs in FP8: each row of the output gradient in e4m3 with its own "
             "scale, the weight with one", needs="an Ada or Hopper GPU", requires=("bf16",),
             excludes=("fp8",), fp8_gemms="qkv_fc_dgrad", in_max=True,
             # torchao's filter for its rowwise recipe (torchao/float8/float8_linear_utils.py,
             # _auto_filter_for_rowwise, from its H100 benchmarks): the GEMM's saving grows with M·N·K, the casts'
             # cost with M·N, so below some K the casts cost more than the GEMM saves (BENCHMARKS.md: at 124M,
             # K = 768, they did; at gpt2-xl, K = 1,600, they did not)
             layers_wider_than=(2048, 1024),
             fsdp="its FP8 casts have not been tried on FSDP's shards",
             phrase="the input-gradient GEMMs of c_attn and c_fc in FP8 (`fp8_dgrad`), each row of the output "
                    "gradient cast to e4m3 with its own scale",
             why="an input-gradient GEMM sums along the layout its output gradient already has, so FP8 needs no "
                 "transposed copy of an activation, only of the weight, and a scale for each row lets one pass read "
                 "the gradient once to cast it; it takes only layers wider than 1,024, where the GEMM saves more "
                 "than the casts cost; at gpt2-xl it made 300 steps 3.6% faster, with the loss of its last 50 steps "
                 "within the gap of two seeds of max without it (BENCHMARKS.md)"),
    Addition("fp8", "model", "compute", "the blocks' linear layers as FP8 matmuls with per-tensor scales",
             needs="torchao and an Ada or Hopper GPU", requires=("bf16",), fp8_gemms="blocks",
             fsdp="its scaled matmuls have not been tried on FSDP's shards",
             phrase="FP8 matmuls (`fp8`)"),
    Addition("fold_norm", "model", "memory",
             "each block LayerNorm's weight and bias applied by the layer reading it: no sums over the tokens",
             excludes=("fp8",),
             in_max=True, fsdp="its folded weights have not been tried on FSDP's DTensor shards on a GPU",
             phrase="each block LayerNorm's γ and β applied by the layer that reads its output (`fold_norm`)",
             why="folding a LayerNorm's weights into its reader ((x̂γ + β)Wᵀ + b = x̂(W diag γ)ᵀ + (b + Wβ)) turns "
                 "the LayerNorm's weight gradients, sums over the 65,536 tokens of a batch-64 step that Inductor "
                 "finishes with a memset and an ATen reduction each, into sums over the layer's 2,304 or 3,072 rows, "
                 "out of the weight gradients the layer's GEMM already makes"),
    Addition("master_weights", "model", "memory",
             "linear and embedding parameters and their gradients stored in bf16; AdamW updates fp32 master "
             "weights and writes the bf16 parameters in the same kernel",
             requires=("bf16",), excludes=("8bit",), optimizer="master",
             fsdp="its update kernel reads whole tensors by address, not FSDP's DTensor shards",
             phrase="the parameters stored in bf16, with fp32 master weights that AdamW updates and rounds to them in "
                    "one kernel (`master_weights`)",
             why="bf16 parameters spare each step the cast of every weight to bf16 and of every weight gradient "
                 "back to fp32, and the update reads a 2-byte gradient and writes no gradient back: about 30 bytes "
                 "a parameter outside the GEMMs instead of 48 (Utils.kernels.master_adamw counts them), which "
                 "matters at gpt2-xl's 1.5B parameters"),
    Addition("stochastic_rounding", "model", "memory",
             "linear and embedding parameters stored in bf16 without fp32 master weights: AdamW keeps m and v in "
             "bf16 and rounds each updated bf16 parameter stochastically",
             requires=("bf16",), excludes=("master_weights", "8bit"), optimizer="stochastic", in_max=True,
             fsdp="its update kernel reads whole tensors by address, not FSDP's DTensor shards",
             phrase="the parameters stored in bf16 without fp32 master weights, with bf16 m and v and each parameter "
                    "rounded stochastically (`stochastic_rounding`)",
             why="without master weights and with bf16 states, the weights, gradients and AdamW's states hold 8 bytes "
                 "a parameter instead of master_weights' 16, and the update moves 14 instead of 28; rounding at "
                 "random, up with the probability of the remainder, keeps updates smaller than half a bf16 step in "
                 "expectation"),
    # compile
    Addition("torch_compile", "compile", "overhead",
             "torch.compile: elementwise work fused into few kernels, far fewer launches",
             needs="Triton on a GPU, a C++ compiler on a CPU", compiled=True,
             title="fusion by Inductor",
             notebook=("**What changes.** The model is wrapped in `torch.compile`. On the first step Dynamo traces "
                       "the Python into a graph, and Inductor generates kernels for it (Triton on a GPU).",
                       "**Why it is faster.** Fusion: a chain of elementwise operations and reductions (scale, mask, "
                       "softmax; bias, GELU; residual add and LayerNorm) becomes one kernel that reads its inputs "
                       "once, keeps the intermediates in registers and writes one result, instead of one kernel per "
                       "operation each reading and writing the whole tensor. For a memory-bound step that removes "
                       "most of the traffic, and it also replaces hundreds of launches with tens.",
                       "**What it costs.** Compile time before the first step, paid again whenever a shape changes; "
                       "a less transparent stack to debug; the backward saves what the fused graph decides, usually "
                       "less.")),
    Addition("cudagraphs", "compile", "overhead", "torch.compile with CUDA graphs: a step's launches replayed as one",
             needs="a GPU", requires=("torch_compile",),
             in_max=True, fsdp="a CUDA graph cannot hold FSDP's all-gathers and reduce-scatters",
             phrase="CUDA graphs (`cudagraphs`, `torch.compile`'s `reduce-overhead` mode)", why=_HOST_WAIT),
    Addition("autotune", "compile", "compute",
             "torch.compile's max-autotune: Inductor times its Triton GEMM templates against cuBLAS, shape by shape",
             needs="Triton on a GPU", requires=("torch_compile",),
             phrase="torch.compile's max-autotune (`autotune`)"),
    Addition("combo_kernels", "compile", "overhead",
             "Inductor's combo kernels: up to eight data-independent generated kernels launched as one, "
             "each with its own block sizes",
             needs="Triton on a GPU", requires=("torch_compile",), in_max=True,
             phrase="Inductor's combo kernels (`combo_kernels`), which launch up to eight of its small independent "
                    "kernels as one",
             why="combo kernels remove the gap of a microsecond or two that even a graph leaves between two launches, "
                 "of which the step has some 300 under 10 µs (the weights' casts and amaxes); each of a combo "
                 "kernel's sub-kernels keeps a block shape of its own (Inductor's "
                 "`combo_kernel_per_subkernel_blocks`): with one shape for all, `max` without its bf16 stream took "
                 "38 ms a step at batch 16 instead of 27, a sum over the tokens launched with a per-token reduction "
                 "(BENCHMARKS.md, \"Is it the combo kernels?\")"),
    # optimizer
    Addition("fused", "optimizer", "overhead", "AdamW(fused=True): one kernel over all parameters per step",
             excludes=("8bit",), optimizer="fused",
             title="AdamW in one kernel",
             notebook=("**What changes.** `torch.optim.AdamW(..., fused=True)`.",
                       "**Why it is faster.** The default `foreach` AdamW is a sequence of multi-tensor operations "
                       "(decay the weights, update m, update v, take the square root, divide, add ε, update the "
                       "weights); each is a pass over every parameter, and the intermediates are written out between "
                       "them. The fused implementation does the whole update per value in one kernel over all "
                       "parameters: read the parameter, gradient, m and v once, write the parameter, m and v once. "
                       "Fewer bytes and far fewer launches.",
                       "**What it costs.** Nothing: the same arithmetic. It needs the parameters on a supported "
                       "device (CUDA, and recently CPU) in floating-point types.")),
    Addition("8bit", "optimizer", "memory", "bitsandbytes' AdamW8bit: optimizer states in 8 bits",
             needs="bitsandbytes", optimizer="8bit",
             fsdp="bitsandbytes' optimizer takes whole tensors, not FSDP's DTensor shards",
             title="bitsandbytes' AdamW8bit",
             notebook=("**What changes.** The flash rung's optimizer is replaced by `bitsandbytes.optim.AdamW8bit`.",
                       "**Why it can help.** AdamW keeps two states per parameter, m and v, each 4 bytes in FP32: "
                       "twice the model's own size. AdamW8bit stores them in 8 bits each, quantized block by block "
                       "with a scale per block (dynamic quantization), so the states take four times fewer bytes, in "
                       "memory and in traffic. Tensors smaller than 4096 values keep 32-bit states.",
                       "**What it costs.** Quantization error in the optimizer's statistics (small in practice, "
                       "visible in the loss comparison), a third-party CUDA library, and, in the implementation used "
                       "here, a separate update per parameter tensor driven from Python. It is a memory optimization "
                       "first: it pays when the optimizer states are what does not fit, for models of billions of "
                       "parameters.")),
    Addition("fold_clip", "optimizer", "memory",
             "fused AdamW divides by the clip factor as it reads each gradient", requires=("fused",),
             excludes=("compiled_update",), optimizer="fused", clip_folded=True,
             in_max=True, fsdp="its grad_scale from the gradients' norm has not been tried on FSDP's DTensor shards",
             phrase="the gradient clip folded into fused AdamW, which divides each gradient by the clip's factor as "
                    "it reads it (`fold_clip`)",
             why="the folded clip lets fused AdamW apply the clip's factor as it reads each gradient, so the clip's "
                 "own pass over 124M fp32 gradients is gone (AdamW still writes each gradient back divided)"),
    Addition("compiled_update", "optimizer", "overhead", "torch.compile of the gradient clip and optimizer step",
             requires=("torch_compile",),
             phrase="a compiled optimizer step (`compiled_update`)"),
    # loop
    Addition("prefetch", "loop", "overhead", "the next batch copied to the GPU on a side stream", needs="a GPU",
             in_max=True,
             phrase="the next batch copied on a side stream (`prefetch`)", why=_HOST_WAIT),
    Addition("sync_every", "loop", "overhead", "the host reads losses and step times back every 10 steps",
             needs="a GPU", in_max=True, readback_deferred=True,
             phrase="losses and timings read back every 10 steps instead of every step (`sync_every`)",
             why=_HOST_WAIT),
]
ADDITIONS = {a.name: a for a in _ADDITIONS}


@dataclass(frozen=True)
class Rung:
    name: str
    script: str
    additions: tuple


_FLASH = ("tf32", "bf16", "torch_compile", "flash")
_FUSED = _FLASH + ("fused",)
# The fused rung plus every addition that measured faster on an H100 or H200 and kept the loss (Addition.in_max), in
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
# `make ablation` (FROM=fused) runs the fused rung with each of these in turn: those of ABLATION that run there alone.
# One that builds on another beyond the fused rung (recompute_logits on fp8_head) is tried with it, joined by '+'.
FUSED_ALONE = tuple(name for name in ABLATION if set(ADDITIONS[name].requires) <= set(RUNGS["fused"].additions))
# `make ablation FROM=max` runs the max rung without each of these in turn: what each one adds among the others.
LEAVE_ONE_OUT = tuple(name for name in ADDITIONS if name in MAX_ADDITIONS)
# make ablation's base rungs (FROM=) and what each tries
ABLATION_TRIES = {"fused": FUSED_ALONE, "max": LEAVE_ONE_OUT}
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


def additions_named(named: str | Iterable[str]) -> tuple:
    """resolve for a rung's name, or addition names: a list, or the words of one string (WITH)."""
    if isinstance(named, str):
        named = RUNGS[named].additions if named in RUNGS else named.split()
    return resolve(named)


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
    unknown = [p for p in parts if p not in (ABLATION if base == "fused" else tries)]
    if unknown:
        raise RegistryError(f"make ablation FROM={base} does not try '{unknown[0]}': use some of {', '.join(tries)}, "
                            f"or several joined by '+' to try them together")
    if len(set(parts)) < len(parts):
        raise RegistryError(f"'{item}' names an addition twice: name each once")
    if base == "fused":
        missing = [r for p in parts for r in ADDITIONS[p].requires if r not in RUNGS["fused"].additions + tuple(parts)]
        if missing:
            raise RegistryError(f"{item} needs {missing[0]}: try {'+'.join([missing[0], *parts])}")
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
