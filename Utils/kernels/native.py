"""The one loader of the native libraries that the kernels call through ctypes: NVRTC, the CUDA driver and
cuBLASLt.

Each caller names its candidate files and the C signatures it uses; `load` returns the first candidate
that loads and has every one of those functions, each typed, so that ctypes passes every argument at
its declared width. Every function used this way returns a status int (nvrtcResult, CUresult,
cublasStatus_t), 0 for success.
"""
import ctypes
import glob
import os
import sys
from collections.abc import Iterable, Mapping, Sequence

# The C types the signatures are written in.
POINTER, INT, UINT, SIZE = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_size_t
INT64, UINT64, STRING = ctypes.c_int64, ctypes.c_uint64, ctypes.c_char_p

SUCCESS = 0   # NVRTC_SUCCESS (nvrtc.h), CUDA_SUCCESS (cuda.h), CUBLAS_STATUS_SUCCESS (cublas_api.h)

Signatures = Mapping[str, Sequence[type]]


def load(candidates: Iterable[str], signatures: Signatures) -> ctypes.CDLL | None:
    """The first of `candidates` (file names or paths) that loads and has every function of `signatures`,
    each typed to return a status int; None if none does."""
    for name in candidates:
        try:
            lib = ctypes.CDLL(name)
            for function, argtypes in signatures.items():
                getattr(lib, function).argtypes, getattr(lib, function).restype = list(argtypes), INT
        except (OSError, AttributeError):   # not found, not loadable, or too old to have a function
            continue
        return lib
    return None


def wheel_libraries(stem: str, major: str = "") -> list[str]:
    """Paths of `stem`.so* under site-packages/nvidia/*/lib, where NVIDIA's wheels put their libraries and
    the dynamic loader does not look; those of CUDA major version `major` first."""
    paths = sorted(p for d in sys.path for p in glob.glob(os.path.join(d, "nvidia", "*", "lib", f"{stem}.so*")))
    return sorted(paths, key=lambda p: not (major and os.path.basename(p).startswith(f"{stem}.so.{major}")))


def mapped_library(stem: str) -> str | None:
    """The path of the `stem`.so* that this process has loaded already (one PyTorch loaded, say), so that
    a second copy is not loaded beside it; None if none is, or where /proc does not exist (not Linux)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if f"/{stem}.so" in line}
    except OSError:
        return None
    return min(paths) if paths else None


def check(status: int, what: str) -> None:
    """Raise with `what` unless status is SUCCESS."""
    if status != SUCCESS:
        raise RuntimeError(f"{what} failed with status {status}")
