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
