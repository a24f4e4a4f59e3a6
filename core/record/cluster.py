"""The cluster record (kind ``cluster``): one per several-node run, written by the node that holds rank 0 beside its
own record (``cluster.toml``), from every node's record as that node wrote it.

It holds each node's record whole, as text, with its sha256 (so it is verified on its own, with no access to the other
nodes' disks), the node's host and verdict; per device (every rank of every node) the plan, the measured peak and
whether it fits, read from the rank-0 node's record, which gathered every rank's measurement; and the cluster's verdict:
pass exactly when every node's record passed. ``gpuaccept verify`` checks each embedded record as it checks a node's
own (its schema, signature aside, and every verdict recomputed), each sha256, that every node ran the same spec, and
recomputes the device rows and the verdict (:func:`cluster_problems`).
"""

from __future__ import annotations

import hashlib
import tomllib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from core.criteria import device_label
from core.record.written import TOOL, tool_version, utc_now

CLUSTER_SCHEMA_VERSION = 1
KIND = "cluster"
#: a node record's problems as ``gpuaccept verify`` finds them: (schema problems, verdict problems)
NodeCheck = Callable[[dict[str, Any]], tuple[list[str], list[str]]]


def sha256(text: str) -> str:
    """The sha256 of a record's text (UTF-8), hex."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def cluster_record(texts: Sequence[str], rank0: int) -> dict[str, Any]:
    """The cluster record of every node's record (``texts``, as written), ``rank0`` the index of the node that
    holds rank 0 (whose record gathered every rank's measurement).

    Raises:
        tomllib.TOMLDecodeError, KeyError: a text that is not a node record.
    """
    records = [tomllib.loads(t) for t in texts]
    nodes = [{"host": str(r["environment"]["host"]), "sha256": sha256(t), "verdict": str(r["verdict"]["status"]),
              "holds_rank_0": i == rank0, "record": t} for i, (r, t) in enumerate(zip(records, texts))]
    status, evidence = cluster_verdict(nodes, rank_problems(records))
    return {"kind": KIND, "schema_version": CLUSTER_SCHEMA_VERSION, "tool": TOOL, "tool_version": tool_version(),
            "created_utc": utc_now(), "spec_hash": str(records[rank0]["spec"]["hash"]), "nodes": nodes,
            "devices": cluster_devices(records, rank0), "verdict": {"status": status, "evidence": evidence},
            "signoff": {"status": "unsigned"}}


def cluster_verdict(nodes: Sequence[Mapping[str, Any]], problems: Sequence[str] = ()) -> tuple[str, str]:
    """pass exactly when every node's record passed and the nodes ran one job (``problems``: :func:`rank_problems`);
    the evidence names what did not."""
    failed = [f"{n['host']} ({n['verdict']})" for n in nodes if n["verdict"] != "pass"]
    why = ([f"{len(failed)} of {len(nodes)} nodes did not pass: {', '.join(failed)}"] if failed else []) + list(problems)
    if why:
        return "fail", "; ".join(why)
    return "pass", f"every one of the {len(nodes)} nodes passed"


def rank_problems(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """Why the nodes' records are not one job's, for records of a user's command (each node measures its own ranks):
    a global rank measured on two nodes (each node ran a job of its own), or fewer ranks than the world size the
    Trainer reported. gpuaccept's recipe gathers every rank over its own process group, so its ranks are one job's by
    construction."""
    if not records or records[0].get("kind") != "command":
        return []
    seen: dict[int, str] = {}
    problems = []
    for r in records:
        host = str(r.get("environment", {}).get("host", "?"))
        for d in r.get("probe", {}).get("devices", []):
            rank = d.get("rank")
            if isinstance(rank, int) and rank in seen and seen[rank] != host:
                problems.append(f"rank {rank} ran on {seen[rank]} and on {host}: each node ran a job of its own, "
                                "not one job over the nodes (does the launcher line give every node the same "
                                "rendezvous and --nnodes?)")
            elif isinstance(rank, int):
                seen[rank] = host
    worlds = {r.get("ran", {}).get("world_size") for r in records} - {None}
    if len(worlds) == 1 and not problems:
        (world,) = worlds
        if isinstance(world, int) and len(seen) < world:
            problems.append(f"{len(seen)} ranks measured over the nodes, and the Trainer reported world size {world}")
    return problems


def cluster_devices(records: Sequence[Mapping[str, Any]], rank0: int) -> list[dict[str, Any]]:
    """The cluster's device rows: gpuaccept's recipe gathers every rank's measurement into the rank-0 node's record
    (:func:`device_rows`); a user's command is measured on each node, each node's record holding its own devices
    (:func:`command_device_rows`, in rank order)."""
    if records[rank0].get("kind") == "command":
        return sorted((row for r in records for row in command_device_rows(r)), key=lambda row: (row["rank"], row["host"]))
    return device_rows(records[rank0])


def command_device_rows(rec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A command record's devices as cluster rows: its host, each device and rank its probe measured, the measured
    bytes its fit is judged by, the plan's bytes where the plan compared them (``plan.comparison``), and the fit."""
    host = str(rec.get("environment", {}).get("host", "?"))
    planned = {(c.get("device"), c.get("rank")): c.get("planned_bytes")
               for c in rec.get("plan", {}).get("comparison", []) if isinstance(c, dict)}
    rows = []
    for d in rec.get("probe", {}).get("devices", []):
        row: dict[str, Any] = {"host": host, "device": d["device"], "rank": d["rank"],
                               "measured_peak_bytes": d["measured_bytes"]}
        if planned.get((d["device"], d["rank"])) is not None:
            row["planned_bytes"] = planned[(d["device"], d["rank"])]
        if isinstance(d.get("fits"), bool):
            row["fits"] = d["fits"]
        rows.append(row)
    return rows


def device_rows(rank0: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per rank of every node (the rank-0 node's ``probe.devices``): host, device, rank, the plan's tensors and the
    measured peak compared with them (``probe.plan_comparison``), and the device's fit row (``max_device_share``);
    none when the probe did not run."""
    probe = rank0.get("probe", {})
    compared = {(c["device"], c["rank"]): c for c in probe.get("plan_comparison", [])}
    shares = {r.get("on", ""): r for r in rank0.get("verdict", {}).get("stages", {}).get("probe", {}).get("criteria", [])
              if r.get("criterion") == "max_device_share"}
    rows = []
    for d in probe.get("devices", []):
        row: dict[str, Any] = {"host": d["host"], "device": d["device"], "rank": d["rank"],
                               "measured_peak_bytes": d["peak_bytes"]}
        c = compared.get((d["device"], d["rank"]))
        if c is not None:
            row["planned_bytes"] = c["planned_bytes"]
        label = device_label(d["device"], d["rank"], d.get("world_size", 1))  # how the probe's rows name it
        if label in shares and "met" in shares[label]:
            row["fits"] = shares[label]["met"]
        rows.append(row)
    return rows


def cluster_problems(rec: dict[str, Any], node_check: NodeCheck) -> tuple[list[str], list[str]]:
    """(schema problems, verdict problems) of a cluster record: each node's embedded record checked by
    ``node_check`` (``gpuaccept verify``'s own check of a record), its sha256, one spec hash over every node, and the
    device rows and verdict recomputed."""
    schema: list[str] = []
    for key in ("schema_version", "spec_hash", "nodes", "devices", "verdict"):
        if key not in rec:
            schema.append(f"a cluster record without {key}")
    if rec.get("schema_version") not in (None, CLUSTER_SCHEMA_VERSION):
        schema.append(f"schema_version {rec.get('schema_version')!r}: this gpuaccept reads cluster records of version "
                      f"{CLUSTER_SCHEMA_VERSION}")
    nodes = rec.get("nodes")
    if not isinstance(nodes, list) or not nodes or not all(isinstance(n, dict) for n in nodes):
        return schema + ["nodes is not a list of node tables"], []
    if schema:
        return schema, []
    verdicts: list[str] = []
    parsed = []
    for i, n in enumerate(nodes):
        where = f"nodes[{i}] ({n.get('host', '?')})"
        text = n.get("record")
        if not isinstance(text, str):
            schema.append(f"{where}.record is not the node's record text")
            continue
        if sha256(text) != n.get("sha256"):
            verdicts.append(f"{where}: its record's sha256 is {sha256(text)}, the cluster record says {n.get('sha256')}")
        try:
            node = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            schema.append(f"{where}.record is not TOML ({exc})")
            continue
        node_schema, node_verdicts = node_check(node)
        schema.extend(f"{where}: {p}" for p in node_schema)
        verdicts.extend(f"{where}: {p}" for p in node_verdicts)
        parsed.append((n, node))
    if schema:
        return schema, verdicts
    for n, node in parsed:
        if node.get("spec", {}).get("hash") != rec["spec_hash"]:
            verdicts.append(f"{n['host']}: its record's spec hash is not the cluster's {rec['spec_hash']}: the nodes "
                            "did not run the same spec")
        if node.get("verdict", {}).get("status") != n.get("verdict"):
            verdicts.append(f"{n['host']}: the cluster record says {n.get('verdict')!r}, its record says "
                            f"{node.get('verdict', {}).get('status')!r}")
    holders = [i for i, (n, _) in enumerate(parsed) if n.get("holds_rank_0") is True]
    if len(holders) != 1:
        verdicts.append(f"{len(holders)} nodes are said to hold rank 0; one does")
    elif cluster_devices([node for _, node in parsed], holders[0]) != rec["devices"]:
        verdicts.append("devices do not follow from the node records (their probes' devices and plan comparison)")
    status, _ = cluster_verdict([n for n, _ in parsed], rank_problems([node for _, node in parsed]))
    if rec["verdict"].get("status") != status:
        verdicts.append(f"verdict.status is {rec['verdict'].get('status')!r}, the nodes' verdicts give {status!r}")
    verdicts.extend(signoff_problems(rec.get("signoff"), status))
    return schema, verdicts


def signoff_problems(signoff: Any, status: str) -> list[str]:
    """The sign-off against the cluster's verdict, by the rule of a node record's (core/record/signoff.py
    ``checked_signoff``): an accept of a cluster that did not pass holds the operator's ``override`` (the reason), and
    one that passed holds none."""
    if not isinstance(signoff, dict):
        return ["signoff is not a table"]
    if signoff.get("status") == "unsigned":
        return []
    override = signoff.get("override")
    if signoff.get("decision") == "accept" and status != "pass":
        if not (isinstance(override, str) and override.strip()):
            return ["the sign-off accepts a cluster that did not pass without the operator's override (the reason)"]
    elif override is not None:
        return ["the sign-off holds an override, but there is nothing to override (an accept of a pass, or a reject)"]
    return []
