"""One addition tried for the max rung: alone on top of the fused rung, recorded as run fused+<addition>;
or left out of the max rung, recorded as run max-<addition>.

    python ablation.py --add loss --steps 60 --batch-size 16 --prefix out
    python ablation.py --drop prefetch --steps 60 --batch-size 16 --prefix out
"""
import shlex
import sys

from Utils.ladder.registry import ABLATION, LEAVE_ONE_OUT, RUNGS
from Utils.train.launch import launch
from Utils.train.usage import fail, take_option

if __name__ == "__main__":
    args = sys.argv[1:]
    added, rest = take_option(args, "--add")
    dropped, rest = take_option(rest, "--drop")
    if (added is None) == (dropped is None):
        sys.exit(fail(f"give one of --add ({', '.join(ABLATION)}) or --drop ({', '.join(LEAVE_ONE_OUT)})"))
    if added is not None and added not in ABLATION:
        sys.exit(fail(f"--add {added!r} is not an addition tried for the max rung: use one of {', '.join(ABLATION)}"))
    if dropped is not None and dropped not in LEAVE_ONE_OUT:
        sys.exit(fail(f"--drop {dropped!r} is not one of the max rung's additions beyond the fused rung: use one "
                      f"of {', '.join(LEAVE_ONE_OUT)}"))
    command = " ".join(shlex.quote(a) for a in ["ablation.py"] + args)
    if added is not None:
        sys.exit(launch(RUNGS["fused"].additions + (added,), rest, command))
    sys.exit(launch(tuple(a for a in RUNGS["max"].additions if a != dropped), rest, command))
