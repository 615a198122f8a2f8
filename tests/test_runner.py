"""The training loop's own behaviour: deferred read-back, the ablation entry point, the summary."""
import subprocess
import sys
from dataclasses import replace

from Utils.recipes import BASELINE
from Utils.runner import main

from conftest import REPO_ROOT, read_csv

ARGS = ["--batch-size", "2", "--seq-len", "16", "--data", "synthetic", "--warmup", "2"]


def test_deferred_read_back_records_every_step_with_the_same_losses(tmp_path, capsys):
    assert main(BASELINE, ["--steps", "7", "--prefix", str(tmp_path / "a")] + ARGS) == 0
    deferred = replace(BASELINE, name="deferred", sync_every=3)
    assert main(deferred, ["--steps", "7", "--prefix", str(tmp_path / "b")] + ARGS) == 0
    a, b = read_csv(tmp_path / "a" / "results.csv"), read_csv(tmp_path / "b" / "results.csv")
    assert [r["step"] for r in b] == [str(i) for i in range(7)]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    out = capsys.readouterr().out
    assert "deferred synchronization has no effect on a CPU" in out
    assert out.count("step 7/7 |") == 2


def test_summary_uses_the_measured_steps_only(tmp_path):
    assert main(BASELINE, ["--steps", "6", "--prefix", str(tmp_path)] + ARGS) == 0
    steps = [float(r["step_ms"]) for r in read_csv(tmp_path / "results.csv")]
    run = read_csv(tmp_path / "runs.csv")[0]
    measured = sorted(steps[2:])
    assert abs(float(run["median_step_ms"]) - (measured[1] + measured[2]) / 2) < 1e-3 * measured[1]
    assert run["compile_s"] == "" and run["warmup_steps"] == "2"


def test_ablation_adds_one_change_to_the_fused_rung(tmp_path, suite_env):
    r = subprocess.run([sys.executable, "ablation.py", "--add", "loss", "--steps", "2", "--prefix", str(tmp_path)]
                       + ARGS[:-2] + ["--warmup", "1"], cwd=REPO_ROOT, env=suite_env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    run = read_csv(tmp_path / "runs.csv")[0]
    assert run["optimization"] == "fused+loss" and '"loss": "chunked"' in run["config"]
    assert '"optimizer": "adamw_fused"' in run["config"] and '"vocab_multiple": 1' in run["config"]
    bad = subprocess.run([sys.executable, "ablation.py", "--add", "turbo", "--steps", "2", "--prefix",
                          str(tmp_path)], cwd=REPO_ROOT, env=suite_env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: --add 'turbo' is not an addition")
    assert len(bad.stderr.strip().splitlines()) == 1


def test_a_baseline_run_is_exactly_the_textbook_loop(tmp_path):
    import pytest
    import torch

    from Utils.data import TokenLoader, inputs_targets, synthetic_tokens
    from Utils.model import GPT, PRESETS
    assert main(BASELINE, ["--steps", "4", "--prefix", str(tmp_path)] + ARGS) == 0
    recorded = [float(r["loss"]) for r in read_csv(tmp_path / "results.csv")]
    torch.manual_seed(1337)
    model = GPT(PRESETS["tiny"])
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), eps=1e-8)
    loader = TokenLoader(synthetic_tokens(50257, 1337), 2, 16)
    expected = []
    for _ in range(4):
        x, y = inputs_targets(loader.next_batch(), 2, 16)
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        expected.append(loss.item())
    assert recorded == pytest.approx(expected, rel=1e-5)   # results.csv keeps 6 significant digits


def test_the_runner_builds_and_steps_what_the_recipe_says(tmp_path, monkeypatch):
    from Utils import runner
    from Utils.recipes import MAX
    built, calls, autocasts = [], [], []
    real_gpt, real_autocast = runner.GPT, runner.autocast_context

    def gpt(config):
        built.append(config)
        return real_gpt(config)

    def compile_spy(model, recipe, device):
        def stepped(*a, **kw):
            calls.append(torch.is_autocast_enabled("cpu"))
            return model(*a, **kw)
        return stepped, None

    def autocast_spy(recipe, device):
        autocasts.append(recipe.bf16)
        return real_autocast(recipe, device)

    updates = []
    real_update = runner.make_update

    def update_spy(model, optimizer, recipe, device):
        update, note = real_update(model, optimizer, recipe, device)
        return (lambda: updates.append(update())), note

    import torch
    monkeypatch.setattr(runner, "make_update", update_spy)
    monkeypatch.setattr(runner, "GPT", gpt)
    monkeypatch.setattr(runner, "apply_compile", compile_spy)
    monkeypatch.setattr(runner, "autocast_context", autocast_spy)
    assert main(MAX, ["--steps", "3", "--prefix", str(tmp_path)] + ARGS) == 0
    (config,) = built
    assert (config.attention, config.vocab_multiple, config.loss) == ("sdpa", 128, "chunked")
    assert calls == [True, True, True]            # every step through the compiled model, under bf16 autocast
    assert len(updates) == 3                      # and one clip + optimizer step after each
    assert autocasts and all(autocasts)
