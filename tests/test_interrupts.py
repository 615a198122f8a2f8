"""Ctrl-C, SIGTERM, SIGHUP and SIGQUIT at any moment: one line, status interrupted, every finished step kept."""
import contextlib
import os
import signal
import subprocess
import sys
import time
import types

import pytest

from Utils.results.schema import RUN_COLUMNS, STEP_COLUMNS
from Utils.results.store import check_file
from Utils.train import run as run_module
from Utils.train.interrupts import EXIT_INTERRUPTED
from Utils.train.run import main

from conftest import REPO_ROOT, read_csv

TINY = ["--batch-size", "2", "--seq-len", "16", "--data", "synthetic"]


def _interrupt_self():
    os.kill(os.getpid(), signal.SIGINT)


def _assert_interrupted_with_every_step(prefix, steps):
    check_file(prefix / "results.csv", STEP_COLUMNS)
    check_file(prefix / "runs.csv", RUN_COLUMNS)
    (run,) = read_csv(prefix / "runs.csv")
    assert run["status"] == "interrupted"
    assert len(read_csv(prefix / "results.csv")) == steps
    assert f"interrupted after {steps} of {steps} steps" in run["message"]


def test_a_signal_just_after_the_last_step_keeps_every_step(tmp_path, monkeypatch):
    real_train = run_module.train

    def train_then_signal(*args):
        profiled = real_train(*args)
        _interrupt_self()   # arrives as train returns: before the run is recorded
        return profiled

    monkeypatch.setattr(run_module, "train", train_then_signal)
    assert main("baseline", ["--steps", "3", "--prefix", str(tmp_path)] + TINY) == EXIT_INTERRUPTED
    _assert_interrupted_with_every_step(tmp_path, 3)


def test_signals_during_the_shutdown_change_nothing_but_the_status(tmp_path, monkeypatch, capsys):
    # One signal while the run's memory is released, another while it is summarized: neither may break
    # the shutdown (a traceback there loses the run's rows).
    monkeypatch.setattr(run_module, "gc", types.SimpleNamespace(collect=_interrupt_self))
    real_figures = run_module.add_run_figures

    def add_run_figures(*args):
        _interrupt_self()
        return real_figures(*args)

    monkeypatch.setattr(run_module, "add_run_figures", add_run_figures)
    assert main("baseline", ["--steps", "3", "--prefix", str(tmp_path)] + TINY) == EXIT_INTERRUPTED
    _assert_interrupted_with_every_step(tmp_path, 3)
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("error: baseline interrupted")


def test_a_second_signal_while_the_first_is_handled_is_only_noted(tmp_path, monkeypatch):
    real_train = run_module.train

    def train_interrupted_twice(*args):
        real_train(*args)
        _interrupt_self()
        raise AssertionError("the first signal must stop the run where it is")

    monkeypatch.setattr(run_module, "train", train_interrupted_twice)
    monkeypatch.setattr(run_module, "gc", types.SimpleNamespace(collect=_interrupt_self))
    assert main("baseline", ["--steps", "2", "--prefix", str(tmp_path)] + TINY) == EXIT_INTERRUPTED
    _assert_interrupted_with_every_step(tmp_path, 2)


def test_a_signal_while_the_script_starts_is_one_line(tmp_path, suite_env):
    # torch takes seconds to import: a Ctrl-C then must end the program with one line, not a traceback.
    proc = subprocess.Popen([sys.executable, "no_optimization.py", "--steps", "2", "--prefix", str(tmp_path)] + TINY,
                            cwd=REPO_ROOT, env=suite_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_INTERRUPTED, err
    assert err.splitlines() == ["error: interrupted before the run started; nothing was recorded"]
    assert not (tmp_path / "runs.csv").exists()


# A terminal's signal to the whole group reaches the run with the driver's SIGTERM just behind it; the second's
# handler may run inside the first's, at its write: it is held there.
SECOND_SIGNAL_INSIDE_THE_FIRST = """
import os, signal
from Utils.train import interrupts
write = os.write
def write_after_the_second(fd, data):
    os.write = write
    interrupts._exit_at_once(signal.SIGTERM, None)
    return write(fd, data)
interrupts.exit_on_signal()
os.write = write_after_the_second
os.kill(os.getpid(), signal.SIGINT)
"""


def test_a_second_signal_before_the_run_starts_adds_no_line():
    done = subprocess.run([sys.executable, "-c", SECOND_SIGNAL_INSIDE_THE_FIRST], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60)
    assert (done.returncode, done.stderr) == (128 + signal.SIGINT,
                                              "error: interrupted before the run started; nothing was recorded\n")


def test_sigterm_to_make_returns_only_once_the_run_is_recorded(tmp_path, suite_env):
    # make passes SIGTERM to the shell it started: were that shell to die at once, make would return while
    # the run went on training (or writing) in the background.
    prefix = tmp_path / "out"
    proc = subprocess.Popen(["make", "--no-print-directory", f"PYTHON={sys.executable}", "baseline", "STEPS=100000",
                             "BATCH_SIZE=2", "SEQ_LEN=16", "DATA=synthetic", f"PREFIX={prefix}"], cwd=REPO_ROOT,
                            env=suite_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        for line in proc.stdout:
            if line.startswith("step 3/"):
                break
        proc.send_signal(signal.SIGTERM)   # make alone, as a scheduler or `kill PID` would
        proc.communicate(timeout=120)
        (run,) = read_csv(prefix / "runs.csv")   # written before make returned
        assert run["status"] == "interrupted" and proc.returncode != 0
        assert len(read_csv(prefix / "results.csv")) >= 3
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def test_steps_waiting_to_be_read_back_are_kept_when_a_signal_stops_the_run(tmp_path, monkeypatch):
    # With sync_every the host reads steps back in groups: the finished steps of an unread group count too.
    from Utils.train import loop
    monkeypatch.setattr("Utils.ladder.apply.SYNC_EVERY", 5)
    real_inputs_targets, calls = loop.inputs_targets, []

    def inputs_targets(*args):
        calls.append(1)
        if len(calls) == 4:   # step 3 begins: steps 0-2 have finished, none read back yet
            _interrupt_self()
        return real_inputs_targets(*args)

    monkeypatch.setattr(loop, "inputs_targets", inputs_targets)
    assert main(["sync_every"], ["--steps", "7", "--prefix", str(tmp_path)] + TINY) == EXIT_INTERRUPTED
    (run,) = read_csv(tmp_path / "runs.csv")
    assert [r["step"] for r in read_csv(tmp_path / "results.csv")] == ["0", "1", "2"]
    assert run["status"] == "interrupted" and "interrupted after 3 of 7 steps" in run["message"]


def test_a_signal_after_the_run_is_recorded_changes_nothing(tmp_path, suite_env):
    # What a script runs (launch), then a signal once main has returned: the run stands as recorded.
    code = ("import os, signal, sys, time\n"
            "from Utils.train.launch import launch\n"
            f"rc = launch('baseline', {['--steps', '2', '--prefix', str(tmp_path)] + TINY!r})\n"
            "os.kill(os.getpid(), signal.SIGINT)\n"
            "time.sleep(0.2)\n"
            "print('exit', rc)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=suite_env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "exit 0", r.stderr
    assert "nothing was recorded" not in r.stderr
    assert read_csv(tmp_path / "runs.csv")[0]["status"] == "ok"


def _make_in_own_group(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(["make", "--no-print-directory", f"PYTHON={sys.executable}", *args], cwd=REPO_ROOT,
                            env=dict(env, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGQUIT, signal.SIGINT], ids=lambda s: s.name)
def test_a_terminal_signal_to_the_whole_group_records_the_run_and_the_driver_names_it(tmp_path, suite_env, sig):
    # A closed terminal (SIGHUP), Ctrl-\ (SIGQUIT) or Ctrl-C reaches make, the driver and the run at once.
    prefix = tmp_path / "out"
    proc = _make_in_own_group(["baseline", "STEPS=100000", "BATCH_SIZE=2", "SEQ_LEN=16", "DATA=synthetic",
                               f"PREFIX={prefix}"], suite_env)
    try:
        for line in proc.stdout:
            if line.startswith("step 3/"):
                break
        os.killpg(proc.pid, sig)
        err = proc.communicate(timeout=120)[1]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    (run,) = read_csv(prefix / "runs.csv")
    assert run["status"] == "interrupted" and len(read_csv(prefix / "results.csv")) >= 3
    assert f"error: run baseline stopped by {sig.name}" in err.splitlines(), err
    assert "Traceback" not in err


def test_ctrl_c_while_the_charts_draw_is_one_line(tmp_path, suite_env):
    # plots draws for a second or two from a folder of runs: Ctrl-C then ends it with one line, no traceback.
    prefix = tmp_path / "out"
    made = subprocess.run(["make", "--no-print-directory", f"PYTHON={sys.executable}", "baseline", "STEPS=3",
                           "BATCH_SIZE=2", "SEQ_LEN=16", "DATA=synthetic", f"PREFIX={prefix}", "REPEAT=2"],
                          cwd=REPO_ROOT, env=suite_env, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    proc = _make_in_own_group(["plots", f"PREFIX={prefix}"], suite_env)
    for line in proc.stdout:   # the driver prints the chart's command as it starts it
        if "plot_results.py" in line:
            break
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)
    err = proc.communicate(timeout=120)[1]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.splitlines()[0] == "error: plots stopped by SIGINT", err
