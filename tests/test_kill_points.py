"""Kill points across a run's whole life: SIGINT, SIGTERM, SIGHUP, SIGQUIT and SIGKILL at seeded random moments of
a rung (what `make baseline` runs), of `make plots` and of `make all`, each followed by the same property: the
results folder holds whole runs only.

One unkilled life of a rung and of the charts is timed first; a rung's stdout lines are its phase markers (the
driver's command line, the run's start line, each step, the summary line that follows the append). A kill point is
a fraction of that life, drawn from a seeded RNG, one in each of n equal slices so that the points spread over all
of it; at run time it becomes "this marker, then this many seconds", so that a slower machine still stops the
target in the same phase. The phase it landed in is read off the process tree at the kill (which child ran) and
the lines seen so far, and printed (pytest -rP shows it). KILL_POINTS_SEED=n draws other points.

The signals come as they do in use: SIGTERM to the driver alone (a scheduler, `kill PID`); SIGINT, SIGHUP and
SIGQUIT to the whole process group (Ctrl-C, a closed terminal, Ctrl-\\); SIGKILL to whatever child runs at that
moment (the run, the charts, the check), the kernel's out-of-memory killer's way. The append itself lasts
milliseconds, which random points seldom hit: a child stopped inside it at each rename covers it.

After each kill: a stopping signal ends the driver with 128 + n, its one `error: ... stopped by SIG...` line last,
and no traceback; the folder reads with Utils.results.read.load, every step row's run has its runs.csv row and
every run its step rows (all of them, or, interrupted, the ones its message counts), the rows that were there
before are kept byte for byte, no temporary file or journal of an append is left (after SIGKILL: once the next
append has run), and the next append lands whole."""
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import pytest
from filelock import FileLock

from Utils.ladder.registry import RUNGS
from Utils.results.read import load
from Utils.results.schema import LOCK_FILE, RUNS_FILE, STEPS_FILE
from Utils.results.store import BACKUP_PREFIX, append_run
from Utils.results.files import TEMPORARY_PREFIX

from conftest import REPO_ROOT, clean_env

SEED = int(os.environ.get("KILL_POINTS_SEED", "57"))
STEPS = 20
RUN = ["BATCH_SIZE=2", "SEQ_LEN=16", "DATA=synthetic", f"STEPS={STEPS}"]
STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
FROM_A_TERMINAL = (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)   # sent to the whole process group
SIGNALS = (*STOPPING, signal.SIGKILL)
SCRIPTS = {r.script: name for name, r in RUNGS.items()}
# What an interrupted run says on stderr besides the driver's line: before it existed, or once it was recorded.
RUN_LINE = re.compile(r"error: (interrupted before the run started; nothing was recorded|"
                      r"\w+ interrupted: interrupted after \d+ of \d+ steps; the measured steps are kept)$")
INTERRUPTED = re.compile(r"interrupted after (\d+) of (\d+) steps")
# The stdout lines that mark a phase, the same in every life of a target (a line's key: what the match covers).
MARKER = re.compile(r"\S*python\S* \S+|=== all \w+ ===|step \d+/\d+|summary \| \w+|# Ladder results|\w+ \| ")
TIMEOUT_S = 180


def _points(n: int, rng: random.Random) -> list:
    """n kill points: (signal, fraction of its life), fraction i in [i/n, (i+1)/n), the signals dealt
    round so that each comes about equally often, in a drawn order."""
    fractions = [(i + rng.random()) / n for i in range(n)]
    signals = [SIGNALS[i % len(SIGNALS)] for i in range(n)]
    rng.shuffle(signals)
    return [pytest.param(sig, f, id=f"{sig.name}-at-{f:.2f}") for sig, f in zip(signals, fractions)]


_rng = random.Random(SEED)
RUNG_POINTS = _points(11, _rng)
PLOTS_POINTS = _points(5, _rng)
# make all: its start (the driver, the check of every run argument), its first rung, and the next rung starting after
# the first was killed with -9; the tail of the ladder (torch.compile on a CPU) repeats these phases at a minute's
# cost.
_ALL_SIGNALS = _rng.sample(STOPPING, 3)
ALL_POINTS = [pytest.param(anchor, sig, _rng.random(), id=f"{sig.name}-{label}")
              for (anchor, label), sig in zip([(None, "at-start"), ("=== all baseline ===", "in-baseline")],
                                              _ALL_SIGNALS)]
ALL_AFTER_KILL_9 = (_ALL_SIGNALS[2], _rng.random(), _rng.random())   # the signal; where -9 and it land


# --- one life of a target, its stdout timed ---------------------------------------------------------------------

class Life:
    """A target started in a session of its own (so that a signal can go to its whole group), its stdout lines
    timed as they come and its stderr kept in a file. Its clock starts when the driver takes the signals: what
    runs before it (the interpreter's own start-up, some 20 ms; under make, make reading the registry) cannot end
    in the driver's one line."""

    def __init__(self, argv: list[str], env: dict, stderr_path, prefix=None):
        self.stderr_path = stderr_path
        self.prefix = prefix
        self.lines: list[tuple[float, str]] = []   # (seconds since the start, line)
        self.ended = False
        self._seen = threading.Condition()
        self.t0 = time.monotonic()
        with open(stderr_path, "w") as stderr:
            self.proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr,
                                         text=True, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._driver_ready()

    def _driver_ready(self) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while self.proc.poll() is None and time.monotonic() < deadline:
            driver = next((p for p in _descendants(self.proc.pid) if "Utils.suite" in _argv(p)), None)
            if driver and _caught(driver) & (1 << (signal.SIGTERM - 1)):
                break
            time.sleep(0.002)
        with self._seen:
            shift, self.t0 = time.monotonic() - self.t0, time.monotonic()
            self.lines = [(t - shift, line) for t, line in self.lines]

    def _read(self):
        for line in self.proc.stdout:
            with self._seen:
                self.lines.append((time.monotonic() - self.t0, line.rstrip("\n")))
                self._seen.notify_all()
        with self._seen:
            self.ended = True
            self._seen.notify_all()

    def wait_for(self, pattern: str, after: int = 0) -> tuple[float, int]:
        """(when, index) of the first line from index `after` on that starts with `pattern` (a regex)."""
        deadline = time.monotonic() + TIMEOUT_S
        with self._seen:
            while True:
                for i in range(after, len(self.lines)):
                    if re.match(pattern, self.lines[i][1]):
                        return self.lines[i][0], i
                if self.ended or time.monotonic() > deadline:
                    raise AssertionError(f"no line {pattern!r} came; stdout:\n" + self.stdout()[-3000:])
                self._seen.wait(1)

    def sleep_until(self, t: float) -> None:
        time.sleep(max(0.0, t - (time.monotonic() - self.t0)))

    def stdout(self) -> str:
        with self._seen:
            return "\n".join(line for _, line in self.lines)

    def seen(self) -> list[str]:
        with self._seen:
            return [line for _, line in self.lines]

    def end(self) -> tuple[int, str]:
        """The exit status (-n: killed by signal n) and stderr, once the target has ended."""
        try:
            rc = self.proc.wait(timeout=TIMEOUT_S)
        finally:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)   # whatever of its group is left
            except ProcessLookupError:
                pass
            self.proc.wait()
        self._reader.join(10)
        with open(self.stderr_path) as f:
            return rc, f.read()


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process (/proc/PID/stat; /proc/PID/task/*/children is not on every kernel)."""
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    found[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return found


def _descendants(pid: int) -> list[int]:
    """pid and its descendants, parents first."""
    parents, found = _parents(), [pid]
    for p in found:
        found += sorted(c for c, parent in parents.items() if parent == p)
    return found


def _caught(pid: int) -> int:
    """The mask of the signals pid has handlers for (SigCgt)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1], 16) for line in f if line.startswith("SigCgt:")), 0)
    except OSError:
        return 0


def _deepest(pid: int) -> int:
    """The youngest descendant along the chain of children from pid (the driver's child, or pid itself)."""
    parents = _parents()
    while True:
        children = sorted(p for p, parent in parents.items() if parent == pid)
        if not children:
            return pid
        pid = children[-1]


def _argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _phase(argv: list[str], lines: list[str]) -> str:
    """Where a life was when it was stopped: by the process that ran (its argv) and the lines seen so far."""
    words = " ".join(argv)
    if "plot_results.py" in words:
        return "charts"
    if "Utils.train.cli" in words:
        return "checks"
    script = next((SCRIPTS[os.path.basename(a)] for a in argv if os.path.basename(a) in SCRIPTS), None)
    if script is None:
        return "driver: start-up" if not lines else "driver: between its children"
    mine = [line for line in lines if line.startswith((f"{script} | ", "step ", f"summary | {script}"))]
    mine = mine[max((i for i, line in enumerate(mine) if line.startswith(f"{script} | ")), default=0):]
    earlier = any(line.startswith(("summary | ", "=== all ")) and not line.startswith((f"summary | {script}",
                                                                                    f"=== all {script} "))
                  for line in lines)
    if not mine or not mine[0].startswith(f"{script} | "):
        return "next rung starting" if earlier else "run start-up: imports, checks, data"
    if any(line.startswith("summary | ") for line in mine):
        return "run recorded, exiting"
    steps = [line for line in mine if line.startswith("step ")]
    if not steps:
        return "model build, first step"
    done, total = map(int, re.match(r"step (\d+)/(\d+)", steps[-1]).groups())
    return "last step to record: summary, append" if done == total else "training steps"


@dataclass
class Kill:
    sig: signal.Signals
    phase: str


def _kill(life: Life, sig: signal.Signals, child_only: bool = False) -> Kill:
    """Send sig as it comes in use (see the module's docstring) and say where the life was ("after the end" where
    it had ended: nothing is sent). child_only: SIGKILL waits for the driver's child to exist (the driver starts
    the next one just after its line)."""
    if life.proc.poll() is not None:
        return Kill(sig, "after the end")
    target = _deepest(life.proc.pid)
    deadline = time.monotonic() + 10
    while child_only and "Utils.suite" in _argv(target) and time.monotonic() < deadline:
        time.sleep(0.01)
        target = _deepest(life.proc.pid)
    phase = _phase(_argv(target), life.seen())
    if phase == "charts" and life.prefix is not None:
        drawing = any(n.startswith(TEMPORARY_PREFIX) for n in os.listdir(life.prefix))
        phase = "charts: writing one" if drawing else "charts: reading the results, drawing"
    if sig == signal.SIGKILL:
        os.kill(target, sig)
    elif sig in FROM_A_TERMINAL:
        os.killpg(life.proc.pid, sig)
    else:
        os.kill(life.proc.pid, sig)
    return Kill(sig, phase)


# --- what every kill must leave -----------------------------------------------------------------------------

def whole_runs(prefix) -> list[str]:
    """The run ids PREFIX records, read with the project's reader, once each run is proven whole: its step rows
    numbered from 0, all of its steps where it is ok, the steps its message counts where it was interrupted; and
    no step row without its run."""
    if not os.path.exists(prefix / STEPS_FILE) and not os.path.exists(prefix / RUNS_FILE):
        return []
    steps, runs = load(prefix)
    assert runs["run_id"].is_unique, list(runs["run_id"])
    orphans = sorted(set(steps["run_id"]) - set(runs["run_id"]))
    assert not orphans, f"step rows without their run in runs.csv: {orphans}"
    for run in runs.itertuples():
        mine = steps[steps["run_id"] == run.run_id]
        assert list(mine["step"]) == list(range(len(mine))), (run.run_id, list(mine["step"]))
        if run.status == "ok":
            assert len(mine) == run.steps, (run.run_id, len(mine), run.steps)
        else:
            assert run.status == "interrupted", (run.run_id, run.status, run.message)
            counted = INTERRUPTED.search(run.message)
            assert counted and (int(counted[1]), int(counted[2])) == (len(mine), run.steps), (run.message, len(mine))
    return list(runs["run_id"])


def leftovers(prefix) -> list[str]:
    """What a write left in PREFIX: any hidden file but the lock (.tmp-*, .before-append-*, .write-test-*)."""
    return sorted(n for n in os.listdir(prefix) if n.startswith(".") and n != LOCK_FILE)


def _next_append(prefix, name: str) -> None:
    """The next run's append into PREFIX, two steps: it lands whole, after whatever the kill left."""
    before = whole_runs(prefix) if not [n for n in leftovers(prefix) if n.startswith(BACKUP_PREFIX)] else None
    append_run(prefix, {"run_id": name, "optimization": "baseline", "status": "ok", "message": "", "steps": 2},
               [{"run_id": name, "optimization": "baseline", "step": k, "warmup": k == 0, "step_ms": 10.0,
                 "tokens_per_s": 100.0, "loss": 5.0} for k in range(2)])
    after = whole_runs(prefix)
    assert after[-1] == name and (before is None or after == before + [name]), (before, after)


def assert_whole(prefix, kill: Kill, kept: dict[str, bytes] | None = None) -> list[str]:
    """The property, after a kill: whole runs, the old rows kept, nothing temporary left (after SIGKILL: once the
    next append has finished or undone what it cut), and the next append whole. The runs recorded, before that
    append."""
    if not os.path.isdir(prefix):   # stopped before the run made its folder
        os.makedirs(prefix)
    if kill.sig == signal.SIGKILL:
        # kill -9 may cut a write: the next append removes its temporary CSV, and finishes or undoes a cut append
        _next_append(prefix, f"next-after-{kill.sig.name}")
        runs = whole_runs(prefix)[:-1]
        # A chart cut by kill -9 leaves its temporary PNG: nothing in PREFIX's lock removes a chart's (known).
        left = [n for n in leftovers(prefix) if not (kill.phase.startswith("charts") and
                                                     n.startswith(TEMPORARY_PREFIX) and n.endswith((".png", ".md")))]
        assert left == [], left
    else:
        runs = whole_runs(prefix)
        assert leftovers(prefix) == [], leftovers(prefix)
        _next_append(prefix, f"next-after-{kill.sig.name}")
    for name, old in (kept or {}).items():
        assert (prefix / name).read_bytes().startswith(old), f"{name}'s earlier rows were changed"
    return runs


def assert_stopped(rc: int, err: str, what: str, sig: signal.Signals, through_make: bool = False) -> None:
    """A stopping signal: exit 128 + n, the driver's one line, last, and at most the run's own besides; no
    traceback. make, stopped by the signal too, ends by it, or with 1 on SIGQUIT (GNU make exits rather than dump
    core)."""
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert rc == 128 + sig or (through_make and rc == (1 if sig == signal.SIGQUIT else -sig)), (rc, err)
    lines = [line for line in err.splitlines() if not (through_make and line.startswith("make: "))]
    assert [line for line in lines if "stopped by" in line] == [f"error: {what} stopped by {sig.name}"], err
    assert lines[-1] == f"error: {what} stopped by {sig.name}", err
    others = [line for line in lines[:-1] if line.startswith("error:")]
    assert len(others) <= 1 and all(RUN_LINE.match(line) for line in others), err


def _report(point: str, kill: Kill, runs: list[str] | None = None) -> None:
    print(f"kill point {point}: {kill.sig.name} in phase {kill.phase!r}" + (f", {len(runs)} runs" if runs else ""))


# --- one unkilled life of each target, shared by the xdist workers ---------------------------------------------

def _env(suite_env) -> dict:
    # One thread per run: two workers' runs share the CI machine's two cores without thrashing.
    return dict(suite_env, OMP_NUM_THREADS="1")


def _driver(*args: str) -> list[str]:
    return [sys.executable, "-m", "Utils.suite", *args, f"PYTHON={sys.executable}"]


def _measure(folder, env) -> dict:
    ref = folder / "ref"
    life = Life(_driver("run", "baseline", *RUN, f"PREFIX={ref}"), env, folder / "run.err")
    rc, err = life.end()
    assert rc == 0, err
    run = {"markers": _markers(life.lines), "end": time.monotonic() - life.t0}
    plots = Life(_driver("plots", f"PREFIX={ref}"), env, folder / "plots.err")
    rc, err = plots.end()
    assert rc == 0 and leftovers(ref) == [], err
    return {"run": run, "plots_end": time.monotonic() - plots.t0, "ref": str(ref)}


def _markers(lines) -> list[tuple[float, str]]:
    """The first (time, key) of each marker line."""
    found = {}
    for t, line in lines:
        m = MARKER.match(line)
        if m and m.group(0) not in found:
            found[m.group(0)] = t
    return sorted((t, key) for key, t in found.items())


@pytest.fixture(scope="session")
def lives(tmp_path_factory, suite_env):
    """One unkilled life of a rung (the driver's `run baseline`) and of `plots`: the rung's markers, both lengths,
    and the folder they wrote (one ok run, its charts); measured once for all the xdist workers."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent   # the session's folder, which every worker's lies in
    with FileLock(str(shared / "kill-points.lock")):
        found = shared / "kill-points" / "lives.json"
        if not found.exists():
            found.parent.mkdir(exist_ok=True)
            measured = _measure(found.parent, _env(suite_env))
            found.write_text(json.dumps(measured))
        return json.loads(found.read_text())


def _anchor(markers, t: float) -> tuple[str | None, float]:
    """A moment `t` seconds into the timed life as (the last marker before it, seconds after that marker)."""
    before = [(mt, key) for mt, key in markers if mt <= t]
    if not before:
        return None, t
    mt, key = before[-1]
    return key, t - mt


def _copy(ref, prefix):
    """PREFIX with ref's results (no summary.md: a run then draws no charts); their bytes."""
    prefix.mkdir()
    for name in (STEPS_FILE, RUNS_FILE):
        shutil.copyfile(os.path.join(ref, name), prefix / name)
    return {name: (prefix / name).read_bytes() for name in (STEPS_FILE, RUNS_FILE)}


def _stop_at(life: Life, anchor: str | None, delay: float, sig: signal.Signals, child_only: bool = False) -> Kill:
    """sig, `delay` seconds after the first line that starts with `anchor` (None: after the start)."""
    start = life.wait_for(re.escape(anchor))[0] if anchor else 0.0
    life.sleep_until(start + delay)
    return _kill(life, sig, child_only)


# --- the kill points ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sig,fraction", RUNG_POINTS)
def test_a_rung_killed_anywhere_leaves_whole_runs(tmp_path, suite_env, lives, sig, fraction):
    # make baseline into a folder that holds a run: the driver, the run's imports and checks, its steps, its append,
    # its exit. (The charts it draws after that where PREFIX holds a summary.md: test_make_plots_...)
    prefix = tmp_path / "out"
    kept = _copy(lives["ref"], prefix)
    anchor, delay = _anchor(lives["run"]["markers"], fraction * lives["run"]["end"])
    life = Life(_driver("run", "baseline", *RUN, f"PREFIX={prefix}"), _env(suite_env), tmp_path / "err", prefix)
    kill = _stop_at(life, anchor, delay, sig)
    rc, err = life.end()
    if kill.phase == "after the end":   # a quicker life than the timed one
        assert rc == 0, err
    elif sig == signal.SIGKILL:
        assert rc in (128 + sig, -sig) and "Traceback" not in err, (rc, err)   # the child's, or the driver's
    else:
        assert_stopped(rc, err, "run baseline", sig)
    runs = assert_whole(prefix, kill, kept)
    assert len(runs) in (1, 2)
    _report(f"rung {sig.name} at {fraction:.2f} of the life ({anchor or 'start'} + {delay:.2f} s)", kill, runs)


@pytest.mark.parametrize("sig,fraction", PLOTS_POINTS)
def test_make_plots_killed_anywhere_leaves_the_folder_as_it_was(tmp_path, suite_env, lives, sig, fraction):
    prefix = tmp_path / "out"
    kept = _copy(lives["ref"], prefix)
    life = Life(_driver("plots", f"PREFIX={prefix}"), _env(suite_env), tmp_path / "err", prefix)
    kill = _stop_at(life, None, fraction * lives["plots_end"], sig)
    rc, err = life.end()
    if kill.phase == "after the end":
        assert rc == 0, err
    elif sig == signal.SIGKILL:
        assert rc in (128 + sig, -sig) and "Traceback" not in err, (rc, err)
    else:
        assert_stopped(rc, err, "plots", sig)
    for name, old in kept.items():
        assert (prefix / name).read_bytes() == old   # the charts read the results; they never write them
    assert_whole(prefix, kill)
    _report(f"plots {sig.name} at {fraction:.2f} of the life", kill)


def _make_all(prefix, env, stderr_path) -> Life:
    return Life(["make", "--no-print-directory", f"PYTHON={sys.executable}", "all", *RUN, f"PREFIX={prefix}"], env,
                stderr_path, prefix)


@pytest.mark.parametrize("anchor,sig,fraction", ALL_POINTS)
def test_make_all_stopped_in_its_first_rung_leaves_whole_runs(tmp_path, suite_env, lives, anchor, sig, fraction):
    prefix = tmp_path / "out"   # a folder that does not exist yet
    markers = dict((key, t) for t, key in lives["run"]["markers"])
    # Its start (the driver, then the check) takes about a run's start-up; its first rung, up to its summary line.
    span = markers["summary | baseline"] if anchor else markers["baseline | "]
    life = _make_all(prefix, _env(suite_env), tmp_path / "err")
    kill = _stop_at(life, anchor, fraction * span, sig)
    rc, err = life.end()
    assert_stopped(rc, err, "all", sig, through_make=True)
    runs = assert_whole(prefix, kill)
    _report(f"make all {sig.name} {anchor or 'start'} + {fraction * span:.2f} s", kill, runs)


def test_make_all_goes_on_after_kill_9_of_a_run_and_stops_as_the_next_starts(tmp_path, suite_env, lives):
    # The run's process killed with -9 (the out-of-memory killer, say) somewhere in its life: the driver goes on
    # with the next rung; a stopping signal as that one starts.
    sig, at_kill, at_stop = ALL_AFTER_KILL_9
    markers = dict((key, t) for t, key in lives["run"]["markers"])
    prefix = tmp_path / "out"
    life = _make_all(prefix, _env(suite_env), tmp_path / "err")
    killed = _stop_at(life, "=== all baseline ===", at_kill * markers["summary | baseline"], signal.SIGKILL,
                      child_only=True)
    assert not killed.phase.startswith(("checks", "charts", "driver")), killed
    stopped = _stop_at(life, "=== all tf32 ===", at_stop * markers["baseline | "], sig)
    rc, err = life.end()
    assert_stopped(rc, err, "all", sig, through_make=True)
    runs = assert_whole(prefix, killed)
    recorded = load(prefix)[1].set_index("run_id").loc[runs]   # without the next append's
    status = dict(zip(recorded["optimization"], recorded["status"]))
    assert status.get("baseline") in (None, "ok") and status.get("tf32") in (None, "interrupted"), status
    _report(f"make all SIGKILL baseline + {at_kill * markers['summary | baseline']:.2f} s", killed, runs)
    _report(f"make all, then {sig.name} as tf32 starts + {at_stop * markers['baseline | ']:.2f} s", stopped)


# The driver's own start-up lasts some 50 ms, which random points seldom hit: a driver held inside its imports.
HELD_IN_ITS_IMPORTS = """
import runpy, sys, time
def hold(event, args):
    if event == "import" and args[0] == "Utils.ladder.__main__":
        print("importing", flush=True)
        time.sleep(60)
sys.addaudithook(hold)
sys.argv = ["Utils.suite", *sys.argv[1:]]
runpy.run_module("Utils.suite", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("sig", STOPPING, ids=lambda s: s.name)
def test_a_signal_while_the_driver_imports_is_its_one_line(tmp_path, suite_env, sig):
    proc = subprocess.Popen([sys.executable, "-c", HELD_IN_ITS_IMPORTS, "run", "baseline", *RUN,
                             f"PREFIX={tmp_path / 'out'}", f"PYTHON={sys.executable}"], cwd=REPO_ROOT,
                            env=dict(suite_env, PYTHONPATH=REPO_ROOT), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "importing\n"
        proc.send_signal(sig)
        err = proc.communicate(timeout=60)[1]
    finally:
        proc.kill()
        proc.wait()
    assert (proc.returncode, err) == (128 + sig, f"error: run baseline stopped by {sig.name}\n")
    assert not os.path.exists(tmp_path / "out")


# Shutting the interpreter down gives the signals their default action back: one that came then ended the driver by
# the signal, without its line. The driver holds them once main has returned; this one comes just as it does.
AS_THE_DRIVER_ENDS = """
import os, runpy, signal, sys
hold, sig = signal.pthread_sigmask, signal.Signals[sys.argv[1]]
def held(how, mask):
    old = hold(how, mask)
    if how == signal.SIG_BLOCK and sig in mask:
        os.kill(os.getpid(), sig)
    return old
signal.pthread_sigmask = held
sys.argv = ["Utils.suite", *sys.argv[2:]]
runpy.run_module("Utils.suite", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("sig", STOPPING, ids=lambda s: s.name)
def test_a_signal_as_the_driver_ends_is_its_one_line(sig):
    done = subprocess.run([sys.executable, "-c", AS_THE_DRIVER_ENDS, sig.name, "additions"], cwd=REPO_ROOT,
                          env=dict(clean_env(), PYTHONPATH=REPO_ROOT), capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() and (done.returncode, done.stderr) == (128 + sig, f"error: additions stopped by "
                                                                                 f"{sig.name}\n")


# --- inside the append: a child stopped at each rename ---------------------------------------------------------

APPEND_CHILD = """
import json, os, signal, sys
from Utils.results import store
prefix, sig, at, run, steps = json.loads(sys.argv[1])
# A handler that ends the process at once: were the signal not held back, the append would be cut where it came.
for s in store.STOPPING:
    signal.signal(s, lambda signum, frame: os._exit(128 + signum))
stage, replace, calls = store._stage, os.replace, {"stage": 0, "rename": 0}
def staged(*args):
    tmp = stage(*args)
    calls["stage"] += 1
    if at == "both files staged" and calls["stage"] == 2:
        os.kill(os.getpid(), sig)
    return tmp
def renamed(src, dst):
    replace(src, dst)
    calls["rename"] += 1
    if calls["rename"] == {"first rename": 1, "second rename": 2}.get(at):
        os.kill(os.getpid(), sig)
store._stage, store.os.replace = staged, renamed
store.append_run(prefix, run, steps)
"""


def _one_run(prefix) -> dict[str, bytes]:
    """PREFIX with one run appended (in this process); the files' bytes."""
    prefix.mkdir()
    _next_append(prefix, "first")
    return {name: (prefix / name).read_bytes() for name in (STEPS_FILE, RUNS_FILE)}


def _append_killed(prefix, sig: signal.Signals, at: str) -> subprocess.CompletedProcess:
    """A run's append into prefix (one ok run of 3 steps, run id 'cut'), with sig sent to itself at `at`."""
    run = {"run_id": "cut", "optimization": "baseline", "status": "ok", "message": "", "steps": 3}
    steps = [{"run_id": "cut", "optimization": "baseline", "step": k, "warmup": k == 0, "step_ms": 10.0,
              "tokens_per_s": 100.0, "loss": 5.0} for k in range(3)]
    return subprocess.run([sys.executable, "-c", APPEND_CHILD, json.dumps([str(prefix), sig, at, run, steps])],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("sig,at", [(s, "first rename") for s in STOPPING] + [
    (signal.SIGKILL, "both files staged"), (signal.SIGKILL, "first rename"), (signal.SIGKILL, "second rename")],
    ids=lambda v: v.name if isinstance(v, signal.Signals) else v.replace(" ", "-"))
def test_a_signal_inside_the_append_leaves_whole_runs(tmp_path, sig, at):
    prefix = tmp_path / "out"
    kept = _one_run(prefix)
    child = _append_killed(prefix, sig, at)
    assert child.returncode == (-sig if sig == signal.SIGKILL else 128 + sig), child.stderr
    assert_whole(prefix, Kill(sig, f"append: {at}"), kept)
    # A stopping signal waits until both files are written; kill -9 after the last rename keeps the run, before it
    # the next append undoes it.
    assert ("cut" in whole_runs(prefix)) == (sig != signal.SIGKILL or at == "second rename")


def test_a_reader_sees_whole_runs_while_an_append_cut_by_kill_9_waits_for_the_next(tmp_path):
    prefix = tmp_path / "out"
    _one_run(prefix)
    assert _append_killed(prefix, signal.SIGKILL, "first rename").returncode == -signal.SIGKILL
    whole_runs(prefix)
