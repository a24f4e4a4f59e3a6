"""Issue 39: the nodes of a several-node run stop together (core/cluster/agree.py). Two agreements in this process
stand for two nodes on one host (the first holds the store, the second finds its port taken and joins it); each gate
is passed in a thread, as each node passes it in its own process."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from core.cluster.agree import NodeAgreement, is_local, stopped_by, store_port
from core.errors import GpuAcceptError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def two_nodes():
    port = free_port() - 1  # the store listens on the rendezvous port + 1
    nodes = [NodeAgreement(f"127.0.0.1:{port}", "test", 2, wait_s=20) for _ in range(2)]
    assert [n.holds for n in nodes] == [True, False]
    return nodes


def both(nodes, *words):
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda nw: nw[0].gate("probe", *nw[1]), zip(nodes, words)))


def test_every_node_goes_on_only_when_every_node_does(two_nodes):
    assert both(two_nodes, (True,), (True,)) == [[], []]
    first, second = two_nodes
    with ThreadPoolExecutor(2) as pool:
        stops, goes = pool.map(lambda a: a[0].gate("train_eval", *a[1]),
                               [(first, (False, "its probe failed: min_busbw_gbps 0.1 MISSED")), (second, (True,))])
    assert stops == []  # the node that stops hears of no other
    (word,) = goes
    assert (word.node, word.goes_on) == (first.node, False)
    assert stopped_by(goes) == f"{first.node}: its probe failed: min_busbw_gbps 0.1 MISSED"


def test_a_node_that_stopped_for_good_stops_the_others_at_their_next_gate(two_nodes):
    first, second = two_nodes
    first.stop("plan: the plan does not fit on the device")
    (word,) = second.gate("probe", True)  # returns at once: the other will never post
    assert word.why == "plan: the plan does not fit on the device"
    second.close()
    first.close(wait_s=5)  # the holder waits until both are done


def test_a_node_that_never_comes_is_named_after_the_wait():
    port = free_port() - 1
    alone = NodeAgreement(f"127.0.0.1:{port}", "alone", 2, wait_s=0.5)
    with pytest.raises(GpuAcceptError, match="1 of 2 nodes reached this stage within 0 s"):
        alone.gate("probe", True)


def test_the_store_is_beside_the_rendezvous():
    assert store_port("node0.cluster:29500") == ("node0.cluster", 29501)
    assert store_port("[::1]:29500") == ("::1", 29501)
    assert is_local("127.0.0.1") and not is_local("192.0.2.1")  # TEST-NET-1: never this machine's


def test_the_wizard_refuses_several_nodes_by_name(capsys):
    """The nodes pass their gates and share their records in the headless run only: the wizard says so, exit 2."""
    from tui.cli import main

    code = main(["run", "--nnodes", "2", "--rdzv-endpoint", "10.0.0.1:29500", "--strategy", "ddp", "--devices", "cpu",
                 "--nproc", "1"])
    assert code == 2
    assert "a run on 2 nodes is headless" in capsys.readouterr().err


def test_nodes_exchange_words_and_one_tells_the_others(two_nodes):
    """The resume check across nodes: each posts its newest complete checkpoint and gets every node's; the lost node
    tells the others it was killed, which they read without waiting."""
    first, second = two_nodes
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda nw: nw[0].exchange("checkpoint", nw[1]), [(first, "20"), (second, "10")]))
    assert all(sorted(g) == sorted([(first.node, "20"), (second.node, "10")]) for g in got)
    assert first.heard("lost") is None
    second.tell("lost", '{"node": 1}')
    deadline = time.monotonic() + 10  # a client's set is not acknowledged: the other node sees it within a poll or two
    while first.heard("lost") is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first.heard("lost") == '{"node": 1}'
    first.stop("resume: its checkpoint failed manifest")
    with pytest.raises(GpuAcceptError, match="resumable: another node stopped: .*its checkpoint failed manifest"):
        second.exchange("resumable", "{}")


def test_the_resume_check_across_nodes_runs_under_ddp_and_is_refused_by_name_under_zero3(tiny_model_dir):
    from core import api
    from core.plan.devices import DeviceInfo
    from core.spec import RunSpec

    host = [DeviceInfo("cpu", "cpu", "test host", 64 * 2**30, "constructed for tests")]
    reasons = {}
    for strategy in ("ddp", "zero3"):
        spec = RunSpec.build(model=str(tiny_model_dir), seq_len=64, strategy=strategy, torchrun_nnodes=2,
                             torchrun_rdzv_endpoint="10.0.0.1:29500", torchrun_nproc_per_node=1)
        reasons[strategy] = api.runnable_reason(spec, api.plan(spec, host))
    assert reasons["ddp"] is None
    assert reasons["zero3"] is not None and reasons["zero3"].startswith(
        "resume.check: across nodes the kill-and-resume check runs under ddp")


def test_a_node_running_another_spec_is_refused_by_name_at_the_first_gate():
    """Found by trying it: node0 given --nnodes 2 and node1 --nnodes 3 once left both waiting (node0 at torchrun's
    rendezvous, node1 at its gate) with nothing named; the spec's hash in each word refuses it at once."""
    port = free_port() - 1
    nodes = [NodeAgreement(f"127.0.0.1:{port}", "spec", 2, wait_s=20, spec_hash=h) for h in ("a" * 64, "b" * 64)]
    with ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(lambda n: _gate_or_error(n), nodes))
    assert all(isinstance(o, GpuAcceptError) for o in outcomes), outcomes
    assert "runs another spec (hash bbbbbbbbbbbb, this node's aaaaaaaaaaaa)" in str(outcomes[0])


def _gate_or_error(node):
    try:
        return node.gate("probe", True)
    except GpuAcceptError as exc:
        return exc


def test_the_node_holding_rank_0_gets_every_record_and_a_missing_node_is_counted(two_nodes):
    first, second = two_nodes
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda a: a[0].share(*a[1]), [(first, ("rec0", False)), (second, ("rec1", True))]))
    assert got[0] is None and sorted(got[1]) == [("rec0", False), ("rec1", True)]  # the rank-0 node writes
    port = free_port() - 1
    alone = NodeAgreement(f"127.0.0.1:{port}", "alone", 2, wait_s=5)
    with pytest.raises(GpuAcceptError, match="1 of 2 nodes shared their record within 0 s"):
        alone.share("rec", True, wait_s=0.3)


def test_a_run_started_again_on_a_store_still_held_does_not_read_the_previous_runs_words(two_nodes):
    """The store's holder waits up to 60 s in close() for the other nodes; a run started again meanwhile joins that
    store, and its gates must wait for its own nodes, not pass on the previous run's posts."""
    first, second = two_nodes
    assert both(two_nodes, (True,), (True,)) == [[], []]  # the previous run passed its probe gate
    again = NodeAgreement(f"127.0.0.1:{first.store.port - 1}", "test", 2, wait_s=0.5)  # the store's port - 1  # the same run id, on the store still held
    assert not again.holds and again.prefix != first.prefix == second.prefix
    with pytest.raises(GpuAcceptError, match="1 of 2 nodes reached this stage"):
        again.gate("probe", True)
