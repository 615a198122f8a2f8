"""python -m Utils.suite COMMAND [RUNG] [NAME=value ...] [--dry-run]

Commands: run RUNG, all, custom, scaling, ablation, peers, profile (train); plots, compare, init_results, peak,
clean, reset (a results folder); additions, help. NAME=value words are make's variables (make help lists them;
PYTHON= names the interpreter of the runs); the environment fills in the ones not given. --dry-run checks the
values and prints the commands without running them. Exit status: 0 ok, 2 bad input, a single run's own status,
1 where a loop had a run that was not ok, 128+n after signal n."""
import os
import signal
import sys
from collections.abc import Callable, Sequence

from Utils.results.store import STOPPING


def _stopped(target: str, signum: int) -> str:
    """What the driver ends with where signal signum stopped `target` (its command, and the rung after run)."""
    return f"{target} stopped by {signal.Signals(signum).name}"


_said_stopped = False   # the driver's line that a signal stopped it has been written


def _stopped_outside_main(signum: int, frame) -> None:
    """Until main takes the signals (Runner.handle_signals), and once it has given them back, no child runs: a
    signal ends the driver at once, with the line main would end with; after main has said it, it is left out."""
    global _said_stopped
    if _said_stopped:
        return
    _said_stopped = True
    command = sys.argv[1:2] + (sys.argv[2:3] if sys.argv[1:2] == ["run"] else [])
    os.write(2, f"error: {_stopped(' '.join(command) or 'help', signum)}\n".encode())
    os._exit(128 + signum)


if __name__ == "__main__":   # before the registry and the targets load: a Ctrl-C then is one line, no traceback
    for _signum in STOPPING:
        signal.signal(_signum, _stopped_outside_main)

from Utils.ladder.__main__ import table  # noqa: E402
from Utils.ladder.registry import RUNGS  # noqa: E402
from Utils.suite import folders, targets  # noqa: E402
from Utils.suite.given import Given, parse  # noqa: E402
from Utils.suite.process import Runner  # noqa: E402
from Utils.suite.text import help_text, unknown_target  # noqa: E402
from Utils.train.usage import UsageError, fail  # noqa: E402

COMMANDS: dict[str, Callable[[Given, Runner], int]] = {
    "all": targets.all_rungs, "custom": targets.custom, "scaling": targets.scaling, "ablation": targets.ablation,
    "peers": targets.peers, "profile": targets.profile, "plots": folders.plots, "compare": folders.compare,
    "init_results": folders.init_results, "peak": folders.peak, "clean": folders.clean, "reset": folders.reset,
}


def main(argv: Sequence[str]) -> int:
    sys.stdout.reconfigure(line_buffering=True)   # its lines between the children's, in order, through a pipe
    command, rest = (argv[0], list(argv[1:])) if argv else ("help", [])
    if command in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    if command == "help":
        print(help_text())
        return 0
    if command == "additions":
        print(table())
        return 0
    if command == "unknown" or (command == "run" and (not rest or rest[0] not in RUNGS)):
        return fail(unknown_target(rest[0] if rest else ""))
    if command not in COMMANDS and command != "run":
        fix = f"run {command}" if command in RUNGS else "--help"
        return fail(f"python -m Utils.suite: no command {command!r} (python -m Utils.suite {fix})")
    name = rest.pop(0) if command == "run" else None
    try:
        g = parse(rest, os.environ)
        # On several hosts, torchrun's processes take their host's place among the hosts from NODE_RANK (Utils.train).
        runner = Runner(g.dry_run, {**os.environ, "NODE_RANK": g.stripped("NODE_RANK")} if g.multinode() else None)
        previous = runner.handle_signals()
        try:
            rc = targets.rung(g, runner, name) if name else COMMANDS[command](g, runner)
        finally:
            runner.restore_signals(previous)
        if runner.interrupted is None:
            return rc
        # Whatever the child made of the SIGTERM passed on to it, the driver ends as the signal it got says.
        global _said_stopped
        _said_stopped = True
        return fail(_stopped(f"{command}{' ' + name if name else ''}", runner.interrupted), runner.stopped())
    except UsageError as e:
        return fail(str(e))


if __name__ == "__main__":
    try:
        rc = main(sys.argv[1:])
    except BrokenPipeError:   # what read its lines has gone (`| head`): it ends as a shell's tools do, no traceback
        rc = 128 + signal.SIGPIPE
    # Shutting the interpreter down gives the signals their default action back, and a SIGTERM then would end the
    # driver by the signal, without its line. From here they are held: one that came after main ends it as one
    # before main would, unless main already said that a signal stopped it. The driver then leaves without the
    # interpreter's shutdown (tens of ms, in which a signal held would be dropped: an exit 0 after a SIGTERM).
    signal.pthread_sigmask(signal.SIG_BLOCK, STOPPING)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:   # a reader gone: nothing left to tell it
            pass
    came = sorted(signal.sigpending() & STOPPING)
    if came:
        _stopped_outside_main(came[0], None)
    os._exit(rc)
