"""Issue 39: command mode's resume check across nodes (core/command/nodeloss.py and its part of core/command/resume.py),
its decisions taken against a stand-in for the nodes' agreement. The runs themselves, two network-namespace hosts each
running its gpuaccept, are in tests/integration/test_nodes.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from core.command.nodeloss import CommandNodes
from core.command.resume import _agreed_checkpoint, _every_node_resumable, _Progress
from core.command.resumechecks import KillPlan
from core.command.run import RunOutcome
from core.errors import StageError
from core.stages.checkpoint import Checkpoint, trainer_files
from core.stages.noise import Tier
from core.status import StageStatus


class Agreement:
    """The NodeAgreement calls the check makes, with the other node's words given (``said``: key -> its text)."""

    def __init__(self, id_: str, holds: bool, said: dict[str, str], other: str = "node0 (pid 1)") -> None:
        self.id, self.holds, self.said, self.other = id_, holds, said, other
        self.node = "node1 (pid 2)"
        self.told: dict[str, str] = {}
        self.stops: list[str] = []

    def exchange(self, key: str, text: str) -> list[tuple[str, str]]:
        return [(self.other, self.said[key]), (self.node, text)]

    def tell(self, key: str, text: str) -> None:
        self.told[key] = text

    def heard(self, key: str) -> str | None:
        return self.said.get(key)

    def stopped(self) -> list:
        return []

    def stop(self, why: str) -> None:
        self.stops.append(why)


def test_the_node_lost_is_one_that_does_not_hold_the_store():
    # node0 holds the store the nodes agree through (the rendezvous host): node1 is lost, whatever the ids' order
    words = {"command-resume/nodes": json.dumps({"id": "zzz", "holds": True})}
    nodes = CommandNodes.choose(Agreement("aaa", False, words), 2)
    assert (nodes.lost, nodes.lost_name, nodes.is_lost) == ("aaa", "node1 (pid 2)", True)
    words = {"command-resume/nodes": json.dumps({"id": "aaa", "holds": False})}
    nodes = CommandNodes.choose(Agreement("zzz", True, words), 2)
    assert (nodes.lost, nodes.lost_name, nodes.is_lost) == ("aaa", "node0 (pid 1)", False)


def checkpoint(root: Path, step: int, files: list[str]) -> Checkpoint:
    folder = root / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    for name in files:
        (folder / name).write_bytes(b"x")
    return Checkpoint(step, folder)


def node1(tmp_path: Path, files: list[str]) -> tuple[RunOutcome, _Progress]:
    """Node 1's interrupted run after the loss, its checkpoint-2 holding ``files``; its required files are a LoRA
    Trainer's with its own rank's RNG state."""
    run = RunOutcome("interrupted", [], tmp_path, tmp_path, tmp_path / "command.log")
    run.checkpoints = [checkpoint(tmp_path, 2, files)]
    return run, _Progress(time.perf_counter(), Tier("cpu-fp32-exact", "exact", 0.0, "the CPU"), trainer_files(True, False, 2, [1]))


def test_a_node_without_a_whole_checkpoint_of_its_own_stops_every_nodes_resume(tmp_path):
    """Trainer's default across nodes (save_on_each_node off): rank 0's node writes the checkpoint, the other node's
    folder holds its ranks' RNG states only. After losing a node, that node has nothing to resume from on its disk:
    no checkpoint is complete on every node, and the check says which files and what to change."""
    run, progress = node1(tmp_path, ["rng_state_1.pth"])
    nodes = CommandNodes(Agreement("b", False, {"checkpoint": json.dumps(2)}), 2, "b", "node1 (pid 2)")
    assert _agreed_checkpoint(nodes, run, KillPlan(2, 4, 3, 6), progress) is None
    (check,) = progress.checks
    assert (check.name, check.status) == ("checkpoint_selection", StageStatus.FAIL)
    assert check.evidence == (
        "the newest checkpoint complete on every node is none, not checkpoint-2 (this node's: none; node0 (pid 1)'s "
        "newest complete checkpoint is checkpoint-2); missing here: adapter weights (adapter_model.safetensors), "
        "optimizer (optimizer.pt), scheduler (scheduler.pt), trainer state (trainer_state.json) from checkpoint-2 (a node resumes from its own disk: the job must save a "
        "whole checkpoint on each node, Trainer's save_on_each_node)")


def test_with_a_whole_checkpoint_on_each_node_every_node_resumes_from_the_same_one(tmp_path):
    run, progress = node1(tmp_path, ["adapter_model.safetensors", "optimizer.pt", "scheduler.pt",
                                     "trainer_state.json", "rng_state_1.pth"])
    nodes = CommandNodes(Agreement("b", False, {"checkpoint": json.dumps(2)}), 2, "b", "node1 (pid 2)")
    assert _agreed_checkpoint(nodes, run, KillPlan(2, 4, 3, 6), progress) == run.checkpoints[0]
    assert progress.checks == []


def test_a_node_that_may_not_resume_stops_the_others_restart(tmp_path):
    _, progress = node1(tmp_path, [])
    said = {"resumable": json.dumps({"ok": False, "why": "its checkpoint failed safe_loading"})}
    nodes = CommandNodes(Agreement("b", False, said), 2, "b", "node1 (pid 2)")
    assert _every_node_resumable(nodes, True, progress) is False
    (check,) = progress.checks
    assert check.evidence == "not every node may resume, so none restarts: node0 (pid 1): its checkpoint failed " \
                             "safe_loading"
    said = {"resumable": json.dumps({"ok": True, "why": ""})}
    _, progress = node1(tmp_path / "again", [])
    assert _every_node_resumable(CommandNodes(Agreement("b", False, said), 2, "b", "n"), True, progress) is True


def test_a_surviving_node_is_killed_after_the_grace_and_waits_for_the_word():
    words: dict[str, str] = {}
    nodes = CommandNodes(Agreement("a", True, words), 2, "b", "node1 (pid 2)")
    kill = nodes.survivor_kill(grace_s=0.05, read_every_s=0.0)
    assert kill(None) is False  # nothing said: its ranks are still training
    words["command-lost"] = json.dumps({"node": "node1 (pid 2)", "host": "node1", "step": 3, "ranks": [1]})
    assert kill(None) is False  # told: the grace begins
    time.sleep(0.06)
    assert kill(None) is True
    assert nodes.wait_lost(0.1)["step"] == 3
    del words["command-lost"]
    with pytest.raises(StageError, match="never said its command was killed at its kill point within 0 s"):
        nodes.wait_lost(0.01)


# ------------------------------------------------------------------------------ resuming at another world size
def test_the_resume_lines_world_size_is_read_from_torchrun():
    from core.command.resumechecks import resize_of
    from core.commandspec import CommandSpec, launcher_nproc, with_nproc

    run = "python -m torch.distributed.run --standalone --nproc-per-node {n} train.py --out {{out}}"
    spec = CommandSpec.from_dict({"train": run.format(n=4), "resume": run.format(n=2) + " --resume {checkpoint}",
                                  "metrics": "m.jsonl", "checkpoint_files": [".metadata"]})
    resize = resize_of(spec)
    assert (resize.trained, resize.resumed, resize.nproc) == (4, 2, 2)
    assert resize_of(CommandSpec.from_dict({"train": run.format(n=4), "metrics": "m.jsonl"})) is None  # {command}
    assert launcher_nproc(["torchrun", "--nproc_per_node=gpu", "t.py"]) is None  # only the node knows
    assert launcher_nproc(["torchrun", "t.py", "--nproc-per-node", "8"]) == 1  # the script's own flag: torchrun's 1
    assert with_nproc(["torchrun", "--nproc_per_node=4", "t.py"], 1) == ["torchrun", "--nproc_per_node=1", "t.py"]
    assert with_nproc(["torchrun", "--nproc-per-node", "4", "t.py", "--nproc-per-node", "9"], 2)[:4] == \
        ["torchrun", "--nproc-per-node", "2", "t.py"]
    assert with_nproc(["torchrun", "t.py"], 2) == ["torchrun", "--nproc-per-node=2", "t.py"]
    exact = Tier("cuda-bf16-twin-noise", "twin", 4.0, "CUDA")
    assert resize.tier(exact).name == "cuda-bf16-world-size-twin" and resize.tier(exact).loss_multiple == 0.0
    assert resize.tier(exact).twins == 2  # at least two: a spread, not one draw


def test_a_checkpoint_at_another_world_size_is_resumed_only_when_dcp_can_reshard_it(tmp_path):
    from core.command.resumechecks import Resize, dcp_world_check
    from core.stages.checkpoint import world_size_check

    resize = Resize(trained=2, resumed=1, nproc=1)
    dcp = tmp_path / "checkpoint-2"
    dcp.mkdir()
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):
        (dcp / name).write_bytes(b"x")
    allowed = dcp_world_check(dcp, resize)
    assert allowed.status == StageStatus.PASS and "DCP reshards it on load" in allowed.evidence
    (dcp / ".metadata").unlink()  # one file per rank, nothing saying how they reshard: refused by name
    refused = dcp_world_check(dcp, resize)
    assert refused.status == StageStatus.FAIL and refused.evidence.startswith(
        "refused: the resume command runs at world size 1 and the training ran at 2, and checkpoint-2 is not a "
        "torch.distributed.checkpoint (DCP) checkpoint (no .metadata)")
    # Trainer's checkpoint: an RNG state per rank, each rank's data shard: refused at the resume's world size
    trainer = tmp_path / "trainer" / "checkpoint-2"
    trainer.mkdir(parents=True)
    for r in range(2):
        (trainer / f"rng_state_{r}.pth").write_bytes(b"x")
    check = world_size_check(trainer, resize.resumed)
    assert check.status == StageStatus.FAIL and check.evidence.startswith(
        "refused: checkpoint-2 was written by 2 process(es) (rng_state_0..1.pth) and this resume would run 1")


def test_a_resize_across_nodes_is_refused_by_name(tmp_path):
    from core.command.resume import resume_stage
    from core.commandspec import CommandSpec

    line = "python -m torch.distributed.run --nnodes {n} --nproc-per-node 1 --rdzv-endpoint n0:29500 t.py --out {{out}}"
    spec = CommandSpec.from_dict({"train": line.format(n=2), "resume": line.format(n=1) + " --resume {checkpoint}",
                                  "nnodes": 2, "rdzv_endpoint": "n0:29500", "metrics": "m.jsonl"})
    reference = RunOutcome("reference", [], tmp_path, tmp_path, tmp_path / "command.log")
    reference.hook.trainers.append({"rank": 0, "world_size": 2})
    nodes = CommandNodes(Agreement("a", True, {}), 2, "b", "node1 (pid 2)")
    stage = resume_stage(spec, reference, tmp_path, {}, Tier("cpu-fp32-exact", "exact", 0.0, "the CPU"), nodes=nodes)
    with pytest.raises(StopIteration) as done:
        next(stage)
    (check,) = done.value.value.checks
    assert check.name == "world_size" and check.status == StageStatus.FAIL
    assert "after losing a node the others hold only their own ranks' shards" in check.evidence


def test_a_node_whose_check_ends_before_the_runs_tells_the_others(tmp_path):
    """A node that cannot place the kill (no checkpoint in its uninterrupted run) ends its check there, and says so to
    the others, which would otherwise wait for it at the next run's rendezvous."""
    from core.command.resume import resume_stage
    from core.commandspec import CommandSpec

    line = "python -m torch.distributed.run --nnodes 2 --nproc-per-node 1 --rdzv-endpoint n0:29500 t.py --out {out}"
    spec = CommandSpec.from_dict({"train": line, "nnodes": 2, "rdzv_endpoint": "n0:29500"})
    reference = RunOutcome("reference", [], tmp_path, tmp_path, tmp_path / "command.log")
    reference.hook.trainers.append({"rank": 1, "world_size": 2})
    agreement = Agreement("a", True, {})
    stage = resume_stage(spec, reference, tmp_path, {}, Tier("cpu-fp32-exact", "exact", 0.0, "the CPU"),
                         nodes=CommandNodes(agreement, 2, "b", "node1 (pid 2)"))
    with pytest.raises(StopIteration) as done:
        next(stage)
    assert [c.name for c in done.value.value.checks] == ["checkpoints"]
    (why,) = agreement.stops
    assert why.startswith("its resume check stopped before the runs every node makes together: failed: checkpoints")
