"""Several hosts through torchrun's c10d rendezvous (NNODES, NODE_RANK, RDZV_ENDPOINT), on the CPU with gloo: two
launchers on this host stand for two nodes. The command lines and refusals in-process; the runs end to end."""
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from Utils.suite import checks, commands
from Utils.suite.given import Given
from Utils.train.usage import UsageError

from conftest import REPO_ROOT, clean_env, make, read_csv

BASICS = {"STEPS": "3", "BATCH_SIZE": "2", "PREFIX": "out"}


def given(**values: str) -> Given:
    return Given({**BASICS, **values}, ("py",))


def test_several_nodes_join_at_the_rendezvous_that_node_0_hosts():
    base = dict(NNODES="2", RDZV_ENDPOINT="node0:29500", NPROC="8")
    for rank, host in (("0", "true"), ("1", "false")):
        g = given(NODE_RANK=rank, **base)
        checks.nodes(g)
        assert g.distributed() and g.multinode()
        assert commands.launch(g, ["fused_optimizer.py"]) == [
            "py", "-m", "torch.distributed.run", "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            "node0:29500", "--rdzv-id", "gpt-suite", "--rdzv-conf", f"join_timeout=300,is_host={host}",
            "--max-restarts", "0", "--nproc-per-node", "8", "fused_optimizer.py", "--parallel", "ddp"]
    g = given(NODE_RANK="1", RDZV_ID="job-42.a", RDZV_TIMEOUT="30", **base)
    assert commands.rendezvous(g)[7:10] == ["job-42.a", "--rdzv-conf", "join_timeout=30,is_host=false"]


@pytest.mark.parametrize("values", [{}, {"NNODES": "1"}, {"NNODES": " 1 ", "NPROC": "2"}])
def test_one_node_stays_standalone(values):
    g = given(**values)
    checks.nodes(g)
    assert not g.multinode()
    assert commands.rendezvous(g) == ["--standalone"]


@pytest.mark.parametrize("values, error", [
    ({"NNODES": "0"}, "NNODES must be a number of hosts, 1 or more, not '0'"),
    ({"NNODES": "two"}, "NNODES must be a number of hosts, 1 or more, not 'two'"),
    ({"NODE_RANK": "1"}, "NODE_RANK is for a run on several hosts: give NNODES=2 or more too"),
    ({"NNODES": "1", "RDZV_ENDPOINT": "h:1"}, "RDZV_ENDPOINT is for a run on several hosts"),
    ({"NNODES": "2", "RDZV_ENDPOINT": "h:1"}, "NODE_RANK must be this host's place among the NNODES=2 hosts, 0 to 1, "
                                              "not ''"),
    ({"NNODES": "2", "NODE_RANK": "2", "RDZV_ENDPOINT": "h:1"}, "NODE_RANK must be this host's place among the "
                                                                 "NNODES=2 hosts, 0 to 1, not '2'"),
    ({"NNODES": "2", "NODE_RANK": "-1", "RDZV_ENDPOINT": "h:1"}, "not '-1'"),
    ({"NNODES": "2", "NODE_RANK": "0"}, "RDZV_ENDPOINT must be host:port"),
    ({"NNODES": "2", "NODE_RANK": "0", "RDZV_ENDPOINT": "node0"}, "RDZV_ENDPOINT must be host:port, the address "
                                                                   "where node 0 listens, with a port from 1 to 65535, "
                                                                   "not 'node0'"),
    ({"NNODES": "2", "NODE_RANK": "0", "RDZV_ENDPOINT": ":29500"}, "not ':29500'"),
    ({"NNODES": "2", "NODE_RANK": "0", "RDZV_ENDPOINT": "h:70000"}, "not 'h:70000'"),
    ({"NNODES": "2", "NODE_RANK": "0", "RDZV_ENDPOINT": "h:1", "RDZV_ID": "a b"}, "RDZV_ID must be one word"),
    ({"NNODES": "2", "NODE_RANK": "0", "RDZV_ENDPOINT": "h:1", "RDZV_TIMEOUT": "0"}, "RDZV_TIMEOUT must be the "
                                                                                      "seconds"),
])
def test_bad_node_settings_are_refused_in_one_line(values, error):
    with pytest.raises(UsageError, match=re.escape(error)) as e:
        checks.nodes(given(**values))
    assert "\n" not in str(e.value)


def test_nnodes_given_empty_is_refused_and_peers_stay_on_one_host():
    with pytest.raises(UsageError, match="NNODES is empty: use NNODES=2 or more"):
        checks.not_empty(given(NNODES=""), "NNODES")
    with pytest.raises(UsageError, match="make peers runs on one host: leave out NNODES"):
        checks.peers(given(NNODES="2", NODE_RANK="0", RDZV_ENDPOINT="h:1"))


# --- end to end: two launchers on this host as two nodes ----------------------------------------------------------

RUN = ["DATA=synthetic", "SEQ_LEN=32", "WARMUP=1", "DEVICE=cpu", "MODEL=tiny"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(rank: int, port: int, args: list[str], prefix, env: dict, **extra: str) -> subprocess.Popen:
    """One node's `make`: NNODES=2, this node's NODE_RANK, the rendezvous on this host."""
    values = dict(NNODES="2", NODE_RANK=str(rank), RDZV_ENDPOINT=f"127.0.0.1:{port}", PREFIX=str(prefix), **extra)
    cmd = ["make", "--no-print-directory", f"PYTHON={sys.executable}", *args, *RUN,
           *(f"{k}={v}" for k, v in values.items())]
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=dict(env, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _kill_node(node: subprocess.Popen, prefix: str) -> None:
    """SIGKILL every process of one node, as if the host were gone: its make and driver (their process group), and
    the processes torchrun started, which it puts in sessions of their own (found by the PREFIX in their argv)."""
    os.killpg(node.pid, signal.SIGKILL)
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f"--prefix={prefix}".encode() in f.read():
                    os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError):   # not a process, or gone already
            pass


def _losses(prefix) -> list[float]:
    return [float(r["loss"]) for r in read_csv(os.path.join(prefix, "results.csv"))]


def test_two_nodes_train_as_one_process_on_twice_the_batch(tmp_path):
    # As two processes on one node do (test_distributed).
    env = dict(clean_env(), OMP_NUM_THREADS="1")
    steps = ["baseline", "STEPS=5"]
    one = make(steps + ["BATCH_SIZE=4", f"PREFIX={tmp_path / 'one'}"] + RUN, env, timeout=300)
    assert one.returncode == 0, one.stderr
    port = _free_port()
    nodes = [_node(rank, port, steps + ["BATCH_SIZE=2"], tmp_path / f"node{rank}", env) for rank in (1, 0)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    # Node 0 records the run, whichever node the rendezvous ranked first; node 1's folder holds nothing.
    assert not os.listdir(tmp_path / "node1")
    # results.csv keeps 6 significant digits: the sums may differ by a step of that rounding at most.
    assert _losses(tmp_path / "node0") == pytest.approx(_losses(tmp_path / "one"), abs=2e-4)
    run, = read_csv(tmp_path / "node0" / "runs.csv")
    assert (run["status"], run["nproc"], run["nnodes"], run["batch_size"]) == ("ok", "2", "2", "2")
    assert run["hosts"] == f"{socket.gethostname()} {socket.gethostname()}"


def test_runs_in_a_row_on_two_nodes_are_all_recorded_on_node_0(tmp_path):
    # Each run is a rendezvous of its own: node 1 waits for node 0's last one to close before it starts the next.
    env, port = dict(clean_env(), OMP_NUM_THREADS="1"), _free_port()
    args = ["baseline", "STEPS=3", "BATCH_SIZE=2", "REPEAT=2"]
    nodes = [_node(rank, port, args, tmp_path / f"node{rank}", env) for rank in (0, 1)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert [run["status"] for run in read_csv(tmp_path / "node0" / "runs.csv")] == ["ok"] * 2


def test_a_node_killed_mid_run_ends_the_run_on_the_other_and_is_recorded_failed(tmp_path):
    env = dict(clean_env(), OMP_NUM_THREADS="1", DIST_TIMEOUT_S="60")
    port, args = _free_port(), ["baseline", "STEPS=3000", "BATCH_SIZE=2"]
    node0 = _node(0, port, args, tmp_path / "node0", env)
    node1 = _node(1, port, args, tmp_path / "node1", env)
    deadline = time.time() + 240
    for line in node0.stdout:
        if line.startswith("step 5/") or time.time() > deadline:
            break
    _kill_node(node1, str(tmp_path / "node1"))
    node1.wait()
    start = time.time()
    node0.communicate(timeout=120)
    assert node0.returncode != 0 and time.time() - start < 90
    run, = read_csv(tmp_path / "node0" / "runs.csv")
    assert run["status"] == "failed" and run["nnodes"] == "2", run["message"]
    assert run["message"].startswith(f"node 1 ({socket.gethostname()}) stopped or failed: "), run["message"]
    assert 5 <= len(read_csv(tmp_path / "node0" / "results.csv")) < 3000   # the steps it measured are kept


def test_a_node_that_never_joins_ends_the_run_after_the_rendezvous_timeout_and_node_0_records_it(tmp_path):
    env = dict(clean_env(), OMP_NUM_THREADS="1")
    start, port = time.time(), _free_port()
    node0 = _node(0, port, ["baseline", "STEPS=3", "BATCH_SIZE=2"], tmp_path / "node0", env, RDZV_TIMEOUT="5")
    out = node0.communicate(timeout=120)[0]
    assert node0.returncode != 0 and time.time() - start < 60, out
    assert "Traceback" not in out, out   # torchrun's own traceback is replaced by the run's one line
    run, = read_csv(tmp_path / "node0" / "runs.csv")
    assert (run["status"], run["nnodes"], run["nproc"], run["optimization"]) == ("failed", "2", "2", "baseline")
    assert run["message"].startswith(f"node 1 never joined the rendezvous at 127.0.0.1:{port} within RDZV_TIMEOUT=5 s")
    assert f"error: baseline failed: {run['message']}" in out
    assert not read_csv(tmp_path / "node0" / "results.csv")   # nothing ran, so no step


def test_a_node_whose_node_0_never_starts_ends_in_one_line_after_the_rendezvous_timeout(tmp_path):
    env = dict(clean_env(), OMP_NUM_THREADS="1")
    start, port = time.time(), _free_port()
    node1 = _node(1, port, ["baseline", "STEPS=3", "BATCH_SIZE=2"], tmp_path / "node1", env, RDZV_TIMEOUT="3")
    out = node1.communicate(timeout=120)[0]
    assert node1.returncode != 0 and time.time() - start < 30, out
    assert f"error: node 1: nothing listened at RDZV_ENDPOINT=127.0.0.1:{port} within RDZV_TIMEOUT=3 s" in out
    assert "Traceback" not in out and not os.listdir(tmp_path / "node1")


def test_make_scaling_runs_each_process_count_on_every_node(tmp_path, capsys, monkeypatch):
    from Utils.suite.__main__ import main
    monkeypatch.delenv("NODE_RANK", raising=False)
    rc = main(["scaling", "RUNG=fused", "NPROC=1 2", "NNODES=2", "NODE_RANK=1", "RDZV_ENDPOINT=h:29500", "STEPS=2",
               "BATCH_SIZE=2", f"PREFIX={tmp_path}", "DEVICE=cpu", f"PYTHON={sys.executable}", "--dry-run"])
    assert rc == 0
    launches = [line.split() for line in capsys.readouterr().out.splitlines() if "torch.distributed.run" in line]
    assert [line[line.index("--nproc-per-node") + 1] for line in launches] == ["1", "2"]
    assert all(line[line.index("--nnodes") + 1] == "2" and "is_host=false" in line[line.index("--rdzv-conf") + 1]
               for line in launches)
    assert "NODE_RANK" not in os.environ   # the children's environment has it; the driver's own is left alone


def test_torchruns_stderr_passes_whole_but_for_its_rendezvous_timeout_traceback(capsys):
    import io
    from Utils.suite.process import Runner
    worker = ["Traceback (most recent call last):\n", '  File "x.py", line 1, in <module>\n', "    f()\n",
              "ValueError: a worker's own error\n"]
    timeout = ["Traceback (most recent call last):\n", '  File "run.py", line 9, in main\n',
               "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError\n"]
    runner = Runner()
    runner._pass_on(io.StringIO("".join(["step 1\n", *worker, "between\n", *timeout])))
    assert capsys.readouterr().err == "".join(["step 1\n", *worker, "between\n"])
    assert runner.rendezvous_timed_out
    runner = Runner()
    runner._pass_on(io.StringIO("".join(worker[:2])))   # cut off mid-traceback: what came is still passed on
    assert capsys.readouterr().err == "".join(worker[:2]) and not runner.rendezvous_timed_out
