"""Bias gradients from the weight-gradient GEMM (Utils.bias_gemm), on the CPU: the same model and gradients
as autograd's sums, with the plain and the epilogue MLP, compiled so that the LayerNorm writes straight
into the buffer beside its column of ones."""
from dataclasses import replace

import pytest
import torch

from conftest import model_pair
from Utils import bias_gemm, cublaslt
from Utils.model import BIAS_GRADS, PRESETS, GPTConfig
from Utils.recipes import FUSED, MAX, Recipe

CONFIG = replace(PRESETS["tiny"], vocab_size=97)


def test_one_gemm_gives_the_weight_gradient_and_the_bias_gradient():
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(40, 24, generator=g, dtype=torch.float64), torch.randn(40, 16, generator=g, dtype=torch.float64)
    x_ones = bias_gemm.with_ones(x)
    assert x_ones.shape == (40, 24 + bias_gemm.ONES) and torch.equal(x_ones[:, :24], x)
    assert torch.equal(x_ones[:, 24:], torch.ones(40, bias_gemm.ONES, dtype=torch.float64))
    weight_grad, bias_grad = bias_gemm.weight_and_bias_grad(dy, x_ones)
    torch.testing.assert_close(weight_grad, dy.t() @ x, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(bias_grad, dy.sum(0), rtol=1e-14, atol=1e-14)


def _pair(dtype=torch.float64, **changes):
    return model_pair({"bias_grad": "gemm"}, dtype, **changes)


@pytest.mark.parametrize("mlp", ["modules", "epilogue"])
def test_model_gives_autograds_loss_and_gradients_in_float64(monkeypatch, mlp):
    calls = []
    real = bias_gemm.weight_and_bias_grad
    monkeypatch.setattr(bias_gemm, "weight_and_bias_grad", lambda *a: calls.append(1) or real(*a))
    plain, gemm, x, y = _pair(mlp=mlp)
    losses = []
    for model in (plain, gemm):
        _, loss = model(x, y)
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    assert len(calls) == 2 * CONFIG.n_layer   # c_attn's and c_fc's in every block
    for (name, a), b in zip(plain.named_parameters(), gemm.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-14, msg=name)


def test_under_bf16_autocast_it_computes_in_bf16_and_biases_get_fp32_gradients():
    plain, gemm, x, y = _pair(torch.float32, mlp="epilogue")
    losses = []
    for model in (plain, gemm):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) < 1e-3
    for layer in ("attn.c_attn", "mlp.c_fc"):
        a = plain.get_submodule(f"transformer.h.0.{layer}")
        b = gemm.get_submodule(f"transformer.h.0.{layer}")
        assert b.bias.grad.dtype == b.weight.grad.dtype == torch.float32
        # Both are sums of the same bf16 products in fp32, rounded to bf16: equal to that rounding.
        torch.testing.assert_close(b.bias.grad, a.bias.grad, rtol=2 ** -7, atol=1e-6)


def test_compiled_model_writes_the_layernorm_beside_its_ones_and_equals_eager():
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    _, gemm, x, y = _pair(torch.float32)
    _, eager = gemm(x, y)
    eager.backward()
    grads = [p.grad.clone() for p in gemm.parameters()]
    gemm.zero_grad(set_to_none=True)
    compiled = torch.compile(gemm)

    def step():
        loss = compiled(x, y)[1]
        loss.backward()
        return loss
    loss, code = run_and_get_code(step)
    code = "\n".join(code)
    # One generated kernel both normalizes and fills the concatenated buffer: no copy of X into it.
    kernels = {word for word in code.replace("(", " ").split() if "fused" in word}
    assert any("native_layer_norm" in k and "cat" in k for k in kernels), sorted(kernels)
    torch.testing.assert_close(loss, eager, rtol=1e-5, atol=1e-5)
    for a, p in zip(grads, gemm.parameters()):
        torch.testing.assert_close(p.grad, a, rtol=1e-4, atol=1e-5)


def _aligned(*shape):
    """A bf16 tensor whose data starts on a 256-byte boundary, as the GPU allocator's do."""
    n = torch.Size(shape).numel()
    buffer = torch.zeros(n + 128, dtype=torch.bfloat16)
    skip = (-buffer.data_ptr() % 256) // 2
    return buffer[skip:skip + n].view(shape)


@pytest.mark.parametrize("width, accepted", [(16, True), (12, False)])
def test_cublaslt_takes_x_as_the_first_columns_of_a_wider_matrix_with_aligned_rows(width, accepted):
    x = _aligned(4, width)[:, :8]   # rows 16 elements (32 bytes) apart: aligned; 12 (24 bytes): not
    args = dict(y=_aligned(16, 8), out=_aligned(4, 16), bias=_aligned(16), aux=_aligned(4, 16))
    # Everything else right, a CPU tensor is refused last: "CUDA device" means the layout was accepted.
    with pytest.raises(ValueError, match="CUDA device" if accepted else "contiguous"):
        cublaslt._matmul(cublaslt.GELU_AUX_BIAS, x, args["y"], args["out"], args["bias"], args["aux"], y_t=True)
    # Transposed, x must be contiguous: the leading dimension given to cuBLASLt is that of x's rows.
    with pytest.raises(ValueError, match="contiguous"):
        cublaslt._matmul(cublaslt.GELU_AUX_BIAS, _aligned(8, width)[:, :4], args["y"], args["out"], args["bias"],
                         args["aux"], x_t=True, y_t=True)


@pytest.mark.skipif(not (torch.cuda.is_available() and cublaslt.available(torch.device("cuda"))),
                    reason="cuBLASLt's epilogue GEMMs need a GPU")
def test_on_a_gpu_the_epilogue_gemm_reads_x_beside_its_ones_as_it_reads_x_alone():
    from Utils.gelu_mlp import linear_gelu
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(128, device="cuda", dtype=torch.bfloat16, generator=g)
    view = bias_gemm.with_ones(x)[:, :64]
    assert not view.is_contiguous()
    for got, want in zip(linear_gelu(view, w, b), linear_gelu(x, w, b)):
        torch.testing.assert_close(got, want)   # to rounding: each layout times its own candidate kernels


def test_recipes_name_it_and_refuse_it_with_fp8():
    assert BIAS_GRADS == ("sum", "gemm") and MAX.bias_grad == "gemm" and FUSED.bias_grad == "sum"
    with pytest.raises(ValueError, match="fp8"):
        Recipe("x", bf16=True, fp8=True, bias_grad="gemm")
    with pytest.raises(ValueError, match="bias_grad must be one of"):
        GPTConfig(bias_grad="fused")
