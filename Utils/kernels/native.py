"""The one loader of the native libraries that the kernels call through ctypes (NVRTC, the CUDA driver and
cuBLASLt), and CUDA C++ kernels compiled at run time by NVRTC and launched through the driver.

Each caller names its candidate files and the C signatures it uses; `load` returns the first candidate
that loads and has every one of those functions, each typed, so that ctypes passes every argument at
its declared width. Every function used this way returns a status int (nvrtcResult, CUresult,
cublasStatus_t), 0 for success.

`Kernel` is for a kernel that Triton cannot express: one that stages data in shared memory by hand. NVRTC
comes with PyTorch's CUDA wheels (PyTorch uses it itself) and the driver with the GPU, so this needs no
compiler and no build step. A kernel is compiled for the GPU at hand on first use, once per process and device.

Not torch.cuda._compile_kernel (PyTorch 2.11 to 2.13): it adds cpp_extension.include_paths("cuda") to every
compile, which raises OSError where no CUDA toolkit is found (PyTorch's pip wheels alone bring none), and it
cannot find NVRTC on a CPU build (it reads torch.version.cuda), where the tests compile these kernels. Its
launch would do: on the current stream, with more than 48 KiB of dynamic shared memory once allowed.
"""
import ctypes
import glob
import os
import sys
from collections.abc import Iterable, Mapping, Sequence

import torch

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


# --- NVRTC and the CUDA driver: CUDA C++ kernels compiled at run time and launched on the current stream.
# nvrtc.h
_NVRTC = {
    "nvrtcCreateProgram": [POINTER, STRING, STRING, INT, POINTER, POINTER],
    "nvrtcCompileProgram": [POINTER, INT, POINTER],
    "nvrtcGetProgramLogSize": [POINTER, POINTER],
    "nvrtcGetProgramLog": [POINTER, STRING],
    "nvrtcGetCUBINSize": [POINTER, POINTER],
    "nvrtcGetCUBIN": [POINTER, STRING],
    "nvrtcDestroyProgram": [POINTER],
}
# cuda.h
_DRIVER = {
    "cuInit": [UINT],
    "cuModuleLoadData": [POINTER, STRING],
    "cuModuleGetFunction": [POINTER, POINTER, STRING],
    "cuFuncSetAttribute": [POINTER, INT, INT],
    "cuLaunchKernel": [POINTER, UINT, UINT, UINT, UINT, UINT, UINT, UINT, POINTER, POINTER, POINTER],
    "cuCtxGetCurrent": [POINTER],
    "cuCtxGetDevice": [POINTER],
    "cuDeviceGet": [POINTER, INT],
    "cuDevicePrimaryCtxRetain": [POINTER, INT],
    "cuCtxPushCurrent_v2": [POINTER],
    "cuCtxPopCurrent_v2": [POINTER],
}
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8   # CUfunction_attribute (cuda.h)
DEFAULT_DYNAMIC_SHARED_BYTES = 48 << 10   # what a launch may use before that attribute is raised

_libraries = {}


def _nvrtc():
    if "nvrtc" not in _libraries:
        major = (torch.version.cuda or "").split(".")[0]
        # The NVRTC of PyTorch's own CUDA version first: already loaded where PyTorch uses it.
        loaded = [f"libnvrtc.so.{major}"] if major else []
        _libraries["nvrtc"] = load(loaded + wheel_libraries("libnvrtc", major) + ["libnvrtc.so"], _NVRTC)
    return _libraries["nvrtc"]


def _driver():
    if "driver" not in _libraries:
        lib = load(["libcuda.so.1", "libcuda.so"], _DRIVER)
        # Initialized already wherever PyTorch has used the GPU; idempotent, and needed before any other call.
        _libraries["driver"] = lib if lib is not None and lib.cuInit(0) == SUCCESS else None
    return _libraries["driver"]


def nvrtc_unavailable(device: torch.device) -> str | None:
    """None where NVRTC kernels compile and launch on this device, else why not."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "NVRTC kernels need a CUDA GPU"
    try:
        if _nvrtc() is None:
            return "NVRTC was not found (it comes with PyTorch's CUDA builds)"
        if _driver() is None:
            return "the CUDA driver library could not be loaded"
    except Exception as e:   # a broken library is as good as none
        return f"NVRTC or the CUDA driver failed to load ({type(e).__name__})"
    return None


def compile_cubin(source: str, name: str, arch: str, options: tuple[str, ...] = ()) -> bytes:
    """The cubin of `source` for sm_<arch> (e.g. "90"); a compile error raises with NVRTC's log."""
    lib = _nvrtc()
    if lib is None:
        raise RuntimeError("NVRTC was not found: it comes with PyTorch's CUDA builds")
    program = ctypes.c_void_p()
    check(lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), f"{name}.cu".encode(), 0, None, None),
          "nvrtcCreateProgram")
    try:
        flags = [f"--gpu-architecture=sm_{arch}".encode(), *(o.encode() for o in options)]
        status = lib.nvrtcCompileProgram(program, len(flags), (ctypes.c_char_p * len(flags))(*flags))
        if status != SUCCESS:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(program, log)
            raise RuntimeError(f"NVRTC could not compile {name}:\n{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        check(lib.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        check(lib.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


_contexts = {}   # device index -> its primary context, retained once


class _Context:
    """Makes the device's primary context (the one PyTorch uses) current for a block, where it is not already:
    a thread that has made no CUDA runtime call yet has none, and the driver API needs one."""

    def __init__(self, device_index: int):
        self.index, self.pushed = device_index, False

    def __enter__(self):
        lib, current, device = _driver(), ctypes.c_void_p(), ctypes.c_int(-1)
        check(lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
        if current.value and lib.cuCtxGetDevice(ctypes.byref(device)) == SUCCESS and device.value == self.index:
            return self
        if self.index not in _contexts:
            context = ctypes.c_void_p()
            check(lib.cuDeviceGet(ctypes.byref(device), self.index), "cuDeviceGet")
            check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device.value), "cuDevicePrimaryCtxRetain")
            _contexts[self.index] = context
        check(lib.cuCtxPushCurrent_v2(_contexts[self.index]), "cuCtxPushCurrent")
        self.pushed = True
        return self

    def __exit__(self, *exc):
        if self.pushed:
            _driver().cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class Kernel:
    """An `extern "C"` kernel of `source`, compiled on first launch on each device."""

    def __init__(self, source: str, name: str, options: tuple[str, ...] = ("--use_fast_math",)):
        self.source, self.name, self.options = source, name, tuple(options)
        self._functions = {}   # device index -> [module, function, dynamic shared memory allowed]

    def _function(self, device_index: int, shared_bytes: int) -> ctypes.c_void_p:
        """The kernel on this device, allowed `shared_bytes` of dynamic shared memory; call with the device's
        context current."""
        lib = _driver()
        if device_index not in self._functions:
            major, minor = torch.cuda.get_device_capability(device_index)
            cubin = compile_cubin(self.source, self.name, f"{major}{minor}", self.options)
            module, function = ctypes.c_void_p(), ctypes.c_void_p()
            check(lib.cuModuleLoadData(ctypes.byref(module), cubin), "cuModuleLoadData")
            check(lib.cuModuleGetFunction(ctypes.byref(function), module, self.name.encode()), "cuModuleGetFunction")
            self._functions[device_index] = [module, function, DEFAULT_DYNAMIC_SHARED_BYTES]
        entry = self._functions[device_index]
        if shared_bytes > entry[2]:
            check(lib.cuFuncSetAttribute(entry[1], CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_bytes),
                  f"allowing {self.name} {shared_bytes} bytes of shared memory")
            entry[2] = shared_bytes
        return entry[1]

    def prepare(self, device: torch.device, shared_bytes: int = 0) -> None:
        """Compile, load and allow `shared_bytes` now: none of these is a stream operation, so none to do
        while a CUDA graph is being captured."""
        index = _index(device)
        with _Context(index):
            self._function(index, shared_bytes)

    def launch(self, grid: tuple[int, int, int], block: tuple[int, int, int], args: list, device: torch.device,
               shared_bytes: int = 0) -> None:
        """Launch on `device`'s current stream (so it is captured into a CUDA graph like any other kernel).
        args: tensors (passed as their data pointers) and ctypes scalars, in the kernel's order."""
        index = _index(device)
        values = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else a for a in args]
        params = (ctypes.c_void_p * len(values))(*(ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values))
        stream = ctypes.c_void_p(torch.cuda.current_stream(index).cuda_stream)
        with _Context(index):
            function = self._function(index, shared_bytes)
            check(_driver().cuLaunchKernel(function, *grid, *block, shared_bytes, stream, params, None),
                  f"launching {self.name}")
