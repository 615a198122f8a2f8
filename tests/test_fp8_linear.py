"""Utils.kernels.fp8_linear: the forward GEMMs that read a LayerNorm's output, in FP8 with a scale the
LayerNorm's weights bound (Utils.kernels.fp8); and their use in the linear layer and the MLP of
Utils.ladder.linear."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from Utils.kernels import cublaslt, fp8, fp8_linear, gemm_bias_grad
from Utils.kernels.fp8 import E4M3, E4M3_MAX, E5M2, fits, norm_bound, normed_to_e4m3, rows_to_fp8, to_e4m3
from Utils.ladder import linear, modules
from Utils.ladder.linear import LinearPlan

FP8_ONES = LinearPlan(bias_grad=True, fp8_forward=True)

C = 64


def norm_with_weights(seed: int) -> nn.LayerNorm:
    torch.manual_seed(seed)
    norm = nn.LayerNorm(C)
    with torch.no_grad():
        norm.weight.uniform_(-1.5, 1.5)
        norm.bias.uniform_(-0.3, 0.3)
    return norm


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_layernorm_output_exceeds_the_bound_and_a_spike_nearly_reaches_it(seed):
    norm = norm_with_weights(seed)
    bound = norm_bound(norm.weight, norm.bias).item()
    # Random rows, and rows that are one spike among equal entries: x̂ = sqrt(C - 1) at the spike.
    spikes = torch.zeros(C, C).fill_diagonal_(1000.0)
    y = norm(torch.cat([torch.randn(256, C) * 5 + 2, spikes])).detach()
    assert y.abs().max().item() <= bound * (1 + 1e-6)
    big = norm.weight.abs().argmax()
    spike_at_big = y[256 + big, big].abs().item()
    assert spike_at_big >= norm.weight.abs().max().item() * (C - 1) ** 0.5 - norm.bias.abs().max().item() - 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cast_keeps_e4m3s_precision_and_never_overflows(dtype):
    norm = norm_with_weights(3)
    spikes = torch.zeros(C, C).fill_diagonal_(1000.0)
    y = norm(torch.cat([torch.randn(128, C), spikes])).detach().to(dtype)
    y8, inv = normed_to_e4m3(y, norm.weight, norm.bias)
    assert y8.dtype == E4M3 and inv.dtype == torch.float32 and inv.dim() == 0
    back = y8.float() * inv
    assert torch.isfinite(back).all() and y8.float().abs().max().item() <= E4M3_MAX
    normal = y.float().abs() >= 2.0 ** -6 * inv   # entries whose scaled value is a normal e4m3 number
    assert normal.float().mean() > 0.9
    # Round to nearest with 3 mantissa bits: at most half a step, 2^-4 of the value.
    assert ((back - y.float()).abs() <= y.float().abs() * 2.0 ** -4 + 1e-12)[normal].all()


def operands(m=48, n=96, seed=4):
    norm = norm_with_weights(seed)
    y = norm(torch.randn(m, C) * 3).detach().bfloat16()
    w = (torch.randn(n, C) * 0.05).bfloat16()
    b = (torch.randn(n) * 0.1).bfloat16()
    return norm, y, w, b


def test_the_linear_and_gelu_ops_compute_their_references_on_the_fp8_operands():
    norm, y, w, b = operands()
    y8, y_inv = normed_to_e4m3(y, norm.weight, norm.bias)
    w8, w_inv = to_e4m3(w)
    out = fp8_linear.linear(y8, y_inv, w8, w_inv, b)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, fp8_linear.reference(y8, y_inv, w8, w_inv, b), atol=1e-2, rtol=1e-2)
    a, h = fp8_linear.linear_gelu(y8, y_inv, w8, w_inv, b)
    a_ref, h_ref = fp8_linear.reference_gelu(y8, y_inv, w8, w_inv, b)
    assert torch.equal(a, a_ref) and torch.equal(h, h_ref)
    # The activation is GPT-2's tanh GELU of the pre-activation (on a CPU the op is the reference itself, so this
    # is what checks the reference).
    torch.testing.assert_close(a, F.gelu(h.float(), approximate="tanh").bfloat16(), rtol=2**-7, atol=2**-7)
    # The reference itself, tightly: the tanh GELU of the fp32 pre-activation, rounded once to bf16 (the loose
    # check above cannot tell tanh GELU from exact GELU, which differ by under 2^-7).
    h32 = y8.float() @ w8.float().t() * (y_inv * w_inv) + b.float()
    torch.testing.assert_close(h_ref, h32.bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(a_ref, F.gelu(h32, approximate="tanh").bfloat16(), rtol=0, atol=0)
    # And FP8's answer is near the bf16 operands' (a wrong scale would be off by a factor).
    exact = y.float() @ w.float().t() + b.float()
    assert ((h.float() - exact).norm() / exact.norm()).item() < 0.08


@pytest.mark.parametrize("ones", [True, False], ids=["gemm_bias_grad", "sum"])
def test_the_fp8_linear_changes_the_forward_only(ones):
    norm, y, w, b = operands()
    layer = nn.Linear(C, w.size(0)).bfloat16()
    with torch.no_grad():
        layer.weight.copy_(w), layer.bias.copy_(b)
    grad = torch.randn(y.size(0), w.size(0)).bfloat16()
    results = []
    for with_norm in (None, norm):
        x = y.clone().requires_grad_()
        layer.zero_grad()
        out = linear.linear(x, layer, LinearPlan(bias_grad=ones, fp8_forward=with_norm is not None), with_norm)
        out.backward(grad)
        results.append((out.detach(), x.grad, layer.weight.grad.clone(), layer.bias.grad.clone()))
    (bf16, *grads_bf16), (fp8, *grads_fp8) = results
    assert not torch.equal(bf16, fp8)
    assert ((fp8.float() - bf16.float()).norm() / bf16.float().norm()).item() < 0.08
    for g_bf16, g_fp8 in zip(grads_bf16, grads_fp8):   # backward reads the saved bf16 input and weight
        assert torch.equal(g_bf16, g_fp8)
    assert norm.weight.grad is None   # the bound is not differentiated through


def test_the_fp8_mlp_changes_the_forward_only_and_tokens_not_a_multiple_of_16_run_in_bf16():
    norm, y, _, _ = operands(m=48)
    torch.manual_seed(5)
    fc, proj = nn.Linear(C, 4 * C).bfloat16(), nn.Linear(4 * C, C).bfloat16()
    grad = torch.randn(48, C).bfloat16()
    results = []
    for with_norm in (None, norm):
        x = y.clone().requires_grad_()
        fc.zero_grad(), proj.zero_grad()
        out = linear.gelu_mlp(x, fc, proj, LinearPlan(bias_grad=True, fp8_forward=with_norm is not None),
                              with_norm)
        out.backward(grad)
        results.append((out.detach(), x.grad))
    (bf16, gx_bf16), (fp8, gx_fp8) = results
    assert not torch.equal(bf16, fp8)
    assert ((fp8.float() - bf16.float()).norm() / bf16.float().norm()).item() < 0.1
    assert torch.isfinite(gx_fp8).all() and gx_fp8.shape == gx_bf16.shape
    # 40 tokens: FP8 GEMMs need multiples of 16, so the MLP runs its bf16 GEMMs, output for output.
    odd = y[:40]
    assert not fits(odd)
    assert torch.equal(linear.gelu_mlp(odd, fc, proj, FP8_ONES, norm),
                       linear.gelu_mlp(odd, fc, proj, LinearPlan(bias_grad=True)))


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_each_row_gets_the_largest_power_of_two_scale_that_keeps_it_in_range(dtype):
    torch.manual_seed(5)
    largest = torch.finfo(dtype).max
    x = torch.randn(6, 40) * torch.tensor([1e-7, 1e-4, 1.0, 3e3, 1.0, 0.0])[:, None]   # rows far apart, one zero
    x[4, 7] = 1e5                                                                      # one row's single spike
    x8, inv = rows_to_fp8(x.bfloat16(), dtype)
    assert x8.dtype == dtype and x8.is_contiguous() and inv.shape == (6, 1) and inv.dtype == torch.float32
    exponents = torch.log2(inv)
    assert torch.equal(exponents, exponents.round())                       # powers of two: the scaling is exact
    row_max = x8.float().abs().amax(1)
    assert torch.isfinite(x8.float()).all() and (row_max <= largest).all()
    # The largest such power: each live row's amax, scaled, lies in the top binade below dtype's largest value.
    scaled_amax = x.bfloat16().float().abs().amax(1)[:5] / inv[:5, 0]
    assert ((scaled_amax > largest / 2) & (scaled_amax <= largest)).all()
    assert not x8[5].float().any()
    # Back to within the cast's rounding (2 or 3 mantissa bits) where no spike shares the row; the spike itself too.
    torch.testing.assert_close((x8.float() * inv)[:4], x.bfloat16().float()[:4], rtol=2**-2, atol=0)
    torch.testing.assert_close(x8[4, 7].float() * inv[4, 0], torch.tensor(1e5), rtol=2**-2, atol=0)


def test_the_input_gradient_in_fp8_is_the_product_of_the_dequantized_operands_near_the_bf16_one():
    torch.manual_seed(6)
    # Rows of sizes orders of magnitude apart, as a gradient's tokens can be: a row's scale applied to another
    # row, twice or not at all would be off by orders of magnitude.
    grad = (torch.randn(48, 3 * C) * 10 ** torch.empty(48, 1).uniform_(-7, -2)).bfloat16()
    weight = (torch.randn(3 * C, C) * 0.02).bfloat16()
    out = fp8_linear.input_grad(grad, weight)
    assert out.dtype == torch.bfloat16 and out.shape == (48, C)
    g8, g_inv = rows_to_fp8(grad, E4M3)
    w8, w_inv = to_e4m3(weight)
    assert g_inv.shape == (48, 1) and w_inv.shape == ()
    dequantized = (g8.float() * g_inv) @ (w8.float() * w_inv)
    torch.testing.assert_close(out.float(), dequantized, rtol=2**-7, atol=0)
    # Near the bf16 operands' product, to e4m3's rounding (3 mantissa bits).
    exact = grad.float() @ weight.float()
    assert 0 < ((out.float() - exact).norm() / exact.norm()).item() < 0.1


@pytest.mark.parametrize("mlp", [False, True], ids=["c_attn", "c_fc"])
def test_fp8_dgrad_changes_the_input_gradient_only_and_runs_bf16_for_tokens_not_a_multiple_of_16(mlp):
    norm, y, _, _ = operands(m=48)
    torch.manual_seed(8)
    layer, proj = nn.Linear(C, 4 * C if mlp else 3 * C).bfloat16(), nn.Linear(4 * C, C).bfloat16()
    grad = (torch.randn(48, C if mlp else 3 * C) * 1e-3).bfloat16()

    def run(x, plan):
        layer.zero_grad()
        out = linear.gelu_mlp(x, layer, proj, plan) if mlp else linear.linear(x, layer, plan)
        out.backward(grad[:x.size(0)])
        return out.detach(), layer.weight.grad.clone(), layer.bias.grad.clone()

    results = []
    for fp8_dgrad in (False, True):
        x = y.clone().requires_grad_()
        results.append((*run(x, LinearPlan(bias_grad=True, fp8_dgrad=fp8_dgrad)), x.grad))
    (*same, gx), (*same8, gx8) = results
    assert all(torch.equal(a, b) for a, b in zip(same, same8))   # the forward, and the weight-gradient GEMM
    assert 0 < ((gx8.float() - gx.float()).norm() / gx.float().norm()).item() < 0.1
    # 40 tokens: FP8 GEMMs need multiples of 16, so the input gradient is the bf16 GEMM's, value for value.
    grads = []
    for plan in (LinearPlan(fp8_dgrad=True), LinearPlan()):
        x = y[:40].clone().requires_grad_()
        run(x, plan)
        grads.append(x.grad)
    assert torch.equal(*grads)


def test_a_feature_with_its_norm_keeps_the_models_parameters_and_state_dict():
    block = nn.ModuleDict(dict(ln=nn.LayerNorm(C), fc=nn.Linear(C, 3 * C)))
    names, weight = list(block.state_dict()), block["fc"].weight
    fc = modules.planned(block, "fc")
    modules.add_feature(fc, block["ln"], fp8_forward=True)
    assert block["fc"] is fc and fc.weight is weight and fc.norm is block["ln"]
    assert fc.plan == LinearPlan(fp8_forward=True)
    assert list(block.state_dict()) == names and len(list(block.parameters())) == 4
    fresh = modules.PlannedLinear(C, C)
    assert fresh.norm is None and fresh.plan == LinearPlan()   # no feature: the plain layer


def test_cublaslt_refuses_fp8_operands_it_cannot_take():
    y8 = torch.zeros(32, C, dtype=E4M3)
    w8 = torch.zeros(96, C, dtype=E4M3)
    out = torch.empty(32, 96, dtype=torch.bfloat16)
    s = torch.ones((), dtype=torch.float32)
    for bad in (dict(x=y8, y=w8, out=out, scales=None, y_t=True),                     # no scales
                dict(x=y8, y=w8, out=out.float(), scales=(s, s), y_t=True),           # fp32 output
                dict(x=y8, y=w8.t().contiguous(), out=out, scales=(s, s), y_t=False),  # not "TN"
                dict(x=y8.bfloat16(), y=w8.bfloat16(), out=out, scales=(s, s), y_t=True)):  # bf16 with scales
        with pytest.raises(ValueError, match="cuBLASLt"):
            cublaslt._matmul(cublaslt.CUBLASLT_EPILOGUE_DEFAULT, bad["x"], bad["y"], bad["out"], None, None,
                             y_t=bad["y_t"], scales=bad["scales"])


@pytest.mark.gpu
def test_cublaslts_fp8_gelu_epilogue_matches_its_reference_on_the_gpu():
    why = fp8_linear.unavailable(torch.device("cuda")) if torch.cuda.is_available() else "no CUDA GPU"
    if why:
        pytest.skip(why)
    norm, y, w, b = operands(m=4096, n=3072)
    norm, y, w, b = norm.cuda(), y.cuda(), w.cuda(), b.cuda()
    y8, y_inv = normed_to_e4m3(y, norm.weight, norm.bias)
    w8, w_inv = to_e4m3(w)
    a, h = fp8_linear.linear_gelu(y8, y_inv, w8, w_inv, b)
    a_ref, h_ref = fp8_linear.reference_gelu(y8, y_inv, w8, w_inv, b)
    for got, ref in ((a, a_ref), (h, h_ref)):
        assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
    out = fp8_linear.linear(y8, y_inv, w8, w_inv, b)
    ref = fp8_linear.reference(y8, y_inv, w8, w_inv, b)
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed_grad"])
def test_the_input_gradient_in_fp8_is_the_dequantized_product_on_the_gpu(transposed):
    why = fp8.unavailable(torch.device("cuda")) if torch.cuda.is_available() else "no CUDA GPU"
    if why:
        pytest.skip(why)
    torch.manual_seed(9)
    # Rows of sizes orders of magnitude apart, so that a scale applied to the wrong rows is far off.
    grad = (torch.randn(3 * C * 4, 4096, device="cuda") * 10 ** torch.empty(1, 4096, device="cuda").uniform_(-7, -2))
    grad = grad.bfloat16().t() if transposed else grad.bfloat16().t().contiguous()   # [4096, 3C * 4], strided or not
    weight = (torch.randn(3 * C * 4, C * 4, device="cuda") * 0.02).bfloat16()
    out = fp8_linear.input_grad(grad, weight)
    g8, g_inv = rows_to_fp8(grad, E4M3)
    w8, w_inv = to_e4m3(weight)
    dequantized = (g8.float() * g_inv) @ (w8.float() * w_inv)
    assert ((out.float() - dequantized).norm() / dequantized.norm()).item() < 1e-2


def saved_by_the_compiled_step(plan: LinearPlan, mlp: bool) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of each tensor that a LayerNorm and a `plan` layer (the MLP with it, if mlp), compiled with
    aot_eager_decomp_partition (Inductor's decompositions and partitioner, without generating code), save for
    their backward."""
    norm, y, w, _ = operands(m=32)
    block = nn.ModuleDict(dict(ln=norm, fc=nn.Linear(C, w.size(0)), proj=nn.Linear(w.size(0), C))).bfloat16()

    def step(x):
        h = block["ln"](x)
        if mlp:
            return linear.gelu_mlp(h, block["fc"], block["proj"], plan, block["ln"])
        return linear.linear(h, block["fc"], plan, block["ln"])

    torch._dynamo.reset()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((tuple(t.shape), t.dtype)) or t,
                                                  lambda t: t):
        out = torch.compile(step, backend="aot_eager_decomp_partition", fullgraph=True)(y.clone().requires_grad_())
    out.float().sum().backward()
    return saved


@pytest.mark.parametrize("mlp", [False, True], ids=["linear", "epilogue_mlp"])
def test_under_an_fp8_forward_the_fp8_input_gradient_reuses_the_forwards_weight_cast(mlp):
    # input_grad scales the weight as the forward's FP8 GEMM does (one scale, from its amax), so the partitioner
    # saves the forward's amax for the backward, a 0-d tensor that the forward alone saves none of, and the
    # backward's cast of the weight reads it once, with no amax pass of its own. (Scales of its own, one a column,
    # cost 4.2 ms a step at gpt2-xl: BENCHMARKS.md.)
    saved = saved_by_the_compiled_step(LinearPlan(bias_grad=True, fp8_forward=True, fp8_dgrad=True), mlp)
    assert any(shape == () for shape, _ in saved), saved


@pytest.mark.parametrize("mlp", [False, True], ids=["linear", "epilogue_mlp"])
def test_the_compiled_step_keeps_the_input_beside_its_ones_for_the_backward(mlp):
    # The FP8 cast reads the first columns of [x 1], so [x 1] is made in the forward pass and saved. Cast from x
    # itself, the partitioner saved the LayerNorm's statistics instead and rebuilt [x 1] in the backward, a pass of
    # its own over the tokens (BENCHMARKS.md, "[x 1] saved again").
    saved = [shape for shape, _ in saved_by_the_compiled_step(FP8_ONES, mlp)]
    assert (32, C + gemm_bias_grad.ONES) in saved, saved
