"""Utils/model.py on CPU: shapes, the loss at init, weight tying and the parameter count, the GPT-2
initialization, manual attention against SDPA, causality, config validation, and the padded vocabulary and
the replaceable loss module changing nothing but rounding."""
import copy
import math
import os
import sys
from dataclasses import fields, replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from Utils.model import GPT  # noqa: E402
from Utils.model_config import PRESETS, GPTConfig  # noqa: E402
from Utils.kernels import chunked_loss  # noqa: E402
from Utils.ladder.modules import ChunkedLoss  # noqa: E402

TINY = PRESETS["tiny"]
# Small enough to run forward and backward in milliseconds, with more than one head and layer.
SMALL = GPTConfig(block_size=32, vocab_size=97, n_layer=2, n_head=4, n_embd=32)
# The two attention branches: written out (flash=False) and F.scaled_dot_product_attention (flash=True).
ATTENTIONS = pytest.mark.parametrize("flash", [False, True], ids=["manual", "sdpa"])


def build(config, seed=0, **overrides):
    torch.manual_seed(seed)
    return GPT(replace(config, **overrides) if overrides else config)


def random_tokens(config, B, T, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (B, T), generator=g)


def expected_params(c):
    """GPT-2's parameter count by hand, the tied embedding once and wpe included."""
    C = c.n_embd
    per_block = (2 * C) + (3 * C * C + 3 * C) + (C * C + C) + (2 * C) + (4 * C * C + 4 * C) + (4 * C * C + C)
    return c.vocab_size * C + c.block_size * C + c.n_layer * per_block + 2 * C


def max_rel_diff(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


# ---------------------------------------------------------------------------------------------- forward


@ATTENTIONS
def test_logits_shape_and_no_loss_without_targets(flash):
    model = build(TINY, flash=flash)
    for B, T in [(2, 16), (1, TINY.block_size)]:
        with torch.no_grad():
            logits, loss = model(random_tokens(TINY, B, T))
        assert logits.shape == (B, T, TINY.vocab_size)
        assert logits.dtype == torch.float32
        assert torch.isfinite(logits).all()
        assert loss is None


@ATTENTIONS
def test_sequence_longer_than_block_size_raises(flash):
    model = build(SMALL, flash=flash)
    with pytest.raises(ValueError, match="block_size"):
        model(random_tokens(SMALL, 2, SMALL.block_size + 1))


def test_loss_at_init_is_close_to_ln_vocab_size():
    model = build(TINY, seed=0)
    idx, targets = random_tokens(TINY, 4, 64, seed=1), random_tokens(TINY, 4, 64, seed=2)
    with torch.no_grad():
        no_logits, loss = model(idx, targets)
        logits, no_loss = model(idx)
    assert no_logits is None and no_loss is None   # a step gets the loss only; the logits come without targets
    assert loss.shape == ()
    assert abs(loss.item() - math.log(TINY.vocab_size)) < 0.1
    # The loss is the mean over every position of -log p(target at that position).
    nll = -F.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert loss.item() == pytest.approx(nll.mean().item(), rel=1e-5)


# ------------------------------------------------------------------------------ weight tying and counts


def test_lm_head_is_the_token_embedding():
    model = build(TINY)
    wte, head = model.transformer.wte.weight, model.lm_head.weight
    assert head is wte
    assert head.data_ptr() == wte.data_ptr()
    assert head.shape == (TINY.vocab_size, TINY.n_embd)
    assert sum(p is wte for p in model.parameters()) == 1


def test_tied_weight_gets_both_gradients_and_a_step_moves_both():
    model = build(SMALL)
    # The same model with the head untied: the tied gradient is the sum of the two uses' gradients.
    untied = copy.deepcopy(model)
    untied.lm_head.weight = nn.Parameter(untied.transformer.wte.weight.detach().clone())
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    idx, targets = random_tokens(SMALL, 3, 16, seed=1), random_tokens(SMALL, 3, 16, seed=2)

    model(idx, targets)[1].backward()
    untied(idx, targets)[1].backward()
    emb_grad, head_grad = untied.transformer.wte.weight.grad, untied.lm_head.weight.grad
    assert emb_grad.abs().sum() > 0 and head_grad.abs().sum() > 0
    torch.testing.assert_close(model.transformer.wte.weight.grad, emb_grad + head_grad, rtol=1e-5, atol=1e-7)

    before = model.transformer.wte.weight.detach().clone()
    lr = 0.1
    torch.optim.SGD(model.parameters(), lr=lr).step()
    wte, head = model.transformer.wte.weight, model.lm_head.weight
    assert head is wte
    assert not torch.equal(wte.detach(), before)
    torch.testing.assert_close(head.detach(), before - lr * (emb_grad + head_grad), rtol=1e-5, atol=1e-7)
    # Rows of tokens absent from the input still move through the head's gradient.
    absent = sorted(set(range(SMALL.vocab_size)) - set(idx.flatten().tolist()))
    assert absent and not torch.equal(head.detach()[absent], before[absent])


@pytest.mark.parametrize("config", [TINY, SMALL], ids=["tiny", "small"])
def test_num_params_counts_tied_weight_once_and_can_exclude_wpe(config):
    model = build(config)
    total = model.num_params(exclude_position_embedding=False)
    assert total == expected_params(config)
    every_use = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert total == every_use - config.vocab_size * config.n_embd
    assert model.num_params() == total - model.transformer.wpe.weight.numel()
    assert model.num_params(exclude_position_embedding=True) == total - config.block_size * config.n_embd


def test_gpt2_parameter_count():
    with torch.device("meta"):
        model = GPT(PRESETS["gpt2"])
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.num_params(exclude_position_embedding=False) == 124_439_808
    assert model.num_params() == 124_439_808 - 1024 * 768
    assert expected_params(PRESETS["gpt2"]) == 124_439_808


# ------------------------------------------------------------------------------------------ initialization


@pytest.mark.parametrize("n_layer", [1, 6])
def test_init_follows_gpt2(n_layer):
    config = GPTConfig(block_size=256, vocab_size=512, n_layer=n_layer, n_head=4, n_embd=256)
    model = build(config)
    residual_std = 0.02 / math.sqrt(2 * n_layer)

    def check_std(w, std):
        # Over tens of thousands of samples the estimates are within about 1% of the truth.
        assert w.std().item() == pytest.approx(std, rel=0.03)
        assert abs(w.mean().item()) < 0.05 * std

    check_std(model.transformer.wte.weight, 0.02)
    check_std(model.transformer.wpe.weight, 0.02)
    linears = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name != "lm_head":
            linears += 1
            residual = name.endswith("attn.c_proj") or name.endswith("mlp.c_proj")
            check_std(module.weight, residual_std if residual else 0.02)
            assert torch.count_nonzero(module.bias) == 0, name
        elif isinstance(module, nn.LayerNorm):
            assert torch.equal(module.weight, torch.ones_like(module.weight)), name
            assert torch.count_nonzero(module.bias) == 0, name
    assert linears == 4 * n_layer


# ------------------------------------------------------------------------------------- attention kinds


def manual_and_sdpa(config, dtype):
    manual = build(config, seed=0, flash=False)
    sdpa = build(config, seed=123, flash=True)   # other weights until the state_dict is loaded
    state = manual.state_dict()
    assert not any(k.endswith("mask") for k in state), "the causal mask must not be saved"
    sdpa.load_state_dict(state, strict=True)
    assert sdpa.lm_head.weight is sdpa.transformer.wte.weight
    return manual.to(dtype), sdpa.to(dtype)


def test_state_dict_loads_both_ways_between_attention_kinds():
    manual = build(SMALL, seed=0, flash=False)
    sdpa = build(SMALL, seed=1, flash=True)
    assert "transformer.h.0.attn.mask" in dict(manual.named_buffers())
    assert not any(name.endswith("mask") for name, _ in sdpa.named_buffers())   # SDPA masks by itself
    assert set(manual.state_dict()) == set(sdpa.state_dict())
    manual.load_state_dict(sdpa.state_dict(), strict=True)
    for (name, a), b in zip(manual.state_dict().items(), sdpa.state_dict().values()):
        assert torch.equal(a, b), name
    # The mask is still there, and still causal, after the load.
    mask = manual.transformer.h[0].attn.mask
    assert torch.equal(mask[0, 0], torch.tril(torch.ones(SMALL.block_size, SMALL.block_size, dtype=torch.bool)))


@pytest.mark.parametrize("dtype, rel", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("T", [SMALL.block_size, 7])
def test_manual_attention_equals_sdpa(dtype, rel, T):
    manual, sdpa = manual_and_sdpa(SMALL, dtype)
    idx, targets = random_tokens(SMALL, 3, T, seed=1), random_tokens(SMALL, 3, T, seed=2)

    (logits_m, _), (logits_s, _) = manual(idx), sdpa(idx)
    loss_m, loss_s = manual(idx, targets)[1], sdpa(idx, targets)[1]
    assert logits_m.dtype == logits_s.dtype == dtype
    assert max_rel_diff(logits_m, logits_s) < rel
    assert loss_m.item() == pytest.approx(loss_s.item(), rel=rel)

    loss_m.backward()
    loss_s.backward()
    grads_s = dict(sdpa.named_parameters())
    for name, p in manual.named_parameters():
        g_m, g_s = p.grad, grads_s[name].grad
        assert g_m is not None and g_s is not None, name
        assert max_rel_diff(g_m, g_s) < 10 * rel, name


@ATTENTIONS
def test_future_tokens_do_not_change_earlier_logits(flash):
    model = build(SMALL, flash=flash).double()
    idx = random_tokens(SMALL, 2, SMALL.block_size, seed=1)
    t = 10
    changed = idx.clone()
    changed[:, t] = (changed[:, t] + 1) % SMALL.vocab_size
    changed[:, t + 5:] = random_tokens(SMALL, 2, SMALL.block_size - t - 5, seed=7)
    with torch.no_grad():
        before, _ = model(idx)
        after, _ = model(changed)
    torch.testing.assert_close(after[:, :t], before[:, :t], rtol=1e-12, atol=1e-12)
    # The test can see a change: every position from t on depends on token t.
    assert ((after[:, t:] - before[:, t:]).abs().amax(dim=-1) > 1e-6).all()


# ------------------------------------------------------------------------------------------------ config


def test_config_rejects_n_embd_not_divisible_by_n_head():
    with pytest.raises(ValueError, match="multiple of n_head"):
        GPTConfig(n_embd=65, n_head=2)
    with pytest.raises(ValueError, match="n_embd=100"):
        replace(TINY, n_embd=100, n_head=3)


@pytest.mark.parametrize("field", ["block_size", "vocab_size", "n_layer", "n_head", "n_embd", "vocab_multiple"])
@pytest.mark.parametrize("value", [0, -1])
def test_config_rejects_sizes_that_are_not_positive(field, value):
    with pytest.raises(ValueError, match=f"{field}={value} must be positive"):
        replace(TINY, **{field: value})


def test_every_preset_is_the_baselines_model():
    # Attention written out, the vocabulary unpadded: the additions, not the presets, change them.
    for name, config in PRESETS.items():
        assert config.vocab_size == config.padded_vocab_size == 50257 and not config.flash, name


def test_the_config_holds_the_model_and_its_two_switches_only():
    # Every other addition swaps a module in from outside (Utils.ladder): the model never asks which
    # kernels exist, so its config has no field for any of them.
    assert {f.name for f in fields(GPTConfig)} == {"block_size", "vocab_size", "n_layer", "n_head", "n_embd",
                                                   "flash", "vocab_multiple"}


# ---------------------------------------------------------------------------------------------
# A padded vocabulary (vocab_multiple) and the chunked loss module that the loss additions swap in for
# model.loss keep the mathematics

V = 1000   # a vocabulary that 128 does not divide, small enough for float64 on a CPU


def _pair(vocab_multiple=1, chunked=False):
    """The tiny model with vocabulary V, and one drawn from the same seed with its vocabulary padded to a
    multiple of vocab_multiple and, if chunked, its loss module replaced as the loss addition replaces it;
    and a batch with its targets."""
    config = replace(TINY, vocab_size=V)
    torch.manual_seed(0)
    plain = GPT(config).double()
    torch.manual_seed(0)
    other = GPT(replace(config, vocab_multiple=vocab_multiple)).double()
    if chunked:
        other.loss = ChunkedLoss(V, kernel=False)
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, V, (3, 40), generator=g)
    y = torch.randint(0, V, (3, 40), generator=g)
    return plain, other, idx, y


@pytest.mark.parametrize("vocab_multiple, chunked", [(128, False), (1, True), (128, True)])
def test_padding_and_chunked_loss_change_nothing_but_rounding(vocab_multiple, chunked, monkeypatch):
    monkeypatch.setattr(chunked_loss, "CHUNK_ROWS", 37)   # several chunks, the last one short
    plain, other, idx, y = _pair(vocab_multiple, chunked)
    for (name, p), q in zip(plain.named_parameters(), other.parameters()):
        assert torch.equal(p, q[:p.shape[0]]), name        # the same init, padding rows aside
    loss_a, loss_b = plain(idx, y)[1], other(idx, y)[1]
    loss_a.backward()
    loss_b.backward()
    assert torch.allclose(loss_a, loss_b, rtol=1e-12, atol=0)
    for (name, p), q in zip(plain.named_parameters(), other.parameters()):
        assert torch.allclose(p.grad, q.grad[:p.shape[0]], rtol=1e-9, atol=1e-15), name
    wte = other.transformer.wte.weight
    if vocab_multiple > 1:
        assert torch.count_nonzero(wte[V:]) == 0
        assert wte.shape[0] == 1024 and torch.count_nonzero(wte.grad[V:]) == 0
        assert other.num_params() == plain.num_params()      # padding is not counted as model
        assert other.lm_head.weight is wte


def test_padded_logits_are_cut_to_the_vocabulary():
    _, padded, idx, _ = _pair(vocab_multiple=128)
    assert padded.lm_head.out_features == 1024
    assert padded(idx)[0].shape == (3, 40, V)


def test_chunked_loss_under_bf16_autocast_is_close(monkeypatch):
    monkeypatch.setattr(chunked_loss, "CHUNK_ROWS", 50)
    full, chunked, idx, _ = _pair(chunked=True)
    full, chunked = full.float(), chunked.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = full(idx, idx)[1], chunked(idx, idx)[1]
    a.backward()
    b.backward()
    assert a.dtype == b.dtype == torch.float32
    assert abs(a.item() - b.item()) < 5e-3
    ga, gb = full.transformer.wte.weight.grad, chunked.transformer.wte.weight.grad
    assert (ga - gb).norm() / ga.norm() < 2e-2
