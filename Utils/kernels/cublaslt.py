"""cuBLASLt matmuls with a GELU epilogue, called through ctypes on the library that PyTorch itself loads.

cuBLASLt can finish a GEMM's output tiles in registers before they are stored: add a bias, apply GELU
(tanh approximation, as GPT-2's), write the pre-activation as a second "auxiliary" output, or, going
backward, multiply by GELU's derivative at that stored pre-activation. PyTorch reaches only the forward
GELU epilogue (torch._addmm_activation), without the auxiliary output that a backward pass needs; these
two calls reach both. Everything here is row-major PyTorch on the outside; cuBLASLt is column-major, so
each call computes the transposed product. `reference_linear_gelu` and `reference_linear_dgelu` are the
same mathematics in PyTorch operations.
"""
import ctypes
import ctypes.util
import functools
import statistics

import torch
import torch.nn.functional as F
from torch import Tensor

from Utils.kernels import native
from Utils.kernels.native import INT, INT64, POINTER, SIZE, UINT64

# Enum values, each under its name in cublasLt.h, cublas_api.h or library_types.h.
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1                        # cublasOperation_t
CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF, CUDA_R_8F_E4M3 = 0, 2, 14, 28   # cudaDataType_t
CUBLAS_COMPUTE_32F = 68                                # cublasComputeType_t
# cublasLtMatmulDescAttributes_t
CUBLASLT_MATMUL_DESC_TRANSA = 3
CUBLASLT_MATMUL_DESC_TRANSB = 4
CUBLASLT_MATMUL_DESC_EPILOGUE = 7
CUBLASLT_MATMUL_DESC_BIAS_POINTER = 8
CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER = 11
CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD = 12
CUBLASLT_MATMUL_DESC_A_SCALE_POINTER = 17
CUBLASLT_MATMUL_DESC_B_SCALE_POINTER = 18
CUBLASLT_MATMUL_DESC_FAST_ACCUM = 25
# cublasLtMatmulPreferenceAttributes_t
CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1
# cublasLtEpilogue_t
CUBLASLT_EPILOGUE_DEFAULT = 1
CUBLASLT_EPILOGUE_BIAS = 4
CUBLASLT_EPILOGUE_GELU = 32
CUBLASLT_EPILOGUE_GELU_AUX = CUBLASLT_EPILOGUE_GELU | 128                     # the GELU's input stored too
CUBLASLT_EPILOGUE_GELU_AUX_BIAS = CUBLASLT_EPILOGUE_GELU_AUX | CUBLASLT_EPILOGUE_BIAS
CUBLASLT_EPILOGUE_DGELU = 64 | 128                                            # times GELU'(auxiliary input)
CUBLASLT_EPILOGUE_DGELU_BGRAD = CUBLASLT_EPILOGUE_DGELU | 16                  # and the bias gradient

CANDIDATES = 8                 # up to this many heuristic algorithms are timed on a shape's first call
WORKSPACE_BYTES = 32 << 20     # what cuBLAS asks for on Hopper
_DTYPES = {torch.bfloat16: CUDA_R_16BF, torch.float16: CUDA_R_16F, torch.float8_e4m3fn: CUDA_R_8F_E4M3}


class _HeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t"""
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


# cublasLt.h
_SIGNATURES = {
    "cublasLtCreate": [POINTER],
    "cublasLtMatmulDescCreate": [POINTER, INT, INT],
    "cublasLtMatmulDescSetAttribute": [POINTER, INT, POINTER, SIZE],
    "cublasLtMatrixLayoutCreate": [POINTER, INT, UINT64, UINT64, INT64],
    "cublasLtMatmulPreferenceCreate": [POINTER],
    "cublasLtMatmulPreferenceSetAttribute": [POINTER, INT, POINTER, SIZE],
    "cublasLtMatmulPreferenceDestroy": [POINTER],
    "cublasLtMatmulAlgoGetHeuristic": [POINTER, POINTER, POINTER, POINTER, POINTER, POINTER, POINTER, INT, POINTER,
                                       POINTER],
    "cublasLtMatmul": [POINTER] * 14 + [SIZE, POINTER],
}

@functools.cache
def _library():
    """The cuBLASLt that PyTorch loaded (so that both use one copy), else the system's; None if neither."""
    try:
        torch.cuda.current_blas_handle()   # loads cuBLAS, and with it cuBLASLt
    except Exception:   # no GPU, or a CUDA that will not initialize
        return None
    path = native.mapped_library("libcublasLt") or ctypes.util.find_library("cublasLt")
    return native.load([path], _SIGNATURES) if path else None


def unavailable(device: torch.device) -> str | None:
    """None where the epilogue GEMMs run on this device, else why not."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 8:
        return "GEMM epilogues need cuBLASLt on an Ampere or newer GPU"
    if _library() is None:
        return "cuBLASLt could not be loaded"
    return None


def prepare(device: torch.device) -> None:
    """Create this device's handle and workspace now: inside a CUDA graph's memory pool, the workspace would
    be an allocation the graph does not own."""
    _handle(device.index if device.index is not None else torch.cuda.current_device())


def _handle(device_index: int):
    if device_index not in _handles:
        handle = ctypes.c_void_p()
        with torch.cuda.device(device_index):
            native.check(_library().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{device_index}")
        _handles[device_index] = handle, workspace
    return _handles[device_index]


# One handle and workspace per device, one descriptor per shape, kept for the process's life: calls made
# from several streams or threads at once would share them, and the training loop makes one at a time.
_handles = {}
_plans = {}


def _set(lib, desc, attribute, value):
    native.check(lib.cublasLtMatmulDescSetAttribute(desc, attribute, ctypes.byref(value), ctypes.sizeof(value)),
                 "cublasLtMatmulDescSetAttribute")


def _layout(lib, dtype, rows, cols, ld):
    layout = ctypes.c_void_p()
    native.check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, ld),
                 "cublasLtMatrixLayoutCreate")
    return layout


def _plan(device_index, epilogue, trans_a, trans_b, m, n, k, dtype, ld_b, out_dtype):
    """Descriptors and the heuristic's algorithms for column-major D[m, n] = op(A) @ op(B), A and B of dtype,
    D of out_dtype, B's columns ld_b elements apart, made once per shape: the bias, auxiliary and scale
    pointers are set on the descriptor at each call."""
    key = device_index, epilogue, trans_a, trans_b, m, n, k, dtype, ld_b, out_dtype
    if key in _plans:
        return _plans[key]
    lib, (handle, _) = _library(), _handle(device_index)
    desc = ctypes.c_void_p()
    native.check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F),
                 "cublasLtMatmulDescCreate")
    _set(lib, desc, CUBLASLT_MATMUL_DESC_TRANSA, ctypes.c_int32(trans_a))
    _set(lib, desc, CUBLASLT_MATMUL_DESC_TRANSB, ctypes.c_int32(trans_b))
    _set(lib, desc, CUBLASLT_MATMUL_DESC_EPILOGUE, ctypes.c_int32(epilogue))
    _set(lib, desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, ctypes.c_int64(m))
    if dtype == CUDA_R_8F_E4M3:
        # Hopper's fast FP8 accumulation never promotes partial sums to fp32: fine for sums over a layer's
        # 768 features, as the FP8 output layer's logits GEMM takes it (fp8_loss).
        _set(lib, desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, ctypes.c_int8(1))
    a = _layout(lib, dtype, k, m, k) if trans_a == CUBLAS_OP_T else _layout(lib, dtype, m, k, m)
    b = _layout(lib, dtype, n, k, ld_b) if trans_b == CUBLAS_OP_T else _layout(lib, dtype, k, n, ld_b)
    d = _layout(lib, out_dtype, m, n, m)
    status, usable = heuristic(lib, handle, desc, a, b, d, d)
    native.check(status, "cublasLtMatmulAlgoGetHeuristic")
    if not usable:
        raise RuntimeError(f"cuBLASLt has no algorithm for epilogue {epilogue} at m={m} n={n} k={k}")
    _plans[key] = [desc, a, b, d, usable, None]   # None: the fastest not yet known
    return _plans[key]


def heuristic(lib, handle, desc, a, b, c, d) -> tuple[int, list]:
    """(cuBLASLt's status, the usable ones of its first CANDIDATES algorithms) for the matmul descriptor `desc`
    and the layouts of A, B, C and D, with WORKSPACE_BYTES of workspace; no algorithm where the status is not
    success."""
    preference = ctypes.c_void_p()
    native.check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(preference)), "cublasLtMatmulPreferenceCreate")
    limit = ctypes.c_uint64(WORKSPACE_BYTES)
    native.check(lib.cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                          ctypes.byref(limit), ctypes.sizeof(limit)),
                 "cublasLtMatmulPreferenceSetAttribute")
    results, count = (_HeuristicResult * CANDIDATES)(), ctypes.c_int()
    status = lib.cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, c, d, preference, CANDIDATES, results,
                                                ctypes.byref(count))
    lib.cublasLtMatmulPreferenceDestroy(preference)
    if status != native.SUCCESS:
        return status, []
    # A result's other fields hold only where its state is success (cublasLt.h, cublasLtMatmulHeuristicResult_t).
    return status, [r for r in results[:count.value] if r.state == native.SUCCESS]


def _fastest(launch, candidates):
    """Index of the candidate whose launch(i) takes the least time on the GPU (median of 10, after 2)."""
    times = []
    for i in range(candidates):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(11)]
        launch(i), launch(i)
        events[0].record()
        for event in events[1:]:
            launch(i)
            event.record()
        events[-1].synchronize()
        times.append(statistics.median(a.elapsed_time(b) for a, b in zip(events, events[1:])))
    return min(range(candidates), key=times.__getitem__)


def _shape(x: Tensor, y: Tensor, out: Tensor, bias: Tensor | None, aux: Tensor | None, x_t: bool, y_t: bool,
           scales: tuple[Tensor, Tensor] | None) -> tuple[int, int, int]:
    """(rows, columns, k) of _matmul's product, after checking what cuBLASLt takes: dtypes, layout, alignment,
    shapes and device; a ValueError names what does not fit."""
    tensors = [t for t in (x, y, out, bias, aux) if t is not None]
    if x.dtype == torch.float8_e4m3fn:
        if (y.dtype != x.dtype or any(t.dtype != torch.bfloat16 for t in (out, bias, aux) if t is not None)
                or scales is None or any(s.dtype != torch.float32 or s.numel() != 1 for s in scales)
                or x_t or not y_t):
            raise ValueError("cuBLASLt FP8 GEMMs take e4m3 x and y.T, bf16 out, bias and auxiliary, and two "
                             "fp32 scales")
    elif x.dtype not in _DTYPES or any(t.dtype != x.dtype for t in tensors) or scales is not None:
        raise ValueError(f"cuBLASLt epilogue GEMMs take bf16 or fp16 tensors of one dtype, got "
                         f"{', '.join(str(t.dtype) for t in tensors)}")
    # x may also be the first columns of a wider matrix, rows 16 bytes aligned: gemm_bias_grad's inputs,
    # stored with columns of ones beside them.
    x_columns = x.dim() == 2 and x.stride(1) == 1 and x.stride(0) >= x.size(1) and x.stride(0) % 8 == 0
    if not all(t.is_contiguous() for t in tensors if t is not x) or not (x.is_contiguous() or
                                                                       (x_columns and not x_t)):
        raise ValueError("cuBLASLt epilogue GEMMs take contiguous tensors (x may be the first columns of a "
                         "wider matrix whose rows are 16-byte aligned)")
    # The heuristic is asked for algorithms that assume cuBLASLt's default 256-byte alignment, which
    # PyTorch's allocations have.
    if any(t.data_ptr() % 256 for t in tensors):
        raise ValueError("cuBLASLt epilogue GEMMs need 256-byte aligned tensors (fresh allocations, not offset views)")
    rows, k = reversed(x.shape) if x_t else x.shape
    k_y, columns = reversed(y.shape) if y_t else y.shape
    if (k_y != k or tuple(out.shape) != (rows, columns) or (aux is not None and aux.shape != out.shape)
            or (bias is not None and bias.shape != (columns,))):
        raise ValueError(f"cuBLASLt GEMM shapes do not match: {tuple(x.shape)} times {tuple(y.shape)} into "
                         f"{tuple(out.shape)}, bias {None if bias is None else tuple(bias.shape)}, auxiliary "
                         f"{None if aux is None else tuple(aux.shape)}")
    if aux is not None and columns % 8:
        raise ValueError(f"cuBLASLt's GELU epilogues need a multiple of 8 output columns, got {columns}")
    if any(t.device.type != "cuda" or t.device != x.device for t in tensors + list(scales or ())):
        raise ValueError(f"cuBLASLt GEMMs take tensors on one CUDA device, got "
                         f"{', '.join(str(t.device) for t in tensors)}")
    return rows, columns, k


def _matmul(epilogue: int, x: Tensor, y: Tensor, out: Tensor, bias: Tensor | None, aux: Tensor | None,
            x_t: bool = False, y_t: bool = False, algo: int | None = None,
            scales: tuple[Tensor, Tensor] | None = None) -> None:
    """out = op(x) @ op(y), op transposing where x_t / y_t, with `epilogue`; `bias` (one entry per column of
    out) and `aux` (out's shape) as the epilogue uses them. `algo` picks a heuristic candidate; by default,
    the one found fastest on the shape's first call (the heuristic's first while a CUDA graph is captured).
    With e4m3 x and y, `scales` are x's and y's inverse scales (0-d fp32 tensors that the product is
    multiplied by), out, bias and aux are bf16, and y must be transposed (Hopper's FP8 GEMMs read both
    operands along the summed dimension).
    """
    rows, columns, k = _shape(x, y, out, bias, aux, x_t, y_t, scales)
    if _library() is None:
        raise RuntimeError("cuBLASLt was not found: the GEMM epilogues need a CUDA build of PyTorch on a GPU")
    # Row-major out = op(x) @ op(y) is column-major out.T = op(y).T @ op(x).T: A is y, B is x.
    device_index = x.device.index
    ld_x = x.stride(0) if x.size(0) > 1 else x.size(1)   # a 1-row x's stride is arbitrary
    plan = _plan(device_index, epilogue, CUBLAS_OP_T if y_t else CUBLAS_OP_N, CUBLAS_OP_T if x_t else CUBLAS_OP_N,
                 columns, rows, k, _DTYPES[x.dtype], ld_x, _DTYPES[out.dtype])
    desc, a_layout, b_layout, d_layout, results, fastest = plan
    lib, (handle, workspace) = _library(), _handle(device_index)
    _set(lib, desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, ctypes.c_void_p(bias.data_ptr() if bias is not None else 0))
    _set(lib, desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
         ctypes.c_void_p(aux.data_ptr() if aux is not None else 0))
    if scales is not None:   # A is y, B is x
        _set(lib, desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, ctypes.c_void_p(scales[1].data_ptr()))
        _set(lib, desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, ctypes.c_void_p(scales[0].data_ptr()))
    alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
    stream = torch.cuda.current_stream(x.device).cuda_stream

    def launch(i):
        native.check(lib.cublasLtMatmul(handle, desc, ctypes.byref(alpha), ctypes.c_void_p(y.data_ptr()), a_layout,
                                        ctypes.c_void_p(x.data_ptr()), b_layout, ctypes.byref(beta),
                                        ctypes.c_void_p(out.data_ptr()), d_layout, ctypes.c_void_p(out.data_ptr()),
                                        d_layout, ctypes.byref(results[i].algo),
                                        ctypes.c_void_p(workspace.data_ptr()), ctypes.c_size_t(WORKSPACE_BYTES),
                                        ctypes.c_void_p(stream)), "cublasLtMatmul")

    with torch.cuda.device(x.device):
        if algo is None and fastest is None:
            if torch.cuda.is_current_stream_capturing():
                algo = 0
            else:
                # The heuristic's first choice can be slower than another of its candidates at these
                # shapes (BENCHMARKS.md, kernel tuning history). Timing makes the choice depend on the
                # run: results agree to rounding between runs, not bit for bit.
                algo = plan[5] = _fastest(launch, len(results))
        launch(fastest if algo is None else algo)


# --- GELU_AUX_BIAS: fuses the bias add, GELU and the store of GELU's input into the GEMM's epilogue, so
# that no separate pass reads the pre-activation to apply GELU.
def linear_gelu(x: Tensor, weight: Tensor, bias: Tensor,
                scales: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """(gelu(x @ weight.T + bias), x @ weight.T + bias) in one GEMM; x [M, K], weight [N, K], bias [N]. With
    e4m3 x and weight, `scales` are their inverse scales, and the outputs are in bias's dtype (bf16)."""
    h = torch.empty(x.size(0), weight.size(0), dtype=bias.dtype, device=x.device)
    a = torch.empty_like(h)
    _matmul(CUBLASLT_EPILOGUE_GELU_AUX_BIAS, x, weight, a, bias, h, y_t=True, scales=scales)
    return a, h


# --- DGELU: fuses GELU's derivative at the stored pre-activation into the input-gradient GEMM's epilogue,
# so that no separate pass reads the GEMM's output and the pre-activation. Not DGELU_BGRAD, which would
# also sum the bias gradient: its kernels were slower than this GEMM and a separate sum (BENCHMARKS.md).
def linear_dgelu(grad: Tensor, weight: Tensor, h: Tensor) -> Tensor:
    """grad_h = (grad @ weight) * gelu'(h) in one GEMM, the gradient through a = gelu(h) and y = a @ weight.T;
    grad [M, N2], weight [N2, N], h [M, N]."""
    grad_h = torch.empty_like(h)
    _matmul(CUBLASLT_EPILOGUE_DGELU, grad, weight, grad_h, None, h)
    return grad_h


def reference_linear_gelu(x: Tensor, weight: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """What linear_gelu computes, in PyTorch operations (GELU's tanh approximation, as GPT-2's)."""
    h = torch.addmm(bias, x, weight.t())
    return F.gelu(h, approximate="tanh"), h


def reference_linear_dgelu(grad: Tensor, weight: Tensor, h: Tensor) -> Tensor:
    """What linear_dgelu computes, in PyTorch operations."""
    return torch.ops.aten.gelu_backward(grad @ weight, h, approximate="tanh")
