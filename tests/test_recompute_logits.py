"""Utils.kernels.recompute_logits: the FP8 output layer's loss and e5m2 gradient from two Triton GEMMs that never
store a logit, under Triton's interpreter on the CPU (tile shapes, padded columns, a chunk's columns of the
transposed buffer, the whole FP8 loss through it) and on a Hopper GPU against the stored form; and the addition
that swaps it in."""
from dataclasses import replace

import pytest
import torch

from conftest import cuda_graph, run_interpreted
from Utils.kernels import fp8_loss, recompute_logits

# The interpreter's float-to-FP8 cast rounds wrongly where rounding carries into the exponent (1.99 becomes 1.0,
# not 2.0; a GPU's cast is right), so the expected gradient is cast by the interpreter too, as
# tests/test_fp8_loss.py does: what is checked is the GEMMs, the log-sum-exp from the tiles' partial sums, the
# one-hot, the scale, the masks and both layouts.
KERNEL_CHECKS = """
    import json
    import torch
    import triton
    import triton.language as tl
    from Utils.kernels import fp8, fp8_loss, recompute_logits

    @triton.jit
    def cast(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + o, tl.load(x_ptr + o, mask=o < n).to(y_ptr.dtype.element_ty), mask=o < n)

    g = torch.Generator().manual_seed(0)
    rows, width, before = 200, 64, 16      # rows: not a multiple of any tile's; before: where the chunk's columns start
    h8, h_inv = fp8.to_e4m3(torch.randn(rows, width, generator=g))
    w8, w_inv = fp8.to_e4m3(torch.nn.functional.pad(torch.randn(VOCAB, width, generator=g) * 0.3,
                                                    (0, 0, 0, COLS - VOCAB)))
    targets = torch.randint(0, VOCAB, (rows,), generator=g)
    row_loss, grad = torch.empty(rows), torch.zeros(rows, COLS, dtype=fp8.E5M2)
    wide = torch.full((COLS, before + rows + 24), 1.0).to(fp8.E5M2)   # rows 16-byte aligned, as TMA needs
    recompute_logits.loss_and_grad(h8, h_inv, w8, w_inv, targets, VOCAB, fp8_loss.GRAD_SCALE, row_loss, grad,
                                   wide[:, before:before + rows], tile=TILE)
    want_loss, want = recompute_logits.reference(h8, h_inv, w8, w_inv, targets, VOCAB)
    scaled = (want * fp8_loss.GRAD_SCALE).float().contiguous()
    expected = torch.empty(rows, COLS, dtype=fp8.E5M2)
    cast[(triton.cdiv(scaled.numel(), 1024),)](scaled, expected, scaled.numel(), BLOCK=1024)
    step = (grad.float() - expected.float()).abs() / expected.float().abs().clamp(min=2.0 ** -16)
    print(json.dumps(dict(
        loss_err=(row_loss.double() - want_loss).abs().max().item(),
        same=(grad.view(torch.uint8) == expected.view(torch.uint8)).float().mean().item(),
        largest_step=step.max().item(),
        transposed=torch.equal(wide[:, before:before + rows].view(torch.uint8), grad.t().view(torch.uint8)),
        untouched=bool((wide[:, :before].float() == 1).all() and (wide[:, before + rows:].float() == 1).all()),
        padded=grad[:, VOCAB:].float().abs().max().item(),
        target=grad.float()[torch.arange(rows), targets].max().item())))
"""


@pytest.mark.parametrize("vocab, cols, tile", [
    (500, 512, None),                                                     # the module's TILE: two column tiles
    (500, 512, dict(BM=64, BN=128, BK=32, GROUP_M=2)),                    # four row tiles walked two at a time
    (200, 512, dict(BM=32, BN=256, BK=32, GROUP_M=1, WS=False)),          # the second column tile padding alone
], ids=["module", "64x128-groups-of-2", "a-tile-of-padding"])
def test_the_kernels_write_the_loss_and_the_scaled_gradient_in_both_layouts(repo_root, vocab, cols, tile):
    r = run_interpreted(f"\n    VOCAB, COLS, TILE = {vocab}, {cols}, {tile!r}" + KERNEL_CHECKS, repo_root)
    assert r["loss_err"] < 1e-4
    # exp in fp32 against float64: a few values land one FP8 step apart (e5m2's step is 1/4 to 1/8 of a value)
    assert r["same"] > 0.99 and r["largest_step"] <= 0.25
    assert r["transposed"] and r["untouched"] and r["padded"] == 0
    assert r["target"] < 0   # the one-hot: the target's gradient is p - 1


LOSS_CHECKS = """
    import json
    import torch
    from Utils.kernels import fp8_loss, recompute_logits

    fp8_loss.CHUNK_ROWS = 48                          # 48, 48 and a short 16: each chunk's slices
    recompute_logits.TILE.update(BM=32, BN=64, BK=32, GROUP_M=2)
    g = torch.Generator().manual_seed(0)
    n, width, vocab, rows = 112, 32, 90, 112          # rows of the padded output layer
    h = torch.nn.functional.layer_norm(torch.randn(n, width, generator=g, dtype=torch.float64), (width,))
    w = torch.randn(rows, width, generator=g, dtype=torch.float64) * 0.3
    w[vocab:] = 0
    y = torch.randint(0, vocab, (n,), generator=g)

    def run(f, dtype, **kw):
        hh, ww = h.detach().to(dtype).requires_grad_(), w.detach().to(dtype).requires_grad_()
        loss = f(hh, ww, y, vocab, **kw)
        loss.backward()
        return loss.double(), hh.grad.double(), ww.grad.double()

    rel = lambda a, b: ((a - b).norm() / b.norm()).item()
    want = run(fp8_loss.reference, torch.float64)   # its loss only: the interpreter's cast skews the gradients
    stored = run(fp8_loss.fp8_cross_entropy, torch.float32)
    recomputed = run(fp8_loss.fp8_cross_entropy, torch.float32, recompute=True)
    print(json.dumps(dict(
        loss_err=abs(recomputed[0] - want[0]).item(),
        loss_apart=abs(recomputed[0] - stored[0]).item(),
        apart=[rel(recomputed[1], stored[1]), rel(recomputed[2], stored[2])],
        padded_rows=int(torch.count_nonzero(recomputed[2][vocab:])))))
"""


def test_the_fp8_loss_through_it_is_the_stored_form_within_bf16_rounding(repo_root):
    # Against the stored form under the interpreter too (its kernels, with the same wrong cast): what differs is
    # the stored form's logits rounded to bf16, 1.4 to 1.6% of the gradients here. A chunk's rows or columns misplaced
    # would be far more. tests/test_fp8_loss.py holds the stored form to the reference.
    r = run_interpreted(LOSS_CHECKS, repo_root)
    assert r["loss_err"] < 0.01 and r["loss_apart"] < 1e-3, r
    assert 0 < max(r["apart"]) < 0.03, r   # 1.6% and 1.4% with Triton 3.7.1
    assert r["padded_rows"] == 0


@pytest.mark.parametrize("capability, runs", [((8, 9), False), ((9, 0), True), ((10, 0), False), ((12, 0), False)])
def test_it_needs_a_hopper_gpu(monkeypatch, capability, runs):
    # Hopper only: the gradient kernel's 213 KB of shared memory is compiled for sm_90 alone.
    assert "Hopper" in recompute_logits.unavailable(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    why = recompute_logits.unavailable(torch.device("cuda"))
    assert why is None if runs else "Hopper" in why


def test_on_a_cpu_the_fp8_loss_keeps_the_stored_form():
    # Without a GPU or the interpreter the kernels cannot run: recompute asks for them and gets the stored form,
    # the same numbers bit for bit.
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(32, 16, generator=g), torch.randn(128, 16, generator=g) * 0.3
    y = torch.randint(0, 100, (32,), generator=g)
    assert torch.equal(fp8_loss.fp8_cross_entropy(h, w, y, 100, recompute=True),
                       fp8_loss.fp8_cross_entropy(h, w, y, 100))


def test_the_addition_leaves_the_loss_stored_where_it_cannot_or_should_not_run(monkeypatch):
    from Utils.ladder import apply, modules
    from Utils.model import GPT
    from Utils.model_config import PRESETS

    def build(width):
        config = replace(PRESETS["tiny"], n_embd=width)
        b = apply.Build(model=GPT(config), config=config, device=torch.device("cpu"))
        b.model.loss = modules.ChunkedLoss(config.vocab_size, kernel=True, fp8=True)
        return b

    b = build(64)
    assert "Hopper" in apply.apply_recompute_logits(b) and not b.model.loss.recompute
    monkeypatch.setattr(recompute_logits, "unavailable", lambda device: None)
    b = build(apply.RECOMPUTE_LOGITS_WIDEST + 64)
    assert "width" in apply.apply_recompute_logits(b) and not b.model.loss.recompute
    b = build(64)
    b.model.loss.fp8 = False   # fp8_head fell back to bf16
    assert "not in FP8" in apply.apply_recompute_logits(b) and not b.model.loss.recompute
    b = build(64)
    assert apply.apply_recompute_logits(b) is None and b.model.loss.recompute


# ---------------------------------------------------------------------------------------------
# On a Hopper GPU: the hardware's cast, the compiled kernels, the chunks' slices at real sizes.

def _on_hopper():
    if not torch.cuda.is_available() or recompute_logits.unavailable(torch.device("cuda")):
        pytest.skip("needs a Hopper GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("width", [256, 768])
def test_on_a_gpu_it_matches_the_stored_form(monkeypatch, width):
    _on_hopper()
    monkeypatch.setattr(fp8_loss, "CHUNK_ROWS", 1024)   # 1,024, 1,024 and a short 560: no whole tile of rows
    n = 2608
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.nn.functional.layer_norm(torch.randn(n, width, device="cuda", generator=g), (width,))
    w = torch.randn(50304, width, device="cuda", generator=g) * 0.02
    y = torch.randint(0, 50257, (n,), device="cuda", generator=g)
    out = {}
    for recompute in (False, True):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fp8_loss.fp8_cross_entropy(hh, ww, y, 50257, recompute=recompute)
        loss.backward()
        out[recompute] = loss.item(), hh.grad.float(), ww.grad.float()
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()   # noqa: E731
    assert abs(out[True][0] - out[False][0]) < 1e-3
    assert rel(out[True][1], out[False][1]) < 0.05 and rel(out[True][2], out[False][2]) < 0.05
    assert torch.count_nonzero(out[True][2][50257:]) == 0


@pytest.mark.gpu
def test_on_a_gpu_a_chunk_writes_its_own_columns_only_and_replays_as_a_cuda_graph():
    # The hardware's TMA stores clip at the descriptors' bounds: 200 rows (no whole tile) into columns 16 to 216 of
    # a wider buffer, as a chunk's; then the same launch captured in a CUDA graph (as max's step is) and replayed.
    _on_hopper()
    from Utils.kernels import fp8
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, width, vocab, cols, before = 200, 768, 50257, 50304, 16
    h8, h_inv = fp8.to_e4m3(torch.randn(rows, width, device="cuda", generator=g))
    w8, w_inv = fp8.to_e4m3(torch.nn.functional.pad(torch.randn(vocab, width, device="cuda", generator=g) * 0.02,
                                                    (0, 0, 0, cols - vocab)))
    y = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    want_loss, want = recompute_logits.reference(h8, h_inv, w8, w_inv, y, vocab)
    row_loss, grad = torch.empty(rows, device="cuda"), torch.zeros(rows, cols, dtype=fp8.E5M2, device="cuda")
    wide = torch.full((cols, before + rows + 24), 1.0, device="cuda").to(fp8.E5M2)

    def run():
        recompute_logits.loss_and_grad(h8, h_inv, w8, w_inv, y, vocab, fp8_loss.GRAD_SCALE, row_loss, grad,
                                       wide[:, before:before + rows])
    run()
    assert (row_loss.double() - want_loss).abs().max() < 1e-3
    expected = (want * fp8_loss.GRAD_SCALE).float().to(fp8.E5M2)   # the hardware's cast rounds right
    step = (grad.float() - expected.float()).abs() / expected.float().abs().clamp(min=2.0 ** -16)
    # exp in fp32 against float64: a few values one e5m2 step apart (1/4 to 1/8 of a value), none further
    assert (grad.view(torch.uint8) == expected.view(torch.uint8)).float().mean() > 0.99 and step.max() <= 0.25
    assert torch.equal(wide[:, before:before + rows].view(torch.uint8), grad.t().view(torch.uint8))
    assert bool((wide[:, :before].float() == 1).all() and (wide[:, before + rows:].float() == 1).all())
    eager = row_loss.clone(), grad.clone()
    graph, _ = cuda_graph(run)
    row_loss.zero_()
    grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(row_loss, eager[0]) and torch.equal(grad.view(torch.uint8), eager[1].view(torch.uint8))
