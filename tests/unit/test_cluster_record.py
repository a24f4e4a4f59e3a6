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
    broken["nodes"][0]["record"] = text.replace("schema_version = 5", "schema_version = 99", 1)
    schema, _ = record_problems(broken)
    assert schema and schema[0].startswith("nodes[0] (")  # the node's own schema finding, named by node
