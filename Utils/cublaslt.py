"""cuBLASLt matmuls with a GELU epilogue, called through ctypes on the library that PyTorch itself loads.

cuBLASLt can finish a GEMM's output tiles in registers before they are stored: add a bias, apply GELU
(tanh approximation, as GPT-2's), write the pre-activation as a second "auxiliary" output, or, going
backward, multiply by GELU's derivative at that stored pre-activation and sum the result's rows into a
bias gradient. PyTorch reaches only the forward GELU epilogue (torch._addmm_activation), without the
auxiliary output that a backward pass needs; these two calls reach both. Everything here is row-major
PyTorch on the outside; cuBLASLt is column-major, so each call computes the transposed product.

`available(device)` says whether they run here: a CUDA GPU whose cuBLASLt library can be found.
"""
import ctypes
import ctypes.util
import functools

import torch

_OP_N, _OP_T = 0, 1
_CUDA_R_32F, _CUDA_R_16F, _CUDA_R_16BF = 0, 2, 14
_COMPUTE_32F = 68
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8
_DESC_AUX_POINTER, _DESC_AUX_LD = 11, 12
_PREF_MAX_WORKSPACE_BYTES = 1
GELU_AUX_BIAS = 32 | 128 | 4   # bias, then GELU; the GELU's input stored as the auxiliary output
DGELU_BGRAD = 64 | 128 | 16    # times GELU'(auxiliary input); the result's row sums as bias gradient
WORKSPACE_BYTES = 32 << 20     # what cuBLAS asks for on Hopper
_DTYPES = {torch.bfloat16: _CUDA_R_16BF, torch.float16: _CUDA_R_16F}


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


@functools.cache
def _library():
    """The cuBLASLt that PyTorch loaded (so that both use one copy), else the system's; None if neither."""
    try:
        torch.cuda.current_blas_handle()   # loads cuBLAS, and with it cuBLASLt
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcublasLt.so" in line}
        path = min(paths) if paths else ctypes.util.find_library("cublasLt")
        return ctypes.CDLL(path) if path else None
    except Exception:   # no GPU, no /proc (not Linux), or a library that will not load
        return None


def available(device):
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8 and _library() is not None


def _check(status, what):
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} failed with status {status}")


def _handle(device_index):
    if device_index not in _handles:
        handle = ctypes.c_void_p()
        with torch.cuda.device(device_index):
            _check(_library().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{device_index}")
        _handles[device_index] = handle, workspace
    return _handles[device_index]


_handles = {}
_plans = {}


def _set(lib, desc, attribute, value):
    _check(lib.cublasLtMatmulDescSetAttribute(desc, attribute, ctypes.byref(value), ctypes.sizeof(value)),
           "cublasLtMatmulDescSetAttribute")


def _layout(lib, dtype, rows, cols, ld):
    layout = ctypes.c_void_p()
    _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, ctypes.c_uint64(rows),
                                          ctypes.c_uint64(cols), ctypes.c_int64(ld)), "cublasLtMatrixLayoutCreate")
    return layout


def _plan(device_index, epilogue, trans_a, m, n, k, dtype):
    """The descriptors and the heuristic's first algorithm for D[m, n] = op(A) @ B (column-major), made once
    per shape: the bias and auxiliary pointers are set on the descriptor at each call."""
    key = device_index, epilogue, trans_a, m, n, k, dtype
    if key in _plans:
        return _plans[key]
    lib, (handle, _) = _library(), _handle(device_index)
    desc = ctypes.c_void_p()
    _check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _CUDA_R_32F), "cublasLtMatmulDescCreate")
    _set(lib, desc, _DESC_TRANSA, ctypes.c_int32(trans_a))
    _set(lib, desc, _DESC_TRANSB, ctypes.c_int32(_OP_N))
    _set(lib, desc, _DESC_EPILOGUE, ctypes.c_int32(epilogue))
    _set(lib, desc, _DESC_AUX_LD, ctypes.c_int64(m))
    a = _layout(lib, dtype, k, m, k) if trans_a == _OP_T else _layout(lib, dtype, m, k, m)
    b, d = _layout(lib, dtype, k, n, k), _layout(lib, dtype, m, n, m)
    preference = ctypes.c_void_p()
    _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(preference)), "cublasLtMatmulPreferenceCreate")
    limit = ctypes.c_uint64(WORKSPACE_BYTES)
    _check(lib.cublasLtMatmulPreferenceSetAttribute(preference, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(limit),
                                                    ctypes.sizeof(limit)), "cublasLtMatmulPreferenceSetAttribute")
    result, count = _HeuristicResult(), ctypes.c_int()
    _check(lib.cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, d, d, preference, 1, ctypes.byref(result),
                                              ctypes.byref(count)), "cublasLtMatmulAlgoGetHeuristic")
    if count.value == 0:
        raise RuntimeError(f"cuBLASLt has no algorithm for epilogue {epilogue} at m={m} n={n} k={k}")
    _plans[key] = desc, a, b, d, result
    return _plans[key]


def _matmul(epilogue, trans_a, a, b, out, bias, aux):
    """out[n, m] (row-major) = b[n, k] @ op(a) with `epilogue`; `bias` and `aux` as the epilogue uses them."""
    if _library() is None:
        raise RuntimeError("cuBLASLt was not found: the GEMM epilogues need a CUDA build of PyTorch on a GPU")
    tensors = (a, b, out, bias, aux)
    if a.dtype not in _DTYPES or any(t.dtype != a.dtype or not t.is_contiguous() for t in tensors):
        raise ValueError(f"cuBLASLt epilogue GEMMs take contiguous bf16 or fp16 tensors of one dtype, got "
                         f"{', '.join(str(t.dtype) for t in tensors)}")
    if any(t.data_ptr() % 16 for t in tensors):
        raise ValueError("cuBLASLt epilogue GEMMs need 16-byte aligned tensors")
    n, k = b.shape
    m, k_a = a.shape if trans_a == _OP_T else reversed(a.shape)
    if k_a != k:
        raise ValueError(f"cuBLASLt GEMM shapes do not match: {tuple(b.shape)} times {tuple(a.shape)}")
    device_index = a.device.index if a.device.index is not None else torch.cuda.current_device()
    desc, a_layout, b_layout, d_layout, result = _plan(device_index, epilogue, trans_a, m, n, k, _DTYPES[a.dtype])
    lib, (handle, workspace) = _library(), _handle(device_index)
    _set(lib, desc, _DESC_BIAS_POINTER, ctypes.c_void_p(bias.data_ptr()))
    _set(lib, desc, _DESC_AUX_POINTER, ctypes.c_void_p(aux.data_ptr()))
    alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
    stream = torch.cuda.current_stream(a.device).cuda_stream
    _check(lib.cublasLtMatmul(handle, desc, ctypes.byref(alpha), ctypes.c_void_p(a.data_ptr()), a_layout,
                              ctypes.c_void_p(b.data_ptr()), b_layout, ctypes.byref(beta),
                              ctypes.c_void_p(out.data_ptr()), d_layout, ctypes.c_void_p(out.data_ptr()), d_layout,
                              ctypes.byref(result.algo), ctypes.c_void_p(workspace.data_ptr()),
                              ctypes.c_size_t(WORKSPACE_BYTES), ctypes.c_void_p(stream)), "cublasLtMatmul")


def linear_gelu(x, weight, bias):
    """(gelu(x @ weight.T + bias), x @ weight.T + bias) in one GEMM; x [M, K], weight [N, K], bias [N]."""
    h = torch.empty(x.size(0), weight.size(0), dtype=x.dtype, device=x.device)
    a = torch.empty_like(h)
    _matmul(GELU_AUX_BIAS, _OP_T, weight, x, a, bias, h)
    return a, h


def linear_dgelu(grad, weight, h):
    """(grad_h, grad_bias) for a = gelu(h) followed by y = a @ weight.T: grad_h = (grad @ weight) * gelu'(h)
    and grad_bias = grad_h summed over rows, in one GEMM; grad [M, N2], weight [N2, N], h [M, N]."""
    grad_h = torch.empty_like(h)
    grad_bias = torch.empty(h.size(1), dtype=h.dtype, device=h.device)
    _matmul(DGELU_BGRAD, _OP_N, weight, grad, grad_h, grad_bias, h)
    return grad_h, grad_bias
