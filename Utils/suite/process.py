"""The driver's children: each run, chart and check a process of its own, never through a shell. SIGINT,
SIGTERM, SIGHUP or SIGQUIT to the driver is passed on to the child as SIGTERM and the child is waited for, so that
a run stopped by make, by Ctrl-C, by a closed terminal or by a job scheduler still writes its record before the
driver returns; then nothing more starts. The children start with SIGINT, SIGHUP and SIGQUIT ignored: a terminal
sends those to the whole process group, and a chart or a check would die of them with a traceback or a core,
where the driver's SIGTERM ends it quietly (a run installs its own handlers for all four: Utils.train.interrupts).
"""
import os
import shlex
import signal
import subprocess
import sys
import threading

from Utils.results.store import STOPPING

_FROM_TERMINAL = tuple(s for s in STOPPING if s != signal.SIGTERM)
# The last lines of torchrun's own tracebacks that the driver says in one line instead: its rendezvous did not
# gather every node in time; a signal stopped it (the driver's, or the terminal's to the whole group).
_RENDEZVOUS_TIMEOUT = "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError"
_SIGNALLED = "torch.distributed.elastic.multiprocessing.api.SignalException"
_TRACEBACK = "Traceback (most recent call last):"
_CHAINED = ("", "During handling of the above exception, another exception occurred:",
            "The above exception was the direct cause of the following exception:")


def _write(lines: list[str]) -> None:
    """Lines to our stderr, where it still takes them (a closed terminal or a closed pipe does not)."""
    try:
        sys.stderr.writelines(lines)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _ignore_terminal_signals() -> None:
    for signum in _FROM_TERMINAL:
        signal.signal(signum, signal.SIG_IGN)


class Runner:
    """Starts children one at a time; `interrupted` holds the signal that stopped the driver, if one did."""

    def __init__(self, dry_run: bool = False, env: dict[str, str] | None = None):
        self.dry_run = dry_run
        self.env = env   # the children's environment; None: the driver's own
        self.interrupted: int | None = None
        self.rendezvous_timed_out = False   # the last run's torchrun gave up waiting for the other nodes
        self._child: subprocess.Popen | None = None

    def handle_signals(self) -> dict:
        """Take the STOPPING signals (also where the driver was started with one ignored); returns the handlers it
        replaced, for restore_signals."""
        return {signum: signal.signal(signum, self._on_signal) for signum in STOPPING}

    @staticmethod
    def restore_signals(previous: dict) -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    def _on_signal(self, signum: int, frame) -> None:
        # Never raise here: an exception would end the driver while its child is still writing its record.
        self.interrupted = self.interrupted or signum
        if self._child is not None and self._child.poll() is None:
            self._child.send_signal(signal.SIGTERM)

    def stopped(self) -> int | None:
        """The exit status to end with where a signal stopped the driver (128 + its number), else None."""
        return None if self.interrupted is None else 128 + self.interrupted

    def run(self, argv: list[str], show: bool = False, cwd: str | None = None, torchrun: bool = False,
            env: dict[str, str] | None = None) -> int:
        """argv's exit status (128 + n where signal n killed it); under dry_run printed, not run, and 0.
        torchrun: argv is torchrun; its stderr passes through _pass_on, which sets rendezvous_timed_out where no
        run started for want of a node. env: variables added for this child."""
        if show or self.dry_run:
            print(shlex.join(argv), flush=True)
        if self.dry_run:
            return 0
        child_env = {**(self.env or os.environ), **env} if env else self.env
        if not torchrun:
            return self._wait(subprocess.Popen(argv, cwd=cwd, env=child_env,
                                               preexec_fn=_ignore_terminal_signals))[0]
        self.rendezvous_timed_out = False
        read, write = os.pipe()
        try:
            child = subprocess.Popen(argv, cwd=cwd, env=child_env, stderr=write, preexec_fn=_ignore_terminal_signals)
        finally:
            os.close(write)
        with open(read, encoding="utf-8", errors="replace") as stream:
            reader = threading.Thread(target=self._pass_on, args=(stream,), daemon=True)
            reader.start()
            rc = self._wait(child)[0]
            # A worker that outlives torchrun (torchrun killed with -9) still holds the pipe: past a few seconds
            # its lines go on being copied while the driver goes on.
            reader.join(timeout=5)
        return rc

    def _pass_on(self, stream) -> None:
        """Copy torchrun's stderr (its workers' too) to ours line by line, holding each Python traceback, with those
        chained to it, until its last line: torchrun's own for a rendezvous that timed out or a signal is left out,
        since the driver says each in one line (Utils.suite.targets, Utils.suite.__main__); every other is passed
        on whole. It reads to the end whatever becomes of our stderr, so that no worker blocks on a full pipe."""
        held: list[str] = []
        ended = chained = False   # held ends with an exception's own line; a chain's words came after it
        for line in stream:
            if held and ended:
                if not line.strip() or line.strip() in _CHAINED:
                    held.append(line)
                    chained = chained or bool(line.strip())
                    continue
                if line.startswith(_TRACEBACK) and chained:
                    held.append(line)
                    ended = chained = False
                    continue
                self._settle(held)
                held, ended, chained = [], False, False
            if held:
                held.append(line)
                ended = bool(line.strip()) and not line[:1].isspace()   # the exception's own line
            elif line.startswith(_TRACEBACK):
                held = [line]
            else:
                _write([line])
        self._settle(held)

    def _settle(self, held: list[str]) -> None:
        """A held traceback: dropped where torchrun's own says what the driver says, else passed on."""
        last = next((line for line in reversed(held) if line.strip()), "")
        if last.startswith(_RENDEZVOUS_TIMEOUT):
            self.rendezvous_timed_out = True
        elif not last.startswith(_SIGNALLED):
            _write(held)

    def capture(self, argv: list[str]) -> tuple[int, str]:
        """argv's exit status and stdout (stderr passes through); run under dry_run too: a check, not a run."""
        return self._wait(subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=self.env,
                                           preexec_fn=_ignore_terminal_signals))

    def _wait(self, child: subprocess.Popen) -> tuple[int, str]:
        """The child's exit status (128 + n where signal n killed it) and what it wrote to a pipe, if any."""
        self._child = child
        if self.interrupted is not None:   # a signal came while the child was being started
            child.send_signal(signal.SIGTERM)
        out = child.communicate()[0]
        self._child = None
        sys.stdout.flush()
        return (child.returncode if child.returncode >= 0 else 128 - child.returncode), out or ""
