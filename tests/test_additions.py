"""The max rung's three newest additions on the CPU: the Triton cross-entropy kernel (run by Triton's
interpreter in a subprocess) and the chunked loss that uses it, the bf16 residual stream under autocast,
and the gradient clip folded into fused AdamW."""
from dataclasses import replace

import pytest
import torch
import torch.nn as nn

from conftest import run_interpreted
from Utils import ce_kernel, recipes
from Utils.model import GPT, PRESETS, GPTConfig
from Utils.recipes import BF16, FUSED, TF32, Recipe, apply_optimizer, make_update

CPU = torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# The cross-entropy kernel against a float64 reference

KERNEL_CHECKS = """
    import json
    import torch
    import torch.nn.functional as F
    from Utils import ce_kernel

    def bf16_ulp(v):
        # bf16 keeps 8 significant bits: its spacing around v is 2^(exponent - 8), frexp's mantissa in [0.5, 1)
        return torch.ldexp(torch.ones_like(v), torch.frexp(v).exponent - 8)

    def check(logits, y, vocab):
        ref = logits[:, :vocab].double()   # the same rounded logits the kernel reads
        ref_loss = torch.logsumexp(ref, 1) - ref.gather(1, y[:, None]).squeeze(1)
        ref_grad = torch.softmax(ref, 1) - F.one_hot(y, vocab).double()
        ptr, before = logits.data_ptr(), logits.clone()
        loss = ce_kernel.cross_entropy_grad(logits, y, vocab)
        err = (logits[:, :vocab].double() - ref_grad).abs()
        return dict(loss_dtype=str(loss.dtype), loss_shape=list(loss.shape),
                    loss_err=(loss.double() - ref_loss).abs().max().item(),
                    grad_err=err.max().item(), grad_err_ulps=(err / bf16_ulp(ref_grad)).max().item(),
                    padded_max=logits[:, vocab:].abs().max().item() if logits.size(1) > vocab else 0.0,
                    same_storage=logits.data_ptr() == ptr, overwritten=not torch.equal(logits, before))

    def logits_and_targets(rows, vocab, cols, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(rows, cols, generator=g) * 3
        x[:, vocab:] = 30.0   # would dominate the softmax and the loss if the padding were not masked
        y = torch.randint(0, vocab, (rows,), generator=g)
        y[0], y[1] = 0, vocab - 1
        return x, y

    out = {"available": ce_kernel.available(torch.device("cpu"))}
    x, y = logits_and_targets(70, 1000, 1024, seed=0)
    out["bf16"] = check(x.bfloat16(), y, 1000)
    out["fp32"] = check(x.clone(), y, 1000)
    # Three 2048-column blocks, the last partly padding, and a maximum in the last one for half the rows:
    # the online softmax must rescale its running sums across blocks.
    x, y = logits_and_targets(6, 4500, 4608, seed=1)
    x[::2, 4300] = 15.0
    out["blocks"] = check(x, y, 4500)
    # Each element of the first pass either raises its lane's running maximum or does not: every element
    # does in a rising row, none after the first in a falling or a constant one (where each ties it). A
    # lane sees every 2048th column: a row whose 2048-column blocks alternate between -60 and 60 has each
    # lane jump by 120, where exp(-120) underflows to zero in fp32.
    x, y = logits_and_targets(6, 4500, 4608, seed=3)
    x[0, :4500] = 2.5
    x[1, :4500] = torch.linspace(-50, 50, 4500)
    x[2, :4500] = torch.linspace(50, -50, 4500)
    x[3, :2048], x[3, 2048:4096], x[3, 4096:4500] = -60.0, 60.0, -60.0
    x[4, :2048], x[4, 2048:4096], x[4, 4096:4500] = 60.0, -60.0, 60.0
    out["update_forms"] = check(x, y, 4500)
    # Rows contiguous but further apart than their width (a column slice): only the slice is written.
    x, y = logits_and_targets(70, 1000, 1100, seed=2)
    x[:, 1000:] = 30.0
    outside = x[:, 1024:].clone()
    out["strided"] = check(x[:, :1024], y, 1000)
    out["strided"]["outside_untouched"] = torch.equal(x[:, 1024:], outside)
    print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def kernel_results(repo_root):
    return run_interpreted(KERNEL_CHECKS, repo_root)


def test_the_interpreter_makes_the_kernel_available_on_a_cpu(kernel_results):
    assert kernel_results["available"] is True


@pytest.mark.parametrize("case", ["bf16", "fp32", "blocks", "update_forms", "strided"])
def test_kernel_rows_losses_and_gradient_match_float64(kernel_results, case):
    r = kernel_results[case]
    assert r["loss_dtype"] == "torch.float32" and r["loss_shape"] == [6 if case in ("blocks", "update_forms") else 70]
    # The kernel works in fp32: the losses (about 7 to 30, up to 108 in update_forms) are off by fp32
    # rounding only.
    assert r["loss_err"] < 1e-5, r
    if case == "bf16":
        # One bf16 rounding of an fp32 value (the interpreter truncates, a GPU rounds to nearest): under one
        # unit in the last place of the exact gradient, whatever its size.
        assert r["grad_err_ulps"] < 1.001, r
    else:
        assert r["grad_err"] < 1e-6, r
    assert r["padded_max"] == 0.0           # exactly zero, though those columns held the largest logits
    assert r["same_storage"] and r["overwritten"]
    if case == "strided":
        assert r["outside_untouched"]


def test_kernel_refuses_a_device_it_cannot_run_on_in_one_line(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU") as e:
        ce_kernel.cross_entropy_grad(torch.zeros(70, 1024), torch.zeros(70, dtype=torch.long), 1000)
    assert "\n" not in str(e.value) and "loss='chunked'" in str(e.value)


@pytest.mark.parametrize("logits, targets, vocab, match", [
    (torch.zeros(1024, 70).t(), torch.zeros(70, dtype=torch.long), 1000, "contiguous rows"),
    (torch.zeros(2, 70, 1024), torch.zeros(70, dtype=torch.long), 1000, "2-D"),
    (torch.zeros(70, 1024), torch.zeros(69, dtype=torch.long), 1000, "one per row"),
    (torch.zeros(70, 1024), torch.zeros(70, 1, dtype=torch.long), 1000, "one per row"),
    (torch.zeros(70, 1024), torch.zeros(70, dtype=torch.long), 1025, "vocab_size=1025"),
    (torch.zeros(70, 1024), torch.zeros(70, dtype=torch.long), 0, "vocab_size=0"),
])
def test_kernel_refuses_shapes_it_would_read_past(monkeypatch, logits, targets, vocab, match):
    # Checked on the host before any launch, where the kernel itself would read out of bounds; the check
    # runs here with the device test passed, without the interpreter.
    monkeypatch.setattr(ce_kernel, "available", lambda device: True)
    with pytest.raises(ValueError, match=match):
        ce_kernel.cross_entropy_grad(logits, targets, vocab)
    assert torch.count_nonzero(logits) == 0


def test_kernel_is_unavailable_on_a_cpu_without_the_interpreter(monkeypatch):
    # (apply_loss's fallback to the plain chunked loss is tested in test_recipes.py)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert ce_kernel.available(CPU) is False


# ---------------------------------------------------------------------------------------------
# The chunked loss with the kernel

CHUNKED_CHECKS = """
    import json
    from dataclasses import replace
    import torch
    import torch.nn.functional as F
    import Utils.model as M

    M.CHUNK_ROWS = 50   # three chunks, the last one short
    calls = []
    kernel = M.ce_kernel.cross_entropy_grad
    def counted(logits, targets, vocab_size):
        calls.append(list(logits.shape))
        return kernel(logits, targets, vocab_size)
    M.ce_kernel.cross_entropy_grad = counted

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max()).item()

    g = torch.Generator().manual_seed(0)
    V, C, n = 1000, 32, 130
    h0 = torch.randn(n, C, generator=g, dtype=torch.float64)
    w0 = torch.randn(V, C, generator=g, dtype=torch.float64) * 0.5
    y = torch.randint(0, V, (n,), generator=g)
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    ref = F.cross_entropy(h @ w.t(), y)
    ref.backward()

    out = {}
    for name, rows in (("unpadded", 1000), ("padded", 1024)):
        calls.clear()
        hk = h0.clone().requires_grad_()
        wk = torch.cat([w0, w0.new_zeros(rows - V, C)]).requires_grad_()
        loss = M.chunked_cross_entropy(hk, wk, y, V, kernel=True)
        loss.backward()
        out[name] = dict(calls=calls[:], loss_dtype=str(loss.dtype), loss_err=abs(loss.item() - ref.item()),
                         grad_h=rel(hk.grad, h.grad), grad_w=rel(wk.grad[:V], w.grad),
                         grad_w_shape=list(wk.grad.shape),
                         padded_grad_max=wk.grad[V:].abs().max().item() if rows > V else 0.0)

    # The GPU's case: bf16 logits under autocast, against the same chunked loss without the kernel.
    losses, grads = [], []
    for use_kernel in (True, False):
        hk, wk = h0.float().requires_grad_(), w0.float().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = M.chunked_cross_entropy(hk, wk, y, V, kernel=use_kernel)
        loss.backward()
        losses.append(loss)
        grads.append((hk.grad, wk.grad))
    out["autocast"] = dict(loss_dtype=str(losses[0].dtype), loss_diff=abs(losses[0].item() - losses[1].item()),
                           grad_h=rel(grads[0][0], grads[1][0]), grad_w=rel(grads[0][1], grads[1][1]))

    # Through the model: loss="chunked_kernel" is the full loss, up to the kernel's fp32.
    small = M.GPTConfig(block_size=32, vocab_size=97, n_layer=2, n_head=4, n_embd=32)
    models = []
    for loss_kind in ("full", "chunked_kernel"):
        torch.manual_seed(0)
        models.append(M.GPT(replace(small, loss=loss_kind)).double())
    idx = torch.randint(0, 97, (2, 32), generator=g)
    calls.clear()
    losses = [m(idx, idx)[1] for m in models]
    for loss in losses:
        loss.backward()
    out["model"] = dict(calls=calls[:], loss_err=abs(losses[0].item() - losses[1].item()),
                        grads=max(rel(b.grad, a.grad) for a, b in zip(models[0].parameters(), models[1].parameters())))
    print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def chunked_results(repo_root):
    return run_interpreted(CHUNKED_CHECKS, repo_root)


@pytest.mark.parametrize("weight", ["unpadded", "padded"])
def test_chunked_loss_with_the_kernel_equals_cross_entropy(chunked_results, weight):
    r = chunked_results[weight]
    # One launch per chunk, each on rows padded to a multiple of 128 columns.
    assert r["calls"] == [[50, 1024], [50, 1024], [30, 1024]]
    assert r["loss_dtype"] == "torch.float64"
    assert r["loss_err"] < 1e-6 and r["grad_h"] < 1e-6 and r["grad_w"] < 1e-6, r
    assert r["grad_w_shape"] == ([1000, 32] if weight == "unpadded" else [1024, 32])
    assert r["padded_grad_max"] == 0.0


def test_chunked_loss_with_the_kernel_under_autocast_matches_the_plain_chunked_loss(chunked_results):
    r = chunked_results["autocast"]
    assert r["loss_dtype"] == "torch.float32"
    # The same bf16 logits: the loss differs by fp32 rounding, the gradient by its bf16 rounding (the
    # interpreter truncates where torch rounds to nearest: a bias of up to one ulp, 2^-8, per entry).
    assert r["loss_diff"] < 1e-5 and r["grad_h"] < 2e-2 and r["grad_w"] < 2e-2, r


def test_model_with_the_kernel_loss_matches_the_full_loss(chunked_results):
    r = chunked_results["model"]
    assert r["calls"] == [[50, 128], [14, 128]]   # 64 tokens in chunks of 50, vocabulary 97 in rows of 128
    assert r["loss_err"] < 1e-6 and r["grads"] < 1e-6, r


# ---------------------------------------------------------------------------------------------
# A bf16 residual stream under autocast

def tiny(residual):
    torch.manual_seed(0)
    return GPT(replace(PRESETS["tiny"], residual=residual))


def forward_recording_block_inputs(model, idx):
    seen = []
    hooks = [b.register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
             for b in model.transformer.h]
    try:
        logits, loss = model(idx, idx)
    finally:
        for hook in hooks:
            hook.remove()
    return seen, logits, loss


IDX = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(1))


def test_bf16_residual_stream_enters_every_block_in_bf16_under_autocast():
    n = PRESETS["tiny"].n_layer
    with torch.autocast("cpu", dtype=torch.bfloat16):
        seen_bf16, _, loss_bf16 = forward_recording_block_inputs(tiny("autocast"), IDX)
        seen_fp32, _, loss_fp32 = forward_recording_block_inputs(tiny("fp32"), IDX)
    assert seen_bf16 == [torch.bfloat16] * n
    assert seen_fp32 == [torch.float32] * n
    assert loss_bf16.dtype == loss_fp32.dtype == torch.float32
    # Only the adds' rounding changes: close at init (about ln 50257 = 10.8), but not the same numbers.
    assert abs(loss_bf16.item() - loss_fp32.item()) < 5e-3
    assert loss_bf16.item() != loss_fp32.item()


def test_residual_stays_fp32_under_fp16_autocast():
    # fp16's range could overflow a residual stream that has no loss scaling: only bf16 is taken.
    with torch.autocast("cpu", dtype=torch.float16):
        seen, _, loss = forward_recording_block_inputs(tiny("autocast"), IDX)
    assert seen == [torch.float32] * PRESETS["tiny"].n_layer and torch.isfinite(loss)


def test_bf16_residual_backward_gives_fp32_gradients_close_to_the_fp32_stream():
    models = {r: tiny(r) for r in ("autocast", "fp32")}
    for model in models.values():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(IDX, IDX)[1]
        loss.backward()
    for (name, a), b in zip(models["fp32"].named_parameters(), models["autocast"].parameters()):
        assert b.grad.dtype == torch.float32 and torch.isfinite(b.grad).all(), name
        assert (a.grad - b.grad).norm() / a.grad.norm() < 5e-2, name


def test_residual_setting_changes_nothing_without_autocast():
    seen_a, logits_a, loss_a = forward_recording_block_inputs(tiny("autocast"), IDX)
    seen_b, logits_b, loss_b = forward_recording_block_inputs(tiny("fp32"), IDX)
    assert seen_a == seen_b == [torch.float32] * PRESETS["tiny"].n_layer
    assert torch.equal(logits_a, logits_b) and torch.equal(loss_a, loss_b)


def test_bf16_residual_needs_bf16_autocast_and_a_known_name():
    assert replace(BF16, residual="autocast").residual == "autocast"
    for bad in (dict(residual="autocast"), dict(residual="bf16", bf16=True)):
        with pytest.raises(ValueError, match="residual"):
            replace(TF32, **bad)
    with pytest.raises(ValueError, match="residual"):
        Recipe("r", residual="autocast")
    with pytest.raises(ValueError, match="residual"):
        GPTConfig(residual="bf16")


# ---------------------------------------------------------------------------------------------
# The gradient clip folded into fused AdamW

class Layer(nn.Module):
    """A matrix (weight-decayed) and a bias (not): both of AdamW's parameter groups."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(32, 16) * 0.1)
        self.bias = nn.Parameter(torch.zeros(32))


def train(kind, norms):
    """Parameters after each update, the gradients of step i random with global norm norms[i]; `kind` is
    "clipped" (clip_grad_norm_ then step), "folded" (fold_clip), "unclipped" or "unclamped" (a fold that
    also scales gradients below the threshold up: how a wrong fold would look)."""
    torch.manual_seed(0)
    model = Layer()
    recipe = replace(FUSED, fold_clip=True) if kind == "folded" else FUSED
    opt = apply_optimizer(model, recipe, CPU)
    update, note = make_update(model, opt, recipe, CPU)
    assert note is None

    def unclamped():
        opt.grad_scale = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]) / recipes.GRAD_CLIP
        opt.step()

    update = {"unclipped": opt.step, "unclamped": unclamped}.get(kind, update)
    g = torch.Generator().manual_seed(1)
    snapshots = []
    for norm in norms:
        grads = [torch.randn(p.shape, generator=g) for p in model.parameters()]
        total = torch.sqrt(sum(x.pow(2).sum() for x in grads))
        for p, x in zip(model.parameters(), grads):
            p.grad = x * (norm / total)
        update()
        if kind == "folded":
            assert opt.grad_scale.item() == pytest.approx(max(norm / recipes.GRAD_CLIP, 1.0), rel=1e-5)
        snapshots.append([p.detach().clone() for p in model.parameters()])
    return snapshots


def max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


# Norms change from step to step on purpose: Adam is blind to a constant gradient scale (its first step is
# lr x sign(g) whatever the clip), so a clip shows only when it rescales some steps relative to others.
NORMS = {"above": [40.0, 8.0, 25.0], "below": [0.05, 0.2, 0.01], "across": [30.0, 0.1, 5.0]}


@pytest.mark.parametrize("regime", list(NORMS))
def test_folded_clip_updates_as_clip_then_step(regime):
    clipped, folded = train("clipped", NORMS[regime]), train("folded", NORMS[regime])
    for step in (0, 2):   # after one and after three updates
        for name, a, b in zip(("weight", "bias"), clipped[step], folded[step]):
            assert torch.allclose(b, a, rtol=1e-5, atol=1e-9), (regime, step, name, (a - b).abs().max().item())
    moved = max_diff(clipped[2], train("clipped", [0.0] * 3)[2])
    assert moved > 1e-3   # three steps of lr 6e-4 each: the comparison is not between parameters at rest
    # The same comparison tells a wrong update apart: no clip when gradients are large, or a fold that
    # scales small gradients up to the threshold, ends three lr-sized steps elsewhere.
    wrong = train("unclipped" if regime != "below" else "unclamped", NORMS[regime])
    assert max_diff(wrong[2], clipped[2]) > 1e-4


def test_fold_clip_needs_fused_adamw_and_no_compiled_update():
    assert replace(FUSED, fold_clip=True).fold_clip
    for bad in (dict(optimizer="adamw"), dict(optimizer="adamw8bit"), dict(compile_update=True)):
        with pytest.raises(ValueError, match="fold_clip"):
            replace(FUSED, fold_clip=True, **bad)
