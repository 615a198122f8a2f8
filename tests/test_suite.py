"""End to end on the CPU: every make target and every rung script, checking the rows they write."""
import json
import os
import subprocess
import sys

import pytest

from Utils.ladder.registry import LADDER, RUNGS

from conftest import REPO_ROOT as REPO, clean_env, make, read_csv, two_runs
SCRIPTS = {"baseline": "no_optimization.py", "tf32": "tensorFloat32.py", "bf16": "brainFloat16.py",
           "torch_compile": "torch_compile.py", "flash": "flash_attention.py", "fused": "fused_optimizer.py",
           "8bit": "8-bit_optimizer.py", "max": "max_throughput.py"}
# Over the first 8 steps of the tiny model, every rung's loss stays within this many nats of the
# baseline's: bf16 rounding and 8-bit optimizer states move it by about 1e-4 and 2e-3 on a CPU.
LOSS_TOLERANCE = 0.01


@pytest.fixture
def charted(tmp_path, suite_env):
    """A folder holding a baseline and a tf32 run, written by the suite's writer, and their charts."""
    prefix = two_runs(tmp_path / "charted")
    r = make(["plots", f"PREFIX={prefix}"], suite_env)
    assert r.returncode == 0 and (prefix / "summary.md").exists(), r.stderr
    return prefix


def test_make_all_writes_an_ok_run_per_rung_and_every_rung_tracks_the_baseline_loss(tmp_path, suite_env):
    # The ladder's own test, and its only run of make all (a minute on two cores): a test sharing it could be handed
    # to the other pytest-xdist worker, which would wait for it. 128 tokens a step: a CPU without bf16 instructions
    # runs bf16 matmuls about 8 times slower than fp32, and the output layer's (tokens x 50,304) sets the time of six
    # of the eight rungs.
    prefix = tmp_path / "out"
    r = make(["all", "STEPS=8", "BATCH_SIZE=2", "SEQ_LEN=64", f"PREFIX={prefix}", "DATA=shakespeare"], suite_env,
             timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    runs = read_csv(prefix / "runs.csv")
    assert [x["optimization"] for x in runs] == LADDER
    assert all(x["status"] == "ok" for x in runs)
    for run in runs:
        assert (run["steps"], run["batch_size"], run["seq_len"], run["model"], run["data"], run["device"]) == \
               ("8", "2", "64", "tiny", "shakespeare", "cpu")
        assert float(run["median_step_ms"]) > 0 and float(run["final_loss"]) > 0
        assert run["command"].split()[0] == SCRIPTS[run["optimization"]]
    steps = read_csv(prefix / "results.csv")
    for run in runs:
        mine = [s for s in steps if s["run_id"] == run["run_id"]]
        assert [int(s["step"]) for s in mine] == list(range(8))
        assert [s["warmup"] for s in mine] == ["1"] * 5 + ["0"] * 3
        assert all(float(s["step_ms"]) > 0 and float(s["tokens_per_s"]) > 0 for s in mine)
        assert all(s["mfu"] == "" for s in mine)   # a CPU has no known peak
        assert float(run["final_loss"]) == pytest.approx(float(mine[-1]["loss"]), rel=1e-5)   # the last step's
    notes = {x["optimization"]: x["notes"] for x in runs}
    assert notes["baseline"] == "" and "TF32 has no effect on a CPU" in notes["tf32"]
    # max says what it left out on a CPU: among others, the packed attention (cuDNN) and CUDA graphs.
    assert "packed attention needs cuDNN 9 and its frontend on an Ampere or newer GPU: plain SDPA instead" in notes["max"]
    assert "CUDA graphs need a GPU" in notes["max"]
    assert all((prefix / name).stat().st_size > 0 for name in
               ["speedup.png", "step_time.png", "throughput.png", "memory.png", "loss.png", "summary.md"])
    losses = {}
    for s in steps:
        losses.setdefault(s["optimization"], []).append(float(s["loss"]))
    base = losses["baseline"]
    assert abs(base[0] - 10.82) < 0.1          # ln(50257) at init
    assert base[-1] < base[0] - 0.2            # and it learns
    for rung in LADDER[1:]:
        gaps = [abs(a - b) for a, b in zip(losses[rung], base)]
        assert len(gaps) == 8 and max(gaps) < LOSS_TOLERANCE, (rung, gaps)


def test_a_script_runs_on_its_own(tmp_path, suite_env):
    r = subprocess.run([sys.executable, "brainFloat16.py", "--steps", "3", "--batch-size", "2", "--prefix",
                        str(tmp_path), "--data", "synthetic", "--seq-len", "32"], cwd=REPO, env=suite_env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("bf16 | tiny | B=2 T=32 | data synthetic | cpu")
    assert [l.split(" | ")[0] for l in lines if l.startswith("step ")] == ["step 1/3", "step 2/3", "step 3/3"]
    assert lines[-1].startswith("summary | bf16: ok | median ")
    runs = read_csv(tmp_path / "runs.csv")
    assert len(runs) == 1 and runs[0]["data"] == "synthetic" and runs[0]["warmup_steps"] == "2"
    assert len(read_csv(tmp_path / "results.csv")) == 3


def test_make_one_rung_appends_to_existing_results(charted, suite_env):
    before, summary = (charted / "results.csv").read_bytes(), (charted / "summary.md").read_text()
    # the folder's shapes (conftest.RUN_CONFIG), another warm-up and seed
    r = make(["bf16", "STEPS=3", "BATCH_SIZE=4", f"PREFIX={charted}", "SEQ_LEN=32", "DATA=synthetic", "WARMUP=1",
              "SEED=7"], suite_env, timeout=600)
    assert r.returncode == 0, r.stderr
    assert (charted / "results.csv").read_bytes().startswith(before)
    # The folder had a summary: it is drawn again with the new run, not left behind it.
    assert "wrote speedup.png" in r.stdout and (charted / "summary.md").read_text() != summary
    last = read_csv(charted / "runs.csv")[-1]
    assert (last["optimization"], last["seq_len"], last["warmup_steps"]) == ("bf16", "32", "1")
    assert '"seed": 7' in last["config"]


def test_make_repeat_runs_a_rung_that_many_times_and_stops_at_a_failure(tmp_path, suite_env):
    args = ["STEPS=3", "BATCH_SIZE=2", f"PREFIX={tmp_path}", "SEQ_LEN=16", "WARMUP=1", "DATA=synthetic"]
    r = make(["bf16", "REPEAT=2"] + args, suite_env, timeout=600)
    assert r.returncode == 0, r.stderr
    assert [l for l in r.stdout.splitlines() if l.startswith("===")] == ["=== bf16, run 1 of 2 ===",
                                                                          "=== bf16, run 2 of 2 ==="]
    runs = read_csv(tmp_path / "runs.csv")
    assert [(x["optimization"], x["status"]) for x in runs] == [("bf16", "ok"), ("bf16", "ok")]
    assert not (tmp_path / "summary.md").exists()   # no charts where none were drawn: make plots draws them
    assert len({x["run_id"] for x in runs}) == 2
    # A run that is not ok ends the repetition with its exit status.
    r = make(["bf16", "REPEAT=3"] + args + [f"DATA={tmp_path / 'no-such-text.txt'}"], suite_env, timeout=600)
    assert r.returncode != 0
    assert [l for l in r.stdout.splitlines() if l.startswith("===")] == ["=== bf16, run 1 of 3 ==="]


def test_init_results_reset_and_clean_touch_only_suite_files(charted, suite_env):
    (charted / "mine.txt").write_text("not the suite's")
    (charted / "20261202-182618-peer-llmc-9fc72a.log").write_text("a peer's output, as Utils.peers.record names it")
    (charted / "Optimizing_GPU_Utilization.ipynb").write_text("{}")   # make notebook RESULTS=charted writes it there
    assert make(["clean", f"PREFIX={charted}"], suite_env).returncode == 0
    assert not (charted / "speedup.png").exists() and not (charted / "summary.md").exists()
    assert (charted / "results.csv").exists() and (charted / "mine.txt").exists()
    assert make(["reset", f"PREFIX={charted}"], suite_env).returncode == 0
    assert sorted(os.listdir(charted)) == ["mine.txt"]
    assert make(["init_results", f"PREFIX={charted}"], suite_env).returncode == 0
    assert read_csv(charted / "runs.csv") == [] and (charted / "results.csv").read_text().startswith("run_id,")


def test_profile_writes_the_breakdown_and_leaves_results_alone(tmp_path, suite_env):
    r = make(["fused", "STEPS=3", "BATCH_SIZE=2", "SEQ_LEN=32", "DATA=synthetic", f"PREFIX={tmp_path}",
              "PROFILE=1"], suite_env, timeout=600)
    assert r.returncode == 0, r.stderr
    # the run writes the trace and says so; the report's command, which make runs next, splits it
    assert f"trace | fused: the profiled steps are in {tmp_path / 'trace_fused.json.gz'}" in r.stdout
    assert "profile | fused: cpu_ops" in r.stdout and "the compute/memory split is GPU-only" in r.stdout
    assert not (tmp_path / "results.csv").exists() and not (tmp_path / "runs.csv").exists()
    rows = read_csv(tmp_path / "breakdown.csv")
    assert [x["class"] for x in rows] == ["cpu_ops", "overhead"] and {x["rung"] for x in rows} == {"fused"}
    assert abs(sum(float(x["share"]) for x in rows) - 1) < 1e-6
    assert (tmp_path / "trace_fused.json.gz").stat().st_size > 0
    assert (tmp_path / "breakdown.png").stat().st_size > 0 and "fused" in (tmp_path / "breakdown.md").read_text()


def test_make_all_goes_on_past_a_failed_rung_and_names_it(tmp_path, suite_env):
    # An interpreter that fails tf32's script as an out-of-memory run would (exit 3), runs the baseline and
    # the charts for real, and passes the other rungs by without training (they have tests of their own).
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\ncase "$1" in\n'
                    f'  tensorFloat32.py) echo "error: tf32 oom" >&2; exit 3;;\n'
                    f'  no_optimization.py|plot_results.py|-m) exec {sys.executable} "$@";;\n'
                    f'  *) echo "passed by: $1"; exit 0;;\nesac\n')
    fake.chmod(0o755)
    prefix = tmp_path / "out"
    r = subprocess.run(["make", "--no-print-directory", "all", f"PYTHON={fake}", "STEPS=2", "BATCH_SIZE=1",
                        "SEQ_LEN=8", "DATA=synthetic", f"PREFIX={prefix}"], cwd=REPO, env=suite_env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode != 0
    assert f"error: make all: not ok: tf32 (see {prefix})" in r.stderr
    runs = read_csv(prefix / "runs.csv")
    assert [x["optimization"] for x in runs] == ["baseline"]
    assert r.stdout.count("passed by: ") == len(LADDER) - 2      # every rung after tf32 was still run
    assert (prefix / "summary.md").exists()


def test_make_all_warns_once_when_data_auto_falls_back(tmp_path, suite_env):
    # Were each rung to decide DATA=auto on its own, it would print the same warning eight times. An
    # interpreter that passes the rungs and the charts by (and runs the rest for real) shows what each got.
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\ncase "$1" in\n  *.py) echo "passed by: $*"; exit 0;;\n'
                    f'  *) exec {sys.executable} "$@";;\nesac\n')
    fake.chmod(0o755)
    env = dict(suite_env, DATA_DIR=str(tmp_path / "no-data"), SHAKESPEARE_URL=f"file://{tmp_path}/absent.txt")
    r = subprocess.run(["make", "--no-print-directory", "all", f"PYTHON={fake}", "STEPS=2", "BATCH_SIZE=1",
                        f"PREFIX={tmp_path / 'out'}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("WARNING: DATA=auto falls back to synthetic tokens") == 1
    rungs = [line for line in r.stdout.splitlines() if line.startswith("passed by: ") and "plot_results" not in line]
    assert len(rungs) == len(LADDER) and all("--data=synthetic" in line for line in rungs)


def test_make_n_all_changes_nothing_and_still_refuses_bad_arguments(tmp_path, suite_env):
    # A dry run prints the rungs' commands: it makes no PREFIX, fetches no data and warns of nothing.
    env = dict(suite_env, DATA_DIR=str(tmp_path / "no-data"), SHAKESPEARE_URL=f"file://{tmp_path}/absent.txt")
    prefix = tmp_path / "out"
    r = make(["-n", "all", "STEPS=2", "BATCH_SIZE=1", f"PREFIX={prefix}"], env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "WARNING" not in r.stderr and not prefix.exists() and not (tmp_path / "no-data").exists()
    scripts = [f" {RUNGS[name].script} --steps=2" for name in LADDER]   # each rung's command, printed, in order
    assert [s for line in r.stdout.splitlines() for s in scripts if s in line] == scripts
    assert f"plot_results.py --prefix={prefix}" in r.stdout   # the charts, echoed
    bad = make(["-n", "all", "STEPS=two", "BATCH_SIZE=1", f"PREFIX={prefix}"], env, timeout=120)
    assert bad.returncode != 0 and "STEPS" in bad.stderr and not prefix.exists()


@pytest.mark.parametrize("upgrade, flag", [("", ""), ("UPGRADE=1", " --upgrade")])
def test_make_install_test_and_notebook_install_through_utils_install(upgrade, flag):
    # What each installs on which machine is Utils.install's (tests/test_install.py); make only calls it.
    for target, what in (("install", "suite"), ("test", "test"), ("notebook", "notebook")):
        r = subprocess.run(["make", "-n", "--no-print-directory", target] + ([upgrade] if upgrade else []),
                           cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert f"-m Utils.install {what}{flag}\n" in r.stdout, r.stdout


def test_make_ablation_runs_the_fused_rung_first_then_each_addition_then_the_charts(tmp_path, suite_env):
    # Additions of the loop stage and make all's shapes: one compiled graph, from Inductor's cache where make all
    # has run.
    r = make(["ablation", "STEPS=2", "BATCH_SIZE=2", "SEQ_LEN=64", "WARMUP=1", "DATA=synthetic", f"PREFIX={tmp_path}",
              "ADDITIONS=prefetch sync_every"], suite_env, timeout=600)
    assert r.returncode == 0, r.stderr
    runs = read_csv(tmp_path / "runs.csv")
    assert [x["optimization"] for x in runs] == ["fused", "fused+prefetch", "fused+sync_every"]
    assert all(x["status"] == "ok" for x in runs)
    assert runs[0]["command"].startswith("fused_optimizer.py ")
    assert runs[1]["command"].startswith("ablation.py --add prefetch")
    additions = [json.loads(x["config"])["additions"] for x in runs]
    assert set(additions[1]) - set(additions[0]) == {"prefetch"} and set(additions[2]) - set(additions[0]) == {"sync_every"}
    summary = (tmp_path / "summary.md").read_text()
    assert all(name in summary for name in ("| fused ", "| fused+prefetch ", "| fused+sync_every "))


def test_make_ablation_from_max_runs_max_first_then_max_without_each_addition(tmp_path, suite_env):
    r = make(["ablation", "FROM=max", "STEPS=2", "BATCH_SIZE=2", "SEQ_LEN=64", "WARMUP=1", "DATA=synthetic",
              f"PREFIX={tmp_path}", "ADDITIONS=prefetch sync_every+prefetch"], suite_env, timeout=600)
    assert r.returncode == 0, r.stderr
    runs = read_csv(tmp_path / "runs.csv")
    assert [x["optimization"] for x in runs] == ["max", "max-prefetch", "max-prefetch-sync_every"]
    assert all(x["status"] == "ok" for x in runs)
    assert runs[0]["command"].startswith("max_throughput.py ")
    assert runs[1]["command"].startswith("ablation.py --drop prefetch")
    additions = [json.loads(x["config"])["additions"] for x in runs]
    assert "prefetch" in additions[0] and set(additions[0]) - set(additions[1]) == {"prefetch"}
    assert set(additions[0]) - set(additions[2]) == {"prefetch", "sync_every"}   # both left out of one run
    assert runs[2]["command"].startswith("ablation.py --drop sync_every+prefetch")


@pytest.mark.parametrize("args, first_line", [
    (["FROM=flash"], "error: FROM='flash': use FROM=fused"),
    (["FROM=max", "ADDITIONS=loss"], "error: ADDITIONS: make ablation FROM=max does not try 'loss'"),
    (["FROM=max", "ADDITIONS=prefetch+loss"], "error: ADDITIONS: make ablation FROM=max does not try 'loss'"),
    (["FROM=max", "ADDITIONS=prefetch+sync_every sync_every+prefetch"],
     "error: ADDITIONS: 'sync_every+prefetch' runs what 'prefetch+sync_every' runs: name it once"),
])
def test_make_ablation_refuses_a_bad_from_before_running_any(tmp_path, suite_env, args, first_line):
    r = make(["ablation", "STEPS=2", "BATCH_SIZE=1", f"PREFIX={tmp_path}"] + args, suite_env, timeout=120)
    assert r.returncode == 2 and r.stderr.splitlines()[0].startswith(first_line), r.stderr
    assert not (tmp_path / "runs.csv").exists()


def test_make_ablation_refuses_an_unknown_addition_before_running_any(tmp_path, suite_env):
    r = make(["ablation", "STEPS=2", "BATCH_SIZE=1", f"PREFIX={tmp_path}", "ADDITIONS=loss nonsense"], suite_env,
             timeout=120)
    assert r.returncode == 2 and r.stderr.splitlines()[0].startswith(
        "error: ADDITIONS: make ablation FROM=fused does not try 'nonsense'")
    assert not (tmp_path / "runs.csv").exists()


def test_make_ablation_repeat_runs_rounds_of_the_base_and_each_addition_alternated(tmp_path):
    # The runs are stand-ins that name themselves; the order of the commands is what is tested.
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\ncase "$1" in\n'
                    f'  -m) exec {sys.executable} "$@";;\n'
                    f'  plot_results.py) echo "charts drawn"; exit 0;;\n'
                    f'  *) echo "ran: $1 $2 $3"; exit 0;;\nesac\n')
    fake.chmod(0o755)
    r = subprocess.run(["make", "--no-print-directory", "ablation", f"PYTHON={fake}", "STEPS=2", "BATCH_SIZE=1",
                        "DATA=synthetic", f"PREFIX={tmp_path / 'out'}", "FROM=max", "ADDITIONS=prefetch sync_every",
                        "REPEAT=2"], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    ran = [line.split(" --steps")[0] for line in r.stdout.splitlines() if line.startswith("ran: ")]
    one_round = ["ran: max_throughput.py", "ran: ablation.py --drop prefetch", "ran: ablation.py --drop sync_every"]
    assert ran == one_round * 2
    assert r.stdout.count("charts drawn") == 1   # once, after both rounds


def test_make_ablation_refuses_a_bad_repeat_before_running_any(tmp_path):
    r = make(["ablation", "STEPS=2", "BATCH_SIZE=1", f"PREFIX={tmp_path}", "REPEAT=two"], clean_env(), timeout=120)
    assert r.returncode == 2 and r.stderr.splitlines()[0].startswith("error: REPEAT must be a number of runs")
    assert not (tmp_path / "runs.csv").exists()


def test_make_all_with_profile_splits_each_rungs_trace_and_draws_no_charts(tmp_path, suite_env):
    # Profiled runs are recorded in breakdown.md only: charts of results.csv would show none of them (and
    # in a fresh folder there is no results.csv to draw). The rungs and the split are stand-ins here.
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\ncase "$1 $2" in\n'
                    f'  "-m Utils.report.breakdown") echo "split into breakdown.md"; exit 0;;\n'
                    f'  -m*) exec {sys.executable} "$@";;\n'
                    f'  plot_results.py*) echo "charts drawn"; exit 0;;\n'
                    f'  *) echo "passed by: $1"; exit 0;;\nesac\n')
    fake.chmod(0o755)
    r = subprocess.run(["make", "--no-print-directory", "all", f"PYTHON={fake}", "STEPS=2", "BATCH_SIZE=1",
                        "DATA=synthetic", f"PREFIX={tmp_path / 'out'}", "PROFILE=1"], cwd=REPO, env=suite_env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("passed by: ") == len(LADDER) and all("--profile" in line for line in
                                                                  r.stdout.splitlines() if "--prefix" in line)
    assert r.stdout.count("split into breakdown.md") == len(LADDER)
    assert "charts drawn" not in r.stdout and "PROFILE=1: no charts" in r.stdout
