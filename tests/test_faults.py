"""Faults, interruptions and concurrent runs: nothing lost, always a clear word."""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from Utils import model as model_module
from Utils.results.schema import RUN_COLUMNS, STEP_COLUMNS
from Utils.results.store import check_file
from Utils.train.run import EXIT_OOM, EXIT_SKIPPED, main

from conftest import REPO_ROOT as REPO, clean_env, make, read_csv

TINY = ["--batch-size", "2", "--seq-len", "16", "--data", "synthetic"]


def run_in_process(rung, prefix, steps=4, extra=()):
    return main(rung, ["--steps", str(steps), "--prefix", str(prefix)] + TINY + list(extra))


def test_out_of_memory_is_recorded_and_named(tmp_path, monkeypatch, capsys):
    real_forward = model_module.GPT.forward
    calls = {"n": 0}

    def forward(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_forward(self, *a, **kw)

    monkeypatch.setattr(model_module.GPT, "forward", forward)
    assert main("baseline", ["--steps", "6", "--batch-size", "1", "--seq-len", "16", "--data", "synthetic",
                           "--prefix", str(tmp_path)]) == EXIT_OOM
    run = read_csv(tmp_path / "runs.csv")[-1]
    assert run["status"] == "oom"
    assert "out of memory at MICRO_BATCH=1 (BATCH_SIZE=1) after 2 steps" in run["message"]
    assert "one row does not fit; try SEQ_LEN=8, a smaller MODEL" in run["message"]
    assert "peak" not in run["message"]   # a CPU has no device-memory reading to quote
    assert len(read_csv(tmp_path / "results.csv")) == 2
    assert "error: baseline oom" in capsys.readouterr().err


def test_missing_bitsandbytes_is_skipped_not_faked(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    assert run_in_process("8bit", tmp_path) == EXIT_SKIPPED
    run = read_csv(tmp_path / "runs.csv")[-1]
    assert run["status"] == "skipped" and "bitsandbytes is not usable here" in run["message"]
    assert run["median_step_ms"] == "" and read_csv(tmp_path / "results.csv") == []


def test_no_compiler_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr("Utils.ladder.apply.shutil.which", lambda name: None)
    assert run_in_process("torch_compile", tmp_path) == EXIT_SKIPPED
    run = read_csv(tmp_path / "runs.csv")[-1]
    assert run["status"] == "skipped" and "needs a C++ compiler" in run["message"]


def test_same_seed_same_losses(tmp_path):
    losses = []
    for i, seed in enumerate(["5", "5", "6"]):
        prefix = tmp_path / str(i)
        assert main("baseline", ["--steps", "4", "--batch-size", "2", "--seq-len", "16", "--prefix", str(prefix),
                               "--data", "synthetic", "--seed", seed]) == 0
        losses.append([float(r["loss"]) for r in read_csv(prefix / "results.csv")])
    assert losses[0] == losses[1]
    assert losses[0] != losses[2]


def test_runs_record_how_to_repeat_them(tmp_path):
    assert run_in_process("baseline", tmp_path) == 0
    run = read_csv(tmp_path / "runs.csv")[-1]
    config = json.loads(run["config"])
    assert config["run"]["batch_size"] == 2 and config["run"]["seq_len"] == 16 and config["run"]["seed"] == 1337
    assert run["optimization"] == "baseline" and config["additions"] == []
    assert "--batch-size 2" in run["command"] and "--seq-len 16" in run["command"]
    assert run["torch_version"] == torch.__version__ and run["device"] == "cpu"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT], ids=lambda s: s.name)
def test_interruption_keeps_valid_files(tmp_path, suite_env, sig):
    # SIGHUP is a closed terminal or ssh session; SIGQUIT, Ctrl-\. Each ends the run recorded, exit 128 + its number.
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
    assert proc.returncode == 128 + sig, (tmp_path / "stderr").read_text()
    assert read_csv(prefix / "runs.csv")[0]["status"] == "interrupted"
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
    # A file a later schema wrote (one more column), met by this checkout: its rows are not rewritten.
    (lambda text: "".join(f"{line},{'later_column' if i == 0 else 1}\n" for i, line in enumerate(text.splitlines())),
     "was written by a newer version of the suite"),
])
def test_damaged_results_are_named_and_never_overwritten(tmp_path, suite_env, damage, why):
    assert run_in_process("baseline", tmp_path) == 0
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
    from Utils.ladder import apply

    class BackendCompilerFailed(RuntimeError):
        pass
    BackendCompilerFailed.__module__ = "torch._dynamo.exc"

    def broken(*a, **kw):
        raise BackendCompilerFailed("inductor raised CppCompileError: no such header")

    def compile_broken(b):
        b.step_model = broken

    monkeypatch.setitem(apply.APPLY, "torch_compile", compile_broken)
    assert run_in_process("torch_compile", tmp_path) == EXIT_SKIPPED
    run = read_csv(tmp_path / "runs.csv")[-1]
    assert run["status"] == "skipped"
    assert run["message"].startswith("torch.compile cannot compile here: BackendCompilerFailed: inductor raised")


def test_an_8bit_optimizer_that_cannot_be_built_is_skipped(tmp_path, monkeypatch):
    import bitsandbytes

    def refuse(*a, **kw):
        raise RuntimeError("no kernels for this device")

    monkeypatch.setattr(bitsandbytes.optim, "AdamW8bit", refuse)
    assert run_in_process("8bit", tmp_path) == EXIT_SKIPPED
    run = read_csv(tmp_path / "runs.csv")[-1]
    assert run["status"] == "skipped" and "AdamW8bit does not run on this device (no kernels" in run["message"]


def test_a_compiler_failure_keeps_the_first_line_of_its_cause_and_the_whole_error_in_a_log(tmp_path, monkeypatch):
    # torch.compile wraps the real error: its own message starts "backend='inductor' raised:", which says
    # nothing; the cause's first line must reach the record.
    from Utils.ladder import apply

    class BackendCompilerFailed(RuntimeError):
        def __init__(self, inner):
            super().__init__(f"backend='inductor' raised:\n{type(inner).__name__}: {inner}")
            self.inner_exception = inner
    BackendCompilerFailed.__module__ = "torch._dynamo.exc"

    def broken(*a, **kw):
        raise BackendCompilerFailed(OSError("\nC++ compile error: fatal error: Python.h: No such file\nline two"))

    monkeypatch.setitem(apply.APPLY, "torch_compile", lambda b: setattr(b, "step_model", broken))
    assert run_in_process("torch_compile", tmp_path) == EXIT_SKIPPED
    run = read_csv(tmp_path / "runs.csv")[-1]
    assert run["message"].startswith("torch.compile cannot compile here: OSError: C++ compile error: fatal error: "
                                     "Python.h: No such file (the whole error: ")
    log = tmp_path / f"{run['run_id']}.error.log"
    assert str(log) in run["message"] and "line two" in log.read_text() and "Traceback" in log.read_text()


def test_running_out_of_host_memory_is_oom(tmp_path, monkeypatch):
    def forward(self, *a, **kw):
        # what PyTorch's CPU allocator raises (c10/core/impl/alloc_cpu.cpp)
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 68719476736 bytes. "
                           "Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(model_module.GPT, "forward", forward)
    assert run_in_process("baseline", tmp_path) == EXIT_OOM
    run = read_csv(tmp_path / "runs.csv")[-1]
    # auto took the whole batch (2 rows), ran out, and started again at 1, which ran out too
    assert run["status"] == "oom" and run["message"].startswith(
        "out of memory at MICRO_BATCH=1 (BATCH_SIZE=2) after 0 steps, the run having run out at 2 before "
        "(MICRO_BATCH=auto chose 2): one row does not fit; try SEQ_LEN=")


@pytest.mark.parametrize("target", ["clean", "reset"])
def test_clean_and_reset_say_why_they_cannot(tmp_path, suite_env, target):
    blocker = tmp_path / "a_file"
    blocker.write_text("keep me")
    r = make([target, f"PREFIX={blocker}"], suite_env)
    assert r.returncode != 0 and f"PREFIX={blocker} is not a folder" in r.stderr
    # A folder whose files cannot be removed (root removes anything, so rm itself refuses here).
    prefix = tmp_path / "out"
    prefix.mkdir()
    (prefix / "summary.md").write_text("kept")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "rm").write_text("#!/bin/sh\necho \"rm: cannot remove 'summary.md': Read-only file system\" >&2\nexit 1\n")
    (bin_dir / "rm").chmod(0o755)
    env = dict(suite_env, PATH=f"{bin_dir}:{suite_env['PATH']}")
    r = make([target, f"PREFIX={prefix}"], env)
    assert r.returncode != 0 and "Read-only file system" in r.stderr
    assert f"error: cannot remove the suite's files in PREFIX={prefix}" in r.stderr
    assert (prefix / "summary.md").read_text() == "kept"
    missing = make([target, f"PREFIX={tmp_path / 'nowhere'}"], suite_env)
    assert missing.returncode == 0 and "does not exist: nothing to remove" in missing.stdout


def test_a_prefix_with_a_dollar_sign_is_used_exactly_as_written(tmp_path, suite_env):
    prefix = tmp_path / "runs $5 $(HOME) it's"
    r = make(["baseline", "STEPS=2", "BATCH_SIZE=1", "SEQ_LEN=16", "DATA=synthetic", f"PREFIX={prefix}"],
             suite_env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert len(read_csv(prefix / "runs.csv")) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [prefix.name]


def test_a_prefix_that_is_not_utf8_is_refused_before_anything(tmp_path, suite_env):
    prefix = os.fsencode(tmp_path) + b"/runs-\xff"
    r = subprocess.run([sys.executable.encode(), b"no_optimization.py", b"--steps", b"2", b"--prefix", prefix]
                       + [a.encode() for a in TINY], cwd=REPO, env=suite_env, capture_output=True, timeout=300)
    err = r.stderr.decode()
    assert r.returncode == 2 and err.count("\n") == 1 and "holds bytes that are not UTF-8" in err
    assert not os.path.exists(prefix)


@pytest.mark.parametrize("content,why", [
    (bytes(range(256)) * 64, "is not a UTF-8 text file"),
    (b"To be\x00or not\n" * 50, "holds NUL bytes"),    # valid UTF-8, which a binary file can be
])
def test_a_binary_data_file_is_refused_naming_it(tmp_path, capsys, content, why):
    binary = tmp_path / "model.bin"
    binary.write_bytes(content)
    assert main("baseline", ["--steps", "2", "--batch-size", "1", "--seq-len", "16", "--data", str(binary),
                             "--prefix", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"DATA={binary} {why}" in err[0]
    assert not (tmp_path / "out" / "runs.csv").exists()


@pytest.mark.parametrize("seed", ["18446744073709551616", "-1", "1e3"])
def test_a_seed_out_of_range_is_one_line(tmp_path, capsys, seed):
    assert main("baseline", ["--steps", "2", "--batch-size", "1", "--seed", seed, "--prefix", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "from 0 to 18446744073709551615" in err


def test_a_write_that_fails_halfway_leaves_both_files_as_they_were(tmp_path, suite_env):
    # ulimit -f: results.csv's new rows fit, runs.csv's do not; step rows must never land without their run.
    import resource
    assert run_in_process("baseline", tmp_path) == 0
    runs = (tmp_path / "runs.csv").read_text().splitlines()
    (tmp_path / "runs.csv").write_text("\n".join(runs + [runs[1].replace(runs[1][:8], f"{i:08d}", 1)
                                                         for i in range(200)]) + "\n")
    before = {name: (tmp_path / name).read_bytes() for name in ("results.csv", "runs.csv")}
    limit = len(before["runs.csv"]) - 100

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    r = subprocess.run([sys.executable, "no_optimization.py", "--steps", "3", "--prefix", str(tmp_path)] + TINY,
                       cwd=REPO, env=suite_env, capture_output=True, text=True, timeout=300, preexec_fn=small_files)
    assert r.returncode == 2 and "results not written" in r.stderr and "File too large" in r.stderr
    assert {name: (tmp_path / name).read_bytes() for name in before} == before
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]


def test_a_temporary_file_left_by_a_killed_write_is_removed_saying_so(tmp_path, capsys):
    (tmp_path / ".tmp-gpt-suite-abc123.csv").write_text("run_id,optimiz")   # what kill -9 mid-write leaves
    assert run_in_process("baseline", tmp_path) == 0
    assert not (tmp_path / ".tmp-gpt-suite-abc123.csv").exists()
    assert f"note: removed {tmp_path / '.tmp-gpt-suite-abc123.csv'}, left by a write that was killed" in capsys.readouterr().err
    assert len(read_csv(tmp_path / "runs.csv")) == 1


def test_a_results_file_that_is_a_link_is_written_through_the_link(tmp_path):
    elsewhere = tmp_path / "kept" / "results.csv"
    elsewhere.parent.mkdir()
    prefix = tmp_path / "out"
    assert run_in_process("baseline", prefix) == 0
    os.replace(prefix / "results.csv", elsewhere)
    (prefix / "results.csv").symlink_to(elsewhere)
    assert run_in_process("baseline", prefix) == 0
    assert (prefix / "results.csv").is_symlink()
    assert len(read_csv(elsewhere)) == 8 and len(read_csv(prefix / "runs.csv")) == 2


def test_a_reader_gone_before_the_driver_writes_ends_it_quietly(tmp_path):
    # `make all ... --dry-run | head -1`: the pipe's reader has gone before the driver's lines, as a shell's tools end
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "Utils.suite", "all", "STEPS=3", "BATCH_SIZE=2",
                               f"PREFIX={tmp_path / 'out'}", "--dry-run"], cwd=REPO, env=clean_env(),
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert done.returncode == 128 + signal.SIGPIPE and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()
