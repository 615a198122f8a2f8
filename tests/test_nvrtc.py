"""Utils.nvrtc and the CUDA loss kernel's source. A CPU cannot run the kernel (bench/loss_kernel.py checks its
results on a GPU), but NVRTC compiles it without one: these tests compile the committed source for the
GPUs it is meant for, and check how a compile error and a missing GPU are reported."""
import pytest
import torch

from Utils import ce_kernel, nvrtc


@pytest.mark.parametrize("arch", ["80", "90"])
def test_loss_kernel_source_compiles(arch):
    # cp.async and the bf16x2 conversion need sm_80 or newer; Hopper (sm_90) is what it is tuned for.
    cubin = nvrtc.compile_cubin(ce_kernel._CUDA.source, ce_kernel._CUDA.name, arch, ce_kernel._CUDA.options)
    assert cubin[:4] == b"\x7fELF" and ce_kernel._CUDA.name.encode() in cubin


def test_compile_error_carries_nvrtc_log():
    source = 'extern "C" __global__ void broken(float* x) { x[0] = undeclared_name; }'
    with pytest.raises(RuntimeError, match=r"(?s)could not compile broken.*undeclared_name. is undefined"):
        nvrtc.compile_cubin(source, "broken", "90")


def test_no_gpu_no_cuda_kernel():
    cpu = torch.device("cpu")
    assert not nvrtc.available(cpu)
    assert not ce_kernel._cuda_takes(torch.zeros(4, 64, dtype=torch.bfloat16))
    ce_kernel.prepare(cpu, 64)   # nothing to prepare without a GPU, and no error
