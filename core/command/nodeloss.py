"""Command mode's kill-and-resume check across nodes: one node lost between checkpoints (core/command/resume.py runs
it), as :mod:`core.stages.nodeloss` does for gpuaccept's own recipe.

Every node's gpuaccept runs each run of the check (the twin, the interrupted run, the resumed run) together: the
user's launcher line on every node, one torchrun rendezvous over all of them, as in training. What differs from one
node:

- **Which node is lost**: one the nodes agree on before the interrupted run (:meth:`CommandNodes.choose`): the last,
  by its gpuaccept's id, of those that do not hold the store the nodes agree through (the rendezvous host's), so the
  agreement outlives the loss. torchrun's node rank is not fixed before a rendezvous, so it is not what decides.
- **The loss**: the lost node's command holds after step k (the Trainer hook's ``GPUACCEPT_HOLD_AT_STEP``); once each
  of its ranks held, its gpuaccept SIGKILLs every process of the command (torchrun and its ranks: the node is gone)
  and tells the others. The other nodes' commands run on into step k + 1 and wait for the lost ranks in its
  collectives; they fail on their own (gloo: the connection is closed) or, where they would wait out the backend's
  timeout (NCCL), are SIGKILLed :data:`~core.stages.nodeloss.LOSS_GRACE_S` after the word, as a scheduler ends the
  job step of a node it lost.
- **The checkpoint**: each node resumes from its own ``{out}`` (a node's local disk: the job must save a whole
  checkpoint on each node, Trainer's ``save_on_each_node``, or a node has nothing to resume from after the loss,
  which the check then shows). Its required files hold its own ranks' RNG states only, and the resume starts from
  the newest checkpoint complete on *every* node (:meth:`core.stages.nodeloss.NodeLoss.agree`).
- **The restart**: every node runs the resume command together, or none does: a node whose checkpoint may not be
  loaded stops the others before they wait for it at the rendezvous.

Each node compares its own ranks' steps and its own final checkpoint with the uninterrupted run.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from core.cluster.agree import stopped_by
from core.errors import GpuAcceptError, StageError
from core.stages.nodeloss import LOSS_GRACE_S, TOLD_WAIT_S, NodeLoss, span_ranks

#: the word the lost node posts once every process of its command is killed
LOST = "command-lost"
#: how often a run's poll reads the store for the other nodes' words (the agreement's own poll, core/cluster/agree.py)
STORE_READ_S = 0.2

T = TypeVar("T")


@dataclass(frozen=True)
class CommandNodes:
    """This node's part in losing one node of the user's command (the module's docstring).

    Attributes:
        cluster: the run's :class:`core.cluster.agree.NodeAgreement`.
        nnodes: the nodes of the run.
        lost: the id (``NodeAgreement.id``) of the node the check loses.
        lost_name: that node's name, ``host (pid N)``.
    """

    cluster: Any
    nnodes: int
    lost: str
    lost_name: str

    @classmethod
    def choose(cls, cluster: Any, nnodes: int) -> CommandNodes:
        """Agree which node is lost: every node posts its id and whether it holds the store; the last id of those
        that do not (every node's, where none says it does).

        Raises:
            StageError: a node stopped, or not every node posted in time."""
        posted = together(cluster, "nodes", json.dumps({"id": cluster.id, "holds": bool(cluster.holds)}))
        words = [(node, json.loads(text)) for node, text in posted]
        free = [(w["id"], node) for node, w in words if not w["holds"]] or [(w["id"], node) for node, w in words]
        lost, name = max(free)
        return cls(cluster, nnodes, lost, name)

    @property
    def is_lost(self) -> bool:
        """This node is the one lost."""
        return bool(self.cluster.id == self.lost)

    def agree(self, newest: int | None) -> tuple[int | None, list[str]]:
        """The newest checkpoint step complete on every node, and why other nodes' differ (the recipe's rule,
        :meth:`core.stages.nodeloss.NodeLoss.agree`).

        Raises:
            StageError: a node stopped, or not every node posted in time."""
        return _stage_errors(lambda: NodeLoss(self.cluster, self.nnodes).agree(newest))

    def resumable(self, ok: bool, why: str) -> list[str]:
        """The other nodes' reasons where they may not restart (:meth:`core.stages.nodeloss.NodeLoss.resumable`).

        Raises:
            StageError: a node stopped, or not every node posted in time."""
        return _stage_errors(lambda: NodeLoss(self.cluster, self.nnodes).resumable(ok, why))

    def stopped_reader(self) -> Callable[[], list[Any]]:
        """The other nodes that stopped for good, read from the store at most every :data:`STORE_READ_S` (a run is
        polled every 20 ms; the store is on the rendezvous host)."""
        return _sampled(self.cluster.stopped)

    def together(self, what: str) -> None:
        """Wait until every node is about to start the run ``what`` (each run is one rendezvous over every node).

        Raises:
            StageError: a node stopped (its reason named), or not every node came in time."""
        together(self.cluster, what, "go")

    def tell_lost(self, step: int, ranks: list[int]) -> None:
        """On the lost node, once every process of its command is killed: tell the others where it held."""
        self.cluster.tell(LOST, json.dumps({"node": self.lost_name, "host": socket.gethostname(), "step": step,
                                            "ranks": ranks}))

    def heard_lost(self) -> dict[str, Any] | None:
        """The lost node's word, or None before it spoke (it does not wait)."""
        text = self.cluster.heard(LOST)
        return None if text is None else dict(json.loads(text))

    def survivor_kill(self, grace_s: float = LOSS_GRACE_S, read_every_s: float = STORE_READ_S
                      ) -> Callable[[Any], bool]:
        """The ``kill_when`` of a surviving node's interrupted run: True ``grace_s`` after the lost node's word (its
        ranks would wait out the backend's timeout), or at once when another node stopped for good; the store read
        at most every ``read_every_s``."""
        told_at: list[float] = []
        stopped = _sampled(self.cluster.stopped, read_every_s)
        heard = _sampled(lambda: self.cluster.heard(LOST), read_every_s)

        def kill(_outcome: Any) -> bool:
            if stopped():
                return True
            if not told_at and heard() is not None:
                told_at.append(time.monotonic())
            return bool(told_at) and time.monotonic() - told_at[0] > grace_s

        return kill

    def wait_lost(self, wait_s: float = TOLD_WAIT_S) -> dict[str, Any]:
        """On a surviving node whose command has ended: the lost node's word, waiting up to ``wait_s`` for it.

        Raises:
            StageError: another node stopped for good, or the lost node said nothing in time (its command ended
                before its kill point)."""
        deadline = time.monotonic() + wait_s
        while (word := self.heard_lost()) is None:
            others = self.cluster.stopped()
            if others:
                raise StageError(f"another node stopped, so this one stops too: {stopped_by(others)}")
            if time.monotonic() > deadline:
                raise StageError(f"{self.lost_name}, the node the check loses, never said its command was killed at "
                                 f"its kill point within {wait_s:.0f} s of this node's command ending")
            time.sleep(0.2)
        return word


def together(cluster: Any, what: str, text: str) -> list[tuple[str, str]]:
    """:meth:`NodeAgreement.exchange` under the resume check's key ``what``, its errors as the stage's.

    Raises:
        StageError: a node stopped (its reason named), or not every node posted in time."""
    return _stage_errors(lambda: list(cluster.exchange(f"command-resume/{what}", text)))


def _stage_errors(call: Callable[[], T]) -> T:
    """``call()``, the agreement's errors (a node stopped, a node late) raised as the resume stage's."""
    try:
        return call()
    except GpuAcceptError as exc:
        raise StageError(f"the resume check across nodes: {exc}") from None


def _sampled(read: Callable[[], T], every_s: float | None = None) -> Callable[[], T]:
    """``read`` called again only when :data:`STORE_READ_S` (or ``every_s``) has passed since its last call; its
    last value otherwise."""
    interval = STORE_READ_S if every_s is None else every_s
    last: list[Any] = [None, None]  # (when, value)

    def get() -> T:
        now = time.monotonic()
        if last[0] is None or now - last[0] >= interval:
            last[:] = [now, read()]
        return last[1]  # type: ignore[no-any-return]

    return get


def survived_evidence(word: dict[str, Any], exit_code: int | None, killed: bool, grace_s: float,
                      ranks: list[int]) -> str:
    """The ``kill`` check's evidence on a node that survived the loss: who was lost where, and how this node's
    command ended."""
    mine = f"this node's ranks {span_ranks(tuple(ranks))}" if ranks else "this node's command"
    ended = (f"{mine} were still running {grace_s:.0f} s after the word and were SIGKILLed (every process of its "
             "command), as a scheduler ends the job step of a node it lost" if killed else
             f"{mine} ended on their own (exit status {exit_code})")
    return (f"node loss: every process of {word.get('node')}'s command ({word.get('host')}) SIGKILLed after step "
            f"{word.get('step')} (its ranks {span_ranks(tuple(word.get('ranks') or ()))} held there); {ended}")
