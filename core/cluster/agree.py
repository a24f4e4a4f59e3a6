"""The nodes of one several-node run agree between stages, so that they stop together.

Each node runs its own ``gpuaccept run``; the probe's child and the training's child are one torchrun job over every
node, and torchrun waits up to 900 s for a node that never comes. A node that stopped (its plan does not fit, its probe
failed, its health preflight missed a criterion) would leave the others waiting at the next rendezvous, and then fail
them with a socket timeout that names nothing. So before each stage that starts a child on every node, the nodes
post whether they go on, and each goes on only when every node does; one that stops says why, and the others stop
with its reason.

They meet in torch's own key-value store (``torch.distributed.TCPStore``, what c10d's rendezvous runs on), held by
the node whose address is the rendezvous host, on the rendezvous port + 1 (:func:`store_port`): that port must be
reachable from every node, as the rendezvous port is.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from core.errors import GpuAcceptError

#: how long a node waits for the others at a gate: torchrun's own wait for nodes at its rendezvous (--rdzv-conf
#: join_timeout's default, torch/distributed/elastic/rendezvous/dynamic_rendezvous.py)
WAIT_S = 900.0
POLL_S = 0.2


def store_port(endpoint: str) -> tuple[str, int]:
    """(host, port) of the agreement store: the rendezvous host, its port + 1."""
    host, port = endpoint.rsplit(":", 1)
    return host.strip("[]"), int(port) + 1


def is_local(host: str) -> bool:
    """Whether ``host`` names this machine: an address of it can be bound here (a name resolved first)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.bind((address[0], 0))
                return True
            except OSError:
                continue
    return False


@dataclass(frozen=True)
class NodeWord:
    """One node's word at a gate: its name (host and process), whether it goes on, why not, the id of the
    agreement that posted it (two "nodes" on one host share a name) and the hash of the spec it runs."""

    node: str
    goes_on: bool
    why: str = ""
    id: str = ""
    spec: str = ""


class NodeAgreement:
    """The gate every node of a several-node run passes before a stage (the module's docstring).

    Args:
        endpoint: the rendezvous ``host:port`` (the spec's ``torchrun.rdzv_endpoint``).
        run_id: the rendezvous id: keys are kept apart per run.
        nnodes: nodes taking part.
        wait_s: how long to wait for every node at a gate.
        spec_hash: the hash of the spec this node runs: a node that runs another spec (another --nnodes, --steps...)
            is refused at the first gate, by name, instead of leaving the nodes waiting for each other.

    Raises:
        GpuAcceptError: the store cannot be reached or held (the port named).
    """

    def __init__(self, endpoint: str, run_id: str, nnodes: int, wait_s: float = WAIT_S, spec_hash: str = "") -> None:
        import torch.distributed as dist

        host, port = store_port(endpoint)
        self.nnodes, self.wait_s, self.spec_hash = nnodes, wait_s, spec_hash
        self.node = f"{socket.gethostname()} (pid {os.getpid()})"
        self.id = uuid.uuid4().hex
        timeout = timedelta(seconds=wait_s)
        store: Any = None
        held = False
        if is_local(host):  # this node holds the store; a second "node" on the same host finds the port taken
            try:
                store = dist.TCPStore(host, port, is_master=True, timeout=timeout, wait_for_workers=False)
                held = True
            except (RuntimeError, OSError):
                store = None
        try:
            if store is None:
                store = dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
        except (RuntimeError, OSError) as exc:
            raise GpuAcceptError(f"torchrun.rdzv_endpoint: the nodes agree between stages through a store on "
                                 f"{host}:{port} (the rendezvous port + 1), which could not be reached ({exc}); "
                                 f"open that port between the nodes") from None
        self.store = store
        self.holds = held  # this process holds the store: it must outlive the others' use of it
        self.where = f"{host}:{port}"
        self.prefix = f"gpuaccept/{run_id}/"
        self.prefix += f"attempt{self._attempt()}/"  # keys of one run apart from another's on the same store

    def _attempt(self) -> int:
        """This run's attempt on the store: the nodes join in turn, ``nnodes`` per attempt. A store held by the
        previous run's node (still waiting in :meth:`close`) keeps that run's keys; a run started again at once
        joins it and must not read them (its gates would pass on the old run's words)."""
        joined = int(self._store_call(lambda: self.store.add(self.prefix + "joined", 1), "join"))
        return (joined - 1) // self.nnodes

    def gate(self, stage: str, goes_on: bool, why: str = "") -> list[NodeWord]:
        """Post this node's word before ``stage`` and wait for every node's; return the words of the other nodes
        that stop (empty: every node goes on). A node that stopped for good (:meth:`stop`) counts at every gate.

        Raises:
            GpuAcceptError: not every node posted within ``wait_s`` (naming how many did); a node runs another spec
                (named, with both hashes).
        """
        self._post(stage, goes_on, why)
        self._store_call(lambda: self.store.add(f"{self.prefix}{stage}/posted", 1), stage)
        deadline = time.monotonic() + self.wait_s
        while True:
            posted = int(self._store_call(lambda: self.store.add(f"{self.prefix}{stage}/posted", 0), stage))
            stopped = self._words("stopped")
            if posted >= self.nnodes or stopped:
                break
            if time.monotonic() > deadline:
                raise GpuAcceptError(f"{stage}: {posted} of {self.nnodes} nodes reached this stage within "
                                     f"{self.wait_s:.0f} s; start the same spec on every node")
            time.sleep(POLL_S)
        words = self._words(stage)
        other = next((w for w in words if w.spec and self.spec_hash and w.spec != self.spec_hash), None)
        if other is not None:
            raise GpuAcceptError(f"{stage}: {other.node} runs another spec (hash {other.spec[:12]}, this node's "
                                 f"{self.spec_hash[:12]}): every node must run the same spec, node count and steps "
                                 "included; start the same command on every node")
        return [w for w in words + stopped if not w.goes_on and w.id != self.id]

    def share(self, text: str | None, holds_rank_0: bool, wait_s: float = 300.0) -> list[tuple[str, bool]] | None:
        """Post this node's record (``text``; None: it wrote none, having stopped before its run began) and whether
        this node holds rank 0, and wait for every node's word; return every node's (record text, holds rank 0) on the
        node that writes the cluster record (the first to say it holds rank 0; without one, the node holding the
        store), None on the others.

        Raises:
            GpuAcceptError: not every node posted within ``wait_s`` (naming how many did)."""
        if text is not None:
            self._store_call(lambda: self.store.set(f"{self.prefix}record/{self.id}", text), "record")
        line = f"{self.id}\t{int(holds_rank_0)}\t{int(text is not None)}\n"
        self._store_call(lambda: self.store.append(self.prefix + "records", line), "record")
        deadline = time.monotonic() + wait_s
        while len(posted := self._posted()) < self.nnodes:
            if time.monotonic() > deadline:
                raise GpuAcceptError(f"{len(posted)} of {self.nnodes} nodes shared their record within {wait_s:.0f} s")
            time.sleep(POLL_S)
        posted = self._posted()
        holder = next((id_ for id_, holds, _ in posted if holds), None)
        if holder != self.id and not (holder is None and self.holds):
            return None
        return [(self._text(f"record/{id_}"), holds) for id_, holds, written in posted if written]

    def _text(self, key: str) -> str:
        return bytes(self._store_call(lambda: self.store.get(self.prefix + key), key)).decode()

    def _posted(self) -> list[tuple[str, bool, bool]]:
        """(id, holds rank 0, wrote a record) of each node that posted its word on its record."""
        if not self._store_call(lambda: self.store.check([self.prefix + "records"]), "record"):
            return []
        text = self._text("records")
        return [(id_, holds == "1", written == "1")
                for id_, holds, written in (line.split("\t") for line in text.splitlines() if line)]

    def tell(self, key: str, text: str) -> None:
        """Post ``text`` under ``key`` for the other nodes to read (:meth:`heard`); a later post replaces it."""
        self._store_call(lambda: self.store.set(self.prefix + "told/" + key, text), key)

    def heard(self, key: str) -> str | None:
        """What a node told under ``key`` (:meth:`tell`), or None when nothing yet: it does not wait."""
        if not self._store_call(lambda: self.store.check([self.prefix + "told/" + key]), key):
            return None
        return self._text("told/" + key)

    def exchange(self, key: str, text: str) -> list[tuple[str, str]]:
        """Post this node's ``text`` under ``key`` and wait for every node's; return (node, text) of every node,
        this one included, in the order they posted.

        Raises:
            GpuAcceptError: a node stopped for good (its reason named), or not every node posted within ``wait_s``.
        """
        self._store_call(lambda: self.store.set(f"{self.prefix}{key}/{self.id}", text), key)
        self._store_call(lambda: self.store.append(f"{self.prefix}{key}/ids", f"{self.id}\t{self.node}\n"), key)
        deadline = time.monotonic() + self.wait_s
        while True:
            posted = [line.split("\t", 1) for line in self._text(f"{key}/ids").splitlines() if line]
            if len(posted) >= self.nnodes:
                return [(node, self._text(f"{key}/{id_}")) for id_, node in posted]
            stopped = self.stopped()
            if stopped:
                raise GpuAcceptError(f"{key}: another node stopped: {stopped_by(stopped)}")
            if time.monotonic() > deadline:
                raise GpuAcceptError(f"{key}: {len(posted)} of {self.nnodes} nodes reached this point within "
                                     f"{self.wait_s:.0f} s")
            time.sleep(POLL_S)

    def stopped(self) -> list[NodeWord]:
        """The other nodes that stopped for good (:meth:`stop`), with why; it does not wait."""
        return [w for w in self._words("stopped") if w.id != self.id]

    def stop(self, why: str) -> None:
        """Say this node stopped for good (an error before or between gates), so the others stop at their next."""
        self._post("stopped", False, why)

    def close(self, wait_s: float = 60.0) -> None:
        """Say this node is done with the store; the node holding it waits (up to ``wait_s``) until every node is,
        so that none is cut off in the middle of a gate when it exits."""
        self._store_call(lambda: self.store.add(self.prefix + "done", 1), "close")
        deadline = time.monotonic() + wait_s
        while self.holds and time.monotonic() < deadline:
            if int(self._store_call(lambda: self.store.add(self.prefix + "done", 0), "close")) >= self.nnodes:
                return
            time.sleep(POLL_S)

    def _store_call(self, call: Any, what: str) -> Any:
        """``call()`` on the store; a store gone (its node ended) or unreachable is a named error."""
        try:
            return call()
        except (RuntimeError, OSError) as exc:  # torch's DistNetworkError / DistStoreError are RuntimeErrors
            raise GpuAcceptError(f"{what}: the store the nodes agree through ({self.where}) stopped answering "
                                 f"({' '.join(str(exc).split())[:200]}): the node holding it ended or the network "
                                 "between the nodes failed") from None

    def _post(self, key: str, goes_on: bool, why: str) -> None:
        line = _line(NodeWord(self.node, goes_on, why, self.id, self.spec_hash))
        self._store_call(lambda: self.store.append(self.prefix + key, line), key)

    def _words(self, key: str) -> list[NodeWord]:
        if not self._store_call(lambda: self.store.check([self.prefix + key]), key):
            return []
        text = self._text(key)
        return [_word(line) for line in text.splitlines() if line]


def _line(word: NodeWord) -> str:
    return f"{word.id}\t{word.node}\t{int(word.goes_on)}\t{word.spec}\t{' '.join(word.why.split())}\n"


def _word(line: str) -> NodeWord:
    id_, node, goes_on, spec, why = (line.split("\t") + ["", "", "", ""])[:5]
    return NodeWord(node, goes_on == "1", why, id_, spec)


def stopped_by(words: list[NodeWord]) -> str:
    """The other nodes' reasons in one line: ``node1 (pid 7): the plan does not fit; ...``."""
    return "; ".join(f"{w.node}: {w.why or 'stopped'}" for w in words)
