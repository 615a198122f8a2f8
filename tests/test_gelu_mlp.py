"""The MLP with c_fc's bias and GELU in GEMM epilogues (Utils.gelu_mlp), on the CPU, where its two
operators run their PyTorch definitions: the same model, gradients and compiled graph as the plain MLP.
The cuBLASLt kernels themselves need a GPU (results/logs/gelu-epilogue-gemms-*.log checks them there)."""
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from Utils import cublaslt
from Utils.gelu_mlp import gelu_mlp, linear_dgelu, linear_gelu
from Utils.model import MLPS, PRESETS, GPT, GPTConfig
from Utils.recipes import FUSED, MAX, Recipe, apply_mlp

CPU = torch.device("cpu")
CONFIG = replace(PRESETS["tiny"], vocab_size=97)


def _pair(dtype=torch.float64, **changes):
    torch.manual_seed(0)
    plain = GPT(replace(CONFIG, **changes)).to(dtype)
    fused = GPT(replace(CONFIG, mlp="epilogue", **changes)).to(dtype)
    fused.load_state_dict(plain.state_dict())
    idx = torch.randint(0, CONFIG.vocab_size, (3, 24))
    return plain, fused, idx, torch.roll(idx, -1, 1)


def test_epilogue_mlp_gives_the_plain_models_loss_and_gradients_in_float64():
    plain, fused, x, y = _pair()
    losses = []
    for model in (plain, fused):
        _, loss = model(x, y)
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    for (name, a), b in zip(plain.named_parameters(), fused.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-14, msg=name)


def test_operators_match_their_definitions_and_gradients_flow_to_every_input():
    torch.manual_seed(1)
    x, w1, b1 = torch.randn(10, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    a, h = linear_gelu(x, w1, b1)
    torch.testing.assert_close(h, x @ w1.t() + b1)
    torch.testing.assert_close(a, F.gelu(h, approximate="tanh"))
    g, w2 = torch.randn(10, 5, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)
    h.requires_grad_(True)
    expected, = torch.autograd.grad(F.gelu(h, approximate="tanh") @ w2.t(), h, g)
    torch.testing.assert_close(linear_dgelu(g, w2, h.detach()), expected)

    fc, proj = torch.nn.Linear(6, 8).double(), torch.nn.Linear(8, 5).double()
    inputs = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: gelu_mlp(t, fc, proj), (inputs,))
    out = gelu_mlp(inputs, fc, proj)
    assert out.shape == (2, 5, 5)
    out.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in (fc.weight, fc.bias, proj.weight, proj.bias))


@pytest.mark.parametrize("op, args", [
    (linear_gelu, (torch.randn(4, 3), torch.randn(5, 3), torch.randn(5))),
    (linear_dgelu, (torch.randn(4, 2), torch.randn(2, 5), torch.randn(4, 5))),
])
def test_operators_pass_pytorchs_operator_checks(op, args):
    # Fake (shape-only) implementations agree with the real ones, as torch.compile relies on.
    torch.library.opcheck(op, args)


def test_under_bf16_autocast_the_mlp_computes_in_bf16_and_parameters_get_fp32_gradients():
    plain, fused, x, y = _pair(torch.float32)
    seen = []
    handle = fused.transformer.h[0].mlp.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    losses = []
    for model in (plain, fused):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
    handle.remove()
    assert seen == [torch.bfloat16]
    assert abs(losses[0] - losses[1]) < 2e-2
    fc = fused.transformer.h[0].mlp.c_fc
    assert fc.weight.grad.dtype == fc.bias.grad.dtype == torch.float32
    torch.testing.assert_close(fc.weight.grad, plain.transformer.h[0].mlp.c_fc.weight.grad, rtol=0.1, atol=2e-3)


def test_compiled_epilogue_model_equals_eager():
    _, fused, x, y = _pair(torch.float32)
    _, eager = fused(x, y)
    eager.backward()
    eager_grads = [p.grad.clone() for p in fused.parameters()]
    fused.zero_grad(set_to_none=True)
    _, compiled = torch.compile(fused, fullgraph=True)(x, y)
    compiled.backward()
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    for a, b in zip(eager_grads, fused.parameters()):
        torch.testing.assert_close(b.grad, a, rtol=1e-4, atol=1e-5)


def test_apply_mlp_falls_back_to_the_plain_mlp_with_a_note_where_cublaslt_cannot_run():
    assert MAX.mlp == "epilogue" and FUSED.mlp == "modules"
    config, note = apply_mlp(CONFIG, MAX, CPU)
    assert config.mlp == "modules" and "cuBLASLt" in note
    config, note = apply_mlp(CONFIG, FUSED, CPU)
    assert config.mlp == "modules" and note is None
    assert not cublaslt.available(CPU)


def test_cublaslt_calls_refuse_what_they_cannot_run_with_one_line_errors():
    x, w, b = torch.randn(4, 8).bfloat16(), torch.randn(16, 8).bfloat16(), torch.randn(16).bfloat16()
    with pytest.raises((RuntimeError, ValueError)) as error:
        cublaslt.linear_gelu(x, w, b)
    assert "\n" not in str(error.value) and "cuBLASLt" in str(error.value)


@pytest.mark.parametrize("make", [lambda: GPTConfig(mlp="fused"), lambda: Recipe("x", mlp="fused")])
def test_unknown_mlp_names_are_refused(make):
    with pytest.raises(ValueError, match="mlp must be one of"):
        make()
    assert MLPS == ("modules", "epilogue")
