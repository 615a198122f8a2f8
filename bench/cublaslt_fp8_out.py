"""Asks cuBLASLt's heuristic, without running a GEMM, whether it offers an FP8 output (D) at c_fc's input-gradient
shape at batch 64 (D[3,072 x 65,536] = A[768 x 3,072]^T B[768 x 65,536], column-major), for each mix of A/B, C and
D types, plain and with the DGELU epilogue: the first question behind writing c_fc's output gradient in FP8 from the
GEMM that makes it (BENCHMARKS.md, "What 1.30x at 124M would take"). One line per mix: the heuristic's status
(0 success, 15 not supported) and how many of its algorithms (of the first
Utils.kernels.cublaslt.CANDIDATES) are usable.

    python3 bench/cublaslt_fp8_out.py
"""
import ctypes
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from Utils.kernels import cublaslt as L, native  # noqa: E402


BF16, E4M3, E5M2 = L.CUDA_R_16BF, L.CUDA_R_8F_E4M3, 29   # cudaDataType_t (library_types.h)
NAMES = {BF16: "bf16", E4M3: "e4m3", E5M2: "e5m2"}
D_SCALE, AUX_DATA_TYPE = 20, 22   # cublasLtMatmulDescAttributes_t (cublasLt.h)
dev = torch.device("cuda")
L.prepare(dev)
lib, (handle, _) = L._library(), L._handle(0)
M, N, K = 3072, 65536, 768    # column-major: D[3072, 64*1024] = A[768, 3072]^T B[768, 65536], c_fc's dgrad
one = torch.ones((), device=dev)


def ask(a_t: int, b_t: int, c_t: int, d_t: int, epi: int) -> tuple[int, int]:
    """(the heuristic's status, its usable algorithms) for A, B, C and D of these cudaDataType_t values."""
    desc = ctypes.c_void_p()
    native.check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), L.CUBLAS_COMPUTE_32F, L.CUDA_R_32F), "create")
    L._set(lib, desc, L.CUBLASLT_MATMUL_DESC_TRANSA, ctypes.c_int32(L.CUBLAS_OP_T))
    L._set(lib, desc, L.CUBLASLT_MATMUL_DESC_TRANSB, ctypes.c_int32(L.CUBLAS_OP_N))
    L._set(lib, desc, L.CUBLASLT_MATMUL_DESC_EPILOGUE, ctypes.c_int32(epi))
    if epi != L.CUBLASLT_EPILOGUE_DEFAULT:
        L._set(lib, desc, L.CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, ctypes.c_int64(M))
        L._set(lib, desc, AUX_DATA_TYPE, ctypes.c_int32(BF16))
    if d_t != BF16:
        L._set(lib, desc, D_SCALE, ctypes.c_void_p(one.data_ptr()))
    if a_t != BF16:
        L._set(lib, desc, L.CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, ctypes.c_void_p(one.data_ptr()))
        L._set(lib, desc, L.CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, ctypes.c_void_p(one.data_ptr()))
    a, b = L._layout(lib, a_t, K, M, K), L._layout(lib, b_t, K, N, K)
    c, d = L._layout(lib, c_t, M, N, M), L._layout(lib, d_t, M, N, M)
    status, usable = L.heuristic(lib, handle, desc, a, b, c, d)
    return status, len(usable)


for epi_name, epi in (("default", L.CUBLASLT_EPILOGUE_DEFAULT), ("dgelu", L.CUBLASLT_EPILOGUE_DGELU)):
    for a_t, b_t, c_t, d_t in ((BF16, BF16, BF16, BF16), (BF16, BF16, BF16, E4M3), (BF16, BF16, E4M3, E4M3),
                               (BF16, BF16, BF16, E5M2), (E4M3, E4M3, BF16, BF16), (E4M3, E4M3, BF16, E4M3),
                               (E4M3, E5M2, BF16, E4M3), (E4M3, E5M2, BF16, E5M2)):
        try:
            status, usable = ask(a_t, b_t, c_t, d_t, epi)
        except Exception as e:   # a descriptor the library refuses outright
            status, usable = str(e)[:80], 0
        print(f"fp8 out | {epi_name:7} A {NAMES[a_t]} B {NAMES[b_t]} C {NAMES[c_t]} D {NAMES[d_t]}: "
              f"status {status}, usable algorithms {usable}")
