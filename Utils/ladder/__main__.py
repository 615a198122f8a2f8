"""The registry for the Makefile and for people (no torch):

    python -m Utils.ladder table      the additions as a table: name, pillar, stage, what it changes, needs
    python -m Utils.ladder rungs      rung:script pairs, in ladder order (the Makefile's rung targets)
    python -m Utils.ladder ablation   the additions `make ablation` tries alone on the fused rung
    python -m Utils.ladder check NAMES   exits 2 with the fix where NAMES is not a possible combination
"""
import sys

from Utils.ladder.registry import ABLATION, ADDITIONS, RUNGS, RegistryError, resolve, run_name


def table() -> str:
    header = ("addition", "pillar", "stage", "what it changes", "needs", "in rungs")
    rows = [header] + [(a.name, a.pillar, a.stage, a.changes,
                        ", ".join(filter(None, [a.needs] + [f"+{r}" for r in a.requires])) or "-",
                        " ".join(r.name for r in RUNGS.values() if a.name in r.additions) or "-")
                       for a in ADDITIONS.values()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines[:1] + ["  ".join("-" * w for w in widths)] + lines[1:])


def main(argv: list) -> int:
    verb = argv[0] if argv else "table"
    if verb == "table":
        print(table())
    elif verb == "rungs":
        print(" ".join(f"{r.name}:{r.script}" for r in RUNGS.values()))
    elif verb == "ablation":
        print(" ".join(ABLATION))
    elif verb == "check":
        try:
            print(run_name(resolve(" ".join(argv[1:]).split())))
        except RegistryError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    else:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
