"""``gpuaccept verify``: is a record what gpuaccept wrote, signed, and do its verdicts follow from its own numbers?

Three independent checks, each reported with what it found:

1. **signature** (:mod:`core.signing`): ``record.toml.sig`` over the exact bytes on disk, namespace
   ``gpuaccept-record``; with an allowed-signers file and identity, the signer too;
2. **schema** (:func:`core.record.schema_problems`): version, tables, types, provenance tags, UTC-aware times, the
   spec's sha256;
3. **verdicts** (:func:`recompute_verdicts`): each stage's status recomputed from the record's data (plan totals vs
   capacity, probe peak vs capacity, perplexity before vs after, every resume check) and the overall verdict from
   those. A hand-edited number that changes a verdict fails here even on an unsigned record.

Exit codes (documented in docs/record.md): 0 verified and signed; 3 consistent but unsigned; 4 bad signature;
5 schema invalid; 6 a verdict does not follow from the data; 2 usage (no such file). When several apply, the first of
4, 5, 6, 3 is returned.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EXIT_VERIFIED, EXIT_USAGE, EXIT_UNSIGNED, EXIT_BAD_SIGNATURE, EXIT_SCHEMA, EXIT_VERDICT = 0, 2, 3, 4, 5, 6
PASSING = ("pass", "not_applicable")


@dataclass
class Verification:
    """What ``verify`` found; ``exit_code`` follows the module's table."""

    signature: Any
    schema: list[str] = field(default_factory=list)
    verdicts: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        if self.signature.status == "bad":
            return EXIT_BAD_SIGNATURE
        if self.schema:
            return EXIT_SCHEMA
        if self.verdicts:
            return EXIT_VERDICT
        if self.signature.status == "unsigned":
            return EXIT_UNSIGNED
        return EXIT_VERIFIED

    def lines(self) -> list[str]:
        out = [f"signature: {self.signature.status} · {self.signature.detail}"]
        out += ["schema: ok"] if not self.schema else [f"schema: {p}" for p in self.schema]
        out += ["verdicts: every verdict follows from the record's data"] if not self.verdicts else \
            [f"verdict: {p}" for p in self.verdicts]
        return out


def verify(record_path: Path, allowed_signers: Path | None = None, identity: str | None = None) -> Verification:
    """Check signature, schema and verdicts of ``record_path``.

    Raises:
        FileNotFoundError: no such record.
        core.signing.SigningError: ssh-keygen is missing, or ``allowed_signers`` without ``identity``.
    """
    from core.record import schema_problems
    from core.signing import check_signature

    record_path = Path(record_path)
    if not record_path.is_file():
        raise FileNotFoundError(f"record {record_path} not found")
    signature = check_signature(record_path, allowed_signers, identity)
    try:
        record = tomllib.loads(record_path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        return Verification(signature, [f"not a TOML file: {exc}"], [])
    problems = schema_problems(record)
    verdicts = recompute_verdicts(record) if not problems else []
    return Verification(signature, problems, verdicts)


def recompute_verdicts(rec: dict[str, Any]) -> list[str]:
    """Each stage's status from the record's own data, compared with the statuses it states; the problems found.

    Rules (the ones the pipeline applies, :mod:`core.record`, :mod:`core.probe`, :mod:`core.train`,
    :mod:`core.resume`): plan — every device's components sum to its total, and fits = total <= capacity; a device
    that does not fit fails the stage. Probe — the measured peak (on CPU the larger of peak tensor bytes and peak RSS)
    <= the device's capacity. Evaluation — training: perplexity after < before, each perplexity = exp(mean NLL);
    inference: measured once. Resume — pass exactly when every check passed; a check on the exact tier has largest
    difference 0; each comparison row's difference = |loss reference - loss resumed|. Overall — pass exactly when every
    stage is pass or not_applicable.
    """
    problems: list[str] = []
    stated = {name: item.get("status") for name, item in rec["verdict"].get("stages", {}).items()}
    computed: dict[str, str] = {}

    plan = rec["plan"]
    if plan.get("provenance") == "not_run":
        computed["plan"] = "not_run"
    else:
        fails = False
        for d in plan.get("devices", []):
            total = sum(d.get("components", {}).values())
            if total != d.get("total_bytes"):
                problems.append(f"plan device {d.get('name')}: components sum to {total} B, total_bytes says "
                                f"{d.get('total_bytes')}")
            cap = d.get("capacity_bytes")
            if cap is not None:
                fits = d.get("total_bytes", 0) <= cap
                if d.get("fits") is not fits:
                    problems.append(f"plan device {d.get('name')}: total {d.get('total_bytes')} B vs capacity {cap} B "
                                    f"means fits = {fits}, the record says {d.get('fits')}")
                fails = fails or not fits
        computed["plan"] = "fail" if fails else "pass"

    probe = rec["probe"]
    if probe.get("provenance") == "measured":
        caps = [d.get("capacity_bytes") for d in plan.get("devices", [])[:1]]
        ok = True
        for d in probe.get("devices", []):
            used = d["peak_bytes"] if str(d.get("device", "")).startswith("cuda") else \
                max(d["peak_bytes"], d.get("peak_rss_bytes", 0))
            if caps and caps[0] is not None and used > caps[0]:
                ok = False
        computed["probe"] = "pass" if ok else "fail"
        _same(problems, "probe table", probe.get("status"), computed["probe"])

    ev = rec["evaluation"]
    if ev.get("provenance") == "measured":
        before, after = ev.get("before", {}), ev.get("after", {})
        for when, point in (("before", before), ("after", after)):
            if "perplexity" in point and "mean_nll" in point and not math.isclose(
                    point["perplexity"], math.exp(point["mean_nll"]), rel_tol=1e-9):
                problems.append(f"evaluation {when}: perplexity {point['perplexity']} is not exp(mean NLL "
                                f"{point['mean_nll']}) = {math.exp(point['mean_nll'])}")
        if rec["spec"].get("mode") == "inference":
            computed["evaluation"] = "pass" if "perplexity" in before else "fail"
        else:
            computed["evaluation"] = "pass" if "perplexity" in after and after["perplexity"] < before.get(
                "perplexity", -math.inf) else "fail"
        _same(problems, "evaluation table", ev.get("status"), computed["evaluation"])

    res = rec["resume"]
    if res.get("status") == "not_applicable":
        computed["resume"] = "not_applicable"
        if rec["spec"].get("mode") != "inference" and rec["spec"].get("resume", {}).get("check", True):
            problems.append("resume is not_applicable, but the spec trains with the resume check on")
    elif res.get("provenance") == "measured":
        checks = res.get("checks", [])
        rtol = res.get("tier", {}).get("rtol")
        for ch in checks:
            if ch.get("kind") == "tolerance" and rtol == 0.0 and ch.get("status") == "pass" and \
                    ch.get("largest_difference", 0.0) != 0.0:
                problems.append(f"resume check {ch.get('name')}: passed on an exact tier with largest difference "
                                f"{ch.get('largest_difference')}")
        for row in res.get("comparison", []):
            diff = abs(row["loss_reference"] - row["loss_resumed"])
            if not math.isclose(diff, row["difference"], rel_tol=1e-9, abs_tol=1e-15):
                problems.append(f"resume step {row['step']}: |{row['loss_reference']} - {row['loss_resumed']}| = "
                                f"{diff}, the row says {row['difference']}")
            if rtol is not None and diff > rtol * max(abs(row["loss_reference"]), 1e-12):
                if res.get("status") == "pass":
                    problems.append(f"resume step {row['step']}: loss difference {diff} is outside the tier "
                                    f"(rtol {rtol}) but the resume passed")
        computed["resume"] = "pass" if checks and all(ch.get("status") == "pass" for ch in checks) else "fail"
        _same(problems, "resume table", res.get("status"), computed["resume"])

    for name, status in computed.items():
        if name in stated and stated[name] != status and not (status == "not_run" and stated[name] in
                                                                ("not_run", "cancelled", "error")):
            problems.append(f"verdict.stages.{name} says {stated[name]}, its data says {status}")
    overall = "pass" if stated and all(s in PASSING for s in {**stated, **computed}.values()) else "fail"
    if rec["verdict"].get("status") != overall:
        problems.append(f"verdict.status says {rec['verdict'].get('status')}, the stages say {overall}")
    return problems


def _same(problems: list[str], where: str, stated: Any, computed: str) -> None:
    if stated != computed:
        problems.append(f"{where} says status {stated}, its data says {computed}")
