"""Packed attention (Utils.packed_attention) on the CPU, where its two operators run their PyTorch
definitions: the same outputs, log-sum-exp and gradients as SDPA, the same model and compiled graph as the
sdpa attention, and cuDNN's tensor layout checked against the views it stands for. cuDNN itself needs a
GPU (bench/packed_attention.py checks it there against the same definitions)."""
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from conftest import model_pair
from Utils import packed_attention as pa
from Utils import recipes
from Utils.model import PRESETS
from Utils.recipes import BASELINE, FUSED, MAX, apply_attention

CPU = torch.device("cpu")
B, T, H, D = 2, 16, 3, 8
C = H * D


def _qkv(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, 3 * C, generator=g, dtype=dtype).requires_grad_()


def _sdpa(qkv):
    q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(C, dim=2))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)


def test_output_and_gradient_are_sdpas_in_float64():
    qkv = _qkv()
    y, want = pa.packed_attention(qkv, H), _sdpa(qkv)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    grad_y = torch.randn(B, T, C, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got, = torch.autograd.grad(y, qkv, grad_y)
    expected, = torch.autograd.grad(want, qkv, grad_y)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    assert got.shape == qkv.shape and got[..., 2 * C:].abs().max() > 0   # dv lands in v's columns


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
    half = qkv.detach().bfloat16()
    y16, lse16 = pa.packed_attention_fwd(half, H)
    assert y16.dtype == torch.bfloat16 and lse16.dtype == torch.float32
    torch.testing.assert_close(y16.double(), _sdpa(half.double()), rtol=0, atol=2e-2)


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


def _pair(**changes):   # changes apply to both models
    return model_pair({"attention": "cudnn_packed"}, batch=2, attention="sdpa", **changes)


@pytest.mark.parametrize("bias_grad", ["sum", "gemm"])   # alone, and as in max, with the bias gradients' GEMMs
def test_model_with_packed_attention_gives_sdpas_loss_and_gradients(monkeypatch, bias_grad):
    calls = []
    real = pa.packed_attention_fwd
    monkeypatch.setattr(pa, "packed_attention_fwd", lambda *a: calls.append(1) or real(*a))
    plain, packed, x, y = _pair(bias_grad=bias_grad)
    losses = []
    for model in (plain, packed):
        _, loss = model(x, y)
        loss.backward()
        losses.append(loss)
    assert len(calls) == packed.config.n_layer
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-12, atol=0)
    for (name, a), b in zip(plain.named_parameters(), packed.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-9, atol=1e-12, msg=name)


def test_compiled_model_with_packed_attention_matches_eager():
    torch._dynamo.reset()
    _, packed, x, y = _pair()
    eager = packed(x, y)[1]
    eager.backward()
    grads = [p.grad.clone() for p in packed.parameters()]
    packed.zero_grad()
    compiled = torch.compile(packed)(x, y)[1]
    compiled.backward()
    torch.testing.assert_close(compiled, eager, rtol=1e-10, atol=0)
    for a, p in zip(grads, packed.parameters()):
        torch.testing.assert_close(p.grad, a, rtol=1e-8, atol=1e-12)


PACKED = replace(FUSED, name="fused+packed_attention", attention="cudnn_packed")


def test_packed_attention_falls_back_to_cudnn_sdpa_then_plain_sdpa(monkeypatch):
    base = PRESETS["tiny"]
    assert not pa.available(CPU, 64) and MAX.attention == "cudnn_packed"
    assert apply_attention(base, PACKED, CPU) == (replace(base, attention="sdpa"),
                                                 "cuDNN attention is not available here: plain SDPA instead")
    monkeypatch.setattr(recipes, "cudnn_attention_available", lambda device: True)
    config, note = apply_attention(base, PACKED, CPU)
    assert config.attention == "cudnn" and note == ("packed attention needs cuDNN 9 and its frontend on an Ampere "
                                                    "or newer GPU: SDPA held to cuDNN instead")
    heads = []
    monkeypatch.setattr(pa, "available", lambda device, head_dim: heads.append(head_dim) or True)
    assert apply_attention(base, PACKED, CPU) == (replace(base, attention="cudnn_packed"), None)
    assert heads == [base.n_embd // base.n_head]
    # A GPU whose cuDNN refuses the small graph that prepare() runs: SDPA held to cuDNN, and the reason.
    monkeypatch.setattr(pa, "prepare", lambda device, head_dim: "cuDNN could not run the packed attention here (x)")
    assert apply_attention(base, PACKED, CPU) == (replace(base, attention="cudnn"), "cuDNN could not run the "
                                                 "packed attention here (x): SDPA held to cuDNN instead")


def test_prepare_turns_cudnn_off_with_the_reason_when_its_graph_fails(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(pa, "_failure", None)
    monkeypatch.setattr(pa, "available", lambda device, head_dim: pa._failure is None)

    def refuse(device, head_dim):
        raise RuntimeError("cudnnGraphNotSupportedError: no engine")
    monkeypatch.setattr(pa, "_probe", refuse)
    note = pa.prepare(cuda, 64)
    assert note == ("cuDNN could not run the packed attention here (RuntimeError: cudnnGraphNotSupportedError: no "
                    "engine)")
    assert pa._failure == note and not pa.available(cuda, 64)
    assert pa.prepare(CPU, 64) is None


@pytest.mark.parametrize("head_dim, ok", [(64, True), (128, True), (8, True), (60, False), (192, False)])
def test_cudnn_is_asked_only_for_head_sizes_its_fused_kernels_take(monkeypatch, head_dim, ok):
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(pa, "_frontend", lambda: object())
    assert pa.available(torch.device("cuda"), head_dim) is ok
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert not pa.available(torch.device("cuda"), 64)


def test_recipes_refuse_packed_attention_without_bf16():
    with pytest.raises(ValueError, match="bf16"):
        replace(BASELINE, name="x", attention="cudnn_packed")


GPU = pytest.mark.skipif(not (torch.cuda.is_available() and pa.available(torch.device("cuda"), 64)),
                         reason="cuDNN's packed attention needs a GPU with cuDNN 9 and nvidia-cudnn-frontend")


@GPU
def test_on_a_gpu_cudnn_matches_the_reference_eagerly_and_replayed_from_a_cuda_graph():
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(2, 256, 3 * 4 * 64, device="cuda", dtype=torch.bfloat16, generator=g)
    dy = torch.randn(2, 256, 4 * 64, device="cuda", dtype=torch.bfloat16, generator=g)
    want_y, want_lse = pa._reference_forward(qkv, 4)
    want_grad = pa._reference_backward(dy, qkv, want_y, want_lse, 4)

    def both():
        y, lse = pa.packed_attention_fwd(qkv, 4)
        return y, lse, pa.packed_attention_backward(dy, qkv, y, lse, 4)
    eager = both()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        both()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = both()
    graph.replay()
    torch.cuda.synchronize()
    for got in (eager, replayed):
        y, lse, grad = (t.float() for t in got)
        assert (y - want_y.float()).abs().max() <= 1e-2 * want_y.float().abs().max()
        assert (lse - want_lse).abs().max() < 1e-3
        assert (grad - want_grad.float()).abs().max() <= 2e-2 * want_grad.float().abs().max()
