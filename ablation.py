"""One addition tried for the max rung, alone on top of the fused rung, recorded as run fused+<addition>.

    python ablation.py --add loss --steps 60 --batch-size 16 --prefix out
"""
import shlex
import sys

from Utils.ladder.registry import ABLATION, RUNGS
from Utils.train.launch import launch


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--add" not in args or args.index("--add") + 1 >= len(args):
        sys.exit(fail(f"--add needs one of {', '.join(ABLATION)}"))
    i = args.index("--add")
    name = args[i + 1]
    if name not in ABLATION:
        sys.exit(fail(f"--add {name!r} is not an addition tried for the max rung: use one of {', '.join(ABLATION)}"))
    command = " ".join(shlex.quote(a) for a in ["ablation.py"] + args)
    sys.exit(launch(RUNGS["fused"].additions + (name,), args[:i] + args[i + 2:], command))
