"""Three of the max rung's additions at work in a tiny GPT on the CPU, each built by Utils.ladder.apply.build:
the loss kernel inside the model (run by Triton's interpreter in a subprocess), the bf16 residual stream
under autocast, and the gradient clip folded into fused AdamW. The kernels' own tests against their
references are in test_loss_kernel.py and test_chunked_loss.py."""
from dataclasses import replace

import pytest
import torch

from conftest import run_interpreted
from Utils.ladder.apply import GRAD_CLIP, build
from Utils.ladder.registry import RegistryError, resolve
from Utils.model_config import PRESETS

CPU = torch.device("cpu")
SMALL = replace(PRESETS["tiny"], vocab_size=97)


# ---------------------------------------------------------------------------------------------
# The loss kernel inside the model

MODEL_CHECKS = """
    import json
    import torch
    from Utils.kernels import chunked_loss, loss_kernel
    from Utils.ladder.apply import build
    from Utils.model_config import GPTConfig

    chunked_loss.CHUNK_ROWS = 50   # the 64 tokens in two chunks, the last one short
    calls = []
    kernel = loss_kernel.cross_entropy_grad
    def counted(logits, targets, vocab_size):
        calls.append(list(logits.shape))
        return kernel(logits, targets, vocab_size)
    loss_kernel.cross_entropy_grad = counted   # chunked_loss calls the kernel through its module

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max()).item()

    def losses_and_grads(builds, idx):
        losses = []
        for b in builds:
            with b.autocast():
                loss = b.model(idx, idx)[1]
            loss.backward()
            losses.append(loss)
        grads = max(rel(q.grad, p.grad) for p, q in zip(builds[0].model.parameters(), builds[1].model.parameters()))
        return losses, grads

    small = GPTConfig(block_size=32, vocab_size=97, n_layer=2, n_head=4, n_embd=32)
    cpu = torch.device("cpu")
    idx = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(0))
    out = {}

    # In float64, against the model's own loss (softmax cross-entropy over the whole logits).
    builds = [build(names, cpu, small, seed=0, loader=None) for names in ((), ("loss_kernel",))]
    for b in builds:
        b.model.double()
    (plain, kernel_loss), grads = losses_and_grads(builds, idx)
    out["float64"] = dict(notes=builds[1].notes, kernel=builds[1].model.loss.kernel, calls=calls[:],
                          loss_dtype=str(kernel_loss.dtype), loss_err=abs(plain.item() - kernel_loss.item()),
                          grads=grads)

    # The GPU's case: bf16 logits under the bf16 rung's autocast, against the loss addition's chunked loss.
    builds = [build(names, cpu, small, seed=0, loader=None) for names in (("bf16", "loss"), ("bf16", "loss_kernel"))]
    calls.clear()
    (chunked, kernel_loss), grads = losses_and_grads(builds, idx)
    out["bf16"] = dict(calls=len(calls), loss_dtype=str(kernel_loss.dtype),
                       loss_diff=abs(chunked.item() - kernel_loss.item()), grads=grads)
    print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def model_results(repo_root):
    return run_interpreted(MODEL_CHECKS, repo_root)


def test_under_the_interpreter_the_loss_kernel_addition_runs_the_kernel_in_the_model(model_results):
    r = model_results["float64"]
    assert r["notes"] == [] and r["kernel"] is True
    # One launch per chunk of tokens: 64 tokens in chunks of 50, vocabulary 97 in rows of 128.
    assert r["calls"] == [[50, 128], [14, 128]]


def test_the_model_with_the_loss_kernel_gives_its_own_loss_and_gradients(model_results):
    r = model_results["float64"]
    # The kernel computes in fp32: the float64 model's loss and gradients to fp32 rounding.
    assert r["loss_dtype"] == "torch.float64"
    assert r["loss_err"] < 1e-6 and r["grads"] < 1e-6, r


def test_under_bf16_autocast_the_loss_kernel_matches_the_plain_chunked_loss(model_results):
    r = model_results["bf16"]
    assert r["calls"] == 2 and r["loss_dtype"] == "torch.float32"
    # The kernel's logits come from a GEMM padded to 128 columns (97 here), and a CPU's bf16 GEMM may pick
    # another kernel for that width and round a few logits the other way: 0 on an AVX2 CPU, 1.0e-5 seen on
    # another. A dropped chunk or an unmasked padding column moves the loss by more than 0.1. The gradients
    # differ by their bf16 rounding (the interpreter truncates where torch rounds to nearest: a bias of up to
    # one ulp, 2^-8, per entry).
    assert r["loss_diff"] < 1e-3 and r["grads"] < 2e-2, r


# ---------------------------------------------------------------------------------------------
# A bf16 residual stream under autocast

def tiny(bf16_residual):
    """The bf16 rung's build of the tiny GPT, with or without the bf16 residual stream."""
    return build(("bf16", "bf16_residual") if bf16_residual else ("bf16",), CPU, PRESETS["tiny"], seed=0, loader=None)


def forward_recording_block_inputs(model, idx):
    seen = []
    hooks = [b.register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
             for b in model.transformer.h]
    try:
        loss = model(idx, idx)[1]
        logits = model(idx)[0]
    finally:
        for hook in hooks:
            hook.remove()
    return seen[:len(seen) // 2], logits, loss


IDX = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(1))


def test_bf16_residual_stream_enters_every_block_in_bf16_under_autocast():
    n = PRESETS["tiny"].n_layer
    runs = {}
    for bf16_residual in (True, False):
        b = tiny(bf16_residual)
        with b.autocast():
            runs[bf16_residual] = forward_recording_block_inputs(b.model, IDX)
    (seen_bf16, _, loss_bf16), (seen_fp32, _, loss_fp32) = runs[True], runs[False]
    assert seen_bf16 == [torch.bfloat16] * n
    assert seen_fp32 == [torch.float32] * n
    assert loss_bf16.dtype == loss_fp32.dtype == torch.float32
    # Only the adds' rounding changes: close at init (about ln 50257 = 10.8), but not the same numbers.
    assert abs(loss_bf16.item() - loss_fp32.item()) < 5e-3
    assert loss_bf16.item() != loss_fp32.item()


def test_residual_stays_fp32_under_fp16_autocast():
    # fp16's range could overflow a residual stream that has no loss scaling: only bf16 is taken.
    with torch.autocast("cpu", dtype=torch.float16):
        seen, _, loss = forward_recording_block_inputs(tiny(True).model, IDX)
    assert seen == [torch.float32] * PRESETS["tiny"].n_layer and torch.isfinite(loss)


def test_bf16_residual_backward_gives_fp32_gradients_close_to_the_fp32_stream():
    builds = {r: tiny(r) for r in (True, False)}
    for b in builds.values():
        with b.autocast():
            loss = b.model(IDX, IDX)[1]
        loss.backward()
    for (name, a), b in zip(builds[False].model.named_parameters(), builds[True].model.parameters()):
        assert b.grad.dtype == torch.float32 and torch.isfinite(b.grad).all(), name
        assert (a.grad - b.grad).norm() / a.grad.norm() < 5e-2, name


def test_bf16_residual_changes_nothing_without_autocast():
    seen_a, logits_a, loss_a = forward_recording_block_inputs(tiny(True).model, IDX)
    seen_b, logits_b, loss_b = forward_recording_block_inputs(tiny(False).model, IDX)
    assert seen_a == seen_b == [torch.float32] * PRESETS["tiny"].n_layer
    assert torch.equal(logits_a, logits_b) and torch.equal(loss_a, loss_b)


def test_bf16_residual_needs_bf16_autocast():
    assert resolve(("bf16", "bf16_residual")) == ("bf16", "bf16_residual")
    for names in (("bf16_residual",), ("tf32", "bf16_residual")):
        with pytest.raises(RegistryError, match="bf16_residual needs bf16: add bf16"):
            resolve(names)
        with pytest.raises(RegistryError, match="bf16_residual needs bf16"):
            build(names, CPU, SMALL, seed=0, loader=None)


# ---------------------------------------------------------------------------------------------
# The gradient clip folded into fused AdamW

def train(kind, norms):
    """Parameters of the small GPT after each update, the gradients of step i random with global norm
    norms[i]; `kind` is "clipped" (the fused rung's clip_grad_norm_ then step), "folded" (fold_clip),
    "unclipped" or "unclamped" (a fold that also scales gradients below the threshold up: how a wrong fold
    would look)."""
    b = build(("fused", "fold_clip") if kind == "folded" else ("fused",), CPU, SMALL, seed=0, loader=None)
    assert b.notes == []
    params, opt = list(b.model.parameters()), b.optimizer

    def unclamped():
        opt.grad_scale = torch.nn.utils.get_total_norm([p.grad for p in params]) / GRAD_CLIP
        opt.step()

    update = {"unclipped": opt.step, "unclamped": unclamped}.get(kind, b.update)
    g = torch.Generator().manual_seed(1)
    snapshots = []
    for norm in norms:
        grads = [torch.randn(p.shape, generator=g) for p in params]
        total = torch.sqrt(sum(x.pow(2).sum() for x in grads))
        for p, x in zip(params, grads):
            p.grad = x * (norm / total)
        update()
        if kind == "folded":
            assert opt.grad_scale.item() == pytest.approx(max(norm / GRAD_CLIP, 1.0), rel=1e-5)
        snapshots.append([p.detach().clone() for p in params])
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
        for i, (a, b) in enumerate(zip(clipped[step], folded[step])):
            assert torch.allclose(b, a, rtol=1e-5, atol=1e-9), (regime, step, i, (a - b).abs().max().item())
    moved = max_diff(clipped[2], train("clipped", [0.0] * 3)[2])
    assert moved > 1e-3   # three steps of lr 6e-4 each: the comparison is not between parameters at rest
    # The same comparison tells a wrong update apart: no clip when gradients are large, or a fold that
    # scales small gradients up to the threshold, ends three lr-sized steps elsewhere.
    wrong = train("unclipped" if regime != "below" else "unclamped", NORMS[regime])
    assert max_diff(wrong[2], clipped[2]) > 1e-4


@pytest.mark.parametrize("names, message", [
    (("fold_clip",), "fold_clip needs fused"),
    (("8bit", "fold_clip"), "fold_clip needs fused"),
    (("torch_compile", "fused", "fold_clip", "compiled_update"), "fold_clip cannot run with compiled_update"),
])
def test_fold_clip_needs_fused_adamw_and_no_other_update(names, message):
    assert resolve(("fused", "fold_clip")) == ("fused", "fold_clip")
    with pytest.raises(RegistryError, match=message):
        resolve(names)
