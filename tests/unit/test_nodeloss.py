"""Issue 39: the resume check across nodes, one node lost (core/stages/nodeloss.py and its part of
core/stages/resume.py). The whole path runs on two namespace hosts in tests/integration/test_nodes.py; here each rule
on its own: which ranks hold, the checkpoint every node resumes from, a node's own RNG files, and the words of a node
that survived."""

from __future__ import annotations

import json
import shutil

import pytest

from core.protocol.events import KillPoint
from core.spec import RunSpec
from core.stages.checkpoint import world_size_check
from core.stages.nodeloss import NodeLoss, Survived, lost_node
from core.stages.resumechecks import checkpoint_checks, survivor_checks
from core.status import StageStatus
from tests.unit.test_resume_logic import lora_checkpoint


class Posts:
    """The nodes' agreement as NodeLoss sees it: what every node posts at each exchange, given up front."""

    def __init__(self, **posted: list[tuple[str, object]]) -> None:
        self.posted = posted
        self.node = "node1 (pid 2)"
        self.sent: dict[str, str] = {}

    def exchange(self, key: str, text: str) -> list[tuple[str, str]]:
        self.sent[key] = text
        return [(node, json.dumps(word)) for node, word in self.posted[key]]


def test_the_last_node_is_lost_and_only_its_ranks_hold(monkeypatch):
    from core.child.callbacks import KillSwitch
    from core.protocol.job import worker_job

    assert [lost_node(n) for n in (2, 4)] == [1, 3]
    spec = RunSpec.build(None, mode="lora", strategy="ddp", torchrun_nnodes=2, torchrun_rdzv_endpoint="node0:29500")
    from dataclasses import replace

    job = replace(worker_job(spec, "train", "m", "cpu", ["cpu"]), role="interrupted", kill_at="boundary+1",
                  kill_step=2, kill_node=lost_node(2))
    held = {}
    for node in ("0", "1"):
        monkeypatch.setenv("GROUP_RANK", node)
        held[node] = KillSwitch(job, events=None, grad_accum=1).kill_at  # type: ignore[arg-type]
    assert held == {"0": None, "1": "boundary+1"}  # node 0's ranks run on into the next step's collectives


def ranked_checkpoint(path, spec, step: int, rank: int):
    """One node's checkpoint of a two-node run: a whole LoRA checkpoint with the RNG state of its own rank only."""
    lora_checkpoint(path, spec)
    shutil.move(path / "rng_state.pth", path / f"rng_state_{rank}.pth")
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return path


@pytest.fixture
def two_node_spec():
    return RunSpec.build(None, mode="lora", steps=40, resume_checkpoint_every=10, resume_kill_after_checkpoint=1)


def test_a_node_that_finished_a_newer_checkpoint_resumes_with_the_others_from_the_one_complete_on_every_node(
        tmp_path, two_node_spec):
    """checkpoint-write: the lost node died writing checkpoint-20, which this node finished; both resume from 10."""
    from core.protocol.manifest import write_manifest

    ckpt = ranked_checkpoint(tmp_path / "checkpoint-10", two_node_spec, 10, rank=1)
    ranked_checkpoint(tmp_path / "checkpoint-20", two_node_spec, 20, rank=1)
    posts = Posts(checkpoint=[("node0 (pid 1)", 10), ("node1 (pid 2)", 20)])
    manifest = write_manifest(ckpt, tmp_path / "manifest.json")
    checks, resumable = checkpoint_checks(two_node_spec, tmp_path, ckpt, manifest, 2, 2, (1,), NodeLoss(posts, 2))
    assert posts.sent["checkpoint"] == "20"  # this node's newest complete one
    by = {c.name: c for c in checks}
    assert resumable and all(c.status == StageStatus.PASS for c in checks), checks
    assert by["checkpoint_selection"].evidence == (
        "resume from checkpoint-10, the newest complete checkpoint; skipped checkpoint-20 is complete on this node, "
        "not on every node; node0 (pid 1)'s newest complete checkpoint is checkpoint-10")
    assert "RNG state of rank 1 (rng_state_1.pth)" in by["checkpoint_complete"].evidence
    # a node with no complete checkpoint leaves none to resume from on any node
    posts = Posts(checkpoint=[("node0 (pid 1)", None), ("node1 (pid 2)", 20)])
    checks, resumable = checkpoint_checks(two_node_spec, tmp_path, ckpt, manifest, 2, 2, (1,), NodeLoss(posts, 2))
    assert not resumable and checks[0].status == StageStatus.FAIL
    assert checks[0].evidence.startswith("no complete checkpoint to resume from")


def test_a_nodes_checkpoint_holds_the_rng_states_of_its_own_ranks(tmp_path, two_node_spec):
    ckpt = ranked_checkpoint(tmp_path / "checkpoint-10", two_node_spec, 10, rank=1)
    mine = world_size_check(ckpt, 2, (1,))
    assert mine.status == StageStatus.PASS and "ranks [1] of this node's ranks [1]" in mine.evidence
    theirs = world_size_check(ckpt, 2, (0,))  # another node's ranks given this node's files
    assert theirs.status == StageStatus.FAIL and "not written by this node's ranks" in theirs.evidence


def test_a_node_that_cannot_resume_is_named_to_the_others():
    posts = Posts(resumable=[("node0 (pid 1)", {"ok": False, "why": "its checkpoint failed manifest"}),
                             ("node1 (pid 2)", {"ok": True, "why": ""})])
    assert NodeLoss(posts, 2).resumable(True, "") == ["node0 (pid 1): its checkpoint failed manifest"]
    assert json.loads(posts.sent["resumable"]) == {"ok": True, "why": ""}


@pytest.mark.parametrize("code, seconds, alive, ended, status", [
    (1, 1.8, [], "ranks 0..1 ended on their own 1.8 s later (torchrun exit code 1)", StageStatus.PASS),
    (None, 60.0, [], "ranks 0..1 were still waiting 60 s later and were SIGKILLed", StageStatus.PASS),
    (None, 60.0, [4242], "ranks 0..1 were still waiting 60 s later and were SIGKILLed", StageStatus.FAIL),
])
def test_a_surviving_node_says_where_the_lost_node_died_and_how_its_own_ranks_ended(code, seconds, alive, ended,
                                                                                  status):
    spec = RunSpec.build(None, mode="lora", steps=8, resume_checkpoint_every=2, resume_kill_after_checkpoint=1)
    event = KillPoint(step=2, where="micro", micro_done=1, micro_in_step=1)
    told = {"node": 1, "host": "node1", "event": {"step": 2, "where": "micro", "micro_done": 1, "micro_in_step": 1}}
    kill, point = survivor_checks(spec, Survived(told, seconds, code, alive, 99), (0, 1))
    assert kill.status == status and kill.evidence.startswith("node loss: every process of node 1 (node1)'s run "
                                                              "SIGKILLed inside step ")
    assert f"this node's {ended}" in kill.evidence
    assert ("still alive" in kill.evidence) == bool(alive)
    from core.stages.resumechecks import kill_point_check

    assert point.evidence == "node 1 (node1): " + kill_point_check(spec, event).evidence
    assert point.status == kill_point_check(spec, event).status


class Store(Posts):
    """The agreement's words a surviving node reads while it waits: the lost node's, or another node's stop."""

    def __init__(self, lost: dict | None = None, stopped: list | None = None) -> None:
        super().__init__()
        self.lost, self.words = lost, stopped or []

    def heard(self, key: str) -> str | None:
        return json.dumps(self.lost) if key == "lost" and self.lost is not None else None

    def stopped(self) -> list:
        return self.words


def a_nodes_run(tmp_path, seconds: float):
    """A process standing for this node's run (its own session, as torchrun's is), ending after ``seconds``."""
    import subprocess
    import sys

    from core.stages.childproc import ChildJob

    proc = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"], start_new_session=True)
    return ChildJob("interrupted", tmp_path, job=None, proc=proc)  # type: ignore[arg-type]


LOST = {"node": 1, "host": "node1", "event": {"step": 2, "where": "micro", "micro_done": 1, "micro_in_step": 1}}


def test_a_surviving_node_waits_for_its_run_to_end_then_kills_what_is_left(tmp_path):
    ended = NodeLoss(Store(lost=LOST), 2).survive(a_nodes_run(tmp_path, 0.2), grace_s=20)
    assert ended.exit_code == 0 and ended.seconds < 10 and ended.alive == []  # it ended on its own
    waiting = a_nodes_run(tmp_path, 600)  # a rank waiting out a collective's timeout (NCCL's)
    killed = NodeLoss(Store(lost=LOST), 2).survive(waiting, grace_s=0.5)
    assert killed.exit_code is None and waiting.proc.poll() == -9 and killed.alive == []


def test_another_nodes_stop_ends_the_wait_and_names_it(tmp_path):
    from core.cluster.agree import NodeWord
    from core.errors import StageError

    run = a_nodes_run(tmp_path, 600)
    nodes = NodeLoss(Store(stopped=[NodeWord("node1 (pid 7)", False, "the interrupted run ended before its kill "
                                                                     "point")]), 2)
    assert nodes.told()  # the interrupted run stops being followed
    with pytest.raises(StageError, match=r"another node stopped, so this one stops too: node1 \(pid 7\): the "
                                         "interrupted run ended before its kill point"):
        nodes.survive(run)
    assert run.proc.poll() == -9  # its ranks would wait for the stopped node in a collective
