"""Any combination of additions, by name: python -m Utils.train --with "bf16 torch_compile flash" --steps ...

(make custom WITH="..." STEPS=n BATCH_SIZE=b PREFIX=dir.) The run is recorded under a name built from its
additions (Utils.ladder.registry.run_name).
"""
import shlex
import sys

from Utils.train.launch import launch
from Utils.train.usage import fail, take_option

if __name__ == "__main__":
    args = sys.argv[1:]
    value, rest = take_option(args, "--with")
    if value is None:
        sys.exit(fail('--with needs the additions to run, e.g. --with "bf16 torch_compile flash" '
                      '(make additions lists them)'))
    names = value.split()
    if not names:
        sys.exit(fail('WITH is empty: name the additions to run, e.g. WITH="bf16 torch_compile flash" '
                      '(make additions lists them; the run with none is make baseline)'))
    command = " ".join(shlex.quote(a) for a in ["python", "-m", "Utils.train"] + args)
    sys.exit(launch(names, rest, command))
