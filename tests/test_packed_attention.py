"""Utils.kernels.packed_attention: causal attention on the packed QKV tensor against its reference (the
scores written out) and SDPA. On the CPU its two operators run their PyTorch definitions: the same
outputs, log-sum-exp and gradients, over float64, float32 and bf16, compiled too; and cuDNN's tensor
layout checked against the views it stands for. cuDNN itself runs in the gpu test (and
bench/packed_attention.py times it)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import cuda_graph
from Utils.kernels import packed_attention as pa

CPU = torch.device("cpu")
B, T, H, D = 2, 16, 3, 8
C = H * D
TOLERANCES = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-6),
              torch.bfloat16: dict(rtol=2 ** -6, atol=3e-2)}   # bf16: two units in the last place, at any size


def _qkv(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, 3 * C, generator=g, dtype=torch.float64).to(dtype).requires_grad_()


def _sdpa(qkv):
    q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(C, dim=2))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("against", ["reference", "sdpa"])
def test_output_and_gradient_are_the_references(dtype, against):
    want_op = pa.reference if against == "reference" else (lambda qkv, n_head: _sdpa(qkv))
    results = []
    for op in (pa.packed_attention, want_op):
        qkv = _qkv(dtype)
        y = op(qkv, H)
        grad, = torch.autograd.grad(y, qkv, torch.linspace(-1, 1, y.numel(), dtype=torch.float64).to(dtype).view_as(y))
        results.append((y, grad))
    (y, grad), (want_y, want_grad) = results
    assert y.dtype == grad.dtype == dtype and grad.shape == (B, T, 3 * C)
    torch.testing.assert_close(y, want_y, **TOLERANCES[dtype])
    torch.testing.assert_close(grad, want_grad, **TOLERANCES[dtype])
    assert grad[..., 2 * C:].abs().max() > 0   # dv lands in v's columns


def test_log_sum_exp_is_of_the_scaled_causal_scores_and_bf16_runs_in_fp32():
    qkv = _qkv()
    y, lse = pa.packed_attention_fwd(qkv, H)
    q, k, _ = (t.view(B, T, H, D).transpose(1, 2) for t in qkv.detach().split(C, dim=2))
    scores = (q @ k.transpose(-2, -1)) / D ** 0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-12, atol=1e-12)
    assert lse.shape == (B, H, T)
    # The first query sees only itself: its log-sum-exp is its own scaled score.
    torch.testing.assert_close(lse[..., 0], scores[..., 0, 0], rtol=1e-12, atol=1e-12)
    y16, lse16 = pa.packed_attention_fwd(qkv.detach().bfloat16(), H)
    assert y16.dtype == torch.bfloat16 and lse16.dtype == torch.float32


def test_gradcheck_in_float64():
    qkv = torch.randn(1, 5, 3 * 2 * 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: pa.packed_attention(t, 2), (qkv,))


def test_fake_tensors_have_the_real_outputs_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    for dtype in (torch.bfloat16, torch.float64):
        qkv = _qkv(dtype).detach()
        y, lse = pa.packed_attention_fwd(qkv, H)
        grad = pa.packed_attention_backward(y, qkv, y, lse, H)
        with FakeTensorMode() as mode:
            fq = mode.from_tensor(qkv)
            fy, flse = pa.packed_attention_fwd(fq, H)
            fgrad = pa.packed_attention_backward(fy, fq, fy, flse, H)
        for real, fake in ((y, fy), (lse, flse), (grad, fgrad)):
            assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)


def test_the_log_sum_exp_output_is_not_differentiable():
    y, lse = pa.packed_attention_fwd(_qkv(), H)
    assert y.requires_grad and not lse.requires_grad


def test_cudnn_layout_addresses_q_k_v_the_output_and_lse_as_their_views():
    lay = pa.layout(B, T, H, D)
    qkv = torch.arange(B * T * 3 * C, dtype=torch.float64).view(B, T, 3 * C)
    views = [t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(C, dim=2)]
    for view, offset in zip(views, lay["offsets"]):
        assert torch.equal(qkv.as_strided(lay["dims"], lay["packed"], offset), view)
    y = torch.arange(B * T * C, dtype=torch.float64).view(B, T, C)
    assert torch.equal(y.as_strided(lay["dims"], lay["flat"]), y.view(B, T, H, D).transpose(1, 2))
    lse = torch.arange(B * H * T, dtype=torch.float32).view(B, H, T)
    assert torch.equal(lse.as_strided(lay["stats_dims"], lay["stats"]), lse[..., None])


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)

    def forward(self, x):
        return self.c_proj(pa.packed_attention(self.c_attn(x), H))


def test_compiled_it_equals_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _Attention().double(), torch.randn(B, T, C, dtype=torch.float64)
    eager = model(x).square().sum()
    eager.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model)(x).square().sum()
    compiled.backward()
    torch.testing.assert_close(compiled, eager, rtol=1e-10, atol=0)
    for want, p in zip(grads, model.parameters()):
        torch.testing.assert_close(p.grad, want, rtol=1e-8, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Where cuDNN can run them

def test_without_a_gpu_both_attentions_are_unavailable_in_one_line():
    assert pa.unavailable(CPU, 64) == "packed attention needs cuDNN 9 and its frontend on an Ampere or newer GPU"
    assert pa.cudnn_unavailable(CPU) == "cuDNN attention is not available here"
    assert pa.prepare(CPU, 64) is None


def test_prepare_turns_cudnn_off_with_the_reason_when_its_graph_fails(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(pa, "_failure", None)
    monkeypatch.setattr(pa, "_cudnn_fused_attention", lambda device: True)
    monkeypatch.setattr(pa, "_frontend", lambda: object())

    def refuse(device, head_dim):
        raise RuntimeError("cudnnGraphNotSupportedError: no engine")
    monkeypatch.setattr(pa, "_probe", refuse)
    assert pa.unavailable(cuda, 64) is None
    note = pa.prepare(cuda, 64)
    assert note == ("cuDNN could not run the packed attention here (RuntimeError: cudnnGraphNotSupportedError: no "
                    "engine)")
    assert pa.unavailable(cuda, 64) == note


@pytest.mark.parametrize("head_dim, ok", [(64, True), (128, True), (8, True), (60, False), (192, False)])
def test_cudnn_is_asked_only_for_head_sizes_its_fused_kernels_take(monkeypatch, head_dim, ok):
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(pa, "_frontend", lambda: object())
    assert (pa.unavailable(torch.device("cuda"), head_dim) is None) is ok
    assert pa.cudnn_unavailable(torch.device("cuda")) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert pa.unavailable(torch.device("cuda"), 64) is not None
    assert pa.cudnn_unavailable(torch.device("cuda")) is not None


# ---------------------------------------------------------------------------------------------
# On a GPU: cuDNN against the reference, eagerly and replayed from a CUDA graph

@pytest.mark.gpu
def test_on_a_gpu_cudnn_matches_the_reference_eagerly_and_replayed_from_a_cuda_graph():
    cuda = torch.device("cuda")
    assert pa.unavailable(cuda, 64) is None and pa.prepare(cuda, 64) is None
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(2, 256, 3 * 4 * 64, device="cuda", dtype=torch.bfloat16, generator=g)
    dy = torch.randn(2, 256, 4 * 64, device="cuda", dtype=torch.bfloat16, generator=g)
    want_y, want_lse = pa._reference_forward(qkv, 4)
    want_grad = pa._reference_backward(dy, qkv, want_y, want_lse, 4)
    ref = qkv.float().requires_grad_()
    ref_y = pa.reference(ref, 4)
    autograd_grad, = torch.autograd.grad(ref_y, ref, dy.float())

    def both():
        y, lse = pa.packed_attention_fwd(qkv, 4)
        return y, lse, pa.packed_attention_backward(dy, qkv, y, lse, 4)
    eager = both()
    graph, replayed = cuda_graph(both)
    graph.replay()
    torch.cuda.synchronize()
    for got in (eager, replayed):
        y, lse, grad = (t.float() for t in got)
        assert (y - want_y.float()).abs().max() <= 1e-2 * want_y.float().abs().max()
        assert (y - ref_y.float()).abs().max() <= 1e-2 * ref_y.float().abs().max()
        assert (lse - want_lse).abs().max() < 1e-3
        assert (grad - want_grad.float()).abs().max() <= 2e-2 * want_grad.float().abs().max()
        assert (grad - autograd_grad).abs().max() <= 2e-2 * autograd_grad.abs().max()
