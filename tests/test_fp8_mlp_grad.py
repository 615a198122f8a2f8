"""Utils.kernels.fp8_linear's input-gradient GEMMs (the `fp8_mlp_grad` addition): the residual gradient in
e5m2 with a scale from its amax, times W_proj.T in e4m3; in gemm_bias_grad's linear and gelu_epilogue's MLP,
where only the input gradient may change."""
import pytest
import torch
import torch.nn as nn

from Utils.kernels import cublaslt, fp8_linear, gelu_epilogue, gemm_bias_grad
from Utils.kernels.fp8_loss import E4M3, E5M2

C = 64


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [1e-6, 1e-3, 10.0])
def test_the_gradients_cast_maps_its_amax_to_e5m2s_largest_and_keeps_two_mantissa_bits(dtype, size):
    torch.manual_seed(0)
    grad = (torch.randn(256, C) * size).to(dtype)
    g8, inv = fp8_linear.grad_to_e5m2(grad)
    assert g8.dtype == E5M2 and inv.dtype == torch.float32 and inv.dim() == 0
    assert g8.float().abs().max().item() == fp8_linear.E5M2_MAX   # the amax lands on the largest value
    back = g8.float() * inv
    normal = grad.float().abs() >= 2.0 ** -14 * inv                 # normal e5m2 numbers after scaling
    assert normal.float().mean() > 0.99
    # Round to nearest with 2 mantissa bits: at most half a step, 2^-3 of the value.
    assert ((back - grad.float()).abs() <= grad.float().abs() * 2.0 ** -3 * (1 + 1e-6))[normal].all()


def test_an_all_zero_gradient_casts_to_zeros_with_a_finite_scale():
    g8, inv = fp8_linear.grad_to_e5m2(torch.zeros(32, C, dtype=torch.bfloat16))
    assert torch.isfinite(inv) and (g8.float() == 0).all()


def test_the_weights_transposed_copy_is_e4m3_and_contiguous():
    w = torch.randn(C, 4 * C) * 0.02
    w8t, w_inv = fp8_linear.weight_t_to_e4m3(w)
    assert w8t.dtype == E4M3 and w8t.shape == (4 * C, C) and w8t.is_contiguous()
    assert rel(w8t.float().t() * w_inv, w) < 0.05


def operands(m=48, seed=6):
    torch.manual_seed(seed)
    grad = (torch.randn(m, C) * 1e-3).bfloat16()
    w = (torch.randn(C, 4 * C) * 0.02).bfloat16()   # c_proj's weight: [C, 4C]
    h = torch.randn(m, 4 * C).bfloat16()
    return grad, w, h


def test_the_input_gradient_and_dgelu_ops_compute_their_references_on_the_fp8_operands():
    grad, w, h = operands()
    g8, g_inv = fp8_linear.grad_to_e5m2(grad)
    w8t, w_inv = fp8_linear.weight_t_to_e4m3(w)
    got = fp8_linear.grad_dgelu(grad, w, h)
    assert got.dtype == torch.bfloat16 and torch.equal(got, fp8_linear.reference_dgelu(g8, g_inv, w8t, w_inv, h))
    # Near the bf16 operands' answer (a wrong scale or a transposed weight would be far off).
    assert rel(got, cublaslt.reference_linear_dgelu(grad.float(), w.float(), h.float())) < 0.15
    product = fp8_linear.grad_input(grad, w)
    assert product.dtype == torch.bfloat16
    assert rel(product, g8.float() @ w8t.float().t() * (g_inv * w_inv)) < 1e-2
    assert rel(product, grad.float() @ w.float()) < 0.15


def test_fp8_grad_in_the_linear_layer_changes_its_input_gradient_only():
    grad, w, _ = operands()
    layer = nn.Linear(4 * C, C).bfloat16()
    with torch.no_grad():
        layer.weight.copy_(w)
    x0 = torch.randn(grad.size(0), 4 * C).bfloat16()
    results = []
    for fp8_grad in (False, True):
        x = x0.clone().requires_grad_()
        layer.zero_grad()
        out = gemm_bias_grad.linear(x, layer, ones=False, fp8_grad=fp8_grad)
        out.backward(grad)
        results.append((out.detach(), x.grad, layer.weight.grad.clone(), layer.bias.grad.clone()))
    (out_bf16, gx_bf16, *gw_bf16), (out_fp8, gx_fp8, *gw_fp8) = results
    assert torch.equal(out_bf16, out_fp8)
    assert all(torch.equal(a, b) for a, b in zip(gw_bf16, gw_fp8))
    assert not torch.equal(gx_bf16, gx_fp8) and rel(gx_fp8, gx_bf16) < 0.15


def test_fp8_grad_in_the_epilogue_mlp_changes_the_backward_below_c_proj_only_and_not_for_odd_token_counts():
    torch.manual_seed(7)
    fc, proj = nn.Linear(C, 4 * C).bfloat16(), nn.Linear(4 * C, C).bfloat16()
    x0 = torch.randn(48, C).bfloat16()
    grad = (torch.randn(48, C) * 1e-3).bfloat16()

    def run(tokens, fp8_grad):
        x = x0[:tokens].clone().requires_grad_()
        fc.zero_grad(), proj.zero_grad()
        out = gelu_epilogue.gelu_mlp(x, fc, proj, ones=True, fp8_grad=fp8_grad)
        out.backward(grad[:tokens])
        return out.detach(), x.grad, fc.weight.grad.clone(), proj.weight.grad.clone(), proj.bias.grad.clone()

    bf16, fp8 = run(48, False), run(48, True)
    assert torch.equal(bf16[0], fp8[0])                                      # forward unchanged
    assert torch.equal(bf16[3], fp8[3]) and torch.equal(bf16[4], fp8[4])     # c_proj's own gradients too
    for below_bf16, below_fp8 in ((bf16[1], fp8[1]), (bf16[2], fp8[2])):    # x's and c_fc's from FP8's grad_h
        assert not torch.equal(below_bf16, below_fp8) and rel(below_fp8, below_bf16) < 0.15
    # 40 tokens: FP8 GEMMs need multiples of 16, so the backward stays bf16, gradient for gradient.
    assert all(torch.equal(a, b) for a, b in zip(run(40, False), run(40, True)))


def test_cublaslt_refuses_two_e5m2_operands():
    g8 = torch.zeros(32, C, dtype=E5M2)
    s = torch.ones((), dtype=torch.float32)
    with pytest.raises(ValueError, match="not both e5m2"):
        cublaslt._matmul(cublaslt.CUBLASLT_EPILOGUE_DGELU, g8, torch.zeros(4 * C, C, dtype=E5M2),
                         torch.empty(32, 4 * C, dtype=torch.bfloat16), None,
                         torch.empty(32, 4 * C, dtype=torch.bfloat16), y_t=True, scales=(s, s))


@pytest.mark.gpu
def test_cublaslts_fp8_dgelu_epilogue_and_the_scaled_input_gradient_match_their_references_on_the_gpu():
    why = fp8_linear.unavailable(torch.device("cuda")) if torch.cuda.is_available() else "no CUDA GPU"
    if why:
        pytest.skip(why)
    torch.manual_seed(8)
    grad = (torch.randn(4096, 768, device="cuda") * 1e-3).bfloat16()
    w = (torch.randn(768, 3072, device="cuda") * 0.02).bfloat16()
    h = torch.randn(4096, 3072, device="cuda").bfloat16()
    g8, g_inv = fp8_linear.grad_to_e5m2(grad)
    w8t, w_inv = fp8_linear.weight_t_to_e4m3(w)
    got = fp8_linear.linear_dgelu(g8, g_inv, w8t, w_inv, h)
    assert rel(got, fp8_linear.reference_dgelu(g8, g_inv, w8t, w_inv, h)) < 1e-2
    assert rel(got, cublaslt.reference_linear_dgelu(grad.float(), w.float(), h.float())) < 0.1
    assert rel(fp8_linear.grad_input(grad, w), grad.float() @ w.float()) < 0.1
