"""Ctrl-C, SIGTERM, SIGHUP (a closed terminal or ssh session) and SIGQUIT, from a script's first line to its run's
record.

Before a run exists (imports, argument checks, reading the data), a signal ends the program with one line:
there is nothing to record. Once the run exists, the first signal raises KeyboardInterrupt wherever the run
is; every later one, and any that comes once training is over, is only noted, so that the shutdown (the
summary, the release of device memory, the append) always finishes and the run is recorded as interrupted
with every step that finished. Every signal here does the same, even where it was inherited as ignored (make
runs a background job's commands so, and the suite's driver starts its children so); the exit status is 128 + its
number. Imports nothing heavy: a script installs it before torch loads.
"""
import os
import signal

from Utils.results.store import STOPPING

EXIT_INTERRUPTED = 128 + signal.SIGINT   # Ctrl-C's: 130


_exiting = False


def _exit_at_once(signum, frame):
    # A terminal's signal comes with the driver's SIGTERM: the second's handler can run inside the first's, at its
    # write, and is then to say nothing. (No handler can run between the test and the assignment.)
    global _exiting
    if _exiting:
        return
    _exiting = True
    os.write(2, b"error: interrupted before the run started; nothing was recorded\n")
    os._exit(128 + signum)


def exit_on_signal() -> None:
    """Until a run takes over: a signal ends the program at once, with one line."""
    for sig in STOPPING:
        signal.signal(sig, _exit_at_once)


class Interrupts:
    """`with Interrupts() as interrupts:` around a run, and `interrupts.arm()` as the first statement of the
    `try` that trains: a signal raises KeyboardInterrupt only inside it; `interrupts.requested` says whether
    one came at all."""

    def __init__(self):
        self.armed = False
        self.requested = False
        self.exit_status = EXIT_INTERRUPTED   # 128 + the first signal's number, once one came
        self._previous = {}

    def _handle(self, signum, frame):
        if not self.requested:
            self.exit_status = 128 + signum
        self.requested = True
        if self.armed:
            self.armed = False   # once: a second signal must not break the shutdown of the first
            raise KeyboardInterrupt(f"signal {signum}")

    def arm(self) -> None:
        """From now on the first signal raises KeyboardInterrupt; one that already came raises it at once."""
        self.armed = True
        if self.requested:
            self.armed = False
            raise KeyboardInterrupt("signal before training")

    def disarm(self) -> None:
        """Training is over: from now on a signal is only noted."""
        self.armed = False

    def __enter__(self):
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOPPING}
        return self

    def __exit__(self, *exc):
        self.armed = False
        for sig, handler in self._previous.items():
            # After the record, the program is about to end: a signal then changes nothing, so it is ignored
            # rather than reported as an interruption before the run.
            signal.signal(sig, signal.SIG_IGN if handler is _exit_at_once else handler)
        return False
