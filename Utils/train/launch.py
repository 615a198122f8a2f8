"""What a rung script runs: signals handled from its first moment, its additions checked (both before torch loads),
then the run.

Kept apart from Utils.train.run, which imports torch, so that a script installs the handler first.
"""
import json
import os
from collections.abc import Iterable

from Utils.train.handoff import NOT_STARTED
from Utils.train.interrupts import exit_on_signal


def launch(additions: str | Iterable[str], argv: Iterable[str] | None = None, command: str | None = None) -> int:
    """A rung's name or a list of additions, the command line (sys.argv[1:] by default), and what the record
    says repeats the run (Utils.train.run.main); the exit status."""
    exit_on_signal()
    # The additions are the first thing main checks: refused here, before torch and the kernels load (some 4 s), with
    # the same line.
    from Utils.ladder.registry import RegistryError, additions_named
    from Utils.train.usage import fail
    try:
        additions_named(additions)
    except RegistryError as e:
        return fail(str(e))
    from Utils.train.run import main
    word = os.environ.get(NOT_STARTED)
    return main(additions, argv, command, not_started=json.loads(word) if word else None)
