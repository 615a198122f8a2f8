"""The ladder's recipes and each apply_* function, on the CPU."""
from dataclasses import asdict, replace

import pytest
import torch

from Utils import recipes
from Utils.model import GPT, PRESETS
from Utils.recipes import (BASELINE, FLASH, FUSED, LADDER, MAX, MAX_ADDITIONS, RECIPES, Recipe, Unavailable,
                           apply_attention, apply_compile, apply_loss, apply_optimizer, apply_prefetch, apply_tf32,
                           apply_vocab_padding, autocast_context)

CPU = torch.device("cpu")


def _diff(a, b):
    return {k for k, v in asdict(a).items() if k != "name" and asdict(b)[k] != v}


def test_the_ladder_is_cumulative_one_change_per_rung():
    assert LADDER == ["baseline", "tf32", "bf16", "torch_compile", "flash", "fused", "8bit", "max"]
    expected = {"tf32": {"tf32"}, "bf16": {"bf16"}, "torch_compile": {"compile"}, "flash": {"attention"},
                "fused": {"optimizer"}}
    for prev, rung in zip(LADDER, LADDER[1:6]):
        assert _diff(RECIPES[rung], RECIPES[prev]) == expected[rung]
    assert _diff(RECIPES["8bit"], FLASH) == {"optimizer"} and RECIPES["8bit"].optimizer == "adamw8bit"
    assert _diff(MAX, FUSED) == set(MAX_ADDITIONS)
    assert MAX_ADDITIONS == {"vocab_multiple": 128, "loss": "chunked", "prefetch": True, "sync_every": 10,
                             "compile_mode": "reduce-overhead"}


@pytest.mark.parametrize("bad", [dict(attention="flash2"), dict(optimizer="sgd"), dict(loss="fused"),
                                 dict(vocab_multiple=0), dict(sync_every=0), dict(compile_mode="fast"),
                                 dict(compile_mode="reduce-overhead")])
def test_impossible_recipes_are_refused(bad):
    with pytest.raises(ValueError):
        replace(BASELINE, **bad)


def test_apply_tf32_sets_the_flags_and_says_it_does_nothing_on_a_cpu():
    try:
        assert apply_tf32(recipes.TF32, CPU) == "TF32 has no effect on a CPU"
        assert torch.backends.cuda.matmul.allow_tf32
        assert apply_tf32(BASELINE, CPU) is None
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        apply_tf32(BASELINE, CPU)


def test_autocast_context():
    with autocast_context(BASELINE, CPU):
        assert not torch.is_autocast_enabled("cpu")
    with autocast_context(recipes.BF16, CPU):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


def test_config_level_applies():
    base = PRESETS["tiny"]
    assert apply_attention(base, FLASH).attention == "sdpa" and apply_attention(base, BASELINE).attention == "manual"
    padded = apply_vocab_padding(base, MAX)
    assert padded.vocab_multiple == 128 and padded.padded_vocab_size == 50304
    assert apply_vocab_padding(base, FUSED).padded_vocab_size == 50257
    assert apply_loss(base, MAX).loss == "chunked" and apply_loss(base, FUSED).loss == "full"


def test_apply_prefetch_on_a_cpu_keeps_the_loader_and_says_so():
    loader = object()
    assert apply_prefetch(loader, FUSED, CPU) == (loader, None)
    assert apply_prefetch(loader, MAX, CPU) == (loader, "prefetch has no effect on a CPU")


def test_apply_compile(monkeypatch):
    model = torch.nn.Linear(2, 2)
    assert apply_compile(model, Recipe("eager"), CPU) == (model, None)
    compiled, note = apply_compile(model, FUSED, CPU)
    assert compiled is not model and note is None
    compiled, note = apply_compile(model, MAX, CPU)
    assert "CUDA graphs need a GPU" in note
    monkeypatch.setattr(recipes.shutil, "which", lambda name: None)
    with pytest.raises(Unavailable, match="C\\+\\+ compiler"):
        apply_compile(model, FUSED, CPU)


def test_apply_optimizer_builds_each_optimizer_with_the_same_hyperparameters():
    model = GPT(PRESETS["tiny"])
    default = apply_optimizer(model, BASELINE, CPU)
    fused = apply_optimizer(model, FUSED, CPU)
    eight = apply_optimizer(model, RECIPES["8bit"], CPU)
    assert type(default) is torch.optim.AdamW and not default.defaults["fused"]
    assert type(fused) is torch.optim.AdamW and fused.defaults["fused"]
    assert type(eight).__name__ == "AdamW8bit"
    for opt in (default, fused, eight):
        decay, no_decay = opt.param_groups
        assert decay["weight_decay"] == recipes.WEIGHT_DECAY and no_decay["weight_decay"] == 0.0
        assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
        # nanoGPT's GPT-2 124M settings, the same on every rung
        assert opt.defaults["lr"] == 6e-4 and tuple(opt.defaults["betas"]) == (0.9, 0.95)
        assert opt.defaults["eps"] == 1e-8 and decay["weight_decay"] == 0.1
        n = sum(p.numel() for g in opt.param_groups for p in g["params"])
        assert n == model.num_params(exclude_position_embedding=False)
