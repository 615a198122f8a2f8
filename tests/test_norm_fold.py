"""Utils.kernels.norm_fold and the `fold_norm` addition: a LayerNorm's γ and β applied by the linear layer that
reads its output, against the plain LayerNorm then linear layer: Utils.ladder.linear's layer in float64 (the
same function and gradients, to rounding), float32 and bf16; its MLP in float64 and float32; both with their
forward GEMM in FP8; and the built model."""
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from Utils.kernels import norm_fold
from Utils.kernels.fp8 import normed_to_e4m3
from Utils.ladder import linear, modules
from Utils.ladder.apply import build
from Utils.ladder.registry import RegistryError, resolve
from Utils.model_config import PRESETS
from Utils.ladder.linear import LinearPlan

CPU = torch.device("cpu")
SMALL = replace(PRESETS["tiny"], vocab_size=97)
TOLERANCES = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=1e-4, atol=1e-5)}


def _norm(width, dtype, g):
    """A LayerNorm whose weight and bias are far from their initial 1 and 0, so that folding them matters."""
    norm = nn.LayerNorm(width).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(width, generator=g, dtype=dtype))
        norm.bias.copy_(0.5 * torch.randn(width, generator=g, dtype=dtype))
    return norm


def test_the_fold_and_its_gradients_are_the_chain_rule_of_the_plain_layer():
    g = torch.Generator().manual_seed(0)
    xhat, weight, bias, gamma, beta, dy = (torch.randn(*s, generator=g, dtype=torch.float64)
                                           for s in ((30, 12), (7, 12), (7,), (12,), (12,), (30, 7)))
    w, b = norm_fold.folded(weight, bias, gamma, beta)
    plain = [t.clone().requires_grad_() for t in (weight, bias, gamma, beta)]
    y = F.linear(xhat * plain[2] + plain[3], plain[0], plain[1])
    torch.testing.assert_close(F.linear(xhat, w, b), y, rtol=1e-12, atol=1e-12)
    y.backward(dy)
    got = norm_fold.unfolded_grads(dy.t() @ xhat, dy.sum(0), weight, gamma, beta)
    for mine, autograd in zip(got, plain):
        torch.testing.assert_close(mine, autograd.grad, rtol=1e-12, atol=1e-12)


def test_the_reference_is_the_affine_then_the_layer_and_runs_anywhere():
    g = torch.Generator().manual_seed(3)
    norm, layer = _norm(12, torch.float64, g), nn.Linear(12, 7).double()
    xhat = torch.randn(30, 12, generator=g, dtype=torch.float64)
    w, b = norm_fold.folded(layer.weight, layer.bias, norm.weight, norm.bias)
    torch.testing.assert_close(norm_fold.reference(xhat, layer, norm), F.linear(xhat, w, b), rtol=1e-12, atol=1e-12)
    assert norm_fold.unavailable(CPU) is None


def _plain_and_folded(dtype, width=24, out=16):
    """(x, norm, layer) drawn in float64 and rounded to dtype, so that float64 can give the exact answer."""
    torch.manual_seed(1)   # nn.Linear draws its initial weights from the global generator
    g = torch.Generator().manual_seed(1)
    norm, layer = _norm(width, torch.float64, g), nn.Linear(width, out).double()
    x = torch.randn(3, 10, width, generator=g, dtype=torch.float64)
    with torch.no_grad():
        for p in (*norm.parameters(), *layer.parameters()):
            p.copy_(p.to(dtype))
    return x.to(dtype), norm, layer


@pytest.mark.parametrize("ones", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_folded_linear_is_layernorm_then_linear(dtype, ones):
    # Against the plain LayerNorm and layer in float64 on the same values: the fold in dtype must be as close to
    # it as dtype allows.
    results = []
    for folded, run_dtype in ((True, dtype), (False, torch.float64)):
        x, norm, layer = _plain_and_folded(dtype)
        x = x.to(run_dtype).requires_grad_()
        norm, layer = norm.to(run_dtype), layer.to(run_dtype)
        if folded:
            y = linear.linear(F.layer_norm(x, (24,)), layer, LinearPlan(bias_grad=ones, fold=True), norm)
        else:
            y = linear.linear(norm(x), layer, LinearPlan(bias_grad=ones))
        y.backward(torch.linspace(-1, 1, y.numel(), dtype=run_dtype).view_as(y))
        results.append((y, x.grad, layer.weight.grad, layer.bias.grad, norm.weight.grad, norm.bias.grad))
    for got, want in zip(*results):
        assert got.dtype == dtype and got.shape == want.shape
        scale = want.abs().max().item()
        tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
        torch.testing.assert_close(got.double(), want, rtol=0, atol=tol * scale)


def test_folded_linear_gradcheck_in_float64():
    g = torch.Generator().manual_seed(2)
    x, weight, bias, gamma, beta = (torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)
                                    for s in ((2, 3, 5), (4, 5), (4,), (5,), (5,)))

    def folded_linear(x, weight, bias, gamma, beta):
        layer, norm = nn.Module(), nn.Module()   # gradcheck differentiates their tensors as inputs
        layer.weight, layer.bias, norm.weight, norm.bias = weight, bias, gamma, beta
        return linear.linear(x, layer, LinearPlan(bias_grad=True, fold=True), norm)
    assert torch.autograd.gradcheck(folded_linear, (x, weight, bias, gamma, beta))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_folded_gelu_mlp_is_layernorm_then_mlp(dtype):
    results = []
    for folded in (True, False):
        torch.manual_seed(3)
        g = torch.Generator().manual_seed(3)
        norm, fc, proj = _norm(16, dtype, g), nn.Linear(16, 64).to(dtype), nn.Linear(64, 16).to(dtype)
        x = torch.randn(2, 8, 16, generator=g, dtype=dtype, requires_grad=True)
        if folded:
            y = linear.gelu_mlp(F.layer_norm(x, (16,)), fc, proj, LinearPlan(bias_grad=True, fold=True), norm)
        else:
            y = linear.gelu_mlp(norm(x), fc, proj, LinearPlan(bias_grad=True))
        y.backward(torch.linspace(-1, 1, y.numel(), dtype=dtype).view_as(y))
        results.append((y, x.grad, fc.weight.grad, fc.bias.grad, proj.weight.grad, norm.weight.grad, norm.bias.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, **TOLERANCES[dtype])


def test_normalized_input_casts_to_e4m3_with_the_bound_of_a_row_alone():
    # The largest entry a normalized row of C features can hold is sqrt(C - 1): one entry against C - 1 equal ones.
    row = torch.zeros(1, 768)
    row[0, 0] = 1000.0   # large against LayerNorm's eps
    xhat = F.layer_norm(row, (768,))
    assert abs(xhat.max().item() - 767 ** 0.5) < 1e-3
    x8, inv = normed_to_e4m3(xhat, None, None)
    assert torch.isfinite(x8.float()).all() and x8.float().abs().max().item() <= 448
    torch.testing.assert_close(x8.float() * inv, xhat, rtol=2 ** -3, atol=1e-6)


def _built(names, dtype=torch.float64):
    b = build(names, CPU, SMALL, seed=0, loader=None)
    b.model.to(dtype)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in b.model.named_parameters():
            if ".ln_" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=dtype) * 0.5 + name.endswith("weight"))
    return b


@pytest.mark.parametrize("base", [(), ("gemm_bias_grad",)])
def test_fold_norm_in_the_model_keeps_its_parameters_loss_and_gradients(base):
    idx = torch.randint(0, SMALL.vocab_size, (2, 16), generator=torch.Generator().manual_seed(5))
    runs = {}
    for names in (base, base + ("fold_norm",)):
        b = _built(names)
        loss = b.model(idx, idx)[1]
        loss.backward()
        runs[names] = b, loss, {n: p.grad for n, p in b.model.named_parameters()}
    (plain, loss_a, grads_a), (folded, loss_b, grads_b) = runs.values()
    block = folded.model.transformer.h[0]
    assert isinstance(block.ln_1, modules.NormalizeOnly) and isinstance(block.ln_2, modules.NormalizeOnly)
    assert block.attn.c_attn.norm is block.ln_1 and block.mlp.c_fc.norm is block.ln_2
    assert block.attn.c_attn.plan == block.mlp.c_fc.plan == LinearPlan(bias_grad=bool(base), fold=True)
    assert type(folded.model.transformer.ln_f) is nn.LayerNorm   # the output layer has no bias to take β
    assert list(folded.model.state_dict()) == list(plain.model.state_dict())
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-12, atol=1e-12)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-9, atol=1e-12, msg=name)


def test_fold_norm_alone_swaps_the_plain_layers_and_excludes_torchaos_fp8():
    b = _built(("fold_norm",))
    block = b.model.transformer.h[0]
    assert type(block.attn.c_attn) is type(block.mlp.c_fc) is modules.PlannedLinear
    assert block.attn.c_attn.plan == block.mlp.c_fc.plan == LinearPlan(fold=True)
    assert block.attn.c_attn.norm is block.ln_1 and block.mlp.c_fc.norm is block.ln_2
    with pytest.raises(RegistryError, match="fold_norm cannot run with fp8"):
        resolve(("bf16", "fp8", "fold_norm"))


@pytest.mark.parametrize("mlp", [False, True], ids=["linear", "gelu_mlp"])
def test_the_fp8_forward_with_the_fold_reads_the_folded_weights_and_bounds_xhat_alone(mlp):
    # γ small: a bound from the LayerNorm's weights (max|γ| sqrt(C - 1) + max|β| < 2.5) would clamp the spike row's
    # x̂ of sqrt(63); unfolded weights would give another output altogether. FP8 where fold_norm runs with fp8_qkv_fc.
    torch.manual_seed(6)
    g = torch.Generator().manual_seed(6)
    norm = nn.LayerNorm(64)
    with torch.no_grad():
        norm.weight.uniform_(-0.3, 0.3, generator=g)
        norm.bias.uniform_(-0.1, 0.1, generator=g)
    x = torch.randn(32, 64, generator=g)
    x[0] = 0
    x[0, 5] = 50.0
    xhat = F.layer_norm(x, (64,)).bfloat16()
    layers = (nn.Linear(64, 256).bfloat16(), nn.Linear(256, 64).bfloat16()) if mlp else (nn.Linear(64, 48).bfloat16(),)
    with torch.no_grad():
        layers[0].weight[:, 5] *= 30   # so that the spike's feature carries its row's output
    grad = torch.randn(32, layers[-1].out_features, generator=g).bfloat16()
    runs = []
    for fp8 in (False, True):
        norm.zero_grad()
        for layer in layers:
            layer.zero_grad()
        xi = xhat.clone().requires_grad_()
        plan = LinearPlan(bias_grad=True, fold=True, fp8_forward=fp8)
        out = linear.gelu_mlp(xi, *layers, plan, norm) if mlp else linear.linear(xi, layers[0], plan, norm)
        out.backward(grad)
        runs.append((out.detach().float(), [xi.grad, norm.weight.grad, norm.bias.grad,
                                            *(p.grad for layer in layers for p in layer.parameters())]))
    (bf16, grads_bf16), (fp8, grads_fp8) = runs
    assert not torch.equal(bf16, fp8)
    row_error = (fp8 - bf16).norm(dim=1) / bf16.norm(dim=1)
    assert row_error.max().item() < 0.1, row_error[:4]
    for a, b in zip(grads_bf16, grads_fp8):
        if mlp:   # GELU's derivative reads the pre-activation the FP8 GEMM wrote
            assert ((a.float() - b.float()).norm() / a.float().norm()).item() < 0.1
        else:     # the backward reads the saved bf16 [x̂ 1] and W'
            assert torch.equal(a, b)
