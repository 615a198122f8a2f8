"""The targets that train: one rung or custom REPEAT times in a row, and the loops over rungs, process counts,
ablation tries and peers. Each loop checks every run argument once, then goes on past a run that is not ok, and
ends naming what was not ok; a signal ends it at once with the interrupted run's status."""
import json
import os
import shlex
import socket
import time
from collections.abc import Callable

from Utils.ladder.__main__ import check_ablation
from Utils.ladder.registry import ABLATION_TRIES, RUNGS
from Utils.suite import checks, commands
from Utils.suite.given import Given
from Utils.suite.process import Runner
from Utils.train.handoff import NOT_STARTED
from Utils.train.usage import UsageError, fail

Step = Callable[[str, str], int]   # (item, the data every run takes, "" for as given) -> exit status


def rung(g: Given, runner: Runner, name: str, drawn: bool = False, checked: bool = False) -> int:
    """make <rung>: the rung REPEAT times in a row; its summary drawn again where PREFIX has one (drawn: the
    caller draws once at its end; checked: the caller's loop has checked the run arguments and process counts, each
    check a process that imports torch, and leaves the rung's additions against PARALLEL)."""
    checks.run_basics(g)
    if checked:
        checks.parallel_rung(g, name)
        rc = 0
    else:
        rc = checks.parallel(g, runner, name)
    return rc or _repeat(g, runner, name, [RUNGS[name].script], commands.run_args(g), checks.repeat(g), drawn)


def custom(g: Given, runner: Runner) -> int:
    """make custom: exactly the additions in WITH, REPEAT times in a row."""
    checks.run_basics(g)
    if not g.stripped("WITH"):
        raise UsageError('WITH is required: the additions to run, e.g. make custom WITH="bf16 torch_compile flash" '
                         "STEPS=50 BATCH_SIZE=16 PREFIX=./out (make additions lists them)")
    rc = checks.parallel(g, runner, g.text("WITH"))
    return rc or _repeat(g, runner, "custom", ["-m", "Utils.train"], ["--with", g.text("WITH"), *commands.run_args(g)],
                         checks.repeat(g), drawn=False)


def _repeat(g: Given, runner: Runner, name: str, target: list[str], args: list[str], times: int,
            drawn: bool) -> int:
    """target with args `times` times, stopping at the first run that is not ok (its status is the result): on a
    GPU whose clock moves one run's median by a few percent, summary.md then reports the median of the medians."""
    print(shlex.join(commands.launch(g, target) + args), flush=True)
    if runner.dry_run:
        return 0
    for k in range(1, times + 1):
        if times > 1:
            print(f"=== {name}, run {k} of {times} ===", flush=True)
        rc = _launched(g, runner, target, args)
        if not rc and g.on("PROFILE"):   # the run wrote its trace; the report splits it
            rc = runner.run(commands.breakdown(g))
        if rc or runner.interrupted:
            return rc or runner.stopped()
    # A summary left as it was would leave out the runs just appended.
    summary = os.path.join(g.text("PREFIX"), "summary.md")
    if not drawn and not g.on("PROFILE") and g.records() and os.path.isfile(summary):
        return runner.run(commands.plot(g))
    return 0


def _launched(g: Given, runner: Runner, target: list[str], args: list[str], limit_s: float = 15.0) -> int:
    """Run target with args (through torchrun where distributed); its exit status. On several hosts each run is a
    rendezvous of its own at one endpoint, which node 0's torchrun hosts:
    - another node starts once something listens there, and ends in one line where nothing has within
      RDZV_TIMEOUT (torchrun would wait twice its own 60 s, whatever RDZV_TIMEOUT says);
    - where a node never joined, torchrun starts nothing: node 0 records the run failed, naming the node;
    - another node returns once node 0's rendezvous of the run just ended has closed (at most limit_s): one that
      started the next while node 0's torchrun still served the last would join a rendezvous that is closing."""
    waits = g.multinode() and not g.records() and not runner.dry_run
    if waits and not _listening(g, runner, float(_rdzv_timeout(g)), until=True):
        if runner.interrupted:
            return runner.stopped()
        return fail(f"node {g.stripped('NODE_RANK')}: nothing listened at RDZV_ENDPOINT={g.stripped('RDZV_ENDPOINT')} "
                    f"within RDZV_TIMEOUT={_rdzv_timeout(g)} s: start node 0 (NODE_RANK=0, on the host it names) with "
                    f"the same command", 1)
    rc = runner.run(commands.launch(g, target) + args, torchrun=g.distributed())
    if runner.rendezvous_timed_out:
        return _not_joined(g, runner, target, args)
    if waits and not runner.interrupted:
        _listening(g, runner, limit_s, until=False)
    return rc


def _rdzv_timeout(g: Given) -> str:
    return g.stripped("RDZV_TIMEOUT") or commands.RDZV_TIMEOUT_S


def _listening(g: Given, runner: Runner, limit_s: float, until: bool) -> bool:
    """Whether something listens at RDZV_ENDPOINT, once that is `until` (at most limit_s, asking every 0.2 s, and
    no longer once a signal stopped the driver)."""
    host, _, port = g.stripped("RDZV_ENDPOINT").rpartition(":")
    deadline = time.monotonic() + limit_s
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1).close()
            listening = True
        except OSError:
            listening = False
        if listening == until or time.monotonic() >= deadline or runner.interrupted:
            return listening
        time.sleep(0.2)


def _not_joined(g: Given, runner: Runner, target: list[str], args: list[str]) -> int:
    """A rendezvous that timed out: node 0 records the run failed (one process of the target, started with the
    driver's word, Utils.train.handoff.NOT_STARTED) and says which node it lacked; another node says it in one
    line. Both end non-zero."""
    nnodes, endpoint = int(g.stripped("NNODES")), g.stripped("RDZV_ENDPOINT")
    waited = f"within RDZV_TIMEOUT={_rdzv_timeout(g)} s"
    if not g.records():
        return fail(f"node {g.stripped('NODE_RANK')}: the rendezvous at {endpoint} did not gather all {nnodes} nodes "
                    f"{waited}; node 0, which hosts it, records the run", 1)
    lacked = "node 1" if nnodes == 2 else f"at least one of nodes 1-{nnodes - 1}"
    message = (f"{lacked} never joined the rendezvous at {endpoint} {waited}: no process started (start the same "
               f"command on every node, with the same RDZV_ENDPOINT and RDZV_ID)")
    word = json.dumps({"nnodes": nnodes, "nproc": nnodes * int(g.stripped("NPROC") or "1"), "parallel": g.parallel(),
                       "message": message})
    rc = runner.run([*g.python, *target, *args], env={NOT_STARTED: word})
    return rc or 1


def each(g: Given, runner: Runner, name: str, items: list[str], step: Step,
         after: Callable[[], list[str]] = lambda: [], first: str | None = None, rounds: int = 1) -> int:
    """step for every item, going on past failures, then after (what it names was not ok too); 1 naming what was
    not ok. `first` begins each of `rounds` rounds, headed as such where there are several."""
    rc, data = checks.arguments(g, runner)
    if rc:
        return rc
    failed, round_ = [], 0
    for item in items:
        print(f"=== {name} {item} ===", flush=True)
        if item == first:
            round_ += 1
            if rounds > 1:
                print(f"--- round {round_} of {rounds} ---", flush=True)
        try:
            rc = step(item, data)
        except UsageError as e:   # a check of this item alone (PARALLEL=fsdp and max)
            rc = fail(str(e))
        if runner.interrupted:
            return rc or runner.stopped()
        if rc:
            failed.append(item)
    failed = list(dict.fromkeys(failed + after()))
    if failed:
        return fail(f"make {name}: not ok: {' '.join(failed)} (see {g.text('PREFIX')})", 1)
    return 0


def charts(g: Given, runner: Runner) -> list[str]:
    """The charts after several runs (["plots"] where they failed); with PROFILE=1 none, since profiled runs are
    recorded in breakdown.md only."""
    if g.on("PROFILE"):
        print("PROFILE=1: no charts (the profiled runs are in breakdown.md only)", flush=True)
        return []
    if not g.records():
        return []
    return ["plots"] if runner.run(commands.plot(g)) else []


def _data(data: str) -> dict:
    return {"DATA": data} if data else {}


def all_rungs(g: Given, runner: Runner) -> int:
    """make all: every rung in ladder order, then the charts."""
    checks.run_basics(g)
    checks.repeat(g)
    rc = checks.parallel(g, runner, "", arguments=False)
    return rc or each(g, runner, "all", list(RUNGS),
                      lambda x, data: rung(g.with_values(**_data(data)), runner, x, drawn=True, checked=True),
                      lambda: charts(g, runner))


def profile(g: Given, runner: Runner) -> int:
    """make profile: every rung again with --profile, split into the breakdown files; results.csv left alone."""
    checks.run_basics(g)
    checks.repeat(g)
    rc = checks.parallel(g, runner, "", arguments=False)
    return rc or each(g, runner, "profile", list(RUNGS),
                      lambda x, data: rung(g.with_values(PROFILE="1", **_data(data)), runner, x, drawn=True,
                                           checked=True))


def scaling(g: Given, runner: Runner) -> int:
    """make scaling: RUNG at each process count in NPROC, through torchrun, then the charts (scaling.png)."""
    checks.run_basics(g)
    checks.repeat(g)
    name = checks.one_rung(g, ', e.g. make scaling RUNG=max NPROC="1 2" STEPS=60 BATCH_SIZE=16 PREFIX=./out')
    checks.nodes(g)
    counts = g.words("NPROC", "1")
    if not counts:
        raise UsageError('NPROC is required: the GPU counts to run, e.g. NPROC="1 2 4 8"')
    rc = runner.capture(commands.check_counts(g, counts, name))[0]
    return rc or each(g, runner, "scaling", counts,
                      lambda x, data: rung(g.with_values(NPROC=x, PARALLEL=g.parallel(), **_data(data)), runner, name,
                                           drawn=True, checked=True),
                      lambda: charts(g, runner))


def ablation(g: Given, runner: Runner) -> int:
    """make ablation: the FROM rung (fused), then each addition tried alone on it (FROM=max: max without each of
    its additions in turn), REPEAT rounds alternated, so that every pair divides runs of one stretch of the GPU's
    clock; then the charts."""
    checks.run_basics(g)
    times = checks.repeat(g)
    checks.not_empty(g, "FROM", "ADDITIONS")
    base, items = g.stripped("FROM") or "fused", g.words("ADDITIONS")
    if check_ablation(base, items):   # it names the problem
        return 2
    rc = checks.parallel(g, runner, base)
    if rc:
        return rc
    verb = "--drop" if base == "max" else "--add"

    def step(x: str, data: str) -> int:
        target = [RUNGS[base].script] if x == base else ["ablation.py", verb, x]
        return _launched(g, runner, target, commands.run_args(g) + [f"--data={data}"] * bool(data))

    def after() -> list[str]:
        split = g.on("PROFILE") and runner.run(commands.breakdown(g))
        return ["profile"] * bool(split) + charts(g, runner)
    return each(g, runner, "ablation", [base, *(items or ABLATION_TRIES[base])] * times, step, after, base, times)


def peers(g: Given, runner: Runner) -> int:
    """make peers: the peers (and RUNG first, where named), REPEAT rounds alternated; then the charts."""
    checks.run_basics(g)
    times = checks.repeat(g)
    names = checks.peers(g)
    name = g.stripped("RUNG")
    if name:
        checks.one_rung(g, " to run beside the peers, e.g. make peers RUNG=max REPEAT=3 STEPS=30 BATCH_SIZE=64 "
                           "PREFIX=./out")

    def step(x: str, data: str) -> int:
        target = [RUNGS[name].script] if x == name else ["-m", "Utils.peers", x]
        return runner.run([*g.python, *target] + commands.run_args(g) + [f"--data={data}"] * bool(data))
    round_ = ([name] if name else []) + names
    return each(g, runner, "peers", round_ * times, step, lambda: charts(g, runner), round_[0], times)
