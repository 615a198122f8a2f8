"""How the report's programs (make plots, compare, the breakdown) end on a signal: every file they write whole, the
old one or the new, nothing said (the suite's driver names the signal), and 128 + n."""
import signal
from collections.abc import Iterator
from contextlib import contextmanager

from Utils.results.store import STOPPING


class Stopped(KeyboardInterrupt):
    """A stopping signal came; the program ends with exit_status, 128 + its number."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.exit_status = 128 + signum


@contextmanager
def stopped_on_the_way_out() -> Iterator[None]:
    """The signals that stop a run, those this process takes (the suite's driver starts the charts with the
    terminal's ignored, and stops them with SIGTERM), raise Stopped, once: a chart being written then removes its
    temporary file on the way out (Utils.results.files.write_atomic), which the signal's default action would
    leave in PREFIX."""
    taken = [s for s in STOPPING if signal.getsignal(s) is not signal.SIG_IGN]

    def stop(signum, frame):
        for s in taken:   # a second signal must not cut the way out short
            signal.signal(s, signal.SIG_IGN)
        raise Stopped(signum)
    previous = {s: signal.signal(s, stop) for s in taken}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
