"""python -m Utils.report.breakdown --prefix DIR: split the traces that profiled runs left in DIR and that
breakdown.csv does not hold yet, append their rows and redraw breakdown.md and breakdown.png (make runs it
after every run with PROFILE=1). Prints one `profile | ...` line per trace split. Exit codes: 0, also
when there was nothing new; 2 for a missing folder, results that cannot be written, or a trace that cannot
be split (the others are split all the same), with one "error: ..." line on stderr; 128 + n where signal n stopped
it, every file whole (Utils.report.stopping)."""
import os
import sys
from collections.abc import Sequence

from Utils.report.breakdown.files import REPORT_FILE, add_traces
from Utils.report.breakdown.trace import TraceError
from Utils.report.cli import Parser
from Utils.report.stopping import Stopped, stopped_on_the_way_out
from Utils.results.store import ResultsError


def main(argv: "Sequence[str] | None" = None) -> int:
    parser = Parser(prog="python -m Utils.report.breakdown", description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", required=True, help="the results folder the profiled runs wrote into")
    args = parser.parse_or_status(argv)
    if isinstance(args, int):
        return args
    if not os.path.isdir(args.prefix):
        print(f"error: PREFIX={args.prefix} is not a folder: profile a rung into it first, e.g. "
              f"make fused PROFILE=1 STEPS=20 BATCH_SIZE=8 PREFIX={args.prefix}", file=sys.stderr)
        return 2
    try:
        with stopped_on_the_way_out():   # breakdown.csv's append takes the folder's lock itself
            split, problems = add_traces(args.prefix)
    except Stopped as e:
        return e.exit_status
    except (ResultsError, TraceError, OSError, ValueError) as e:
        print(f"error: the profiles in {args.prefix} were not split: {e}", file=sys.stderr)
        return 2
    for rung, bd in split:
        parts = ", ".join(f"{name} {ms:.1f} ms" for name, ms in bd.ms.items())
        print(f"profile | {rung}: {parts} per profiled step of {bd.step_ms:.1f} ms"
              + ("" if bd.gpu else " (CPU run: the compute/memory split is GPU-only)"))
    if split:
        print(f"wrote {REPORT_FILE} and its chart into {args.prefix}")
    if problems:
        print(f"error: {len(problems)} trace(s) in {args.prefix} cannot be split (move or remove them): "
              + "; ".join(problems), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
