"""The ladder's recipes and each apply_* function, on the CPU."""
import os
import sys
import types
from dataclasses import asdict, replace

import pytest
import torch

from Utils import recipes
from Utils.model import GPT, PRESETS
from Utils.recipes import (ADDITIONS, BASELINE, FLASH, FUSED, LADDER, MAX, MAX_ADDITIONS, MAX_PICKS, RECIPES, Recipe,
                           Unavailable, apply_attention, apply_bias_grad, apply_compile, apply_fp8, apply_loss,
                           apply_optimizer, apply_prefetch, apply_residual, apply_tf32, apply_vocab_padding,
                           autocast_context, make_update)

CPU = torch.device("cpu")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    assert MAX_ADDITIONS == {"vocab_multiple": 128, "loss": "chunked_kernel", "prefetch": True, "sync_every": 10,
                             "compile_mode": "reduce-overhead", "residual": "autocast", "mlp": "epilogue",
                             "optimizer": "adamw_triton", "attention": "cudnn_packed",
                             "bias_grad": "gemm"}


def test_every_addition_is_one_valid_change_to_the_fused_rung_and_max_picks_from_them():
    assert set(MAX_PICKS) < set(ADDITIONS)
    for name, change in ADDITIONS.items():
        recipe = replace(FUSED, name=f"fused+{name}", **change)   # a valid recipe on its own
        assert _diff(recipe, FUSED) == set(change), name
    # What the ablation tried and the max rung left out (BENCHMARKS.md says why).
    # "loss" (the chunked loss as Inductor compiles it) is superseded by "loss_kernel", which sets the same field.
    assert set(ADDITIONS) - set(MAX_PICKS) == {"loss", "cudnn_attention", "fp8", "compiled_update", "fold_clip"}


def test_make_ablation_runs_every_addition():
    import re
    with open(os.path.join(REPO, "Makefile")) as f:
        line = re.search(r"^ADDITIONS := (.*)$", f.read(), re.M).group(1)
    assert line.split() == list(ADDITIONS)


@pytest.mark.parametrize("bad", [dict(attention="flash2"), dict(optimizer="sgd"), dict(loss="fused"),
                                 dict(vocab_multiple=0), dict(sync_every=0), dict(compile_mode="fast"),
                                 dict(compile_mode="reduce-overhead"), dict(mlp="epilogue"),
                                 dict(bf16=True, fp8=True, mlp="epilogue")])
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
    assert apply_attention(base, FLASH, CPU) == (replace(base, attention="sdpa"), None)
    assert apply_attention(base, BASELINE, CPU) == (base, None)
    padded = apply_vocab_padding(base, MAX)
    assert padded.vocab_multiple == 128 and padded.padded_vocab_size == 50304
    assert apply_vocab_padding(base, FUSED).padded_vocab_size == 50257
    assert apply_loss(base, FUSED, CPU) == (base, None)
    assert apply_loss(base, replace(FUSED, loss="chunked"), CPU) == (replace(base, loss="chunked"), None)
    # Without a GPU with NVRTC or Triton, the kernel's loss runs as the chunked loss Inductor compiles, and says so.
    config, note = apply_loss(base, MAX, CPU)
    assert config.loss == "chunked" and "loss kernel needs a GPU" in note
    assert apply_residual(base, MAX).residual == "autocast" and apply_residual(base, FUSED).residual == "fp32"
    assert apply_bias_grad(base, MAX) == replace(base, bias_grad="gemm") and apply_bias_grad(base, FUSED) == base


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


CUDNN = replace(FUSED, name="fused+cudnn_attention", attention="cudnn")


def test_cudnn_attention_falls_back_to_sdpa_where_cudnn_has_none(monkeypatch):
    base = PRESETS["tiny"]
    assert not recipes.cudnn_attention_available(CPU)
    config, note = apply_attention(base, CUDNN, CPU)
    assert config.attention == "sdpa" and note == "cuDNN attention is not available here: plain SDPA instead"
    monkeypatch.setattr(recipes, "cudnn_attention_available", lambda device: True)
    assert apply_attention(base, CUDNN, CPU) == (replace(base, attention="cudnn"), None)


FP8 = replace(FUSED, name="fused+fp8", fp8=True)


def test_fp8_is_refused_where_it_cannot_run_and_off_by_default(monkeypatch):
    model = GPT(PRESETS["tiny"])
    apply_fp8(model, FUSED, CPU)
    with pytest.raises(Unavailable, match="compute capability 8.9"):
        apply_fp8(model, FP8, CPU)
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(Unavailable, match="compute capability 8.9"):
        apply_fp8(model, FP8, cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setitem(sys.modules, "torchao", None)      # torchao not installed: import fails
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(Unavailable, match="pip install torchao"):
        apply_fp8(model, FP8, cuda)
    assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_fp8_converts_the_blocks_linear_layers_only(monkeypatch):
    seen = []

    def convert(model, module_filter_fn):
        seen.extend(fqn for fqn, m in model.named_modules()
                    if isinstance(m, torch.nn.Linear) and module_filter_fn(m, fqn))
        return model

    fake = types.ModuleType("torchao.float8")
    fake.convert_to_float8_training = convert
    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    monkeypatch.setitem(sys.modules, "torchao.float8", fake)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    model = GPT(PRESETS["tiny"])
    apply_fp8(model, FP8, torch.device("cuda"))
    blocks = [f"transformer.h.{i}.{name}" for i in range(PRESETS["tiny"].n_layer)
              for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    assert sorted(seen) == sorted(blocks)           # the tied output layer stays in bf16


def _one_update(recipe, compiled):
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"])
    opt = apply_optimizer(model, recipe, CPU)
    update, note = make_update(model, opt, replace(recipe, compile_update=compiled), CPU)
    idx = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model(idx, idx)[1].mul(100).backward()     # a loss scaled so that the clip at norm 1.0 acts
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        update()
        opt.zero_grad(set_to_none=True)
    return model, update, note, norm


@pytest.mark.parametrize("recipe", [FUSED, BASELINE])
def test_the_compiled_update_clips_and_steps_as_the_eager_one(recipe):
    eager, eager_update, note, norm = _one_update(recipe, compiled=False)
    assert note is None and norm > 10 * recipes.GRAD_CLIP
    compiled, compiled_update, note, _ = _one_update(recipe, compiled=True)
    assert note is None and compiled_update is not eager_update and hasattr(compiled_update, "_torchdynamo_orig_callable")
    # Two steps move a weight by up to 2 x lr = 1.2e-3; the traced foreach AdamW may round differently
    # from the eager one by well under a thousandth of that.
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        assert (a - b).abs().max().item() <= 1e-6, name


def test_the_update_clips_to_grad_clip():
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"])
    seen = []

    class Recorder:
        def step(self):
            seen.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())

    update, _ = make_update(model, Recorder(), FUSED, CPU)
    model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))[1].mul(1e3).backward()
    update()
    assert seen == [pytest.approx(recipes.GRAD_CLIP, rel=1e-4)]


def test_the_8bit_optimizer_update_stays_eager_and_says_so():
    model = GPT(PRESETS["tiny"])
    recipe = replace(RECIPES["8bit"], compile_update=True)
    update, note = make_update(model, apply_optimizer(model, recipe, CPU), recipe, CPU)
    assert "not traceable" in note and not hasattr(update, "_torchdynamo_orig_callable")
