"""Several hosts through torchrun's c10d rendezvous (NNODES, NODE_RANK, RDZV_ENDPOINT), on the CPU with gloo: two
launchers on this host stand for two nodes. The command lines and refusals in-process; the runs end to end."""
import re

import pytest

from Utils.suite import checks, commands
from Utils.suite.given import Given
from Utils.train.usage import UsageError

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
