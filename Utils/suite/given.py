"""The variables a command was given: NAME=value words as make passes them, the environment as the fallback
(make's own precedence), and the interpreter that starts every child."""
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from Utils.train.usage import UsageError

# Every variable a user sets on make's command line (the Makefile passes these, and only these, as words).
VARIABLES = ("STEPS", "BATCH_SIZE", "PREFIX", "MODEL", "SEQ_LEN", "DEVICE", "DATA", "WARMUP", "SEED", "DATA_DIR",
             "SDPA_BACKEND", "MICRO_BATCH", "GPU_MEMORY_GIB", "UPGRADE", "PROFILE", "COLD", "REPEAT", "WITH",
             "ADDITIONS", "FROM", "PEERS", "RUNG", "NPROC", "PARALLEL", "NNODES", "NODE_RANK", "RDZV_ENDPOINT",
             "RDZV_ID", "RDZV_TIMEOUT", "PREFIXES", "OUT", "RESULTS", "MATMUL_N", "COPY_GIB")
TRUE = ("1", "yes", "true")


@dataclass(frozen=True)
class Given:
    """The values given by name (set, even to nothing, or absent), the children's interpreter, and whether to
    check and print only (make -n)."""
    values: Mapping[str, str] = field(default_factory=dict)
    python: tuple[str, ...] = (sys.executable,)
    dry_run: bool = False

    def is_set(self, name: str) -> bool:
        return name in self.values

    def text(self, name: str, default: str = "") -> str:
        """The value exactly as given, or `default` where the variable is absent."""
        return self.values.get(name, default)

    def stripped(self, name: str, default: str = "") -> str:
        return self.text(name, default).strip()

    def words(self, name: str, default: str = "") -> list[str]:
        return self.text(name, default).split()

    def on(self, name: str) -> bool:
        """A switch (PROFILE, COLD) is on where one of its words is 1, yes or true, as make's filter reads it."""
        return any(w in TRUE for w in self.words(name))

    def with_values(self, **values: str) -> "Given":
        return replace(self, values={**self.values, **values})

    def distributed(self) -> bool:
        """Several processes through torchrun: NPROC has a count other than 1, PARALLEL is named, or NNODES is more
        than one."""
        return (any(w != "1" for w in self.words("NPROC", "1")) or bool(self.stripped("PARALLEL"))
                or self.multinode())

    def multinode(self) -> bool:
        """Several hosts, joined by torchrun's c10d rendezvous: NNODES is given and is not 1."""
        return self.stripped("NNODES", "1") != "1"

    def records(self) -> bool:
        """This host records the runs and draws the charts: node 0 of several (the others' charts would race it
        for the same files on a shared folder), or the one host."""
        return not self.multinode() or self.stripped("NODE_RANK") == "0"

    def parallel(self) -> str:
        return self.stripped("PARALLEL") or "ddp"


def parse(words: Sequence[str], environ: Mapping[str, str]) -> Given:
    """Given from NAME=value words (PYTHON= names the children's interpreter; --dry-run checks and prints only),
    the environment filling in the variables no word names."""
    values, python, dry_run = {}, None, False
    for word in words:
        name, sep, value = word.partition("=")
        if word == "--dry-run":
            dry_run = True
        elif sep and name == "PYTHON":
            python = tuple(shlex.split(value)) or None
        elif sep and name in VARIABLES:
            values[name] = value
        else:
            raise UsageError(f"{word!r} is not NAME=value for one of {', '.join(VARIABLES)}")
    for name in VARIABLES:
        if name not in values and name in environ:
            values[name] = environ[name]
    return Given(values, python or (sys.executable,), dry_run)
