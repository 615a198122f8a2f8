"""The registry for the Makefile and for people (no torch):

    python -m Utils.ladder table      the additions as a table: name, pillar, stage, what it changes, needs
    python -m Utils.ladder markdown   the same as the README's Markdown table
    python -m Utils.ladder rungs      rung:script pairs, in ladder order (the Makefile's rung targets)
    python -m Utils.ladder ablation   the additions `make ablation` tries alone on the fused rung
    python -m Utils.ladder ablation max   the additions `make ablation FROM=max` leaves out of max in turn
    python -m Utils.ladder check NAMES   exits 2 with the fix where NAMES is not a possible combination
    python -m Utils.ladder check-ablation FROM ITEMS   exits 2 with the fix where `make ablation FROM=... ADDITIONS=...`
                                                     cannot run them (an item: one addition, or several joined by '+')
    python -m Utils.ladder --help    this text
"""
import signal
import sys

if __name__ == "__main__":
    # make reads the rungs through $(shell) as it starts: a Ctrl-C then reaches this program too, which should
    # end as any short command does, silently, while make says it stopped (not with a KeyboardInterrupt
    # traceback). Not where the driver imports this module: it handles its signals itself.
    signal.signal(signal.SIGINT, signal.SIG_DFL)

from Utils.ladder.registry import (ADDITIONS, FUSED_ALONE, LEAVE_ONE_OUT, RUNGS, RegistryError, ablation_additions,
                                   check_ablation_base, resolve, run_name)


VERBS = ("table", "markdown", "rungs", "ablation", "check", "check-ablation")
HEADER = ("addition", "pillar", "stage", "what it changes", "needs", "first in")


def rows() -> list:
    """One row per addition: name, pillar, stage, what it changes, what it needs (machine, +additions), and the
    first rung of the ladder that has it ('-' for those only ablation and `make custom` run)."""
    def first_rung(name):
        return next((r.name for r in RUNGS.values() if name in r.additions), "-")
    return [(a.name, a.pillar, a.stage, a.changes,
             ", ".join(filter(None, [a.needs] + [f"+{r}" for r in a.requires])) or "-", first_rung(a.name))
            for a in ADDITIONS.values()]


def table() -> str:
    lines = [HEADER] + rows()
    widths = [max(len(r[i]) for r in lines) for i in range(len(HEADER))]
    text = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in lines]
    return "\n".join(text[:1] + ["  ".join("-" * w for w in widths)] + text[1:])


def markdown() -> str:
    cells = [(f"`{name}`", pillar, stage, changes, needs, f"`{first}`" if first != "-" else "-")
             for name, pillar, stage, changes, needs, first in rows()]
    return "\n".join(["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
                     + ["| " + " | ".join(c) + " |" for c in cells])


def check_ablation(base: str, items: list) -> int:
    """0 where `make ablation FROM=base ADDITIONS=items` can run every item; else 2, the fix on stderr."""
    try:
        check_ablation_base(base)
    except RegistryError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    seen = {}   # the set of additions of each item -> the item
    for item in items:
        try:
            additions = frozenset(ablation_additions(base, item))
        except RegistryError as e:
            print(f"error: ADDITIONS: {e}", file=sys.stderr)
            return 2
        if additions in seen:
            print(f"error: ADDITIONS: '{item}' runs what '{seen[additions]}' runs: name it once", file=sys.stderr)
            return 2
        seen[additions] = item
    return 0


def main(argv: list) -> int:
    verb = argv[0] if argv else "table"
    if verb == "table":
        print(table())
    elif verb == "markdown":
        print(markdown())
    elif verb == "rungs":
        print(" ".join(f"{r.name}:{r.script}" for r in RUNGS.values()))
    elif verb == "ablation" and argv[1:] in ([], ["fused"]):
        print(" ".join(FUSED_ALONE))
    elif verb == "ablation" and argv[1:] == ["max"]:
        print(" ".join(LEAVE_ONE_OUT))
    elif verb == "check-ablation" and argv[1:]:
        return check_ablation(argv[1], argv[2:])
    elif verb == "check":
        try:
            print(run_name(resolve(" ".join(argv[1:]).split())))
        except RegistryError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    elif verb in ("-h", "--help", "help"):
        print(__doc__.strip())
    else:
        print(f"error: python -m Utils.ladder {' '.join(argv)}: {_usage_problem(verb, argv[1:])} "
              f"(python -m Utils.ladder --help)", file=sys.stderr)
        return 2
    return 0


def _usage_problem(verb: str, rest: list) -> str:
    """What is wrong with a command line main() does not take, in a few words with the fix."""
    if verb == "ablation":
        return f"ablation takes nothing, fused or max, not {' '.join(rest)!r}"
    if verb == "check-ablation":
        return "check-ablation needs FROM (fused or max), then the items to check"
    return f"unknown command {verb!r}: use one of {', '.join(VERBS)}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
