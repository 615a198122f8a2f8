"""The training loop's own behaviour: deferred read-back, the ablation entry point, the summary."""
import json
import subprocess
import sys

import pytest
import torch

from Utils.train.run import main

from conftest import REPO_ROOT, read_csv

ARGS = ["--batch-size", "2", "--seq-len", "16", "--data", "synthetic", "--warmup", "2"]


def test_deferred_read_back_records_every_step_with_the_same_losses(tmp_path, capsys, monkeypatch):
    assert main("baseline", ["--steps", "7", "--prefix", str(tmp_path / "a")] + ARGS) == 0
    monkeypatch.setattr("Utils.ladder.apply.SYNC_EVERY", 3)
    assert main(["sync_every"], ["--steps", "7", "--prefix", str(tmp_path / "b")] + ARGS) == 0
    a, b = read_csv(tmp_path / "a" / "results.csv"), read_csv(tmp_path / "b" / "results.csv")
    assert [r["step"] for r in b] == [str(i) for i in range(7)]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    out = capsys.readouterr().out
    assert "deferred synchronization has no effect on a CPU" in out
    assert out.count("step 7/7 |") == 2


def test_summary_uses_the_measured_steps_only(tmp_path):
    assert main("baseline", ["--steps", "6", "--prefix", str(tmp_path)] + ARGS) == 0
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
    assert run["optimization"] == "fused+loss"
    assert run["command"].startswith("ablation.py --add loss --steps 2")   # what repeats the run
    assert json.loads(run["config"])["additions"] == ["tf32", "bf16", "flash", "loss", "torch_compile", "fused"]
    bad = subprocess.run([sys.executable, "ablation.py", "--add", "turbo", "--steps", "2", "--prefix",
                          str(tmp_path)], cwd=REPO_ROOT, env=suite_env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().startswith(
        "error: --add turbo: make ablation FROM=fused does not try 'turbo'")
    assert len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args, first_line", [
    (["--drop", "loss"], "error: --drop loss: make ablation FROM=max does not try 'loss'"),
    (["--drop", "tf32"], "error: --drop tf32: make ablation FROM=max does not try 'tf32'"),
    (["--drop", "prefetch+tf32"], "error: --drop prefetch+tf32: make ablation FROM=max does not try 'tf32'"),
    (["--add", "loss+fp8_head"], "error: --add loss+fp8_head: fp8_head cannot run with loss"),
    (["--add", "loss", "--drop", "prefetch"], "error: give one of --add"),
    ([], "error: give one of --add"),
])
def test_ablation_refuses_anything_but_one_add_or_one_drop_it_tries(tmp_path, suite_env, args, first_line):
    bad = subprocess.run([sys.executable, "ablation.py"] + args + ["--steps", "2", "--prefix", str(tmp_path)],
                         cwd=REPO_ROOT, env=suite_env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().startswith(first_line), bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and not (tmp_path / "runs.csv").exists()


def test_a_baseline_run_is_exactly_the_textbook_loop(tmp_path):
    import torch

    from Utils.train.data import TokenLoader, inputs_targets, synthetic_tokens
    from Utils.model import GPT
    from Utils.model_config import PRESETS
    assert main("baseline", ["--steps", "4", "--prefix", str(tmp_path)] + ARGS) == 0
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


def test_the_run_builds_and_steps_what_the_rung_says(tmp_path, monkeypatch):
    import torch

    from Utils.ladder import apply
    from Utils.ladder.registry import RUNGS
    built, calls, updates = [], [], []
    real_build = apply.build

    def build_spy(additions, *args):
        b = real_build(additions, *args)
        built.append(b)
        step_model, update = b.step_model, b.update

        def stepped(*a, **kw):
            calls.append(torch.is_autocast_enabled("cpu"))
            return step_model(*a, **kw)

        b.step_model, b.update = stepped, lambda: updates.append(update())
        return b

    monkeypatch.setattr("Utils.train.run.build", build_spy)
    assert main("max", ["--steps", "3", "--prefix", str(tmp_path)] + ARGS) == 0
    (b,) = built
    assert b.additions == tuple(a for a in apply.ADDITIONS if a in RUNGS["max"].additions)
    assert (b.config.flash, b.config.vocab_multiple) == (True, 128)
    assert type(b.model.loss).__name__ == "ChunkedLoss"
    assert calls == [True, True, True]            # every step through the step model, under bf16 autocast
    assert len(updates) == 3                      # and one clip + optimizer step after each


def test_a_loss_that_turns_nan_fails_the_run_and_keeps_its_steps(tmp_path, capsys, monkeypatch):
    # A wrong kernel can train at a fine speed on a loss of nan: such a speed is no result.
    from Utils.ladder import apply
    real_build = apply.build

    def nan_from_the_third_step(*args):
        b = real_build(*args)
        step_model, calls = b.step_model, []

        def stepped(*a, **kw):
            calls.append(1)
            logits, loss = step_model(*a, **kw)
            return logits, loss * float("nan") if len(calls) >= 3 else loss

        b.step_model = stepped
        return b

    monkeypatch.setattr("Utils.train.run.build", nan_from_the_third_step)
    assert main("baseline", ["--steps", "5", "--prefix", str(tmp_path)] + ARGS) == 1
    (run,) = read_csv(tmp_path / "runs.csv")
    assert run["status"] == "failed" and run["message"].startswith("the loss is nan from step 2:")
    assert [r["step"] for r in read_csv(tmp_path / "results.csv")] == ["0", "1", "2", "3", "4"]
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: baseline failed: the loss is nan from step 2:")


def test_make_custom_runs_exactly_its_additions_and_records_how_to_repeat_it(tmp_path, suite_env):
    r = subprocess.run(["make", "--no-print-directory", f"PYTHON={sys.executable}", "custom", "WITH=flash bf16 tf32",
                        "STEPS=2", "BATCH_SIZE=2", "SEQ_LEN=16", "DATA=synthetic", f"PREFIX={tmp_path}"],
                       cwd=REPO_ROOT, env=suite_env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (run,) = read_csv(tmp_path / "runs.csv")
    assert run["optimization"] == "bf16+flash"   # the bf16 rung (tf32 and bf16) plus flash
    config = json.loads(run["config"])
    assert config["additions"] == ["tf32", "bf16", "flash"]
    assert config["fell_back"] == ["tf32"] and "TF32 has no effect on a CPU" in run["notes"]   # what ran instead
    assert run["command"].startswith("python -m Utils.train --with 'flash bf16 tf32' --steps=2")
    bad = subprocess.run(["make", "--no-print-directory", f"PYTHON={sys.executable}", "custom", "WITH=bf16 turbo",
                          "STEPS=2", "BATCH_SIZE=2", f"PREFIX={tmp_path}"], cwd=REPO_ROOT, env=suite_env,
                         capture_output=True, text=True, timeout=300)
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert bad.returncode != 0 and len(errors) == 1 and "unknown addition turbo" in errors[0]
    assert len(read_csv(tmp_path / "runs.csv")) == 1


# The additions are checked before torch loads: a mistyped name is refused at once, not after seconds of imports.
BEFORE_TORCH = """
import sys
from Utils.train.launch import launch
rc = launch(sys.argv[1].split(), ["--steps", "2", "--batch-size", "2", "--prefix", sys.argv[2]])
print(rc, "torch" in sys.modules)
"""


@pytest.mark.parametrize("additions, error", [
    ("bf16 turbo", "error: unknown addition turbo: use names from `make additions` ("),
    ("cudagraphs", "error: cudagraphs needs torch_compile: add torch_compile to WITH"),
])
def test_additions_that_cannot_run_are_refused_before_torch_loads(tmp_path, additions, error):
    done = subprocess.run([sys.executable, "-c", BEFORE_TORCH, additions, str(tmp_path / "out")], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["2", "False"] and done.stderr.startswith(error), done.stdout + done.stderr
    assert not (tmp_path / "out").exists()


def _record(**fields):
    """A run's record with what every run has from its start; `fields` set the rest."""
    from Utils.train.record import Run
    start = dict(run_id="r1", optimization="fused", started_at="2026-01-01T00:00:00+00:00", steps=2, warmup_steps=1,
                 batch_size=1, seq_len=16, model="tiny", data="synthetic", command="make fused", config="{}")
    return Run(**{**start, **fields})


def test_a_runs_record_is_the_schemas_run_columns_in_their_order():
    # A field dropped, renamed or moved is a column lost, blank or misplaced in every runs.csv written after.
    from dataclasses import fields
    from Utils.results.schema import RUN_COLUMNS
    from Utils.train.nvml import Clocks
    from Utils.train.provenance import provenance
    from Utils.train.record import Run
    run = _record()
    assert list(run.row()) == RUN_COLUMNS
    run.provenance, run.clocks = provenance(torch.device("cpu")), Clocks(temp_c_max=60)
    row = run.row()
    assert list(row) == RUN_COLUMNS and (row["gpu_name"], row["temp_c_max"], row["run_id"]) == ("cpu", 60, "r1")
    elsewhere = [f.name for record in (run.provenance, run.clocks) for f in fields(record)]
    own = [f.name for f in fields(Run) if f.name not in ("provenance", "clocks", "rank")]
    assert own == [c for c in RUN_COLUMNS if c not in elsewhere]   # the class reads as the file does
    assert not set(own) & set(elsewhere) and set(elsewhere) <= set(RUN_COLUMNS)


def test_a_misspelt_field_of_a_runs_record_is_an_error():
    run = _record()
    with pytest.raises(AttributeError):
        run.final_los = 1.0
    with pytest.raises(TypeError):
        _record(final_los=1.0)
    with pytest.raises(TypeError):   # what every run has from its start cannot be left out
        type(run)(optimization="fused")


@pytest.mark.parametrize("status", ["ok", "interrupted", "failed"])
def test_a_profiled_run_keeps_its_trace_only_when_it_ended_well(tmp_path, capsys, status):
    # A trace left by a run that did not end well would be split later as if it had.
    from Utils.train.cli import parse_args
    from Utils.train.run import record
    cfg = parse_args(["--steps", "2", "--batch-size", "1", "--prefix", str(tmp_path), "--profile"])
    trace = tmp_path / "trace_fused.json.gz"
    trace.write_bytes(b"")
    run = _record(optimization="fused", status=status, message="" if status == "ok" else "stopped")
    record(cfg, run, [], 0, str(trace))
    assert trace.exists() == (status == "ok")
    assert ("trace | fused:" in capsys.readouterr().out) == (status == "ok")
    assert not (tmp_path / "runs.csv").exists()   # a profiled run is recorded by its trace only


def test_the_recorded_commit_names_a_changed_tree_by_its_changes(tmp_path, monkeypatch):
    from Utils.train import provenance
    git = ["git", "-c", "user.email=t@example.com", "-c", "user.name=t", "-C", str(tmp_path)]
    (tmp_path / "a.py").write_text("x = 1\n")
    for args in (["init", "-q"], ["add", "a.py"], ["commit", "-qm", "a"]):
        subprocess.run(git + args, check=True, capture_output=True)
    sha = subprocess.run(git + ["rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
    monkeypatch.delenv("GIT_COMMIT", raising=False)
    monkeypatch.setattr(provenance, "REPO", str(tmp_path))
    assert provenance.git_commit() == sha
    (tmp_path / "a.py").write_text("x = 2\n")
    changed = provenance.git_commit()
    assert changed.startswith(f"{sha}-dirty-") and len(changed) == len(sha) + len("-dirty-") + 8
    assert provenance.git_commit() == changed                 # the same changes: the same name
    (tmp_path / "a.py").write_text("x = 3\n")
    assert provenance.git_commit() not in (changed, sha)      # other changes: another name
    (tmp_path / "untracked.txt").write_text("not the code")
    (tmp_path / "a.py").write_text("x = 1\n")
    assert provenance.git_commit() == sha                     # untracked files change nothing
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "runs.csv").write_text("run_id\n")
    for args in (["add", "results"], ["commit", "-qm", "results"]):
        subprocess.run(git + args, check=True, capture_output=True)
    sha = subprocess.run(git + ["rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
    (tmp_path / "results" / "runs.csv").write_text("run_id\nr1\n")
    assert provenance.git_commit() == sha                     # a run appended to committed results: the same code
    monkeypatch.setenv("GIT_COMMIT", "from-the-environment")
    assert provenance.git_commit() == "from-the-environment"


def test_a_runs_provenance_is_runs_csv_environment_columns():
    from Utils.results.schema import RUN_COLUMNS
    from Utils.train.provenance import provenance
    columns = provenance(torch.device("cpu")).columns()
    assert set(columns) <= set(RUN_COLUMNS)
    assert columns["device"] == "cpu" and columns["gpu_name"] == "cpu" and columns["gpu_uuid"] == ""
    assert columns["torch_version"] == torch.__version__ and all(isinstance(v, str) for v in columns.values())
