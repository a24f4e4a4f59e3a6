"""A run over several nodes, at its gates (gpuaccept's recipe and a user's command alike): the nodes' agreement
(core/cluster/agree.py), the gate before each stage where every node says whether it goes on, what a node that could
not start tells the others, and the cluster record the node holding rank 0 writes."""

from __future__ import annotations

from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any, Protocol

from core.errors import GpuAcceptError
from core.events import Event, Message
from core.spec import RunSpec


class GatedRun(Protocol):
    """What the gates need of a run (core.pipeline.StagedRun and command mode's run are ones): its folder, its stages'
    results, how it emits an event and how it names a stage it refuses."""

    run_dir: Path
    results: dict[str, Any]

    def emit(self, event: Event) -> Event: ...

    def refused(self, stage: str, why: str) -> GpuAcceptError: ...


def cluster_stage(run: GatedRun, cluster: Any, path: Path | None) -> Generator[Event, None, Path | None]:
    """Several nodes: every node shares its record; the node holding rank 0 writes the cluster record
    (core/record/cluster.py) beside its own, ``cluster.toml``. Returns its path on that node, None elsewhere."""
    from core.record.cluster import cluster_record
    from core.record.written import write_record

    probe = run.results.get("probe")
    holds = probe is not None and any(d.rank == 0 for d in probe.devices)
    text = path.read_text(encoding="utf-8") if path is not None else None
    try:
        shared = cluster.share(text, holds)
    except GpuAcceptError as exc:
        yield Message("record", text=f"the cluster record was not written: {exc}")
        return None
    if shared is None:  # another node writes it
        return None
    rank0 = next((i for i, (_, h) in enumerate(shared) if h), 0)
    out = write_record(cluster_record([t for t, _ in shared], rank0), run.run_dir / "cluster.toml")
    missing = cluster.nnodes - len(shared)
    yield Message("record", text=f"cluster record: {out} ({len(shared)} node records"
                                 + (f"; {missing} node(s) stopped before writing one" if missing else "") + ")")
    return out


def node_agreement(spec: RunSpec) -> Any:
    """The gate the nodes of a several-node run pass together (core/cluster/agree.py ``NodeAgreement``), or None on
    one node."""
    t = spec.torchrun
    return agreement(t.rdzv_endpoint, t.rdzv_id, t.nnodes, spec.spec_hash())


def agreement(endpoint: str, run_id: str, nnodes: int, spec_hash: str) -> Any:
    """The nodes' agreement at the rendezvous ``endpoint`` (its port + 1) for the run ``run_id`` of ``nnodes`` nodes
    running the spec of ``spec_hash``, or None on one node (gpuaccept's recipe and a user's command alike).

    Raises:
        GpuAcceptError: the store cannot be reached or held."""
    if nnodes < 2:
        return None
    from core.cluster.agree import NodeAgreement

    return NodeAgreement(endpoint, run_id, nnodes, spec_hash=spec_hash)


def stopped_before_start(cluster: Any, exc: GpuAcceptError) -> None:
    """This node could not start its run (``exc``): the other nodes stop at their next gate with its reason, and
    none waits for a record from it."""
    if cluster is not None:
        quietly(cluster.stop, str(exc))
        quietly(cluster.share, None, False, 0.0)
        quietly(cluster.close)


def quietly(call: Callable[..., Any], *args: Any) -> None:
    """``call(*args)``, its named error dropped: telling the other nodes is best effort once this one stopped."""
    try:
        call(*args)
    except GpuAcceptError:
        pass


def gate(run: GatedRun, cluster: Any, stage: str, goes_on: bool, why: str = "") -> Generator[Event, None, None]:
    """Before ``stage`` on several nodes: post whether this node goes on and wait for every node's word; when another
    node stops, this one stops too, the record saying which node stopped and why (``stage`` not run).

    Raises:
        GpuAcceptError: another node stopped, or not every node came within the wait.
    """
    if cluster is None:
        return
    from core.cluster.agree import stopped_by

    yield run.emit(Message("pipeline", text=f"waiting for every node of {cluster.nnodes} before the {stage} stage"))
    try:
        others = cluster.gate(stage, goes_on, why)
    except GpuAcceptError as exc:  # another spec on a node, a node that never came: the record keeps why
        raise run.refused(stage, str(exc)) from None
    if others and goes_on:
        raise run.refused(stage, f"another node stopped, so this one stops too: {stopped_by(others)}")
