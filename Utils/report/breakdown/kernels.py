"""The parts a profiled step's time is split into, and which GPU kernels belong to which part.

A kernel is named the way CUPTI reports it (demangled C++, or a generated name such as cuBLAS's nvjet_*
and Inductor's triton_*); KERNEL_CLASSES maps names to a class by pattern. A kernel no pattern names is
"unknown": listed in the report, never guessed.
"""
import functools
import re

# compute: matrix multiplies and attention; memory: every other kernel, copies and memsets (bandwidth-bound
# at GPT-2's sizes); unknown: kernels KERNEL_CLASSES does not name; overhead: no kernel running. On a CPU:
# time inside PyTorch operators (cpu_ops) and the rest (overhead).
COMPUTE, MEMORY, UNKNOWN, OVERHEAD, CPU_OPS = "compute", "memory", "unknown", "overhead", "cpu_ops"
GPU_CLASSES = (COMPUTE, MEMORY, UNKNOWN, OVERHEAD)
CPU_CLASSES = (CPU_OPS, OVERHEAD)

# (pattern, class, label), tried in order; the first match wins. A pattern is searched in the kernel's
# own name, the part before its template arguments and parameters, so that a functor named in the
# template arguments (FillFunctor, a softmax lambda) does not decide the class; a pattern may run on
# into the template arguments where they are what tells kernels apart (fused AdamW is a
# multi_tensor_apply_kernel whose functor is FusedAdamMathFunctor). Case is ignored.
# Names are as CUPTI reports them, demangled, e.g. "void at::native::(anonymous namespace)::
# cunn_SoftMaxForward<4, float, float, float, ...>(float*, float const*, int)".

KERNEL_CLASSES = [
    # Inductor's kernels first: their names list the fused ATen ops, which may mention attention or mm.
    (r"^triton_tem_", COMPUTE, "GEMM (Triton template)"),             # max-autotune's mm/bmm/addmm templates
    (r"^triton_(poi|red|per|for)_", MEMORY, "Triton fused (Inductor)"),  # pointwise, reduction, persistent, foreach
    # Compute: matrix multiplies and attention, the tensor cores' work. The fp32 rung's GEMMs run on the
    # CUDA cores (SIMT) instead, but they are the step's matmuls all the same, so they count here too.
    (r"splitKreduce", COMPUTE, "GEMM (split-K reduce)"),              # cuBLAS finishing a split-K GEMM
    (r"^nvjet_", COMPUTE, "GEMM (cuBLAS)"),                           # cuBLAS 12.8+ on Hopper/Blackwell
    (r"cutlass::Kernel2?<\w*gemm|cutlass::device_kernel<.*gemm", COMPUTE, "GEMM (CUTLASS)"),
    (r"gemm|gemv", COMPUTE, "GEMM (cuBLAS)"),                         # sm90_xmma_gemm_*, ampere_sgemm_*, gemmSN_*
    (r"flash_fwd|flash_bwd|flash::|FlashAttn", COMPUTE, "flash attention"),  # pytorch_flash:: (FA2 in PyTorch)
    (r"^fmha_cutlass", COMPUTE, "attention (memory-efficient)"),      # xformers' kernels inside PyTorch SDPA
    (r"sdpa|^cudnn::fusion", COMPUTE, "attention (cuDNN)"),           # cudnn_generated_fort_native_sdpa_*
    # Memory: the rest, bandwidth-bound at these sizes.
    (r"multi_tensor_apply_kernel<.*FusedAdam", MEMORY, "fused AdamW"),
    (r"multi_tensor_apply_kernel<.*LpNorm|lpnorm_cleanup", MEMORY, "gradient norm (clip)"),
    (r"multi_tensor_apply_kernel", MEMORY, "foreach (multi-tensor)"),  # AdamW's default foreach implementation
    (r"^kOptimizer|^kPreconditionOptimizer", MEMORY, "8-bit AdamW (bitsandbytes)"),
    (r"^_update_kernel$", MEMORY, "AdamW (master_adamw)"),           # Utils.kernels.master_adamw's Triton update
    (r"SoftMax\w*<.*LogSoftMax", MEMORY, "log-softmax (loss)"),       # cross-entropy = log_softmax + nll_loss
    (r"softmax", MEMORY, "softmax"),                                  # cunn_SoftMax*, softmax_warp_*
    (r"layer_norm|LayerNorm|GammaBeta|RowwiseMoments", MEMORY, "layer norm"),
    (r"nll_loss|cross_entropy", MEMORY, "cross-entropy loss"),          # and Utils.kernels.loss_kernel's kernels
    (r"^_row_lse_kernel$|^_grad_fp8_kernel$", MEMORY, "cross-entropy loss"),   # Utils.kernels.fp8_loss's
    (r"^_transpose_kernel$", MEMORY, "transpose"),   # fp8_loss's byte transpose of the loss's FP8 gradient
    (r"indexSelect|index_select", MEMORY, "embedding (index select)"),
    (r"embedding_backward|compute_grad_weight|sum_and_scatter|krn_partial|compute_num_of_partial_segments|renorm",
     MEMORY, "embedding backward"),
    (r"index_elementwise|index_put|scatter|gather", MEMORY, "index / scatter / gather"),
    (r"cub::|DeviceRadixSort|radixSort|sort|DeviceScan|DeviceSelect|DeviceCompact|tensor_kernel_scan",
     MEMORY, "sort / scan"),                                          # the embedding backward's sort by token
    (r"CatArrayBatchedCopy", MEMORY, "cat"),
    (r"^memcpy\d+$", MEMORY, "copy"),                                  # a device-to-device copy in a CUDA graph
    (r"triu_tril", MEMORY, "tril / triu"),
    (r"elementwise", MEMORY, "elementwise"),                          # vectorized_/unrolled_elementwise_kernel
    (r"reduce_kernel", MEMORY, "reduction"),                          # at::native::reduce_kernel (sum, mean)
]
_COMPILED = [(re.compile(r"^[^<(]*?(?:" + p + ")", re.IGNORECASE), c, label) for p, c, label in KERNEL_CLASSES]


def kernel_id(name: str) -> str:
    """A kernel's name without the noise: no leading "void ", no "(anonymous namespace)::"."""
    name = name.strip()
    if name.startswith("void "):
        name = name[5:]
    return name.replace("(anonymous namespace)::", "")


@functools.lru_cache(maxsize=4096)
def classify(name: str) -> tuple[str | None, str | None]:
    """(class, label) of a kernel name, class in {"compute", "memory"}; (None, None) when unknown."""
    ident = kernel_id(name)
    for pattern, cls, label in _COMPILED:
        if pattern.search(ident):
            return cls, label
    return None, None


def short_name(name: str, width: int = 100) -> str:
    """A kernel name for a table: kernel_id without the parameter list, cut to `width` characters."""
    ident = kernel_id(name)
    if name.lstrip().startswith("void ") and ident.endswith(")"):     # a demangled kernel's parameter list
        depth = 0
        for i in range(len(ident) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(ident[i], 0)
            if depth == 0:
                ident = ident[:i] if i else ident
                break
    return ident if len(ident) <= width else ident[:width - 1] + "…"
