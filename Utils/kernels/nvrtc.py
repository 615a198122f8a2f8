"""CUDA C++ kernels compiled at run time with NVRTC and launched through the CUDA driver, both by ctypes.

For a kernel that Triton cannot express: one that stages data in shared memory by hand. NVRTC comes with
PyTorch's CUDA wheels (PyTorch uses it itself) and the driver with the GPU, so this needs no compiler
and no build step. Kernels are compiled for the GPU at hand on first use, once per process and device.

`available(device)` says whether it works here: a CUDA GPU, its driver and an NVRTC library.
"""
import ctypes
import glob
import os
import sys

import torch

_P, _INT, _UINT, _SIZE = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_size_t
_NVRTC = {
    "nvrtcCreateProgram": [_P, ctypes.c_char_p, ctypes.c_char_p, _INT, _P, _P],
    "nvrtcCompileProgram": [_P, _INT, _P],
    "nvrtcGetProgramLogSize": [_P, _P],
    "nvrtcGetProgramLog": [_P, ctypes.c_char_p],
    "nvrtcGetCUBINSize": [_P, _P],
    "nvrtcGetCUBIN": [_P, ctypes.c_char_p],
    "nvrtcDestroyProgram": [_P],
}
_DRIVER = {
    "cuInit": [_UINT],
    "cuModuleLoadData": [_P, ctypes.c_char_p],
    "cuModuleGetFunction": [_P, _P, ctypes.c_char_p],
    "cuFuncSetAttribute": [_P, _INT, _INT],
    "cuLaunchKernel": [_P, _UINT, _UINT, _UINT, _UINT, _UINT, _UINT, _UINT, _P, _P, _P],
    "cuCtxGetCurrent": [_P],
    "cuCtxGetDevice": [_P],
    "cuDeviceGet": [_P, _INT],
    "cuDevicePrimaryCtxRetain": [_P, _INT],
    "cuCtxPushCurrent_v2": [_P],
    "cuCtxPopCurrent_v2": [_P],
}
_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


def _load(names, signatures):
    """The first of `names` that loads and has every function of `signatures`, each typed (every one returns
    a status int); None if none does."""
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            for function, argtypes in signatures.items():
                getattr(lib, function).argtypes, getattr(lib, function).restype = argtypes, _INT
        except (OSError, AttributeError):
            continue
        return lib
    return None


_libraries = {}


def _nvrtc():
    if "nvrtc" not in _libraries:
        major = (torch.version.cuda or "").split(".")[0]
        # PyTorch's wheels put NVRTC under site-packages/nvidia/..., which the loader does not search; the
        # one of PyTorch's own CUDA version first.
        wheels = [p for d in sys.path for p in sorted(glob.glob(os.path.join(d, "nvidia", "*", "lib", "libnvrtc.so*")))
                  if "builtins" not in p]
        wheels.sort(key=lambda p: not (major and os.path.basename(p).startswith(f"libnvrtc.so.{major}")))
        loader = [f"libnvrtc.so.{major}"] if major else []
        _libraries["nvrtc"] = _load(loader + wheels + ["libnvrtc.so"], _NVRTC)
    return _libraries["nvrtc"]


def _driver():
    if "driver" not in _libraries:
        lib = _load(["libcuda.so.1", "libcuda.so"], _DRIVER)
        # Initialized already wherever PyTorch has used the GPU; idempotent, and needed before any other call.
        _libraries["driver"] = lib if lib is not None and lib.cuInit(0) == 0 else None
    return _libraries["driver"]


def available(device):
    try:
        return device.type == "cuda" and torch.cuda.is_available() and _nvrtc() is not None and _driver() is not None
    except Exception:   # a broken library is as good as none
        return False


def _check(status, what):
    if status != 0:
        raise RuntimeError(f"{what} failed with status {status}")


def compile_cubin(source, name, arch, options=()):
    """The cubin of `source` for sm_<arch> (e.g. "90"); a compile error raises with NVRTC's log."""
    lib = _nvrtc()
    if lib is None:
        raise RuntimeError("NVRTC was not found: it comes with PyTorch's CUDA builds")
    program = ctypes.c_void_p()
    _check(lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), f"{name}.cu".encode(), 0, None, None),
           "nvrtcCreateProgram")
    try:
        flags = [f"--gpu-architecture=sm_{arch}".encode(), *(o.encode() for o in options)]
        status = lib.nvrtcCompileProgram(program, len(flags), (ctypes.c_char_p * len(flags))(*flags))
        if status != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(program, log)
            raise RuntimeError(f"NVRTC could not compile {name}:\n{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        _check(lib.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _check(lib.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


_contexts = {}   # device index -> its primary context, retained once


class _Context:
    """Makes the device's primary context (the one PyTorch uses) current for a block, where it is not already:
    a thread that has made no CUDA runtime call yet has none, and the driver API needs one."""

    def __init__(self, device_index):
        self.index, self.pushed = device_index, False

    def __enter__(self):
        lib, current, device = _driver(), ctypes.c_void_p(), ctypes.c_int(-1)
        _check(lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
        if current.value and lib.cuCtxGetDevice(ctypes.byref(device)) == 0 and device.value == self.index:
            return self
        if self.index not in _contexts:
            context = ctypes.c_void_p()
            _check(lib.cuDeviceGet(ctypes.byref(device), self.index), "cuDeviceGet")
            _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device.value), "cuDevicePrimaryCtxRetain")
            _contexts[self.index] = context
        _check(lib.cuCtxPushCurrent_v2(_contexts[self.index]), "cuCtxPushCurrent")
        self.pushed = True
        return self

    def __exit__(self, *exc):
        if self.pushed:
            _driver().cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))


class Kernel:
    """An `extern "C"` kernel of `source`, compiled on first launch on each device."""

    def __init__(self, source, name, options=("--use_fast_math",)):
        self.source, self.name, self.options = source, name, tuple(options)
        self._functions = {}   # device index -> (module, function, dynamic shared memory allowed)

    def _function(self, device_index, shared_bytes):
        """The kernel on this device, allowed `shared_bytes` of dynamic shared memory; call with the device's
        context current."""
        lib = _driver()
        if device_index not in self._functions:
            major, minor = torch.cuda.get_device_capability(device_index)
            cubin = compile_cubin(self.source, self.name, f"{major}{minor}", self.options)
            module, function = ctypes.c_void_p(), ctypes.c_void_p()
            _check(lib.cuModuleLoadData(ctypes.byref(module), cubin), "cuModuleLoadData")
            _check(lib.cuModuleGetFunction(ctypes.byref(function), module, self.name.encode()), "cuModuleGetFunction")
            self._functions[device_index] = [module, function, 48 << 10]
        entry = self._functions[device_index]
        if shared_bytes > entry[2]:
            _check(lib.cuFuncSetAttribute(entry[1], _MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_bytes),
                   f"allowing {self.name} {shared_bytes} bytes of shared memory")
            entry[2] = shared_bytes
        return entry[1]

    def prepare(self, device, shared_bytes=0):
        """Compile, load and allow `shared_bytes` now: none of these is a stream operation, so none to do
        while a CUDA graph is being captured."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        with _Context(index):
            self._function(index, shared_bytes)

    def launch(self, grid, block, args, device, shared_bytes=0):
        """Launch on `device`'s current stream (so it is captured into a CUDA graph like any other kernel).
        args: tensors (passed as their data pointers) and ctypes scalars, in the kernel's order."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        values = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else a for a in args]
        params = (ctypes.c_void_p * len(values))(*(ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values))
        stream = ctypes.c_void_p(torch.cuda.current_stream(index).cuda_stream)
        with _Context(index):
            function = self._function(index, shared_bytes)
            _check(_driver().cuLaunchKernel(function, *grid, *block, shared_bytes, stream, params, None),
                   f"launching {self.name}")
