"""Utils.kernels.fp8_loss: the chunked loss with its three GEMMs in FP8, against the fp64 reference (within
FP8's rounding, and measurably not bf16's), over several chunks and a padded output layer, eager and
compiled; and where it refuses to run."""
import pytest
import torch

from conftest import run_interpreted
from Utils.kernels import chunked_loss, fp8, fp8_loss

V, ROWS, C, N = 90, 112, 32, 96   # vocabulary, rows (padded to 128 inside), width, tokens: chunks of 40


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
    monkeypatch.setattr(fp8_loss, "CHUNK_ROWS", 40)   # three chunks, the last one short


def _grads(f, h, w, y, dtype, autocast, vocab=V):
    h, w = h.detach().to(dtype).requires_grad_(), w.detach().to(dtype).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = f(h, w, y, vocab)
    loss.backward()
    return loss, h.grad, w.grad


@pytest.mark.parametrize("dtype, autocast", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False)],
                         ids=["fp32", "bf16-autocast", "bf16"])
def test_loss_and_gradients_are_the_reference_within_fp8_rounding(small_chunks, dtype, autocast):
    h, w, y = _inputs()
    want, want_h, want_w = _grads(fp8_loss.reference, h, w, y, torch.float64, False)
    loss, grad_h, grad_w = _grads(fp8_loss.fp8_cross_entropy, h, w, y, dtype, autocast)
    assert loss.dtype == torch.float32 and grad_h.dtype == grad_w.dtype == dtype
    # e4m3 is off by at most 1/16 of a value, e5m2 by 1/8; summed over many terms the errors partly cancel.
    assert abs(loss.item() - want.item()) < 0.01
    errors = _rel(grad_h, want_h), _rel(grad_w[:V], want_w[:V])
    assert max(errors) < 0.08, errors
    # ...and FP8 is what ran: bf16 GEMMs stay within 1% of the reference on these inputs.
    bf16_h = _grads(chunked_loss.chunked_cross_entropy, h, w, y, torch.bfloat16, False)[1]
    assert _rel(bf16_h, want_h) < 0.01 < errors[0]
    assert torch.count_nonzero(grad_w[V:]) == 0   # the padding rows get exactly zero gradient


def test_small_probabilities_keep_their_gradient():
    # One word far likelier than the others: every other probability is about 2^-20, below e5m2's smallest
    # value (2^-16) unscaled. The fixed gradient scale of 2^15 keeps each of them, so the weight's gradient
    # has no zero row among the words.
    h = torch.zeros(16, C)
    h[:, 0] = 1
    w = torch.zeros(ROWS, C)
    w[0, 0] = 14
    w.requires_grad_()
    fp8_loss.fp8_cross_entropy(h, w, torch.zeros(16, dtype=torch.long), V).backward()
    assert torch.count_nonzero(w.grad[:V].abs().sum(1)) == V


def test_compiled_is_eager(small_chunks):
    h, w, y = _inputs(1)
    eager = _grads(fp8_loss.fp8_cross_entropy, h, w, y, torch.float32, True)
    compiled = _grads(torch.compile(fp8_loss.fp8_cross_entropy), h, w, y, torch.float32, True)
    # Inductor computes the casts around the operator (the amax, the scaled inputs) in its own order: a few
    # inputs land one FP8 step apart.
    assert abs(eager[0].item() - compiled[0].item()) < 1e-4
    assert _rel(compiled[1], eager[1]) < 0.01 and _rel(compiled[2], eager[2]) < 0.01


def test_tokens_and_width_must_be_multiples_of_16_and_targets_one_per_token():
    h, w, y = _inputs()
    with pytest.raises(ValueError, match=r"targets must be one per row of h \(96\)"):
        fp8_loss.fp8_cross_entropy(h.float(), w.float(), y[:95], V)
    with pytest.raises(ValueError, match=r"vocab_size=113 must be between 1 and the weight's rows 112"):
        fp8_loss.fp8_cross_entropy(h.float(), w.float(), y, 113)
    with pytest.raises(ValueError, match=r"tokens per step \(95\) to be a multiple of 16"):
        fp8_loss.fp8_cross_entropy(h[:95].float(), w.float(), y[:95], V)
    assert fp8.width_problem(768) is None
    assert "width (24)" in fp8.width_problem(24)


def test_it_needs_an_ada_or_hopper_gpu(monkeypatch):
    # PyTorch emulates FP8 matmuls on a CPU (these tests run them), but the training loop is not given them.
    assert "emulates" in fp8_loss.unavailable(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "Ada or Hopper" in fp8_loss.unavailable(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8_loss.unavailable(torch.device("cuda")) is None


# ---------------------------------------------------------------------------------------------
# The Triton kernels under the interpreter. Its float-to-FP8 cast rounds wrongly where rounding carries
# into the exponent (1.99 becomes 1.0, not 2.0; a GPU's cast is right), so the expected gradient is cast by
# the interpreter too: what is checked is the kernels' softmax, one-hot, scale, masks and both layouts.

KERNEL_CHECKS = """
    import json
    import torch
    import triton
    import triton.language as tl
    from Utils.kernels import fp8, fp8_loss, loss_kernel

    @triton.jit
    def cast(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + o, tl.load(x_ptr + o, mask=o < n).to(y_ptr.dtype.element_ty), mask=o < n)

    (fp8_loss.LSE_BLOCK, fp8_loss.LSE_WARPS, fp8_loss.TILE_R, fp8_loss.TILE_C, fp8_loss.TILE_WARPS) = SHAPES or (
        fp8_loss.LSE_BLOCK, fp8_loss.LSE_WARPS, fp8_loss.TILE_R, fp8_loss.TILE_C, fp8_loss.TILE_WARPS)
    g = torch.Generator().manual_seed(0)
    rows, cols, vocab, before = 150, 200, 190, 7       # neither a multiple of a tile's 32, 64 or 128
    logits = (torch.randn(rows, cols, generator=g) * 3).bfloat16()
    targets = torch.randint(0, vocab, (rows,), generator=g)
    grad = torch.zeros(rows, cols, dtype=fp8.E5M2)
    # the transposed gradient lands in columns [before, before + rows) of a wider buffer, as a chunk's does
    wide = torch.full((cols, before + rows + 5), 1.0).to(fp8.E5M2)
    row_loss, lse = torch.empty(rows), torch.empty(rows)
    fp8_loss._softmax_grad_fp8(logits, targets, vocab, row_loss, lse, grad, wide[:, before:before + rows])
    want_loss, want = loss_kernel.reference(logits.double(), targets, vocab, torch.float64)
    scaled = (want * fp8_loss.GRAD_SCALE).float().contiguous()
    expected = torch.empty(rows, cols, dtype=fp8.E5M2)
    cast[(triton.cdiv(scaled.numel(), 1024),)](scaled, expected, scaled.numel(), BLOCK=1024)
    step = (grad.float() - expected.float()).abs() / expected.float().abs().clamp(min=2.0 ** -16)
    print(json.dumps(dict(
        kernels=fp8_loss._kernels is not None and fp8_loss.INTERPRETED,
        loss_err=(row_loss.double() - want_loss).abs().max().item(),
        same=(grad.view(torch.uint8) == expected.view(torch.uint8)).float().mean().item(),
        largest_step=step.max().item(),
        transposed=torch.equal(wide[:, before:before + rows].view(torch.uint8), grad.t().view(torch.uint8)),
        untouched=bool((wide[:, :before].float() == 1).all() and (wide[:, before + rows:].float() == 1).all()),
        padded=grad[:, vocab:].float().abs().max().item(),
        target=grad.float()[torch.arange(rows), targets].max().item())))
"""


# The module's launch shapes, and others that bench/fp8_kernels.py times: several column blocks per row in
# the log-sum-exp pass, and rectangular gradient tiles.
@pytest.mark.parametrize("shapes", [None, (64, 4, 64, 32, 4), (32, 1, 128, 128, 8)],
                         ids=["module", "64-64x32", "32-128x128"])
def test_the_triton_kernels_write_the_scaled_gradient_in_both_layouts(repo_root, shapes):
    r = run_interpreted(f"\n    SHAPES = {shapes!r}" + KERNEL_CHECKS, repo_root)
    assert r["kernels"], "the kernels did not run under the interpreter"
    assert r["loss_err"] < 1e-4
    # exp in fp32 against float64: a few values land one FP8 step apart (e5m2's step is 1/4 to 1/8 of a value)
    assert r["same"] > 0.99 and r["largest_step"] <= 0.25
    assert r["transposed"] and r["untouched"] and r["padded"] == 0
    assert r["target"] < 0   # the one-hot: the target's gradient is p - 1


TRANSPOSE_CHECK = """
    import json
    import torch
    from Utils.kernels import fp8, fp8_loss

    fp8_loss.T_ROWS, fp8_loss.T_COLS = SHAPE
    g = torch.Generator().manual_seed(0)
    rows, cols, before = 150, 200, 7                      # neither a multiple of any tile tried
    src = (torch.randn(rows, cols, generator=g) * 100).to(fp8.E5M2)
    wide = torch.full((cols, before + rows + 5), 1.0).to(fp8.E5M2)   # the chunk's columns of the buffer
    fp8_loss.transpose(src, wide[:, before:before + rows])
    print(json.dumps(dict(
        transposed=torch.equal(wide[:, before:before + rows].view(torch.uint8), src.t().view(torch.uint8)),
        untouched=bool((wide[:, :before].float() == 1).all() and (wide[:, before + rows:].float() == 1).all()))))
"""


@pytest.mark.parametrize("shape", [(128, 128), (64, 32)], ids=["module", "64x32"])
def test_the_transpose_copies_every_byte_into_the_chunks_columns_only(repo_root, shape):
    # the one-pass form's second kernel: after the CUDA pass, on a GPU
    r = run_interpreted(f"\n    SHAPE = {shape!r}" + TRANSPOSE_CHECK, repo_root)
    assert r["transposed"] and r["untouched"]


# ---------------------------------------------------------------------------------------------
# On a GPU: the kernels' cast is the hardware's, and the whole loss runs through cuBLASLt's FP8 GEMMs.

@pytest.mark.gpu
def test_on_a_gpu_it_is_the_reference_within_fp8_rounding(monkeypatch):
    if not torch.cuda.is_available() or fp8_loss.unavailable(torch.device("cuda")):
        pytest.skip("needs an Ada or Hopper GPU")
    monkeypatch.setattr(fp8_loss, "CHUNK_ROWS", 384)   # 384, 384 and a short 256: the last chunk's slices
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.nn.functional.layer_norm(torch.randn(1024, 256, device="cuda", generator=g), (256,))
    w = torch.randn(1000, 256, device="cuda", generator=g) * 0.1
    y = torch.randint(0, 990, (1024,), device="cuda", generator=g)
    want, want_h, want_w = _grads(fp8_loss.reference, h.cpu().double(), w.cpu().double(), y.cpu(),
                                  torch.float64, False, vocab=990)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = fp8_loss.fp8_cross_entropy(hh, ww, y, 990)
    loss.backward()
    assert abs(loss.item() - want.item()) < 0.01
    assert _rel(hh.grad.cpu(), want_h) < 0.08 and _rel(ww.grad[:990].cpu(), want_w[:990]) < 0.08
    assert torch.count_nonzero(ww.grad[990:]) == 0


@pytest.mark.gpu
def test_on_a_gpu_the_cuda_pass_writes_what_the_triton_kernels_write(monkeypatch):
    # The one-pass form (CUDA pass, then the transpose) against the two Triton kernels, on one chunk of
    # logits with padded columns and a transposed buffer wider than the chunk.
    if not torch.cuda.is_available() or fp8_loss.unavailable(torch.device("cuda")):
        pytest.skip("needs an Ada or Hopper GPU")
    from Utils.kernels import loss_kernel
    rows, cols, vocab, before = 300, 1024, 1000, 16
    assert loss_kernel.prepare(torch.device("cuda"), cols) is None, "the CUDA kernels did not build"
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(rows, cols, device="cuda", generator=g) * 3).bfloat16()
    targets = torch.randint(0, vocab, (rows,), device="cuda", generator=g)

    def run():
        loss, lse = torch.empty(rows, device="cuda"), torch.empty(rows, device="cuda")
        grad = torch.empty(rows, cols, dtype=fp8.E5M2, device="cuda")
        wide = torch.full((cols, before + rows + 16), 1.0, device="cuda").to(fp8.E5M2)
        fp8_loss._softmax_grad_fp8(logits, targets, vocab, loss, lse, grad, wide[:, before:before + rows])
        return loss, grad, wide

    loss1, grad1, wide1 = run()
    assert loss_kernel.grad_e5m2(logits, targets, vocab, torch.empty(rows, device="cuda"), grad1.clone(), 1.0)
    # what it refuses, having written nothing: a vocabulary wider than the row, rows that overlap
    assert not loss_kernel.grad_e5m2(logits, targets, cols + 8, torch.empty(rows, device="cuda"), grad1.clone(), 1.0)
    assert not loss_kernel.grad_e5m2(logits[:1].expand(rows, cols), targets, vocab, torch.empty(rows, device="cuda"),
                                     grad1.clone(), 1.0)
    monkeypatch.setattr(loss_kernel, "USE_CUDA", False)   # the two Triton kernels
    loss2, grad2, wide2 = run()
    assert (loss1 - loss2).abs().max().item() < 1e-4
    # The CUDA kernel keeps each exponential in fp16 (11 significant bits) before scaling it: that moves a value
    # by up to 2^-11 of itself, across an e5m2 rounding boundary (1/8 to 1/4 of a value apart) for about 1 value
    # in 1,000 (9.8e-4 in a simulation of its arithmetic); one step at most, never more.
    step = (grad1.float() - grad2.float()).abs() / grad2.float().abs().clamp(min=2.0 ** -16)
    assert (grad1.view(torch.uint8) != grad2.view(torch.uint8)).float().mean().item() < 3e-3
    assert step.max().item() <= 0.25 and grad1[:, vocab:].float().abs().max().item() == 0
    assert torch.equal(wide1[:, before:before + rows].view(torch.uint8), grad1.t().view(torch.uint8))
    assert torch.equal(wide1[:, :before].view(torch.uint8), wide2[:, :before].view(torch.uint8))
    assert torch.equal(wide1[:, before + rows:].view(torch.uint8), wide2[:, before + rows:].view(torch.uint8))
