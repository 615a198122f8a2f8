"""The checks a target makes before anything runs, each a one-line refusal (UsageError), in the order the
targets have always made them, so that of several bad values the same one is named first. A command checks only
the variables it reads. Checks that need torch (the runs' own parser, the GPU count) run as processes."""
import re

from Utils.ladder.registry import RUNGS, RegistryError, additions_named, check_parallel
from Utils.peers import PEERS
from Utils.results.files import loop_error
from Utils.suite import commands
from Utils.suite.given import Given
from Utils.suite.process import Runner
from Utils.train.usage import EXAMPLE, UsageError

SWITCHES = ("", "0", "1", "yes", "no", "true", "false")
REPEAT_EXAMPLE = "e.g. make max STEPS=60 BATCH_SIZE=16 PREFIX=./out REPEAT=3"
NODES_EXAMPLE = "e.g. make fused NNODES=2 NODE_RANK=0 RDZV_ENDPOINT=node0:29500 STEPS=60 BATCH_SIZE=16 PREFIX=./out"
EMPTY = {"NPROC": "use NPROC=1 (one process) or more, or leave it out",
         "NNODES": "use NNODES=2 or more (hosts), or leave it out (1)",
         "PARALLEL": "use PARALLEL=ddp or fsdp, or leave it out (ddp)",
         "FROM": "use FROM=fused or FROM=max, or leave it out (fused)",
         "ADDITIONS": "name the additions to try (make additions lists them), or leave ADDITIONS out to try every one"}


def require(g: Given, *names: str) -> None:
    for name in names:
        if not g.stripped(name):
            raise UsageError(f"{name} is required ({EXAMPLE})")


def folder(g: Given, name: str = "PREFIX") -> None:
    """A folder variable (PREFIX, OUT, each word of PREFIXES) whose path can be a folder: any path the file system
    allows, but not a symbolic link loop, which every later step would report as something else ("File exists",
    "not found", "not a folder")."""
    if name == "PREFIXES":
        given = [(path, f"PREFIXES names {path}, which") for path in g.words(name)]
    else:
        given = [(g.text(name), f"{name}={g.text(name)}")] if g.is_set(name) else []
    for path, subject in given:
        error = loop_error(path, subject)
        if error:
            raise UsageError(error)


def prefix(g: Given) -> None:
    """PREFIX given, and a path that can be a folder: what every target that reads or writes one checks first."""
    require(g, "PREFIX")
    folder(g, "PREFIX")


def run_basics(g: Given) -> None:
    """What every training target needs: steps, batch and folder, and switches that say yes or no."""
    require(g, "STEPS", "BATCH_SIZE", "PREFIX")
    folder(g, "PREFIX")
    if g.text("COLD") not in SWITCHES:
        raise UsageError(f"COLD must be 1 (compile with an empty cache) or 0, not '{g.text('COLD')}'")
    if g.text("PROFILE") not in SWITCHES:
        raise UsageError(f"PROFILE must be 1 (profile the run too) or 0, not '{g.text('PROFILE')}'")


def repeat(g: Given) -> int:
    value = g.text("REPEAT", "1")
    if not re.fullmatch(r"[1-9][0-9]?", value):
        raise UsageError(f"REPEAT must be a number of runs from 1 to 99, not '{value}' ({REPEAT_EXAMPLE})")
    return int(value)


def not_empty(g: Given, *names: str) -> None:
    """A variable given but set to nothing is refused, not read as its default (FROM= would run every try)."""
    for name in names:
        if g.is_set(name) and not g.stripped(name):
            raise UsageError(f"{name} is empty: {EMPTY[name]}")


def one_rung(g: Given, how: str) -> str:
    if len(g.words("RUNG")) != 1 or g.stripped("RUNG") not in RUNGS:
        raise UsageError(f"RUNG must name one rung ({' '.join(RUNGS)}){how}")
    return g.stripped("RUNG")


def peers(g: Given) -> list[str]:
    """The peers to run: PEERS's words (default all), each known and named once, alone with no NPROC or PROFILE."""
    names = g.words("PEERS", " ".join(PEERS))
    if not names:
        raise UsageError(f"PEERS is empty: name some of {' '.join(PEERS)}")
    if g.text("NPROC", "1").strip() != "1" or g.stripped("PARALLEL") or g.on("PROFILE"):
        raise UsageError("make peers runs each peer as one process, unprofiled: leave out NPROC, PARALLEL and PROFILE")
    if g.multinode():
        raise UsageError("make peers runs on one host: leave out NNODES")
    for i, name in enumerate(names):
        if name not in PEERS:
            raise UsageError(f"PEERS names {name}: use some of {' '.join(PEERS)}")
        if name in names[:i]:
            raise UsageError(f"PEERS names {name} twice: name each peer once (REPEAT=n runs rounds)")
    return names


def parallel(g: Given, runner: Runner, additions: str, arguments: bool = True) -> int:
    """NPROC and PARALLEL, and under several processes the additions against PARALLEL and every run argument
    (arguments: False where the caller's loop checks them next), before torchrun starts any process. Returns the
    checks' exit status."""
    not_empty(g, "NPROC", "PARALLEL", "NNODES")
    nodes(g)
    if not g.distributed():
        return 0
    nproc = g.text("NPROC", "1")
    if arguments:
        return runner.capture(commands.check_arguments(g, (nproc, additions)))[0]
    return runner.capture(commands.check_distributed(g, nproc, additions))[0]


def parallel_rung(g: Given, name: str) -> None:
    """Under several processes, the rung's additions against PARALLEL, in this process: what a loop that has checked
    everything else once leaves to each of its rungs."""
    if g.distributed():
        try:
            check_parallel(additions_named(name), g.parallel())
        except RegistryError as e:
            raise UsageError(str(e)) from None


def nodes(g: Given) -> None:
    """NNODES, NODE_RANK, RDZV_ENDPOINT, RDZV_ID and RDZV_TIMEOUT: a count of hosts, this host's place among them,
    where the rendezvous listens (host:port), the run's id and the seconds a node waits for the others; the last
    four only with NNODES of 2 or more."""
    count = g.stripped("NNODES", "1")
    if not re.fullmatch(r"[1-9][0-9]{0,3}", count):
        raise UsageError(f"NNODES must be a number of hosts, 1 or more, not '{g.text('NNODES')}' ({NODES_EXAMPLE})")
    if count == "1":
        given = [name for name in ("NODE_RANK", "RDZV_ENDPOINT", "RDZV_ID", "RDZV_TIMEOUT") if g.is_set(name)]
        if given:
            raise UsageError(f"{given[0]} is for a run on several hosts: give NNODES=2 or more too ({NODES_EXAMPLE})")
        return
    rank = g.stripped("NODE_RANK")
    if not re.fullmatch(r"0|[1-9][0-9]*", rank) or int(rank) >= int(count):
        raise UsageError(f"NODE_RANK must be this host's place among the NNODES={count} hosts, 0 to {int(count) - 1}, "
                         f"not '{g.text('NODE_RANK')}' (0 on the host that RDZV_ENDPOINT names)")
    endpoint = g.stripped("RDZV_ENDPOINT")
    host, _, port = endpoint.rpartition(":")
    if not host or not re.fullmatch(r"[0-9]{1,5}", port) or not 0 < int(port) < 65536 or " " in endpoint:
        raise UsageError(f"RDZV_ENDPOINT must be host:port, the address where node 0 listens, with a port from 1 to "
                         f"65535, not '{g.text('RDZV_ENDPOINT')}' ({NODES_EXAMPLE})")
    if g.is_set("RDZV_ID") and not re.fullmatch(r"[A-Za-z0-9_.-]+", g.stripped("RDZV_ID")):
        raise UsageError(f"RDZV_ID must be one word of letters, digits, '.', '_' or '-', the same on every node, not "
                         f"'{g.text('RDZV_ID')}'")
    if g.is_set("RDZV_TIMEOUT") and not re.fullmatch(r"[1-9][0-9]{0,4}", g.stripped("RDZV_TIMEOUT")):
        raise UsageError(f"RDZV_TIMEOUT must be the seconds a node waits for the others to join, 1 or more, not "
                         f"'{g.text('RDZV_TIMEOUT')}'")


def arguments(g: Given, runner: Runner) -> tuple[int, str]:
    """Every run argument checked once, by the runs' own parser, before the first run: the folder made, and
    DATA=auto resolved (downloaded, or its fallback warned about) once for every run. Returns the exit status and
    the data the runs take ("" where DATA was given)."""
    rc, out = runner.capture(commands.check_arguments(g))
    return rc, out.strip()
