"""Several processes, one GPU each, on PyTorch's own stack: torchrun starts them, torch.distributed joins
them, DistributedDataParallel or FSDP2's fully_shard spreads the model (Utils.ladder.parallel).

A process learns its place from the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK). Every
collective has a timeout (DIST_TIMEOUT_S), so that a rank that hangs ends the run with an error instead of
holding the others forever. Rank 0 records the run; a rank that fails writes one line beside the results
(`failure_path`), which rank 0 reads when torchrun stops it, so that the record names the rank that failed.

    python -m Utils.train.distributed check NPROC PARALLEL DEVICE [RUNG-OR-ADDITIONS]
    python -m Utils.train.distributed counts "NPROC NPROC ..." PARALLEL DEVICE [RUNG-OR-ADDITIONS]

(the driver, before torchrun starts: counts for make scaling's counts; Utils.train.cli's check runs `check` in its
own process for a run on several processes)
"""
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PARALLEL_MODES = ("ddp", "fsdp")
# A collective that waits longer than this ends the run. Ranks compile apart (each its own Inductor) before
# their first all-reduce, so the limit is well above a cold compile (22-32 s a rung on an H200: BENCHMARKS.md,
# "The ladder: wall-clock steps").
DEFAULT_TIMEOUT_S = 300.0
# How long the ranks of a run stopped by a signal wait for each other to agree on the steps they all finished
# (common_steps): well inside a scheduler's grace period (Slurm's KillWait, 30 s; torchrun's own to its workers,
# 30 s). A rank held inside a collective its peers left cannot answer, and then no step is kept.
AGREE_TIMEOUT_S = 10.0
_agreement_group = None   # a gloo group of every rank, used by common_steps alone
_store = None             # a client of torchrun's store, used by stop_step alone


def timeout_s() -> float:
    """DIST_TIMEOUT_S from the environment where it is a positive number of seconds, else the default."""
    try:
        value = float(os.environ.get("DIST_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    except ValueError:
        return DEFAULT_TIMEOUT_S
    return value if value > 0 else DEFAULT_TIMEOUT_S


@dataclass(frozen=True)
class Dist:
    """This process's place among the run's processes; a run without torchrun is rank 0 of 1, parallel ''."""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    parallel: str = ""

    @property
    def main(self) -> bool:
        """The process that prints every step and records the run."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        return bool(self.parallel)


def from_env(parallel: str) -> Dist:
    """The Dist torchrun's variables describe, for a run asked to use `parallel` ('' for none)."""
    if not parallel:
        return Dist()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    return Dist(rank=_rank(local_rank), world_size=int(os.environ["WORLD_SIZE"]), local_rank=local_rank,
                parallel=parallel)


def _rank(local_rank: int) -> int:
    """torchrun's RANK on one host. On several (NODE_RANK, which the driver sets), host i's processes are ranks
    i x LOCAL_WORLD_SIZE + LOCAL_RANK: c10d orders the hosts by their own descriptors, which would put rank 0 (the
    process that prints and records the run) on any host, and the global batch's slices in another order each run."""
    node = os.environ.get("NODE_RANK")
    if node is None:
        return int(os.environ["RANK"])
    return int(node) * int(os.environ["LOCAL_WORLD_SIZE"]) + local_rank


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def init(dist: Dist, device_type: str) -> "torch.device":
    """Join the process group (NCCL between GPUs, gloo between CPU processes) and return this rank's device."""
    import torch
    import torch.distributed as td
    if device_type == "cuda":
        torch.cuda.set_device(dist.local_rank)
        device = torch.device("cuda", dist.local_rank)
    else:
        device = torch.device("cpu")
    td.init_process_group(backend="nccl" if device_type == "cuda" else "gloo", rank=dist.rank,
                          world_size=dist.world_size, timeout=timedelta(seconds=timeout_s()),
                          **({"device_id": device} if device_type == "cuda" else {}))
    global _agreement_group
    # Its own group: after a signal, the default group may still hold a collective some rank left half-done,
    # which a new collective there would be matched with. Gloo finds its address from the host's name; where it
    # cannot connect (a name that resolves to 127.0.1.1, hosts that reach each other over InfiniBand only: set
    # GLOO_SOCKET_IFNAME), the run goes on without it, and a signal then keeps no step.
    try:
        _agreement_group = td.new_group(backend="gloo", timeout=timedelta(seconds=AGREE_TIMEOUT_S))
    except Exception as e:   # noqa: BLE001 - whatever gloo raises, the training does not need this group
        from Utils.train.failures import first_line
        _agreement_group = None
        print(f"note: rank {dist.rank}: no gloo group for agreeing on the steps after a signal ({first_line(e)})",
              file=sys.stderr)
    return device


def barrier() -> bool:
    """Wait for every rank; False (at once) in a single process."""
    import torch.distributed as td
    if not td.is_initialized():
        return False
    td.barrier()
    return True


def close() -> None:
    import torch.distributed as td
    if td.is_initialized():
        td.destroy_process_group()


def reduce_steps(step_ms: list, losses: list, window_s: float | None, device: "torch.device",
                 group=None) -> tuple[list, list, float | None]:
    """Each step's time as the slowest rank's, its loss as the mean over ranks (every rank trains on its own
    share of the global batch), and the measured window as the longest: one all-reduce of each, after the
    last step (in `group`, the default group where None)."""
    import torch
    import torch.distributed as td
    if not td.is_initialized() or td.get_world_size() == 1:
        return step_ms, losses, window_s
    longest = torch.tensor(list(step_ms) + [window_s or 0.0], dtype=torch.float64, device=device)
    loss = torch.tensor(losses, dtype=torch.float64, device=device)
    td.all_reduce(longest, op=td.ReduceOp.MAX, group=group)
    td.all_reduce(loss, op=td.ReduceOp.SUM, group=group)
    times = longest.tolist()
    return times[:-1], (loss / td.get_world_size()).tolist(), (times[-1] if window_s is not None else None)


def stop_step(run_id: str, proposed: int) -> int:
    """The step after which every rank of the run stops, once a signal came: `proposed` where this rank is the
    first to ask, else the first's (an atomic compare-and-set in the store torchrun's processes share)."""
    import torch.distributed as td
    global _store
    if _store is None:
        _store = td.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timedelta(seconds=AGREE_TIMEOUT_S))
    return int(_store.compare_set(f"gpt-suite/stop-after/{run_id}", "", str(proposed)))


def common_steps(step_ms: list, losses: list, window_s: float | None) -> tuple[list, list, float | None] | None:
    """After a signal stopped the ranks, each at its own step: the steps every rank finished, reduced as
    reduce_steps does, through the agreement group; None where a rank did not answer within AGREE_TIMEOUT_S."""
    import torch
    import torch.distributed as td
    if not td.is_initialized() or td.get_world_size() == 1:
        return step_ms, losses, window_s
    if _agreement_group is None:
        return None
    try:
        count = torch.tensor([len(step_ms)], dtype=torch.int64)
        td.all_reduce(count, op=td.ReduceOp.MIN, group=_agreement_group)
        n = int(count.item())
        return reduce_steps(step_ms[:n], losses[:n], window_s, torch.device("cpu"), _agreement_group)
    except Exception:   # a rank gone, or held in a collective of the default group: its steps are unknown
        return None


def smallest(value: int, device: "torch.device") -> int:
    """The smallest of every rank's `value` (the micro-batch that fits on every rank's GPU); `value` alone in a
    single process."""
    import torch
    import torch.distributed as td
    if not td.is_initialized():
        return value
    box = torch.tensor([value], dtype=torch.int64, device=device)
    td.all_reduce(box, op=td.ReduceOp.MIN)
    return int(box.item())


def broadcast_text(text: str, device: "torch.device") -> str:
    """Rank 0's `text` on every rank (the run's id, so that every rank names the same run)."""
    import torch.distributed as td
    if not td.is_initialized():
        return text
    box = [text]
    td.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
    return box[0]


def hosts(dist: Dist, device: "torch.device") -> list[str]:
    """The name of each host the run's processes are on, host 0 first (every rank's list): one per LOCAL_WORLD_SIZE
    ranks, as _rank numbers them; [this host] without torchrun."""
    import socket

    import torch.distributed as td
    name = socket.gethostname()
    if not td.is_initialized():
        return [name]
    names = [""] * dist.world_size
    td.all_gather_object(names, name)
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", dist.world_size))
    return names[::per_host]


def lost_node(hosts: list[str]) -> str:
    """Which node a run on several hosts lost, as node 0 can tell: the other one of two, else one of the others."""
    if len(hosts) == 2:
        return f"node 1 ({hosts[1]}) stopped or failed"
    return f"one of nodes 1-{len(hosts) - 1} ({', '.join(hosts[1:])}) stopped or failed"


def failure_path(prefix: str, run_id: str, rank: int) -> str:
    """Where a rank other than 0 leaves the one line that says why it failed."""
    return os.path.join(prefix, f".rank-failure-{run_id}-{rank}")


def report_failure(prefix: str, run_id: str, rank: int, status: str, message: str) -> None:
    """A failing rank's last word, for rank 0's record: `status` (failed, oom) and its one-line message."""
    try:
        with open(failure_path(prefix, run_id, rank), "w", encoding="utf-8") as f:
            f.write(f"{status}\n{message}\n")
    except OSError:
        pass


def other_failure(prefix: str, run_id: str, world_size: int) -> tuple[str, str] | None:
    """(status, "rank r: message") of the lowest rank that reported a failure of this run, or None; the reports
    are removed once read."""
    found = None
    for rank in range(1, world_size):
        path = failure_path(prefix, run_id, rank)
        try:
            with open(path, encoding="utf-8") as f:
                status, message = (f.read().split("\n") + ["", ""])[:2]
            os.unlink(path)
        except OSError:
            continue
        found = found or (status, f"rank {rank}: {message}")
    return found


def parallel_problem(parallel: str) -> str | None:
    """Why PARALLEL names no mode, in one line with the fix; None when it names one."""
    if parallel not in PARALLEL_MODES:
        return f"PARALLEL={parallel!r} is not one of {', '.join(PARALLEL_MODES)}: e.g. PARALLEL=ddp"
    return None


def gpu_count() -> int:
    """The CUDA GPUs PyTorch sees here."""
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check(nproc: str, parallel: str, device: str, gpus: int | None = None, additions: str = "") -> str | None:
    """Why NPROC and PARALLEL cannot run here, or cannot run `additions` (a rung's name, or addition names
    separated by spaces), in one line with the fix; None when they can. `gpus` is the number of GPUs present
    (counted when None)."""
    try:
        n = int(nproc)
    except ValueError:
        n = 0
    if n < 1:
        return f"NPROC={nproc!r} is not a number of processes: use NPROC=1 (one GPU) or more, e.g. NPROC=2"
    if parallel and parallel_problem(parallel):
        return parallel_problem(parallel)
    if additions.strip():
        from Utils.ladder.registry import RegistryError, additions_named, check_parallel
        try:
            check_parallel(additions_named(additions), parallel)
        except RegistryError as e:
            return str(e)
    if device not in ("auto", "cuda", "cpu"):
        return None   # the run's own argument check names it
    if gpus is None:
        gpus = gpu_count()
    on_gpu = device == "cuda" or (device == "auto" and gpus > 0)
    if device == "cuda" and gpus == 0:
        return "DEVICE=cuda but PyTorch sees no CUDA GPU here: use DEVICE=cpu (gloo between CPU processes)"
    if on_gpu and n > gpus:
        return (f"NPROC={n} but this machine has {gpus} GPU{'s' if gpus != 1 else ''}: use NPROC={gpus} or fewer "
                f"(one process per GPU)")
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (4, 5) or argv[0] not in ("check", "counts"):
        print("usage: python -m Utils.train.distributed check NPROC PARALLEL DEVICE [RUNG-OR-ADDITIONS]\n"
              "       python -m Utils.train.distributed counts \"NPROC NPROC ...\" PARALLEL DEVICE [RUNG-OR-ADDITIONS]",
              file=sys.stderr)
        return 2
    counts = (argv[1].split() or [argv[1]]) if argv[0] == "counts" else [argv[1]]
    gpus = None
    for i, nproc in enumerate(counts):
        problem = check(nproc, argv[2], argv[3], gpus, additions=argv[4] if len(argv) == 5 else "")
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
        if i + 1 < len(counts) and gpus is None:   # counted again by check otherwise, once for each count
            gpus = gpu_count()
    return 0


if __name__ == "__main__":
    sys.exit(main())
