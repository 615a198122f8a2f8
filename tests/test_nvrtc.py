"""Utils.nvrtc and the CUDA loss kernel's source. A CPU cannot run the kernel (bench/loss_kernel.py checks its
results on a GPU), but NVRTC compiles it without one: these tests compile the committed source for the
GPUs it is meant for, and check how a compile error and a missing GPU are reported."""
import sys

import pytest
import torch

from Utils import ce_kernel, nvrtc
from Utils.model import PRESETS
from Utils.recipes import MAX, apply_loss


needs_nvrtc = pytest.mark.skipif(sys.platform != "linux",
                                 reason="NVRTC's wheels (nvidia-cuda-nvrtc) are published for Linux only")


@needs_nvrtc
@pytest.mark.parametrize("arch", ["80", "90"])
def test_loss_kernel_source_compiles(arch):
    # cp.async and the bf16x2 conversion need sm_80 or newer; Hopper (sm_90) is what it is tuned for.
    cubin = nvrtc.compile_cubin(ce_kernel._CUDA.source, ce_kernel._CUDA.name, arch, ce_kernel._CUDA.options)
    assert cubin[:4] == b"\x7fELF" and ce_kernel._CUDA.name.encode() in cubin


@needs_nvrtc
def test_compile_error_carries_nvrtc_log():
    source = 'extern "C" __global__ void broken(float* x) { x[0] = undeclared_name; }'
    with pytest.raises(RuntimeError, match=r"(?s)could not compile broken.*undeclared_name. is undefined"):
        nvrtc.compile_cubin(source, "broken", "90")


def test_no_gpu_no_cuda_kernel():
    cpu = torch.device("cpu")
    assert not nvrtc.available(cpu)
    assert not ce_kernel._cuda_takes(torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.long))
    ce_kernel.prepare(cpu, 64)   # nothing to prepare without a GPU, and no error


def _pretend_gpu(monkeypatch, capability):
    monkeypatch.setattr(nvrtc, "available", lambda device: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(ce_kernel, "_shared_fits", lambda device, n_cols: True)
    monkeypatch.setattr(ce_kernel, "_cuda_failure", None)


def test_pre_ampere_gpus_take_the_triton_kernel(monkeypatch):
    _pretend_gpu(monkeypatch, (7, 5))   # no cp.async: the CUDA kernel would not compile
    assert not ce_kernel._cuda_usable(torch.device("cuda"))
    _pretend_gpu(monkeypatch, (8, 0))
    assert ce_kernel._cuda_usable(torch.device("cuda"))


def test_a_kernel_that_cannot_be_built_falls_back_with_a_note(monkeypatch):
    cuda = torch.device("cuda")
    _pretend_gpu(monkeypatch, (9, 0))

    def broken(device, shared_bytes=0):
        raise RuntimeError("cuModuleLoadData failed with status 218\n(details)")

    monkeypatch.setattr(ce_kernel._CUDA, "prepare", broken)
    config, note = apply_loss(PRESETS["gpt2"], MAX, cuda)
    if ce_kernel._triton_kernel is not None:
        assert config.loss == "chunked_kernel" and note == ("the CUDA loss kernel could not be built here "
                                                            "(cuModuleLoadData failed with status 218): the "
                                                            "Triton kernel instead")
    else:
        assert config.loss == "chunked" and "needs a GPU with NVRTC or Triton" in note
    assert not ce_kernel._cuda_usable(cuda)   # and no later call tries again
