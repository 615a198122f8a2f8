"""What a rung script runs: signals handled from its first moment (before torch loads), then the run.

Kept apart from Utils.train.run, which imports torch, so that a script installs the handler first.
"""
from collections.abc import Iterable

from Utils.train.interrupts import exit_on_signal

# The driver's word for a run whose processes never started, set in the environment of one process it starts in
# their place, without torchrun: JSON {"nnodes": n, "nproc": n, "parallel": mode, "message": why}. The run is recorded failed with it and nothing is
# trained (a node that never joined the rendezvous leaves torchrun nothing to start: Utils.suite.targets).
NOT_STARTED = "GPT_SUITE_NOT_STARTED"


def launch(additions: str | Iterable[str], argv: Iterable[str] | None = None, command: str | None = None) -> int:
    """A rung's name or a list of additions, the command line (sys.argv[1:] by default), and what the record
    says repeats the run (Utils.train.run.main); the exit status."""
    exit_on_signal()
    from Utils.train.run import main
    return main(additions, argv, command)
