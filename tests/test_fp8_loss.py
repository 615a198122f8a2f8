"""Utils.kernels.fp8_loss: the chunked loss with its three GEMMs in FP8, against the fp64 reference (within
FP8's rounding, and measurably not bf16's), over several chunks and a padded output layer, eager and
compiled; and where it refuses to run."""
import pytest
import torch

from Utils.kernels import chunked_loss, fp8_loss

V, ROWS, C, N = 90, 128, 32, 96   # vocabulary, padded rows, width, tokens: 96 tokens in chunks of 40


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.nn.functional.layer_norm(torch.randn(N, C, generator=g, dtype=torch.float64), (C,))
    w = torch.randn(ROWS, C, generator=g, dtype=torch.float64) * 0.3
    w[V:] = 0   # padding rows, as a padded vocabulary has
    return h, w, torch.randint(0, V, (N,), generator=g)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(chunked_loss, "CHUNK_ROWS", 40)   # three chunks, the last one short


def _grads(f, h, w, y, dtype, autocast):
    h, w = h.detach().to(dtype).requires_grad_(), w.detach().to(dtype).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = f(h, w, y, V)
    loss.backward()
    return loss, h.grad, w.grad


@pytest.mark.parametrize("dtype, autocast", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False)],
                         ids=["fp32", "bf16-autocast", "bf16"])
def test_loss_and_gradients_are_the_reference_within_fp8_rounding(small_chunks, dtype, autocast):
    h, w, y = _inputs()
    want, want_h, want_w = _grads(chunked_loss.reference, h, w, y, torch.float64, False)
    loss, grad_h, grad_w = _grads(fp8_loss.fp8_cross_entropy, h, w, y, dtype, autocast)
    assert loss.dtype == torch.float32 and grad_h.dtype == grad_w.dtype == dtype
    # e4m3 rounds to 1/16 of a value, e5m2 to 1/8; summed over many terms the errors partly cancel.
    assert abs(loss.item() - want.item()) < 0.01
    errors = _rel(grad_h, want_h), _rel(grad_w[:V], want_w[:V])
    assert max(errors) < 0.08, errors
    # ...and FP8 is what ran: bf16 GEMMs stay within 1% of the reference on these inputs.
    bf16_h = _grads(chunked_loss.chunked_cross_entropy, h, w, y, torch.bfloat16, False)[1]
    assert _rel(bf16_h, want_h) < 0.01 < errors[0]
    assert torch.count_nonzero(grad_w[V:]) == 0   # the padding rows get exactly zero gradient


def test_small_probabilities_keep_their_gradient():
    # A row whose softmax spreads over the whole vocabulary: each probability 1/V. The fixed gradient scale
    # keeps every one of them in e5m2's range, so the weight's gradient has no zero row among the words.
    g = torch.Generator().manual_seed(3)
    h = torch.nn.functional.layer_norm(torch.randn(16, C, generator=g), (C,))
    w = torch.randn(ROWS, C, generator=g) * 1e-4   # near-zero logits: a near-uniform softmax
    w.requires_grad_()
    fp8_loss.fp8_cross_entropy(h, w, torch.zeros(16, dtype=torch.long), V).backward()
    assert torch.count_nonzero(w.grad[:V].abs().sum(1)) == V


def test_compiled_is_eager(small_chunks):
    h, w, y = _inputs(1)
    eager = _grads(fp8_loss.fp8_cross_entropy, h, w, y, torch.float32, True)
    compiled = _grads(torch.compile(fp8_loss.fp8_cross_entropy), h, w, y, torch.float32, True)
    # Inductor casts the gradient to e5m2 from fp32 where eager rounds it to bf16 first: a few values land
    # one FP8 step apart.
    assert abs(eager[0].item() - compiled[0].item()) < 1e-4
    assert _rel(compiled[1], eager[1]) < 0.01 and _rel(compiled[2], eager[2]) < 0.01


def test_tokens_and_width_must_be_multiples_of_16():
    h, w, y = _inputs()
    with pytest.raises(ValueError, match=r"tokens per step \(95\) to be a multiple of 16"):
        fp8_loss.fp8_cross_entropy(h[:95].float(), w.float(), y[:95], V)
    assert fp8_loss.width_problem(768) is None
    assert "width (24)" in fp8_loss.width_problem(24)


def test_it_needs_an_ada_or_hopper_gpu(monkeypatch):
    assert fp8_loss.unavailable(torch.device("cpu")) is None   # PyTorch emulates FP8 matmuls on a CPU
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "Ada or Hopper" in fp8_loss.unavailable(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8_loss.unavailable(torch.device("cuda")) is None
