"""One addition tried for the max rung, alone on top of the fused rung, recorded as rung fused+<addition>.

    python ablation.py --add loss --steps 60 --batch-size 16 --prefix out
"""
import sys
from dataclasses import replace

from Utils.cli import fail
from Utils.recipes import ADDITIONS, FUSED
from Utils.runner import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--add" not in args or args.index("--add") + 1 >= len(args):
        sys.exit(fail(f"--add needs one of {', '.join(ADDITIONS)}"))
    i = args.index("--add")
    name = args[i + 1]
    if name not in ADDITIONS:
        sys.exit(fail(f"--add {name!r} is not an addition tried for the max rung: use one of {', '.join(ADDITIONS)}"))
    recipe = replace(FUSED, name=f"fused+{name}", **ADDITIONS[name])
    sys.exit(main(recipe, args[:i] + args[i + 2:]))
