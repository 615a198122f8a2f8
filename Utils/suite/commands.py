"""The command lines the driver starts, built from what was given: no shell ever reads a value, so a PREFIX with
spaces, quotes or a $ reaches its run as one word."""
from Utils.suite.given import Given

# Optional run arguments, passed where given (even empty, so that the run refuses WARMUP= instead of dropping it),
# in this order: a run records its command line, so the order is part of its record.
OPTIONAL = (("MODEL", "--model"), ("SEQ_LEN", "--seq-len"), ("DEVICE", "--device"), ("DATA", "--data"),
            ("WARMUP", "--warmup"), ("SEED", "--seed"), ("DATA_DIR", "--data-dir"),
            ("SDPA_BACKEND", "--sdpa-backend"), ("MICRO_BATCH", "--micro-batch"),
            ("GPU_MEMORY_GIB", "--gpu-memory-gib"))


def run_args(g: Given) -> list[str]:
    """The arguments every run takes: steps, batch and folder, then the optional ones given, then the switches."""
    args = [f"--steps={g.text('STEPS')}", f"--batch-size={g.text('BATCH_SIZE')}", f"--prefix={g.text('PREFIX')}"]
    args += [f"{flag}={g.text(name)}" for name, flag in OPTIONAL if g.is_set(name)]
    return args + ["--profile"] * g.on("PROFILE") + ["--cold"] * g.on("COLD")


# Defaults of the rendezvous that joins several hosts: the id every node of one run gives, and how long a node
# waits for the others to join before the run ends (torchrun's own default is 600 s).
RDZV_ID = "gpt-suite"
RDZV_TIMEOUT_S = "300"


def launch(g: Given, target: list[str]) -> list[str]:
    """The command that starts `target` (a script, or -m and a module): NPROC processes through torchrun where the
    run is distributed (--parallel follows the target, as the run's parser reads it), else one."""
    if not g.distributed():
        return [*g.python, *target]
    return [*g.python, "-m", "torch.distributed.run", *rendezvous(g), "--nproc-per-node", g.text("NPROC", "1"),
            *target, "--parallel", g.parallel()]


def rendezvous(g: Given) -> list[str]:
    """torchrun's options that join this host to the run's others: --standalone on one host; on several, the c10d
    rendezvous at RDZV_ENDPOINT, which node 0 hosts (is_host), every node waiting RDZV_TIMEOUT seconds for the
    rest. c10d orders the nodes' ranks itself (torchrun ignores --node-rank under it), and no node restarts: a
    node that fails ends the run on every node."""
    if not g.multinode():
        return ["--standalone"]
    host = "true" if g.stripped("NODE_RANK", "0") == "0" else "false"
    conf = f"join_timeout={g.stripped('RDZV_TIMEOUT') or RDZV_TIMEOUT_S},is_host={host}"
    return ["--nnodes", g.stripped("NNODES"), "--rdzv-backend", "c10d", "--rdzv-endpoint", g.stripped("RDZV_ENDPOINT"),
            "--rdzv-id", g.stripped("RDZV_ID") or RDZV_ID, "--rdzv-conf", conf, "--max-restarts", "0"]


def check_arguments(g: Given, processes: tuple[str, str] | None = None) -> list[str]:
    """Every run argument checked by the runs' own parser (torch's checks included); DATA=auto resolved once.
    processes: (NPROC, the rung or additions, "" for none), checked first by Utils.train.distributed in the same
    process, where each check's process imports torch."""
    led = ["--processes", *_processes(g, *processes), "--"] if processes else []
    return [*g.python, "-m", "Utils.train.cli", *led, *(["--dry-run"] if g.dry_run else []), *run_args(g)]


def check_counts(g: Given, counts: list[str], additions: str) -> list[str]:
    """Each process count of make scaling, and PARALLEL, against the GPUs and the additions, in one process."""
    return [*g.python, "-m", "Utils.train.distributed", "counts", *_processes(g, " ".join(counts), additions)]


def check_distributed(g: Given, nproc: str, additions: str) -> list[str]:
    """NPROC and PARALLEL against the GPUs and the additions (a rung's name, addition names, or "" for none)."""
    return [*g.python, "-m", "Utils.train.distributed", "check", *_processes(g, nproc, additions)]


def _processes(g: Given, nproc: str, additions: str) -> list[str]:
    return [nproc, g.parallel(), g.stripped("DEVICE") or "auto", additions]


def plot(g: Given) -> list[str]:
    return [*g.python, "plot_results.py", f"--prefix={g.text('PREFIX')}"]


def breakdown(g: Given) -> list[str]:
    return [*g.python, "-m", "Utils.report.breakdown", f"--prefix={g.text('PREFIX')}"]
