"""Any combination of additions, by name: python -m Utils.train --with "bf16 torch_compile flash" --steps ...

(make custom WITH="..." STEPS=n BATCH_SIZE=b PREFIX=dir.) The run is recorded under a name built from its
additions (Utils.ladder.registry.run_name).
"""
import shlex
import sys

from Utils.train.launch import launch


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--with" not in args or args.index("--with") + 1 >= len(args):
        sys.exit(fail('--with needs the additions to run, e.g. --with "bf16 torch_compile flash" '
                      '(make additions lists them)'))
    i = args.index("--with")
    names = args[i + 1].split()
    if not names:
        sys.exit(fail('WITH is empty: name the additions to run, e.g. WITH="bf16 torch_compile flash" '
                      '(make additions lists them; the run with none is make baseline)'))
    command = " ".join(shlex.quote(a) for a in ["python", "-m", "Utils.train"] + args)
    sys.exit(launch(names, args[:i] + args[i + 2:], command))
