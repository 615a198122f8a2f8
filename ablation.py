"""One addition tried for the max rung, alone on top of the fused rung, recorded as run fused+<addition>.

    python ablation.py --add loss --steps 60 --batch-size 16 --prefix out
"""
import shlex
import sys

from Utils.ladder.registry import ABLATION, RUNGS
from Utils.train.launch import launch
from Utils.train.usage import fail, take_option

if __name__ == "__main__":
    args = sys.argv[1:]
    name, rest = take_option(args, "--add")
    if name is None:
        sys.exit(fail(f"--add needs one of {', '.join(ABLATION)}"))
    if name not in ABLATION:
        sys.exit(fail(f"--add {name!r} is not an addition tried for the max rung: use one of {', '.join(ABLATION)}"))
    command = " ".join(shlex.quote(a) for a in ["ablation.py"] + args)
    sys.exit(launch(RUNGS["fused"].additions + (name,), rest, command))
