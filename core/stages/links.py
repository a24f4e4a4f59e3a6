"""The probe's link check on the parent side: rank 0's :class:`~core.protocol.events.LinkCheck` (measured in the
child, core/child/links.py) as the record's ``probe.links`` table, the slow members named and the facts the criteria
judge (core/criteria.py ``judge_links``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from core.criteria import LinkFacts, slow_members
from core.protocol.events import LinkCheck

#: how the bandwidths are defined, written into the record beside them
METHOD = ("nccl-tests' bus bandwidth (doc/PERFORMANCE.md) in GB/s = 10^9 bytes/s over the run's own process group, "
          "after the probe's steps: all_reduce busbw = S/t x 2(n-1)/n, all_gather = S/t x (n-1)/n with S its whole "
          "output, a one-way send = S/t; t the slowest rank's median of the operations timed one by one after one "
          "warm-up, the sends interleaved round by round over the pairs; a send's best_busbw_gbps from its slowest "
          "rank's fastest operation, which names a link slow")
OPS = {"all_reduce": "all-reduce", "all_gather": "all-gather"}


def capacity(pair: Mapping[str, Any]) -> float:
    """What a link can carry, in GB/s: its ``best_busbw_gbps`` (the fastest operation: a busy host slows some
    operations, a slow link every one), or its ``busbw_gbps`` in a record written before links kept their best."""
    return float(pair.get("best_busbw_gbps", pair["busbw_gbps"]))


@dataclass(frozen=True)
class LinkReport:
    """The links measured between the ranks of one probe.

    Attributes:
        backend: ``gloo`` (CPU ranks) or ``nccl``.
        bytes: S, each operation's message (the all-gather's whole output).
        iterations: timed operations per measurement.
        members: ``node`` (the first rank of each node) or ``rank`` (one node: every rank), what ``pairs`` join.
        names: each member's name (``node 1 (host)``, ``rank 0 (cuda:0)``).
        collectives: per operation ``op``, ``ranks``, ``bytes``, ``seconds``, ``algbw_gbps``, ``busbw_gbps``.
        pairs: per ordered pair ``from``, ``to`` (indices into ``names``), ``seconds``, ``busbw_gbps`` (the slowest
            rank's median), ``best_seconds``, ``best_busbw_gbps`` (its fastest operation; absent in records written
            before it).
        slow: the members named slow, with their evidence (core/criteria.py ``slow_members``), judged on each link's
            best bandwidth (:func:`capacity`).
    """

    backend: str
    bytes: int
    iterations: int
    members: str
    names: list[str]
    collectives: list[dict[str, Any]]
    pairs: list[dict[str, Any]]
    slow: list[str] = field(default_factory=list)

    @classmethod
    def from_event(cls, event: LinkCheck) -> LinkReport:
        """The report of rank 0's event, its slow members named."""
        return cls(backend=event.backend, bytes=event.bytes, iterations=event.iterations, members=event.members,
                   names=list(event.names), collectives=[dict(c) for c in event.collectives],
                   pairs=[dict(p) for p in event.pairs],
                   slow=slow_members(event.names, [(p["from"], p["to"], capacity(p)) for p in event.pairs]))

    def link_name(self, pair: Mapping[str, Any]) -> str:
        """``node 1 (b) -> node 0 (a)``: the pair's sender and receiver."""
        return f"{self.names[pair['from']]} -> {self.names[pair['to']]}"

    def facts(self) -> LinkFacts:
        """What the criteria judge: each collective's and each link's bus bandwidth."""
        return LinkFacts(
            collectives=tuple((f"{OPS.get(c['op'], c['op'])} over {c['ranks']} ranks", float(c["busbw_gbps"]))
                              for c in self.collectives),
            pairs=tuple((self.link_name(p), float(p["busbw_gbps"])) for p in self.pairs))

    def to_table(self) -> dict[str, Any]:
        """The record's ``probe.links`` table."""
        return {"provenance": "measured", "method": METHOD, "backend": self.backend, "bytes": self.bytes,
                "iterations": self.iterations, "members": self.members, "names": list(self.names),
                "collectives": [dict(c) for c in self.collectives], "pairs": [dict(p) for p in self.pairs],
                "slow": list(self.slow)}

    @classmethod
    def from_table(cls, table: Mapping[str, Any]) -> LinkReport:
        """A report from a record's ``probe.links`` (its ``slow`` recomputed from the pairs, not read).

        Raises:
            KeyError, TypeError: a table without the keys :meth:`to_table` writes (verify checks them first).
        """
        event = LinkCheck(backend=str(table["backend"]), bytes=int(table["bytes"]),
                          iterations=int(table["iterations"]), members=table["members"],
                          names=[str(n) for n in table["names"]], collectives=list(table["collectives"]),
                          pairs=list(table["pairs"]))
        return cls.from_event(event)

    def summary(self) -> str:
        """One line: the collectives' bus bandwidth, the slowest link and who is slow."""
        parts = [f"{OPS.get(c['op'], c['op'])} {c['busbw_gbps']:.3g} GB/s" for c in self.collectives]
        if self.pairs:
            worst = min(self.pairs, key=lambda p: p["busbw_gbps"])
            parts.append(f"slowest of {len(self.pairs)} links {self.link_name(worst)} {worst['busbw_gbps']:.3g} GB/s")
        text = f"links over {self.backend} ({self.bytes / 2**20:g} MiB): " + ", ".join(parts)
        return text + ("; slow: " + "; ".join(self.slow) if self.slow else "")
