"""What the run targets of make hand to their child processes: the argv of every run, chart and trace split, in
order, the `=== ... ===` and `--- round k of R ---` lines around them, the `error:` lines, and whether make
succeeded. PYTHON is a stand-in that logs each call: the checks (Utils.train.cli, Utils.train.distributed,
Utils.ladder, the driver Utils.suite) run for real, the runs, the charts and the splits are passed by. A run's
record (runs.csv's command column) is built from its argv, so the order of its options is part of what is pinned
here."""
import json
import subprocess
import sys
from dataclasses import dataclass

import pytest

from conftest import REPO_ROOT, clean_env
from Utils.ladder.registry import FUSED_ALONE

# The stand-in for PYTHON. Each call is logged as one JSON line; -c and the modules in REAL (the checks, the
# registry, the results files, and the driver make hands its targets to) run for real; everything else is a
# run passed by: it prints "ran" and exits 0, or with the status FAKE_FAIL gives a word of its argv (FAKE_FAIL=
# "tensorFloat32.py=3 plot_results.py": 3 for tf32's script, 1 for the charts).
FAKE = """\
#!{python}
import json, os, sys

argv = sys.argv[1:]
real = argv[:1] == ["-c"] or (argv[:1] == ["-m"] and argv[1:2] in {real})
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps({{"real": real, "argv": argv}}) + "\\n")
if real:
    os.execv(sys.executable, [sys.executable] + argv)
print("ran")
for fail in os.environ.get("FAKE_FAIL", "").split():
    word, _, rc = fail.partition("=")
    if word in argv:
        sys.exit(int(rc or 1))
"""
REAL = [["Utils.train.cli"], ["Utils.train.distributed"], ["Utils.ladder"], ["Utils.results.store"],
        ["Utils.report.compare"], ["Utils.suite"]]

# What every case passes (with DATA=synthetic unless it says otherwise), and the run options they become, in
# RUN_ARGS's order: --steps, --batch-size, --prefix, then the optional ones in their fixed order.
BASE = ["MODEL=tiny", "DEVICE=cpu", "STEPS=2", "BATCH_SIZE=2"]
ARGS = ["--steps=2", "--batch-size=2", "--prefix={tmp}/out", "--model=tiny", "--device=cpu", "--data=synthetic"]
PLOT = ["plot_results.py", "--prefix={tmp}/out"]
SPLIT = ["-m", "Utils.report.breakdown", "--prefix={tmp}/out"]
LADDER = ["no_optimization.py", "tensorFloat32.py", "brainFloat16.py", "torch_compile.py", "flash_attention.py",
          "fused_optimizer.py", "8-bit_optimizer.py", "max_throughput.py"]
RUNGS = ["baseline", "tf32", "bf16", "torch_compile", "flash", "fused", "8bit", "max"]


@dataclass
class Made:
    rc: int
    calls: list       # the argv of each run passed by, in order, with {python} and {tmp} for the fake and tmp_path
    checks: list      # the argv of each check that ran for real (Utils.train.cli, Utils.train.distributed), in order
    outline: list     # stdout's === and --- lines, and "ran" where a passed-by run printed it
    errors: list      # stderr's error: lines
    stdout: str
    stderr: str


def contract(tmp_path, args, data="synthetic", env=None, fail=None, summary=False):
    """make ARGS with the logging PYTHON, BASE, PREFIX=tmp_path/out and DATA=data (None: no DATA). summary: PREFIX
    holds a summary.md before make starts, as after make plots."""
    fake, log = tmp_path / "python", tmp_path / "calls.jsonl"
    fake.write_text(FAKE.format(python=sys.executable, real=REAL))
    fake.chmod(0o755)
    if summary:
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "summary.md").write_text("drawn before\n")
    env = dict(clean_env() if env is None else env, FAKE_LOG=str(log))
    if fail:
        env["FAKE_FAIL"] = fail
    # The target's own variables last: a variable given twice on make's command line takes its last value
    # (STEPS=0 over BASE's).
    argv = ["make", "--no-print-directory", args[0], f"PYTHON={fake}", *BASE, f"PREFIX={tmp_path}/out",
            *([f"DATA={data}"] if data else []), *args[1:]]
    r = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)

    def placeholders(word):
        return word.replace(str(fake), "{python}").replace(str(tmp_path), "{tmp}")
    logged = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    calls = [[placeholders(w) for w in c["argv"]] for c in logged if not c["real"]]
    checks = [[placeholders(w) for w in c["argv"]] for c in logged
              if c["real"] and c["argv"][1:2] in (["Utils.train.cli"], ["Utils.train.distributed"])]
    outline = [ln for ln in r.stdout.splitlines() if ln == "ran" or ln.startswith(("=== ", "--- round "))]
    errors = [placeholders(ln) for ln in r.stderr.splitlines() if ln.startswith("error:")]
    return Made(r.returncode, calls, checks, outline, errors, r.stdout, r.stderr)


def ok(made):
    assert made.rc == 0 and made.errors == [], made.stderr[-3000:]


# --- one rung, custom ---------------------------------------------------------------------------------------

def test_a_rung_hands_every_option_to_its_script_in_run_args_order(tmp_path):
    # Every optional variable set (WARMUP to nothing: it is passed on, for the script to refuse); the rung's
    # script checks them itself, so none is checked before it starts.
    made = contract(tmp_path, ["fused", "SEQ_LEN=16", "WARMUP=", "SEED=7", "DATA_DIR=/d", "SDPA_BACKEND=math",
                               "MICRO_BATCH=1", "GPU_MEMORY_GIB=3.5", "COLD=1", "PROFILE=yes"])
    ok(made)
    assert made.calls == [
        ["fused_optimizer.py", "--steps=2", "--batch-size=2", "--prefix={tmp}/out", "--model=tiny", "--seq-len=16",
         "--device=cpu", "--data=synthetic", "--warmup=", "--seed=7", "--data-dir=/d", "--sdpa-backend=math",
         "--micro-batch=1", "--gpu-memory-gib=3.5", "--profile", "--cold"],
        SPLIT]
    assert made.outline == ["ran", "ran"]


def test_a_prefix_reaches_the_run_exactly_as_written(tmp_path):
    made = contract(tmp_path, ["baseline", f"PREFIX={tmp_path}/runs $5 $(HOME) it's"])
    ok(made)
    assert made.calls == [["no_optimization.py", "--steps=2", "--batch-size=2", "--prefix={tmp}/runs $5 $(HOME) it's",
                           "--model=tiny", "--device=cpu", "--data=synthetic"]]


@pytest.mark.parametrize("summary, after", [(False, []), (True, [PLOT])])
def test_a_rung_draws_the_charts_again_only_where_prefix_holds_a_summary(tmp_path, summary, after):
    made = contract(tmp_path, ["fused"], summary=summary)
    ok(made)
    assert made.calls == [["fused_optimizer.py", *ARGS], *after]
    assert made.outline == ["ran"] * len(made.calls)


def test_a_rung_with_repeat_runs_in_a_row_under_headers_then_redraws_once(tmp_path):
    made = contract(tmp_path, ["fused", "REPEAT=2"], summary=True)
    ok(made)
    assert made.calls == [["fused_optimizer.py", *ARGS], ["fused_optimizer.py", *ARGS], PLOT]
    assert made.outline == ["=== fused, run 1 of 2 ===", "ran", "=== fused, run 2 of 2 ===", "ran", "ran"]


def test_a_rung_with_repeat_stops_at_the_first_run_that_fails(tmp_path):
    made = contract(tmp_path, ["fused", "REPEAT=3"], summary=True, fail="fused_optimizer.py=3")
    assert made.rc != 0 and made.errors == []
    assert made.calls == [["fused_optimizer.py", *ARGS]]     # no second run, no charts
    assert made.outline == ["=== fused, run 1 of 3 ===", "ran"]


def test_a_profiled_rung_splits_its_trace_after_each_run_and_draws_no_charts(tmp_path):
    made = contract(tmp_path, ["fused", "PROFILE=1", "REPEAT=2"], summary=True)
    ok(made)
    assert made.calls == [["fused_optimizer.py", *ARGS, "--profile"], SPLIT] * 2
    assert made.outline == ["=== fused, run 1 of 2 ===", "ran", "ran", "=== fused, run 2 of 2 ===", "ran", "ran"]


# The checks before torchrun starts: the process count and PARALLEL against the GPUs and the additions, and every
# run argument, each once, in as few processes as they can share (each imports torch).
ARGUMENTS_CHECK = ["-m", "Utils.train.cli", *ARGS]


def test_a_rung_on_several_processes_goes_through_torchrun_with_parallel_before_the_run_args(tmp_path):
    made = contract(tmp_path, ["fused", "NPROC=2"])
    ok(made)
    assert made.calls == [["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "fused_optimizer.py", "--parallel", "ddp", *ARGS]]
    assert made.checks == [["-m", "Utils.train.cli", "--processes", "2", "ddp", "cpu", "fused", "--", *ARGS]]


@pytest.mark.parametrize("extra, launch", [
    ([], ["-m", "Utils.train"]),
    (["NPROC=2", "PARALLEL=fsdp"],
     ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "Utils.train",
      "--parallel", "fsdp"]),
])
def test_custom_hands_with_as_one_word_before_the_run_args(tmp_path, extra, launch):
    made = contract(tmp_path, ["custom", "WITH=bf16  torch_compile", *extra], summary=True)
    ok(made)
    assert made.calls == [[*launch, "--with", "bf16  torch_compile", *ARGS], PLOT]


# --- the loops: all, profile, scaling, ablation, peers -----------------------------------------------------

@pytest.mark.parametrize("summary", [False, True])
def test_all_runs_every_rung_in_ladder_order_then_draws_the_charts(tmp_path, summary):
    # all draws the charts at its end whether or not PREFIX held a summary; its rungs never redraw on their own.
    made = contract(tmp_path, ["all"], summary=summary)
    ok(made)
    assert made.calls == [[script, *ARGS] for script in LADDER] + [PLOT]
    assert made.outline == [line for rung in RUNGS for line in (f"=== all {rung} ===", "ran")] + ["ran"]


def test_all_on_several_processes_checks_once_and_refuses_each_rung_parallel_cannot_run(tmp_path):
    # The process count and the run arguments are checked once, not again by each rung; each rung's additions are
    # checked against PARALLEL as it comes, in the driver, and one it cannot run is named and passed by.
    made = contract(tmp_path, ["all", "NPROC=2", "PARALLEL=fsdp"])
    assert made.checks == [["-m", "Utils.train.distributed", "check", "2", "fsdp", "cpu", ""], ARGUMENTS_CHECK]
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    assert made.calls == [[*torchrun, script, "--parallel", "fsdp", *ARGS] for script in LADDER[:6]] + [PLOT]
    assert made.rc == 2 and made.errors == [   # make says 2 for the driver's 1
        "error: 8bit cannot run with PARALLEL=fsdp: bitsandbytes' optimizer takes whole tensors, not FSDP's DTensor "
        "shards; use PARALLEL=ddp, or a run without it",
        made.errors[1], "error: make all: not ok: 8bit max (see {tmp}/out)"]
    assert made.errors[1].startswith("error: gemm_bias_grad (and ") and "cannot run with PARALLEL=fsdp" in \
        made.errors[1]


def test_all_goes_on_past_a_failed_rung_and_failed_charts_and_names_them(tmp_path):
    made = contract(tmp_path, ["all"], fail="tensorFloat32.py=3 plot_results.py")
    assert made.rc != 0
    assert made.calls == [[script, *ARGS] for script in LADDER] + [PLOT]
    assert made.errors == ["error: make all: not ok: tf32 plots (see {tmp}/out)"]


def test_all_with_repeat_runs_each_rung_in_a_row(tmp_path):
    made = contract(tmp_path, ["all", "REPEAT=2"])
    ok(made)
    assert made.calls == [[script, *ARGS] for script in LADDER for _ in range(2)] + [PLOT]
    assert made.outline == [line for rung in RUNGS for line in (
        f"=== all {rung} ===", f"=== {rung}, run 1 of 2 ===", "ran", f"=== {rung}, run 2 of 2 ===", "ran")] + ["ran"]


def test_all_with_profile_splits_each_rungs_trace_and_draws_no_charts(tmp_path):
    made = contract(tmp_path, ["all", "PROFILE=1"])
    ok(made)
    assert made.calls == [call for script in LADDER for call in ([script, *ARGS, "--profile"], SPLIT)]
    assert made.outline == [line for rung in RUNGS for line in (f"=== all {rung} ===", "ran", "ran")]
    assert "PROFILE=1: no charts (the profiled runs are in breakdown.md only)" in made.stdout.splitlines()


def test_profile_splits_each_rungs_trace_and_draws_no_charts(tmp_path):
    made = contract(tmp_path, ["profile"])
    ok(made)
    assert made.calls == [call for script in LADDER for call in ([script, *ARGS, "--profile"], SPLIT)]
    assert made.outline == [line for rung in RUNGS for line in (f"=== profile {rung} ===", "ran", "ran")]
    assert "no charts" not in made.stdout


def test_scaling_runs_the_rung_at_each_count_through_torchrun_then_the_charts(tmp_path):
    made = contract(tmp_path, ["scaling", "RUNG=baseline", "NPROC=1 2"])
    ok(made)
    assert made.checks == [["-m", "Utils.train.distributed", "counts", "1 2", "ddp", "cpu", "baseline"],
                           ARGUMENTS_CHECK]
    assert made.calls == [
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "no_optimization.py",
         "--parallel", "ddp", *ARGS],
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "no_optimization.py",
         "--parallel", "ddp", *ARGS],
        PLOT]
    assert made.outline == ["=== scaling 1 ===", "ran", "=== scaling 2 ===", "ran", "ran"]


def test_ablation_from_max_runs_rounds_of_max_and_max_without_each_addition(tmp_path):
    made = contract(tmp_path, ["ablation", "FROM=max", "ADDITIONS=prefetch sync_every+prefetch", "REPEAT=2"])
    ok(made)
    one_round = [["max_throughput.py", *ARGS], ["ablation.py", "--drop", "prefetch", *ARGS],
                 ["ablation.py", "--drop", "sync_every+prefetch", *ARGS]]
    assert made.calls == one_round * 2 + [PLOT]
    assert made.outline == [
        "=== ablation max ===", "--- round 1 of 2 ---", "ran", "=== ablation prefetch ===", "ran",
        "=== ablation sync_every+prefetch ===", "ran",
        "=== ablation max ===", "--- round 2 of 2 ---", "ran", "=== ablation prefetch ===", "ran",
        "=== ablation sync_every+prefetch ===", "ran",
        "ran"]


def test_ablation_from_fused_adds_each_addition_and_splits_once_when_profiled(tmp_path):
    made = contract(tmp_path, ["ablation", "ADDITIONS=prefetch", "PROFILE=1"])
    ok(made)
    assert made.calls == [["fused_optimizer.py", *ARGS, "--profile"],
                          ["ablation.py", "--add", "prefetch", *ARGS, "--profile"],
                          SPLIT]
    assert made.outline == ["=== ablation fused ===", "ran", "=== ablation prefetch ===", "ran", "ran"]
    assert "PROFILE=1: no charts (the profiled runs are in breakdown.md only)" in made.stdout.splitlines()


def test_peers_with_a_rung_and_repeat_runs_rounds_of_the_rung_then_each_peer(tmp_path):
    made = contract(tmp_path, ["peers", "RUNG=max", "REPEAT=2"], fail="hf=4")
    assert made.rc != 0
    one_round = [["max_throughput.py", *ARGS], ["-m", "Utils.peers", "llmc", *ARGS], ["-m", "Utils.peers", "hf", *ARGS]]
    assert made.calls == one_round * 2 + [PLOT]
    assert made.outline == [
        "=== peers max ===", "--- round 1 of 2 ---", "ran", "=== peers llmc ===", "ran", "=== peers hf ===", "ran",
        "=== peers max ===", "--- round 2 of 2 ---", "ran", "=== peers llmc ===", "ran", "=== peers hf ===", "ran",
        "ran"]
    assert made.errors == ["error: make peers: not ok: hf (see {tmp}/out)"]   # named once, though it failed twice


# --- DATA left out: resolved once, then handed to every run ------------------------------------------------

def fallback_env(tmp_path):
    """No tiny shakespeare in DATA_DIR (given in the environment, as the tests give it) and none to download."""
    (tmp_path / "no-data").mkdir()
    return dict(clean_env(), DATA_DIR=str(tmp_path / "no-data"), SHAKESPEARE_URL="http://127.0.0.1:9/x")


# The run options without DATA: DATA_DIR, from the environment, takes its slot after --device.
NO_DATA = ["--steps=2", "--batch-size=2", "--prefix={tmp}/out", "--model=tiny", "--device=cpu",
           "--data-dir={tmp}/no-data"]


def test_all_without_data_resolves_it_once_and_gives_every_rung_synthetic_in_its_slot(tmp_path):
    made = contract(tmp_path, ["all"], data=None, env=fallback_env(tmp_path))
    ok(made)
    assert made.stderr.count("WARNING: DATA=auto falls back to synthetic tokens") == 1
    in_slot = ["--steps=2", "--batch-size=2", "--prefix={tmp}/out", "--model=tiny", "--device=cpu",
               "--data=synthetic", "--data-dir={tmp}/no-data"]
    assert made.calls == [[script, *in_slot] for script in LADDER] + [PLOT]


@pytest.mark.parametrize("args, runs", [
    (["ablation", "ADDITIONS=prefetch"], [["fused_optimizer.py"], ["ablation.py", "--add", "prefetch"]]),
    (["peers", "PEERS=hf", "RUNG=fused"], [["fused_optimizer.py"], ["-m", "Utils.peers", "hf"]]),
])
def test_ablation_and_peers_without_data_append_the_resolved_data(tmp_path, args, runs):
    made = contract(tmp_path, args, data=None, env=fallback_env(tmp_path))
    ok(made)
    assert made.stderr.count("WARNING: DATA=auto falls back to synthetic tokens") == 1
    assert made.calls == [[*run, *NO_DATA, "--data=synthetic"] for run in runs] + [PLOT]


def test_a_rung_without_data_leaves_it_to_its_script(tmp_path):
    made = contract(tmp_path, ["fused"], data=None, env=fallback_env(tmp_path))
    ok(made)
    assert made.calls == [["fused_optimizer.py", *NO_DATA]]
    assert "WARNING" not in made.stderr


# --- refused before any run starts -------------------------------------------------------------------------

@pytest.mark.parametrize("args, error", [
    (["all", "REPEAT=0"], "error: REPEAT must be a number of runs from 1 to 99, not '0' "
                          "(e.g. make max STEPS=60 BATCH_SIZE=16 PREFIX=./out REPEAT=3)"),
    (["fused", "REPEAT=0"], "error: REPEAT must be a number of runs from 1 to 99, not '0' "
                            "(e.g. make max STEPS=60 BATCH_SIZE=16 PREFIX=./out REPEAT=3)"),
    (["ablation", "FROM="], "error: FROM is empty: use FROM=fused or FROM=max, or leave it out (fused)"),
    (["ablation", "ADDITIONS=prefetch nonsense"],
     # The additions it names are the registry's, in its order, so that a new one changes no test here.
     f"error: ADDITIONS: make ablation FROM=fused does not try 'nonsense': use some of {', '.join(FUSED_ALONE)}, or "
     "several joined by '+' to try them together"),
    (["custom"], "error: WITH is required: the additions to run, e.g. make custom WITH=\"bf16 torch_compile flash\" "
                 "STEPS=50 BATCH_SIZE=16 PREFIX=./out (make additions lists them)"),
    (["scaling", "RUNG=turbo", "NPROC=1 2"], "error: RUNG must name one rung (baseline tf32 bf16 torch_compile flash "
                                             "fused 8bit max), e.g. make scaling RUNG=max NPROC=\"1 2\" STEPS=60 "
                                             "BATCH_SIZE=16 PREFIX=./out"),
    (["peers", "NPROC=2"], "error: make peers runs each peer as one process, unprofiled: leave out NPROC, PARALLEL "
                           "and PROFILE"),
    (["peers", "PEERS=hf hf"], "error: PEERS names hf twice: name each peer once (REPEAT=n runs rounds)"),
    (["all", "STEPS=0"], "error: STEPS='0' is not a positive integer: pass the number of steps to time, e.g. make "
                         "fused STEPS=50 BATCH_SIZE=16 PREFIX=./out"),
    (["fused", "NPROC=2", "PARALLEL=zero"], "error: PARALLEL='zero' is not one of ddp, fsdp: e.g. PARALLEL=ddp"),
])
def test_bad_input_is_refused_before_any_run_starts(tmp_path, args, error):
    made = contract(tmp_path, args)
    assert made.rc == 2 and made.errors == [error], made.stderr
    assert made.calls == [] and made.outline == [] and not (tmp_path / "out").exists()
