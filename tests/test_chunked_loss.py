"""Utils.kernels.chunked_loss: the chunked cross-entropy against its reference, F.cross_entropy over the
whole logits: over float32, float64 and bf16 autocast, with a padded output layer, in several chunks;
with the loss kernel (Triton's interpreter, in one subprocess) and without."""
import pytest
import torch
import torch.nn.functional as F

from conftest import run_interpreted
from Utils.kernels import chunked_loss, loss_kernel

V, C, N = 97, 32, 130   # vocabulary, width, tokens: 130 tokens in chunks of 37 (the last one short)


def _inputs(dtype, rows=V, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, C, generator=g, dtype=torch.float64)
    w = torch.randn(V, C, generator=g, dtype=torch.float64) * 0.5
    w = torch.cat([w, w.new_zeros(rows - V, C)])   # padding rows, as a padded vocabulary has
    y = torch.randint(0, V, (N,), generator=g)
    return h.to(dtype).requires_grad_(), w.to(dtype).requires_grad_(), y


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(chunked_loss, "CHUNK_ROWS", 37)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("rows", [V, 128], ids=["unpadded", "padded"])
def test_loss_and_gradients_are_the_references(small_chunks, dtype, tol, rows):
    h, w, y = _inputs(dtype, rows)
    loss = chunked_loss.chunked_cross_entropy(h, w, y, V)
    loss.backward()
    h2, w2, _ = _inputs(dtype, rows)
    want = chunked_loss.reference(h2, w2, y, V)
    want.backward()
    assert loss.dtype == dtype
    torch.testing.assert_close(loss, want, rtol=tol, atol=0)
    assert _rel(h.grad, h2.grad) < tol and _rel(w.grad[:V], w2.grad[:V]) < tol
    assert torch.count_nonzero(w.grad[V:]) == 0   # the padding rows get exactly zero gradient


def test_under_bf16_autocast_it_multiplies_in_bf16_and_returns_fp32(small_chunks):
    g = torch.Generator().manual_seed(5)
    h = torch.randn(64, 32, generator=g)
    w = torch.randn(97, 32, generator=g)
    y = torch.randint(0, 90, (64,), generator=g)
    # The bf16 logits made by the GEMMs the chunked loss makes (a chunk's rows by all 97 columns): a CPU's bf16
    # GEMM may round a few logits the other way at another shape.
    rows = chunked_loss.CHUNK_ROWS
    logits = torch.cat([h[i:i + rows].bfloat16() @ w.bfloat16().t() for i in range(0, 64, rows)])
    in_bf16 = F.cross_entropy(logits[:, :90].float(), y)
    in_fp32 = chunked_loss.reference(h, w, y, 90)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chunked = chunked_loss.chunked_cross_entropy(h, w, y, 90)
    assert chunked.dtype == torch.float32
    assert abs(chunked.item() - in_bf16.item()) < 1e-5
    assert abs(in_bf16.item() - in_fp32.item()) > 1e-3   # the test can tell the two dtypes apart
    assert abs(chunked_loss.chunked_cross_entropy(h, w, y, 90).item() - in_fp32.item()) < 1e-5


@pytest.mark.parametrize("acc", [torch.float32, torch.float64])
def test_softmax_grad_is_the_summed_cross_entropy_and_its_gradient_over_the_vocabulary(acc):
    # Checked against PyTorch's own cross-entropy and autograd, over the first 12 of 16 columns (the padding).
    g = torch.Generator().manual_seed(1)
    logits, y = torch.randn(5, 16, generator=g, dtype=torch.float64), torch.randint(0, 12, (5,), generator=g)
    loss, grad = chunked_loss.softmax_grad(logits, y, 12, acc)
    leaf = logits[:, :12].clone().requires_grad_()
    want = F.cross_entropy(leaf, y, reduction="sum")
    want.backward()
    tol = 1e-12 if acc == torch.float64 else 1e-6
    torch.testing.assert_close(loss.double(), want.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(grad[:, :12], leaf.grad, rtol=tol, atol=tol)
    assert torch.equal(grad[:, 12:], torch.zeros(5, 4, dtype=grad.dtype))


@pytest.mark.parametrize("rows, width", [(97, 128), (128, 128), (50257, 50304), (50304, 50304)])
def test_the_kernels_logits_are_a_multiple_of_128_wide(rows, width):
    assert loss_kernel.kernel_logits_width(rows) == width


# ---------------------------------------------------------------------------------------------
# With the loss kernel, under Triton's interpreter

CHUNKED_CHECKS = """
    import json
    import torch
    from Utils.kernels import chunked_loss, loss_kernel

    chunked_loss.CHUNK_ROWS = 50   # three chunks, the last one short
    calls = []
    kernel = loss_kernel.cross_entropy_grad
    def counted(logits, targets, vocab_size):
        calls.append(list(logits.shape))
        return kernel(logits, targets, vocab_size)
    loss_kernel.cross_entropy_grad = counted

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max()).item()

    g = torch.Generator().manual_seed(0)
    V, C, n = 1000, 32, 130
    h0 = torch.randn(n, C, generator=g, dtype=torch.float64)
    w0 = torch.randn(V, C, generator=g, dtype=torch.float64) * 0.5
    y = torch.randint(0, V, (n,), generator=g)
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    ref = chunked_loss.reference(h, w, y, V)
    ref.backward()

    out = {}
    for name, rows in (("unpadded", 1000), ("padded", 1024)):
        calls.clear()
        hk = h0.clone().requires_grad_()
        wk = torch.cat([w0, w0.new_zeros(rows - V, C)]).requires_grad_()
        loss = chunked_loss.chunked_cross_entropy(hk, wk, y, V, kernel=True)
        loss.backward()
        out[name] = dict(calls=calls[:], loss_dtype=str(loss.dtype), loss_err=abs(loss.item() - ref.item()),
                         grad_h=rel(hk.grad, h.grad), grad_w=rel(wk.grad[:V], w.grad),
                         grad_w_shape=list(wk.grad.shape),
                         padded_grad_max=wk.grad[V:].abs().max().item() if rows > V else 0.0)

    # The GPU's case: bf16 logits under autocast, against the same chunked loss without the kernel. The
    # weight is padded to the kernel's 1024 rows for both, so that both make their logits with one GEMM
    # shape: a CPU's bf16 GEMM may round a few logits the other way at another width.
    losses, grads = [], []
    w_padded = torch.cat([w0, w0.new_zeros(1024 - V, C)])
    for use_kernel in (True, False):
        hk, wk = h0.float().requires_grad_(), w_padded.float().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = chunked_loss.chunked_cross_entropy(hk, wk, y, V, kernel=use_kernel)
        loss.backward()
        losses.append(loss)
        grads.append((hk.grad, wk.grad))
    out["autocast"] = dict(loss_dtype=str(losses[0].dtype), loss_diff=abs(losses[0].item() - losses[1].item()),
                           grad_h=rel(grads[0][0], grads[1][0]), grad_w=rel(grads[0][1], grads[1][1]))
    print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def kernel_results(repo_root):
    return run_interpreted(CHUNKED_CHECKS, repo_root)


@pytest.mark.parametrize("weight", ["unpadded", "padded"])
def test_with_the_kernel_it_equals_the_reference(kernel_results, weight):
    r = kernel_results[weight]
    # One launch per chunk, each on rows padded to a multiple of 128 columns.
    assert r["calls"] == [[50, 1024], [50, 1024], [30, 1024]]
    assert r["loss_dtype"] == "torch.float64"
    # The kernel computes in fp32: float64 inputs are off by fp32 rounding.
    assert r["loss_err"] < 1e-6 and r["grad_h"] < 1e-6 and r["grad_w"] < 1e-6, r
    assert r["grad_w_shape"] == ([1000, 32] if weight == "unpadded" else [1024, 32])
    assert r["padded_grad_max"] == 0.0


def test_with_the_kernel_under_autocast_it_matches_the_plain_chunked_loss(kernel_results):
    r = kernel_results["autocast"]
    assert r["loss_dtype"] == "torch.float32"
    # The same bf16 logits: the loss differs by fp32 rounding, the gradient by its bf16 rounding (the
    # interpreter truncates where torch rounds to nearest: a bias of up to one ulp, 2^-8, per entry).
    assert r["loss_diff"] < 1e-5 and r["grad_h"] < 2e-2 and r["grad_w"] < 2e-2, r


# ---------------------------------------------------------------------------------------------
# On a GPU: GPT-2's output layer under bf16 autocast, with the kernel

@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "plain"])
def test_on_a_gpu_it_matches_the_reference_under_autocast(kernel):
    device = torch.device("cuda")
    assert loss_kernel.unavailable(device) is None
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(2 * chunked_loss.CHUNK_ROWS + 100, 768, device="cuda", generator=g)
    w = torch.randn(50304, 768, device="cuda", generator=g) * 0.02
    w[50257:] = 0
    y = torch.randint(0, 50257, (h.size(0),), device="cuda", generator=g)
    losses, grads = [], []
    for run in (lambda a, b: chunked_loss.chunked_cross_entropy(a, b, y, 50257, kernel=kernel),
                lambda a, b: chunked_loss.reference(a, b, y, 50257)):
        a, b = h.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = run(a, b)
        loss.backward()
        losses.append(loss.float())
        grads.append((a.grad, b.grad))
    assert abs(losses[0].item() - losses[1].item()) < 1e-3
    assert _rel(grads[0][0], grads[1][0]) < 2e-2 and _rel(grads[0][1][:50257], grads[1][1][:50257]) < 2e-2
    assert torch.count_nonzero(grads[0][1][50257:]) == 0
