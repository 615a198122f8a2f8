"""The MLP with c_fc's bias and GELU in GEMM epilogues (Utils.gelu_mlp), on the CPU, where its two
operators run their PyTorch definitions: the same model, gradients and compiled graph as the plain MLP.
The cuBLASLt kernels themselves need a GPU (results/logs/gelu-epilogue-gemms-*.log checks them there)."""
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from conftest import model_pair
from Utils import cublaslt, gelu_mlp as gelu_mlp_module
from Utils.gelu_mlp import gelu_mlp, linear_dgelu, linear_gelu
from Utils.model import MLPS, PRESETS, GPTConfig
from Utils.recipes import FUSED, MAX, Recipe, apply_mlp

CPU = torch.device("cpu")
CONFIG = replace(PRESETS["tiny"], vocab_size=97)


def _pair(dtype=torch.float64, **changes):
    return model_pair({"mlp": "epilogue"}, dtype, **changes)


@pytest.fixture
def op_calls(monkeypatch):
    """Counts the two operators' calls, so that a test knows the epilogue path ran at all."""
    calls = {"linear_gelu": 0, "linear_dgelu": 0}
    for name in calls:
        op = getattr(gelu_mlp_module, name)

        def counted(*args, _op=op, _name=name):
            calls[_name] += 1
            return _op(*args)
        monkeypatch.setattr(gelu_mlp_module, name, counted)
    return calls


def test_epilogue_mlp_gives_the_plain_models_loss_and_gradients_in_float64(op_calls):
    plain, fused, x, y = _pair()
    assert fused.transformer.h[0].mlp.epilogue and not plain.transformer.h[0].mlp.epilogue
    losses = []
    for model in (plain, fused):
        _, loss = model(x, y)
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    assert op_calls == {"linear_gelu": CONFIG.n_layer, "linear_dgelu": CONFIG.n_layer}
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


def test_under_bf16_autocast_the_mlp_computes_in_bf16_and_parameters_get_fp32_gradients(op_calls):
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
    assert op_calls == {"linear_gelu": CONFIG.n_layer, "linear_dgelu": CONFIG.n_layer}
    assert abs(losses[0] - losses[1]) < 2e-2
    fc = fused.transformer.h[0].mlp.c_fc
    assert fc.weight.grad.dtype == fc.bias.grad.dtype == torch.float32
    torch.testing.assert_close(fc.weight.grad, plain.transformer.h[0].mlp.c_fc.weight.grad, rtol=0.1, atol=2e-3)


def test_compiled_epilogue_model_equals_eager():
    _, fused, x, y = _pair(torch.float32)
    graphs = []

    def backend(gm, example_inputs):   # records the traced graph, then compiles it as torch.compile would
        graphs.append(gm)
        return torch._inductor.compile(gm, example_inputs)
    _, eager = fused(x, y)
    eager.backward()
    eager_grads = [p.grad.clone() for p in fused.parameters()]
    fused.zero_grad(set_to_none=True)
    _, compiled = torch.compile(fused, fullgraph=True, backend=backend)(x, y)
    compiled.backward()
    # The autograd function was traced whole (its forward and backward as subgraphs), its operators as calls.
    code = "".join(m.code for gm in graphs for m in gm.modules() if isinstance(m, torch.fx.GraphModule))
    assert "gpt_suite.linear_gelu" in code and "gpt_suite.linear_dgelu" in code
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


def _aligned(*shape):
    """A bf16 tensor whose data starts on a 256-byte boundary, as the GPU allocator's do (the CPU's need not)."""
    n = torch.Size(shape).numel()
    buffer = torch.zeros(n + 128, dtype=torch.bfloat16)
    skip = (-buffer.data_ptr() % 256) // 2
    return buffer[skip:skip + n].view(shape)


def _gemm_args(**changes):
    args = dict(x=_aligned(4, 8), y=_aligned(16, 8), out=_aligned(4, 16), bias=_aligned(16), aux=_aligned(4, 16))
    args.update(changes)
    return args


@pytest.mark.parametrize("changes, message", [
    ({}, "CUDA device"),                                                   # everything right but the device
    (dict(x=torch.randn(4, 8)), "bf16 or fp16"),                          # fp32 matrices
    (dict(bias=torch.randn(16)), "bf16 or fp16"),                         # an fp32 bias
    (dict(y=torch.randn(8, 16).bfloat16().t()), "contiguous"),            # a transposed view
    (dict(x=_aligned(5, 8)[1:]), "aligned"),                             # a view offset by one row
    (dict(y=_aligned(16, 6)), "shapes do not match"),                     # inner dimensions differ
    (dict(bias=_aligned(12)), "shapes do not match"),                     # bias of the wrong length
    (dict(aux=_aligned(4, 12)), "shapes do not match"),                   # auxiliary output of the wrong shape
    (dict(y=_aligned(12, 8), out=_aligned(4, 12), bias=_aligned(12), aux=_aligned(4, 12)),
     "multiple of 8"),                                                     # 12 output columns
])
def test_cublaslt_gemms_refuse_what_they_cannot_run_with_one_line_errors(changes, message):
    args = _gemm_args(**changes)
    with pytest.raises(ValueError, match=message) as error:
        cublaslt._matmul(cublaslt.GELU_AUX_BIAS, args["x"], args["y"], args["out"], args["bias"], args["aux"],
                         y_t=True)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("make", [lambda: GPTConfig(mlp="fused"), lambda: Recipe("x", mlp="fused")])
def test_unknown_mlp_names_are_refused(make):
    with pytest.raises(ValueError, match="mlp must be one of"):
        make()
    assert MLPS == ("modules", "epilogue")
