"""The additions tried for the max rung: added to the fused rung, recorded as run fused+<addition>; or left out
of the max rung, recorded as run max-<addition>. Several joined by '+' are tried together: fused+loss+prefetch,
max-bf16_residual-combo_kernels.

    python ablation.py --add loss --steps 60 --batch-size 16 --prefix out
    python ablation.py --drop prefetch --steps 60 --batch-size 16 --prefix out
    python ablation.py --drop bf16_residual+combo_kernels --steps 60 --batch-size 16 --prefix out
"""
import shlex
import sys

from Utils.ladder.registry import ABLATION, LEAVE_ONE_OUT, RegistryError, ablation_additions
from Utils.train.launch import launch
from Utils.train.usage import fail, take_option

if __name__ == "__main__":
    args = sys.argv[1:]
    added, rest = take_option(args, "--add")
    dropped, rest = take_option(rest, "--drop")
    if (added is None) == (dropped is None):
        sys.exit(fail(f"give one of --add ({', '.join(ABLATION)}) or --drop ({', '.join(LEAVE_ONE_OUT)}); "
                      f"several joined by '+' are tried together"))
    flag, base, item = ("--add", "fused", added) if added is not None else ("--drop", "max", dropped)
    try:
        additions = ablation_additions(base, item)
    except RegistryError as e:
        sys.exit(fail(f"{flag} {item}: {e}"))
    command = " ".join(shlex.quote(a) for a in ["ablation.py"] + args)
    sys.exit(launch(additions, rest, command))
