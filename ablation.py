"""One of the max rung's additions alone on top of the fused rung, recorded as rung fused+<addition>.

    python ablation.py --add loss --steps 60 --batch-size 16 --prefix out
"""
import sys
from dataclasses import replace

from Utils.cli import fail
from Utils.recipes import FUSED, MAX_ADDITIONS
from Utils.runner import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--add" not in args or args.index("--add") + 1 >= len(args):
        sys.exit(fail(f"--add needs one of {', '.join(MAX_ADDITIONS)}"))
    i = args.index("--add")
    field = args[i + 1]
    if field not in MAX_ADDITIONS:
        sys.exit(fail(f"--add {field!r} is not an addition of the max rung: use one of {', '.join(MAX_ADDITIONS)}"))
    recipe = replace(FUSED, name=f"fused+{field}", **{field: MAX_ADDITIONS[field]})
    sys.exit(main(recipe, args[:i] + args[i + 2:]))
