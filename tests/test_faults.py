"""Faults, interruptions and concurrent runs: nothing lost, always a clear word."""
import json
import signal
import subprocess
import sys

import pytest
import torch

from Utils import model as model_module
from Utils.recipes import BASELINE, EIGHT_BIT, TORCH_COMPILE
from Utils.results import RUN_COLUMNS, STEP_COLUMNS, check_file
from Utils.runner import EXIT_INTERRUPTED, EXIT_OOM, EXIT_SKIPPED, main

from conftest import REPO_ROOT as REPO, make, read_csv

TINY = ["--batch-size", "2", "--seq-len", "16", "--data", "synthetic"]


def run_in_process(recipe, prefix, steps=4, extra=()):
    return main(recipe, ["--steps", str(steps), "--prefix", str(prefix)] + TINY + list(extra))


def test_out_of_memory_is_recorded_and_named(tmp_path, monkeypatch, capsys):
    real_forward = model_module.GPT.forward
    calls = {"n": 0}

    def forward(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_forward(self, *a, **kw)

    monkeypatch.setattr(model_module.GPT, "forward", forward)
    assert main(BASELINE, ["--steps", "6", "--batch-size", "1", "--seq-len", "16", "--data", "synthetic",
                           "--prefix", str(tmp_path)]) == EXIT_OOM
    run = read_csv(tmp_path / "runs.csv")[-1]
    assert run["status"] == "oom"
    assert "out of memory at BATCH_SIZE=1 after 2 steps" in run["message"]
    assert "peak" in run["message"] and "smaller BATCH_SIZE, e.g. 1" in run["message"]
    assert len(read_csv(tmp_path / "results.csv")) == 2
    assert "error: baseline oom" in capsys.readouterr().err


def test_missing_bitsandbytes_is_skipped_not_faked(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    assert run_in_process(EIGHT_BIT, tmp_path) == EXIT_SKIPPED
    run = read_csv(tmp_path / "runs.csv")[-1]
    assert run["status"] == "skipped" and "bitsandbytes is not usable here" in run["message"]
    assert run["median_step_ms"] == "" and read_csv(tmp_path / "results.csv") == []


def test_no_compiler_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr("Utils.recipes.shutil.which", lambda name: None)
    assert run_in_process(TORCH_COMPILE, tmp_path) == EXIT_SKIPPED
    run = read_csv(tmp_path / "runs.csv")[-1]
    assert run["status"] == "skipped" and "needs a C++ compiler" in run["message"]


def test_same_seed_same_losses(tmp_path):
    losses = []
    for i, seed in enumerate(["5", "5", "6"]):
        prefix = tmp_path / str(i)
        assert main(BASELINE, ["--steps", "4", "--batch-size", "2", "--seq-len", "16", "--prefix", str(prefix),
                               "--data", "synthetic", "--seed", seed]) == 0
        losses.append([float(r["loss"]) for r in read_csv(prefix / "results.csv")])
    assert losses[0] == losses[1]
    assert losses[0] != losses[2]


def test_runs_record_how_to_repeat_them(tmp_path):
    assert run_in_process(BASELINE, tmp_path) == 0
    run = read_csv(tmp_path / "runs.csv")[-1]
    config = json.loads(run["config"])
    assert config["run"]["batch_size"] == 2 and config["run"]["seq_len"] == 16 and config["run"]["seed"] == 1337
    assert config["recipe"]["name"] == "baseline" and config["recipe"]["attention"] == "manual"
    assert "--batch-size 2" in run["command"] and "--seq-len 16" in run["command"]
    assert run["torch_version"] == torch.__version__ and run["device"] == "cpu"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interruption_keeps_valid_files(tmp_path, suite_env, sig):
    prefix = tmp_path / "out"
    with open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen([sys.executable, "no_optimization.py", "--steps", "100000", "--prefix", str(prefix)]
                                + TINY, cwd=REPO, env=suite_env, stdout=subprocess.PIPE, stderr=stderr, text=True)
        try:
            for line in proc.stdout:
                if line.startswith("step 3/"):
                    break
            proc.send_signal(sig)
            proc.communicate(timeout=120)
        finally:
            proc.kill()
            proc.wait()
    assert proc.returncode == EXIT_INTERRUPTED, (tmp_path / "stderr").read_text()
    tmp_path = prefix
    check_file(tmp_path / "results.csv", STEP_COLUMNS)
    check_file(tmp_path / "runs.csv", RUN_COLUMNS)
    run = read_csv(tmp_path / "runs.csv")[-1]
    steps = read_csv(tmp_path / "results.csv")
    assert run["status"] == "interrupted" and len(steps) >= 3
    assert f"interrupted after {len(steps)} of 100000 steps" in run["message"]


def test_two_makes_at_once_keep_every_row(tmp_path, suite_env):
    args = ["baseline", "STEPS=6", "BATCH_SIZE=2", "SEQ_LEN=16", "DATA=synthetic", f"PREFIX={tmp_path}"]
    procs = [subprocess.Popen(["make", "--no-print-directory", f"PYTHON={sys.executable}"] + args, cwd=REPO,
                              env=suite_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for _ in range(3)]
    assert all(p.wait(timeout=300) == 0 for p in procs)
    runs = read_csv(tmp_path / "runs.csv")
    steps = read_csv(tmp_path / "results.csv")
    assert len(runs) == 3 and len({r["run_id"] for r in runs}) == 3
    assert sorted(r["run_id"] for r in steps) == sorted([r["run_id"] for r in runs] * 6)


@pytest.mark.parametrize("damage,why", [
    (lambda text: text[:-7], "ends in the middle of a row"),
    (lambda text: "when,what\n1,2\n", "header that is not the suite's"),
])
def test_damaged_results_are_named_and_never_overwritten(tmp_path, suite_env, damage, why):
    assert run_in_process(BASELINE, tmp_path) == 0
    path = tmp_path / "results.csv"
    path.write_text(damage(path.read_text()))
    before = path.read_bytes()
    r = make(["baseline", "STEPS=3", "BATCH_SIZE=2", "SEQ_LEN=16", "DATA=synthetic", f"PREFIX={tmp_path}"],
             suite_env, timeout=300)
    assert r.returncode != 0
    errors = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and why in errors[0] and str(path) in errors[0]
    p = make(["plots", f"PREFIX={tmp_path}"], suite_env, timeout=300)
    assert p.returncode != 0 and why in p.stderr and "Traceback" not in p.stderr
    assert path.read_bytes() == before
    assert len(read_csv(tmp_path / "runs.csv")) == 1


def test_a_compiler_failure_at_the_first_step_is_skipped_with_its_reason(tmp_path, monkeypatch):
    from Utils import runner

    class BackendCompilerFailed(RuntimeError):
        pass
    BackendCompilerFailed.__module__ = "torch._dynamo.exc"

    def broken(*a, **kw):
        raise BackendCompilerFailed("inductor raised CppCompileError: no such header")

    monkeypatch.setattr(runner, "apply_compile", lambda model, recipe, device: (broken, None))
    assert run_in_process(TORCH_COMPILE, tmp_path) == EXIT_SKIPPED
    run = read_csv(tmp_path / "runs.csv")[-1]
    assert run["status"] == "skipped"
    assert run["message"].startswith("torch.compile cannot compile here: BackendCompilerFailed: inductor raised")


def test_an_8bit_optimizer_that_cannot_be_built_is_skipped(tmp_path, monkeypatch):
    import bitsandbytes

    def refuse(*a, **kw):
        raise RuntimeError("no kernels for this device")

    monkeypatch.setattr(bitsandbytes.optim, "AdamW8bit", refuse)
    assert run_in_process(EIGHT_BIT, tmp_path) == EXIT_SKIPPED
    run = read_csv(tmp_path / "runs.csv")[-1]
    assert run["status"] == "skipped" and "AdamW8bit does not run on this device (no kernels" in run["message"]
