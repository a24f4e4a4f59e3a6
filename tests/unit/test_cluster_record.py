"""Issue 39: the cluster record (core/record/cluster.py) over committed node records: built from the records' texts,
verified with every node's record checked inside it, and each kind of edit found. Two real nodes write one in
tests/integration/test_nodes.py."""

from __future__ import annotations

import shutil

import pytest

from core.record.cluster import cluster_record, sha256
from core.record.verify import record_problems
from tests.records import path_of

pytestmark = pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="verify's checks use ssh-keygen")


def test_a_cluster_record_holds_every_node_record_and_verifies():
    text = path_of("lora").read_text()
    rec = cluster_record([text, text], rank0=0)
    assert [n["sha256"] for n in rec["nodes"]] == [sha256(text)] * 2
    assert [n["holds_rank_0"] for n in rec["nodes"]] == [True, False]
    (row,) = rec["devices"]  # one rank: the committed record is a single-process run
    assert row["device"] == "cpu" and row["fits"] is True and row["measured_peak_bytes"] > 0
    assert rec["verdict"] == {"status": "pass", "evidence": "every one of the 2 nodes passed"}
    assert record_problems(rec) == ([], [])
    from core.record.summary import box_of

    host = rec["nodes"][0]["host"]  # `gpuaccept verify FOLDER` names a cluster record's nodes in its box column
    assert box_of(rec) == f"2 nodes: {host}, {host}"


def test_what_a_cluster_record_must_not_hide():
    text = path_of("lora").read_text()
    other = cluster_record([text, path_of("full").read_text()], rank0=0)
    _, verdicts = record_problems(other)
    assert any("did not run the same spec" in v for v in verdicts), verdicts
    edited = cluster_record([text, text], rank0=0)
    edited["verdict"]["status"] = "fail"
    edited["devices"][0]["measured_peak_bytes"] += 1
    edited["nodes"][1]["holds_rank_0"] = True
    _, verdicts = record_problems(edited)
    assert "verdict.status is 'fail', the nodes' verdicts give 'pass'" in verdicts
    assert "2 nodes are said to hold rank 0; one does" in verdicts
    broken = cluster_record([text, text], rank0=0)
    from core.record.written import SCHEMA_VERSION

    assert f"schema_version = {SCHEMA_VERSION}" in text
    broken["nodes"][0]["record"] = text.replace(f"schema_version = {SCHEMA_VERSION}", "schema_version = 99", 1)
    schema, _ = record_problems(broken)
    assert schema and schema[0].startswith("nodes[0] (")  # the node's own schema finding, named by node


def test_a_cluster_record_is_signed_and_its_sign_off_follows_its_verdict(tmp_path):
    import subprocess

    from core.record.cluster import cluster_problems
    from core.record.signoff import sign_record
    from core.record.verify import EXIT_SIGNER_NOT_CHECKED, verify
    from core.record.written import write_record

    text = path_of("lora").read_text()
    path = write_record(cluster_record([text, text], rank0=0), tmp_path / "cluster.toml")
    key = tmp_path / "key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    sign_record(path, key, {"operator": "Ada", "role": "", "decision": "accept", "comment": "",
                            "time_utc": cluster_record([text], 0)["created_utc"]})
    assert verify(path).exit_code == EXIT_SIGNER_NOT_CHECKED  # signed, consistent; the signer not checked
    # a cluster that did not pass, accepted: only with the operator's reason (node records taken as they are here)
    failing = cluster_record([text, text.replace('[verdict]\nstatus = "pass"', '[verdict]\nstatus = "fail"', 1)], 0)
    assert failing["verdict"]["status"] == "fail"
    failing["signoff"] = {"status": "signed", "operator": "Ada", "decision": "accept"}
    as_they_are = lambda rec: ([], [])  # noqa: E731 - the node records' own checks are not what is tested here
    assert cluster_problems(failing, as_they_are)[1] == [
        "the sign-off accepts a cluster that did not pass without the operator's override (the reason)"]
    failing["signoff"]["override"] = "node1's link is being replaced; accepted on node0 alone"
    assert cluster_problems(failing, as_they_are)[1] == []


def command_node(host: str, ranks: list[int], world: int) -> dict:
    """What rank_problems reads of a node's record of a user's command."""
    return {"kind": "command", "environment": {"host": host}, "ran": {"world_size": world},
            "probe": {"devices": [{"device": "cpu:0", "rank": r} for r in ranks]}}


def test_records_of_a_command_that_ran_a_job_per_node_are_not_one_cluster():
    """A launcher line without the nodes' rendezvous: each node trains alone as rank 0 of world 1, and gpuaccept was
    told two nodes; the cluster must not pass on two unrelated runs."""
    from core.record.cluster import cluster_verdict, rank_problems

    assert rank_problems([command_node("node0", [0], 2), command_node("node1", [1], 2)]) == []
    alone = rank_problems([command_node("node0", [0], 1), command_node("node1", [0], 1)])
    assert alone and alone[0].startswith("rank 0 ran on node0 and on node1: each node ran a job of its own")
    nodes = [{"host": h, "verdict": "pass"} for h in ("node0", "node1")]
    assert cluster_verdict(nodes, alone) == ("fail", alone[0])
    short = rank_problems([command_node("node0", [0], 4), command_node("node1", [1], 4)])
    assert short == ["2 ranks measured over the nodes, and the Trainer reported world size 4"]
