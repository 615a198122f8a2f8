"""Utils.kernels.fp8_dgelu: the MLP's GEMM of GELU's derivative on FP8 operands. On the CPU: the gradient's
row-by-row cast to e5m2, the operator's reference against the bf16 DGELU it replaces, the Triton kernel under
Triton's interpreter against the reference, and the MLP's gradients with it against the MLP's without. On a
GPU (the gpu tests): the kernel against the reference, eagerly and replayed from a CUDA graph."""
import pytest
import torch
import torch.nn as nn

from Utils.kernels import cublaslt, fp8_dgelu, gelu_epilogue
from Utils.kernels.fp8_loss import E4M3, E5M2, to_e4m3
from tests.conftest import run_interpreted

E5M2_STEP = 2.0 ** -3   # e5m2 keeps 2 mantissa bits: a normal value rounds within an eighth of itself


def _operands(M, K, N, seed=0, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    grad = (torch.randn(M, K, generator=g, device=device) * 1e-3).bfloat16()
    grad[1] *= 1e4     # rows of very different sizes, which one scale per tensor would squash
    grad[2] = 0        # a row of zeros
    weight = (torch.randn(K, N, generator=g, device=device) * 0.02).bfloat16()
    h = torch.randn(M, N, generator=g, device=device).bfloat16()
    return grad, weight, h


def test_each_row_is_cast_with_its_own_scale_and_comes_back_within_e5m2_rounding():
    grad, _, _ = _operands(48, 64, 16)
    g8, g_inv = fp8_dgelu.grad_to_e5m2(grad)
    assert g8.dtype == E5M2 and g8.shape == grad.shape and g_inv.dtype == torch.float32 and g_inv.shape == (48,)
    back, x = g8.float() * g_inv[:, None], grad.float()
    # Each row's largest value lands on e5m2's largest, and comes back as itself.
    nonzero = x.abs().amax(1) > 0
    assert torch.equal(g8.float().abs().amax(1)[nonzero], torch.full((47,), fp8_dgelu.E5M2_MAX))
    torch.testing.assert_close(back.abs().amax(1), x.abs().amax(1), rtol=1e-6, atol=0)
    normal = x.abs() > x.abs().amax(1, keepdim=True) * 2.0 ** -14   # above e5m2's subnormals, row by row
    assert ((back - x).abs() <= E5M2_STEP * x.abs())[normal].all()
    assert (back - x).abs().max() > 0      # and it is a rounding: not exact
    assert torch.equal(g8[2].float(), torch.zeros(64)) and torch.isfinite(g_inv).all()


def test_the_reference_is_the_bf16_dgelu_within_fp8_rounding():
    grad, weight, h = _operands(64, 32, 48)
    g8, g_inv = fp8_dgelu.grad_to_e5m2(grad)
    w8_t, w_inv = to_e4m3(weight.t().contiguous())
    assert w8_t.dtype == E4M3 and w8_t.shape == (48, 32)
    got = fp8_dgelu.linear_dgelu(g8, g_inv, w8_t, w_inv, h).float()
    want = cublaslt.reference_linear_dgelu(grad.float(), weight.float(), h.float())
    rel = ((got - want).norm() / want.norm()).item()
    assert 0 < rel < 0.1
    assert torch.equal(got[2], torch.zeros(48))   # the row of zeros stays zeros


def test_the_operator_passes_pytorchs_operator_checks():
    grad, weight, h = _operands(32, 32, 16)
    w8_t, w_inv = to_e4m3(weight.t().contiguous())
    # Not test_schema: it multiplies the inputs, which PyTorch does not do for FP8 tensors on a CPU.
    torch.library.opcheck(fp8_dgelu.linear_dgelu, (*fp8_dgelu.grad_to_e5m2(grad), w8_t, w_inv, h),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_fits_needs_every_dimension_a_multiple_of_16():
    assert fp8_dgelu.fits(torch.empty(32, 48), torch.empty(48, 64))
    assert not fp8_dgelu.fits(torch.empty(24, 48), torch.empty(48, 64))
    assert not fp8_dgelu.fits(torch.empty(32, 48), torch.empty(48, 72))


def test_without_a_hopper_gpu_it_is_unavailable_in_one_line():
    why = fp8_dgelu.unavailable(torch.device("cpu"))
    assert why.startswith("the FP8 DGELU kernel needs a Hopper GPU") and "\n" not in why


KERNEL_CHECK = """
    import json
    import torch
    from Utils.kernels import fp8_dgelu
    from Utils.kernels.fp8_loss import to_e4m3
    from tests.test_fp8_dgelu import _operands

    grad, weight, h = _operands(*SHAPE)
    g8, g_inv = fp8_dgelu.grad_to_e5m2(grad)
    w8_t, w_inv = to_e4m3(weight.t().contiguous())
    got, want = fp8_dgelu.launch(g8, g_inv, w8_t, w_inv, h).float(), fp8_dgelu.reference(g8, g_inv, w8_t, w_inv, h).float()
    scale = want.abs().amax(1, keepdim=True).clamp(min=1e-30)
    print(json.dumps(dict(interpreted=fp8_dgelu.INTERPRETED, dtype=str(got.dtype), shape=list(got.shape),
                          err=((got - want).abs() / scale).max().item(), zero_row=got[2].abs().max().item())))
"""


# The tile is 128 x 256 (x 128): rows and columns that are not multiples of it, and shapes smaller than it.
@pytest.mark.parametrize("shape", [(200, 256, 512), (48, 128, 96)], ids=["partial-tiles", "under-one-tile"])
def test_the_triton_kernel_is_the_reference_under_the_interpreter(repo_root, shape):
    r = run_interpreted(f"\n    SHAPE = {shape!r}" + KERNEL_CHECK, repo_root)
    assert r["interpreted"] and r["shape"] == [shape[0], shape[2]]
    assert r["err"] <= 2.0 ** -7   # the same fp32 product, each rounded to bf16: one bf16 step apart at most
    assert r["zero_row"] == 0


def _mlp_grads(fp8_grad):
    torch.manual_seed(0)
    fc, proj = nn.Linear(32, 128), nn.Linear(128, 32)
    x = torch.randn(4, 16, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = gelu_epilogue.gelu_mlp(x, fc, proj, fp8_grad=fp8_grad)
    y.float().backward(torch.linspace(-1, 1, y.numel()).view_as(y))
    return y, x.grad, fc.weight.grad, fc.bias.grad, proj.weight.grad


def test_with_it_the_mlp_computes_the_same_output_and_its_gradients_within_fp8_rounding(monkeypatch):
    calls = []
    op = fp8_dgelu.linear_dgelu
    monkeypatch.setattr(fp8_dgelu, "linear_dgelu", lambda *a: calls.append(1) or op(*a))
    with_fp8, without = _mlp_grads(True), _mlp_grads(False)
    assert calls == [1]
    assert torch.equal(with_fp8[0], without[0])            # the forward pass is untouched
    assert torch.equal(with_fp8[4], without[4])            # c_proj's weight gradient reads the bf16 gradient
    for got, want in zip(with_fp8[1:4], without[1:4]):     # what flows through GELU's derivative: e5m2's rounding
        rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert 0 < rel < 0.1


# ---------------------------------------------------------------------------------------------
# On a GPU: the kernel itself.

def _gpu():
    if not torch.cuda.is_available() or fp8_dgelu.unavailable(torch.device("cuda")):
        pytest.skip("needs a Hopper GPU and Triton")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1024, 1040], ids=["whole-tiles", "partial-tile"])
def test_on_a_gpu_the_kernel_is_the_reference(tokens):
    _gpu()
    grad, weight, h = _operands(tokens, 768, 3072, device="cuda")
    g8, g_inv = fp8_dgelu.grad_to_e5m2(grad)
    w8_t, w_inv = to_e4m3(weight.t().contiguous())
    got = fp8_dgelu.linear_dgelu(g8, g_inv, w8_t, w_inv, h).float()
    want = fp8_dgelu.reference(g8, g_inv, w8_t, w_inv, h).float()
    # tanh.approx.f32 (about 2^-11) under bf16's rounding of the result
    assert ((got - want).abs() / want.abs().amax(1, keepdim=True).clamp(min=1e-30)).max() < 2.0 ** -7
    assert got[2].abs().max() == 0


@pytest.mark.gpu
def test_on_a_gpu_the_kernel_replays_from_a_cuda_graph():
    _gpu()
    grad, weight, h = _operands(1024, 768, 3072, device="cuda")
    g8, g_inv = fp8_dgelu.grad_to_e5m2(grad)
    w8_t, w_inv = to_e4m3(weight.t().contiguous())
    eager = fp8_dgelu.linear_dgelu(g8, g_inv, w8_t, w_inv, h)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_dgelu.linear_dgelu(g8, g_inv, w8_t, w_inv, h)
    h.copy_(torch.randn_like(h))   # new inputs in place: the replay reads them
    graph.replay()
    assert torch.equal(out, fp8_dgelu.linear_dgelu(g8, g_inv, w8_t, w_inv, h)) and not torch.equal(out, eager)
