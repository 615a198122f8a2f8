"""Utils.ladder.linear: every combination of a LinearPlan's features is the plain LayerNorm, linear layer (and, for
the MLP, GELU and second linear layer), output and gradients, within the rounding of its dtype and format."""
import itertools
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from Utils.ladder import linear
from Utils.ladder.linear import LinearPlan

C, HIDDEN, TOKENS = 32, 128, 48
PLANS = [LinearPlan(bias_grad=b, fold=f, fp8_forward=p) for b, f, p in itertools.product((False, True), repeat=3)]


def _plan_id(plan: LinearPlan) -> str:
    return "+".join(name for name in ("bias_grad", "fold", "fp8_forward") if getattr(plan, name)) or "plain"


def _layers(dtype: torch.dtype) -> tuple[nn.LayerNorm, nn.Linear, nn.Linear, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    norm, fc, proj = nn.LayerNorm(C), nn.Linear(C, HIDDEN), nn.Linear(HIDDEN, C)
    with torch.no_grad():
        for p in (*norm.parameters(), *fc.parameters(), *proj.parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + 0.2)
    return norm.to(dtype), fc.to(dtype), proj.to(dtype), torch.randn(TOKENS, C, generator=g).to(dtype)


def _run(plan: LinearPlan | None, mlp: bool, dtype: torch.dtype, bf16_autocast: bool = False) -> list[torch.Tensor]:
    """Output, input gradient and every parameter's gradient: composed with `plan`, or plain where plan is None."""
    norm, fc, proj, x = _layers(dtype)
    x.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_autocast):
        y = _forward(plan, mlp, norm, fc, proj, x)
    y.float().backward(torch.linspace(-1, 1, y.numel(), dtype=torch.float32).view_as(y).to(dtype))
    grads = [p.grad for m in (norm, fc, proj) for p in m.parameters() if m is not proj or mlp]
    return [y.detach(), x.grad, *grads]


def _forward(plan: LinearPlan | None, mlp: bool, norm: nn.LayerNorm, fc: nn.Linear, proj: nn.Linear,
             x: torch.Tensor) -> torch.Tensor:
    if plan is None:
        h = norm(x)
        y = proj(F.gelu(fc(h), approximate="tanh")) if mlp else fc(h)
    else:
        # Folded, the LayerNorm only normalizes and the layer applies its γ and β.
        h = F.layer_norm(x, (C,)) if plan.fold else norm(x)
        y = linear.gelu_mlp(h, fc, proj, plan, norm) if mlp else linear.linear(h, fc, plan, norm)
    return y


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize("mlp", [False, True], ids=["linear", "gelu_mlp"])
@pytest.mark.parametrize("plan", [p for p in PLANS if not p.fp8_forward], ids=_plan_id)
def test_every_combination_of_bf16_features_is_the_plain_layers(plan, mlp):
    # float64: the same mathematics, to float64's rounding.
    got, want = _run(plan, mlp, torch.float64), _run(None, mlp, torch.float64)
    assert [t.shape for t in got] == [t.shape for t in want]
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10, msg=f"tensor {i}")


@pytest.mark.parametrize("mlp", [False, True], ids=["linear", "gelu_mlp"])
@pytest.mark.parametrize("plan", [p for p in PLANS if p.fp8_forward], ids=_plan_id)
def test_fp8_forward_composes_with_every_other_feature_and_changes_the_forward_only(plan, mlp):
    # Against the same plan in bf16, under autocast as the rungs run it: e4m3 keeps 3 mantissa bits in the forward
    # GEMM. The backward reads the saved bf16 input and weights, so a single layer's gradients are bf16's exactly;
    # the MLP's follow its GELU's input.
    got, want = (_run(p, mlp, torch.float32, bf16_autocast=True) for p in (plan, replace(plan, fp8_forward=False)))
    assert not torch.equal(got[0], want[0]) and _relative_error(got[0], want[0]) < 0.1
    for i, (g, w) in enumerate(zip(got[1:], want[1:]), start=1):
        assert g.dtype == w.dtype and g.shape == w.shape
        if mlp:   # the LayerNorm bias's gradient, a sum that cancels, moves most: 0.11 of its norm here
            assert _relative_error(g, w) < 0.2, f"tensor {i}"
        else:
            assert torch.equal(g, w), f"tensor {i}"


@pytest.mark.parametrize("plan", [LinearPlan(fold=True), LinearPlan(fp8_forward=True)], ids=_plan_id)
def test_a_feature_that_reads_the_layernorm_refuses_to_run_without_it(plan):
    _, fc, _, x = _layers(torch.float32)
    with pytest.raises(ValueError, match="needs the LayerNorm"):
        linear.linear(x, fc, plan)
