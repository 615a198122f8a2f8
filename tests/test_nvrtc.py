"""Utils.kernels.native: the one native-library loader, and NVRTC compiling the CUDA
loss kernel's source. A CPU cannot run the kernel (tests/test_loss_kernel.py's gpu tests and
bench/loss_kernel.py do, on a GPU), but NVRTC compiles it without one: these tests compile the committed
source for the GPUs it is meant for, and check how a compile error and a missing GPU are reported."""
import ctypes
import sys

import pytest
import torch

from Utils.kernels import loss_kernel, native

needs_nvrtc = pytest.mark.skipif(sys.platform != "linux",
                                 reason="NVRTC's wheels (nvidia-cuda-nvrtc) are published for Linux only")


@needs_nvrtc
@pytest.mark.parametrize("arch", ["80", "90"])
@pytest.mark.parametrize("kernel", [loss_kernel._CUDA, loss_kernel._CUDA_E5M2],
                         ids=lambda k: k.name)
def test_loss_kernel_source_compiles(arch, kernel):
    # cp.async and the bf16x2 conversion need sm_80 or newer; Hopper (sm_90) is what it is tuned for.
    cubin = native.compile_cubin(kernel.source, kernel.name, arch, kernel.options)
    assert cubin[:4] == b"\x7fELF" and kernel.name.encode() in cubin


@needs_nvrtc
def test_compile_error_carries_nvrtc_log():
    source = 'extern "C" __global__ void broken(float* x) { x[0] = undeclared_name; }'
    with pytest.raises(RuntimeError, match=r"(?s)could not compile broken.*undeclared_name. is undefined"):
        native.compile_cubin(source, "broken", "90")


def test_no_gpu_is_one_line_saying_so():
    why = native.nvrtc_unavailable(torch.device("cpu"))
    assert why == "NVRTC kernels need a CUDA GPU"


def test_the_loader_skips_what_does_not_load_and_types_what_it_returns():
    libc = "libc.so.6" if sys.platform == "linux" else None
    if libc is None:
        pytest.skip("the C library's file name is Linux's")
    # A missing file, then a library without the function asked for, then one with it.
    lib = native.load(["libdoes-not-exist.so", libc], {"no_such_function_here": []})
    assert lib is None
    lib = native.load(["libdoes-not-exist.so", libc], {"abs": [native.INT]})
    assert lib is not None and lib.abs.argtypes == [ctypes.c_int] and lib.abs.restype is ctypes.c_int
    assert lib.abs(-3) == 3


def test_check_raises_with_what_failed_and_its_status():
    native.check(native.SUCCESS, "nothing")
    with pytest.raises(RuntimeError, match="cuModuleLoadData failed with status 218"):
        native.check(218, "cuModuleLoadData")


def test_a_library_already_loaded_is_found_by_its_stem():
    if sys.platform != "linux":
        pytest.skip("read from /proc/self/maps, which only Linux has")
    path = native.mapped_library("libc")
    assert path is not None and "/libc.so" in path
    assert native.mapped_library("libno-such-library") is None


class _RecordingDriver:
    """Stands in for the CUDA driver: records each call's name and arguments and returns success."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, args))
            return native.SUCCESS
        return call


def test_a_kernel_is_loaded_once_per_device_and_allowed_the_shared_memory_it_asks_for(monkeypatch):
    driver = _RecordingDriver()
    monkeypatch.setattr(native, "_driver", lambda: driver)
    monkeypatch.setattr(native, "_contexts", {})
    monkeypatch.setattr(native, "compile_cubin", lambda source, name, arch, options: b"cubin for sm_" + arch.encode())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    kernel = native.Kernel("source", "rows")
    kernel.prepare(torch.device("cuda", 1), shared_bytes=100_000)
    kernel.prepare(torch.device("cuda", 1), shared_bytes=50_000)   # less than allowed already: nothing to do
    names = [name for name, _ in driver.calls]
    # No context was current: the device's primary one was retained and made current for the block.
    assert names == ["cuCtxGetCurrent", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxPushCurrent_v2",
                     "cuModuleLoadData", "cuModuleGetFunction", "cuFuncSetAttribute", "cuCtxPopCurrent_v2",
                     "cuCtxGetCurrent", "cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2"]
    load, = [args for name, args in driver.calls if name == "cuModuleLoadData"]
    assert load[1] == b"cubin for sm_90"
    allow, = [args for name, args in driver.calls if name == "cuFuncSetAttribute"]
    # 8 is CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES in cuda.h's CUfunction_attribute: the literal, since the
    # driver reads a plain int and a wrong module constant would set another attribute.
    assert allow[1:] == (8, 100_000)
