"""One-line refusals of bad input: the message with its fix on stderr, exit status 2. Imports nothing heavy,
so that a script can refuse its arguments before torch loads."""
import argparse
import sys
from typing import NoReturn

EXIT_USAGE = 2
# The example a refusal of a run's arguments ends with.
EXAMPLE = "e.g. make fused STEPS=50 BATCH_SIZE=16 PREFIX=./out"


class UsageError(Exception):
    """A bad argument; the message is one line."""


class Parser(argparse.ArgumentParser):
    """argparse whose every complaint is a UsageError that ends with an example of a good command."""

    def __init__(self, example: str, **kwargs):
        super().__init__(**kwargs)
        self.example = example

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} ({self.example})")


def fail(message: str, code: int = EXIT_USAGE) -> int:
    """Print `error: message` on stderr; returns the exit status."""
    print(f"error: {message}", file=sys.stderr)
    return code


def take_option(args: list, flag: str) -> tuple:
    """(the value after `flag`, args without the two), or (None, args) where `flag` is absent or has no value."""
    if flag not in args or args.index(flag) + 1 >= len(args):
        return None, args
    i = args.index(flag)
    return args[i + 1], args[:i] + args[i + 2:]
