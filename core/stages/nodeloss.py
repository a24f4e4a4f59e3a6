"""The kill-and-resume check across nodes: one node lost between checkpoints (core/stages/resume.py runs it).

On several nodes every node runs the check's children together, each its own torchrun over every node, as in training.
What differs from one node:

- **The loss**: only the ranks of the lost node (:func:`lost_node`, torchrun's node rank ``GROUP_RANK``) hold at the
  kill point; that node's gpuaccept SIGKILLs every one of its processes (torchrun and its ranks: the node is gone) and
  tells the others where (:meth:`NodeLoss.tell_lost`). The other nodes' ranks went on into the next step and wait in
  its collectives for the lost ranks; they fail on their own (gloo: the connection is closed) or, where they would wait
  out the backend's timeout (NCCL), are SIGKILLed after :data:`LOSS_GRACE_S`, as a scheduler ends the job step of a
  node it lost (:meth:`NodeLoss.survive`).
- **The restart**: every node starts torchrun again from the checkpoint, as the scheduler restarts a job (a new
  rendezvous, the same nodes); a node that cannot resume stops the others before they wait for it at the rendezvous.
- **The checkpoint**: each node keeps a whole one in its own run folder (Trainer's ``save_on_each_node``; the RNG states
  of its own ranks only), and the resume starts from the newest checkpoint complete on *every* node
  (:meth:`NodeLoss.agree`): a node that finished checkpoint c + every while the lost node was writing it must not run
  ahead of the others.

Every node compares its own ranks with the uninterrupted run, step by step; the cluster record passes when every node's
record does.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from core.cluster.agree import stopped_by
from core.errors import GpuAcceptError, StageError
from core.protocol.events import KillPoint, Started
from core.stages.childproc import ChildJob, child_groups, groups_left_after_kill, kill_group

#: how long a surviving node's ranks may take to fail on their own once the lost node's are gone, before they are
#: SIGKILLed (NCCL would otherwise wait out its collective timeout, 10 min by default)
LOSS_GRACE_S = 60.0
#: how long a surviving node waits to be told of the loss once its own run has ended
TOLD_WAIT_S = 120.0


def lost_node(nnodes: int) -> int:
    """The node rank (torchrun's ``GROUP_RANK``) whose every rank the check kills: the last, never the one the ranks
    are numbered from."""
    return nnodes - 1


def node_ranks(child: ChildJob) -> tuple[int, ...]:
    """The global ranks this node's run held, from its ranks' ``started`` events."""
    return tuple(sorted({e.global_rank for e in child.events if isinstance(e, Started)}))


def node_rank(child: ChildJob) -> int | None:
    """This node's rank in the run (torchrun's ``GROUP_RANK``), from its ranks' ``started`` events; None before."""
    return next((e.node_rank for e in child.events if isinstance(e, Started)), None)


@dataclass(frozen=True)
class Survived:
    """How a surviving node's run ended after the loss: the lost node's word (its kill point and host), this run's
    seconds from the word to its end, its exit code (None: SIGKILLed after :data:`LOSS_GRACE_S`) and the process groups
    still alive after that."""

    told: dict[str, Any]
    seconds: float
    exit_code: int | None
    alive: list[int]
    pgid: int


class NodeLoss:
    """One node's part of the check on several nodes (the module's docstring), through the nodes' agreement
    (:class:`core.cluster.agree.NodeAgreement`).

    Args:
        cluster: the run's NodeAgreement.
        nnodes: the nodes of the run.
    """

    def __init__(self, cluster: Any, nnodes: int) -> None:
        self.cluster, self.nnodes = cluster, nnodes

    @property
    def lost(self) -> int:
        """The node rank of the node lost."""
        return lost_node(self.nnodes)

    def told(self) -> bool:
        """Whether the lost node said its ranks were killed, or another node stopped (it does not wait)."""
        return self.cluster.heard("lost") is not None or bool(self.cluster.stopped())

    def stop_if_another_stopped(self, child: ChildJob) -> None:
        """When another node stopped for good (its check failed before the loss), SIGKILL this node's run, which
        would wait for it in a collective, and stop naming it.

        Raises:
            StageError: another node stopped."""
        others = self.cluster.stopped()
        if others:
            kill_group(child)
            raise StageError(f"another node stopped, so this one stops too: {stopped_by(others)}")

    def tell_lost(self, event: KillPoint, host: str, node: int) -> None:
        """On the lost node, once every process of its run is killed: tell the others where it held."""
        self.cluster.tell("lost", json.dumps({"node": node, "host": host, "event": asdict(event)}))

    def survive(self, child: ChildJob, grace_s: float = LOSS_GRACE_S, told_wait_s: float = TOLD_WAIT_S) -> Survived:
        """On a surviving node: wait to be told of the loss, then up to ``grace_s`` for this node's run to end on its
        own; SIGKILL what is left of it (every process group).

        Raises:
            GpuAcceptError: the lost node said nothing within ``told_wait_s`` of this run's end (it failed before its
                kill point, or stopped)."""
        assert child.proc is not None
        deadline = time.monotonic() + told_wait_s
        while (text := self.cluster.heard("lost")) is None:
            self.stop_if_another_stopped(child)
            if child.proc.poll() is not None and time.monotonic() > deadline:
                raise GpuAcceptError(f"the lost node never said it was killed at its kill point, and this node's run "
                                     f"ended (exit code {child.proc.returncode}; see {child.log_path})")
            time.sleep(0.2)
        told = json.loads(text)
        start = time.monotonic()
        groups = child_groups(child)
        while child.proc.poll() is None and time.monotonic() - start < grace_s:
            time.sleep(0.2)
        code = child.proc.poll()
        pgid = kill_group(child)  # its ranks' groups too: a rank may outlive a torchrun that exited
        return Survived(told, time.monotonic() - start, code, groups_left_after_kill(groups), pgid)

    def agree(self, newest: int | None) -> tuple[int | None, list[str]]:
        """Post this node's newest complete checkpoint step (None: none) and wait for every node's; return the newest
        step complete on every node (None when a node has none) and, per other node whose newest differs, why.

        Raises:
            GpuAcceptError: a node stopped, or not every node posted in time."""
        posted = [(node, json.loads(text)) for node, text in self.cluster.exchange("checkpoint", json.dumps(newest))]
        steps = [step for _, step in posted]
        agreed = None if any(s is None for s in steps) else min(steps)
        others = [f"{node}'s newest complete checkpoint is " + (f"checkpoint-{step}" if step is not None else "none")
                  for node, step in posted if step != newest]
        return agreed, others

    def resumable(self, ok: bool, why: str) -> list[str]:
        """Post whether this node can resume (its checkpoint passed every check that guards loading) and wait for
        every node's; return the other nodes' reasons where they cannot (empty: every node goes on to the restart).

        Raises:
            GpuAcceptError: a node stopped, or not every node posted in time."""
        posted = [(node, json.loads(text)) for node, text in
                  self.cluster.exchange("resumable", json.dumps({"ok": ok, "why": why}))]
        return [f"{node}: {word['why']}" for node, word in posted if not word["ok"] and node != self.cluster.node]


def span_ranks(ranks: tuple[int, ...]) -> str:
    """Ranks in words: ``0..3``, ``1``."""
    return f"{ranks[0]}..{ranks[-1]}" if len(ranks) > 1 else (str(ranks[0]) if ranks else "?")
