"""Utils.kernels.loss_kernel: the cross-entropy kernel against its reference. On the CPU the Triton kernel
runs under Triton's interpreter (in one subprocess: the interpreter must be chosen before Triton is
imported), over float32, float64 and bf16 logits; the CUDA kernel runs in the gpu tests."""
import types

import pytest
import torch
import torch.nn.functional as F

from conftest import run_interpreted
from Utils.kernels import loss_kernel

CPU = torch.device("cpu")
DTYPES = ["float32", "float64", "bfloat16"]

# ---------------------------------------------------------------------------------------------
# The Triton kernel under the interpreter, against the reference in float64

KERNEL_CHECKS = """
    import json
    import torch
    from Utils.kernels import loss_kernel

    def bf16_ulp(v):
        # bf16 keeps 8 significant bits: its spacing around v is 2^(exponent - 8), frexp's mantissa in [0.5, 1)
        return torch.ldexp(torch.ones_like(v), torch.frexp(v).exponent - 8)

    def check(logits, y, vocab):
        # The reference over the same rounded logits the kernel reads, in float64.
        ref_loss, ref_grad = loss_kernel.reference(logits.double(), y, vocab, torch.float64)
        ptr, before = logits.data_ptr(), logits.clone()
        loss = loss_kernel.cross_entropy_grad(logits, y, vocab)
        err = (logits.double() - ref_grad).abs()
        return dict(loss_dtype=str(loss.dtype), loss_shape=list(loss.shape),
                    loss_err=(loss.double() - ref_loss).abs().max().item(),
                    grad_err=err.max().item(), grad_err_ulps=(err / bf16_ulp(ref_grad)).max().item(),
                    padded_max=logits[:, vocab:].abs().max().item() if logits.size(1) > vocab else 0.0,
                    same_storage=logits.data_ptr() == ptr, overwritten=not torch.equal(logits, before))

    def logits_and_targets(rows, vocab, cols, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(rows, cols, generator=g) * 3
        x[:, vocab:] = 30.0   # would dominate the softmax and the loss if the padding were not masked
        y = torch.randint(0, vocab, (rows,), generator=g)
        y[0], y[1] = 0, vocab - 1
        return x, y

    out = {"unavailable": loss_kernel.unavailable(torch.device("cpu"))}
    x, y = logits_and_targets(70, 1000, 1024, seed=0)
    for dtype in ("float32", "float64", "bfloat16"):
        out[dtype] = check(x.to(getattr(torch, dtype)), y, 1000)
    # Three 2048-column blocks, the last partly padding, and a maximum in the last one for half the rows:
    # the online softmax must rescale its running sums across blocks.
    x, y = logits_and_targets(6, 4500, 4608, seed=1)
    x[::2, 4300] = 15.0
    out["blocks"] = check(x, y, 4500)
    # Each element of the first pass either raises its lane's running maximum or does not: every element
    # does in a rising row, none after the first in a falling or a constant one (where each ties it). A
    # lane sees every 2048th column: a row whose 2048-column blocks alternate between -60 and 60 has each
    # lane jump by 120, where exp(-120) underflows to zero in fp32.
    x, y = logits_and_targets(6, 4500, 4608, seed=3)
    x[0, :4500] = 2.5
    x[1, :4500] = torch.linspace(-50, 50, 4500)
    x[2, :4500] = torch.linspace(50, -50, 4500)
    x[3, :2048], x[3, 2048:4096], x[3, 4096:4500] = -60.0, 60.0, -60.0
    x[4, :2048], x[4, 2048:4096], x[4, 4096:4500] = 60.0, -60.0, 60.0
    out["update_forms"] = check(x, y, 4500)
    # Rows contiguous but further apart than their width (a column slice): only the slice is written.
    x, y = logits_and_targets(70, 1000, 1100, seed=2)
    x[:, 1000:] = 30.0
    outside = x[:, 1024:].clone()
    out["strided"] = check(x[:, :1024], y, 1000)
    out["strided"]["outside_untouched"] = torch.equal(x[:, 1024:], outside)
    print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def kernel_results(repo_root):
    return run_interpreted(KERNEL_CHECKS, repo_root)


def test_the_interpreter_makes_the_kernel_available_on_a_cpu(kernel_results):
    assert kernel_results["unavailable"] is None


@pytest.mark.parametrize("case", DTYPES + ["blocks", "update_forms", "strided"])
def test_kernel_rows_losses_and_gradient_match_the_reference(kernel_results, case):
    r = kernel_results[case]
    assert r["loss_dtype"] == "torch.float32" and r["loss_shape"] == [6 if case in ("blocks", "update_forms") else 70]
    # The kernel works in fp32 whatever the logits' dtype: the losses (about 7 to 30, up to 128 in
    # update_forms, where one fp32 ulp is 7.6e-6) are off by a few ulps of fp32 rounding only (the
    # interpreter runs numpy's exp and log, whose last bit differs between CPUs' vector units).
    assert r["loss_err"] < 5e-5, r
    if case == "bfloat16":
        # One bf16 rounding of an fp32 value (the interpreter truncates, a GPU rounds to nearest): under one
        # unit in the last place of the exact gradient, whatever its size.
        assert r["grad_err_ulps"] < 1.001, r
    else:
        assert r["grad_err"] < 1e-6, r
    assert r["padded_max"] == 0.0           # exactly zero, though those columns held the largest logits
    assert r["same_storage"] and r["overwritten"]
    if case == "strided":
        assert r["outside_untouched"]


# ---------------------------------------------------------------------------------------------
# The reference, and what the op checks on the host

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_reference_is_cross_entropy_and_its_gradient_over_the_unpadded_columns(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(9, 40, generator=g) * 3).to(dtype)
    logits[:, 33:] = 50.0   # padding: masked out of the softmax
    targets = torch.randint(0, 33, (9,), generator=g)
    x = logits[:, :33].double().requires_grad_()
    want = F.cross_entropy(x, targets, reduction="sum")
    want_grad, = torch.autograd.grad(want, x)
    row_loss, grad = loss_kernel.reference(logits, targets, 33, acc=torch.float64)
    assert grad.dtype == dtype and row_loss.dtype == torch.float64
    torch.testing.assert_close(row_loss.sum(), want, rtol=1e-12, atol=1e-12)
    tol = dict(rtol=0, atol=2 ** -8) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad[:, :33].double(), want_grad, **tol)
    assert torch.count_nonzero(grad[:, 33:]) == 0


def test_kernel_refuses_a_device_it_cannot_run_on_in_one_line(monkeypatch):
    monkeypatch.setattr(loss_kernel, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="needs a GPU with NVRTC or Triton") as e:
        loss_kernel.cross_entropy_grad(torch.zeros(70, 1024), torch.zeros(70, dtype=torch.long), 1000)
    assert "\n" not in str(e.value) and "plain chunked loss" in str(e.value)


@pytest.mark.parametrize("logits, targets, vocab, match", [
    (torch.zeros(1024, 70).t(), torch.zeros(70, dtype=torch.long), 1000, "contiguous rows"),
    (torch.zeros(2, 70, 1024), torch.zeros(70, dtype=torch.long), 1000, "2-D"),
    (torch.zeros(70, 1024), torch.zeros(69, dtype=torch.long), 1000, "one per row"),
    (torch.zeros(70, 1024), torch.zeros(70, 1, dtype=torch.long), 1000, "one per row"),
    (torch.zeros(70, 1024), torch.zeros(70, dtype=torch.long), 1025, "vocab_size=1025"),
    (torch.zeros(70, 1024), torch.zeros(70, dtype=torch.long), 0, "vocab_size=0"),
])
def test_kernel_refuses_shapes_it_would_read_past(monkeypatch, logits, targets, vocab, match):
    # Checked on the host before any launch, where the kernel itself would read out of bounds; the check
    # runs here with the device test passed, without the interpreter.
    monkeypatch.setattr(loss_kernel, "unavailable", lambda device: None)
    with pytest.raises(ValueError, match=match):
        loss_kernel.cross_entropy_grad(logits, targets, vocab)
    assert torch.count_nonzero(logits) == 0


def test_kernel_is_unavailable_on_a_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.setattr(loss_kernel, "INTERPRETED", False)
    assert "needs a GPU with NVRTC or Triton" in loss_kernel.unavailable(CPU)


def test_without_a_gpu_there_is_no_cuda_kernel_and_nothing_to_prepare():
    assert not loss_kernel._cuda_takes(torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.long))
    assert loss_kernel.prepare(CPU, 64) is None


def _pretend_gpu(monkeypatch, capability):
    monkeypatch.setattr(loss_kernel.native, "nvrtc_unavailable", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(loss_kernel, "_shared_fits", lambda device, n_cols: True)
    monkeypatch.setattr(loss_kernel, "_cuda_failure", None)


# a block's shared memory on an H100 or H200, an A100, an Ada GPU; whether a 50,304-column row fits
@pytest.mark.parametrize("optin_kib, fits", [(227, True), (163, True), (99, False)])
def test_the_cuda_pass_takes_a_row_only_where_it_fits_in_a_blocks_shared_memory(monkeypatch, optin_kib, fits):
    props = types.SimpleNamespace(shared_memory_per_block_optin=optin_kib * 1024)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    assert loss_kernel._shared_fits(torch.device("cuda"), 50304) == fits


def test_pre_ampere_gpus_take_the_triton_kernel(monkeypatch):
    _pretend_gpu(monkeypatch, (7, 5))   # no cp.async: the CUDA kernel would not compile
    assert not loss_kernel._cuda_usable(torch.device("cuda"))
    _pretend_gpu(monkeypatch, (8, 0))
    assert loss_kernel._cuda_usable(torch.device("cuda"))


def test_a_cuda_kernel_that_cannot_be_built_leaves_a_note_and_the_triton_kernel(monkeypatch):
    cuda = torch.device("cuda")
    _pretend_gpu(monkeypatch, (9, 0))

    def broken(device, shared_bytes=0):
        raise RuntimeError("cuModuleLoadData failed with status 218\n(details)")

    monkeypatch.setattr(loss_kernel._CUDA, "prepare", broken)
    assert loss_kernel.prepare(cuda, 50304) == ("the CUDA loss kernel could not be built here (cuModuleLoadData "
                                                "failed with status 218): the Triton kernel instead")
    assert not loss_kernel._cuda_usable(cuda)   # and no later call tries again
    assert loss_kernel.prepare(cuda, 50304) is None


# ---------------------------------------------------------------------------------------------
# On a GPU: the CUDA kernel and the Triton kernel, eagerly and replayed from a CUDA graph

VOCAB, PADDED = 50257, 50304   # GPT-2's vocabulary, and the logits' width the chunked loss gives the kernel


def _gpu_logits(rows=512, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(rows, PADDED, device="cuda", generator=g) * 3).to(dtype)
    targets = torch.randint(0, VOCAB, (rows,), device="cuda", generator=g)
    return logits, targets


@pytest.mark.gpu
@pytest.mark.parametrize("use_cuda", [True, False], ids=["cuda", "triton"])
def test_on_a_gpu_the_kernel_matches_the_reference(monkeypatch, use_cuda):
    device = torch.device("cuda")
    assert loss_kernel.unavailable(device) is None
    assert loss_kernel.prepare(device, PADDED) is None
    monkeypatch.setattr(loss_kernel, "USE_CUDA", use_cuda)
    logits, targets = _gpu_logits()
    assert loss_kernel._cuda_takes(logits, targets) is use_cuda
    want_loss, want_grad = loss_kernel.reference(logits.double(), targets, VOCAB, torch.float64)
    loss = loss_kernel.cross_entropy_grad(logits, targets, VOCAB)
    assert (loss.double() - want_loss).abs().max() < 1e-4
    # Gradients lie in (-1, 1): one rounding to bf16 is off by at most half its spacing below 1, 2^-9.
    assert (logits.double() - want_grad).abs().max() <= 2 ** -9 * 1.01
    assert torch.count_nonzero(logits[:, VOCAB:]) == 0


@pytest.mark.gpu
def test_on_a_gpu_the_cuda_kernel_replays_from_a_cuda_graph():
    device = torch.device("cuda")
    assert loss_kernel.prepare(device, PADDED) is None   # compiled and allowed its shared memory before capture
    logits, targets = _gpu_logits(rows=256)
    assert loss_kernel._cuda_takes(logits, targets)
    eager = logits.clone()
    eager_loss = loss_kernel.cross_entropy_grad(eager, targets, VOCAB)
    buffer = logits.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_loss = loss_kernel.cross_entropy_grad(buffer, targets, VOCAB)
    buffer.copy_(logits)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_loss, eager_loss) and torch.equal(buffer, eager)
