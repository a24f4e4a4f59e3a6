"""``gpuaccept verify``: is a record what gpuaccept wrote, signed, and do its verdicts follow from its own numbers?

Three independent checks, each reported with what it found:

1. **signature** (:mod:`core.record.signing`): ``record.toml.sig`` over the exact bytes on disk, namespace
   ``gpuaccept-record``; with an allowed-signers file and identity, the signer too;
2. **schema** (:func:`core.record.shape.schema_problems`): version, tables, types, provenance tags, UTC-aware times, the
   spec's sha256;
3. **verdicts** (:func:`recompute_verdicts`): the record's tables read back as the verdict engine's typed facts
   (:mod:`core.record.verdicts`: a value a verdict depends on that is missing or of the wrong type is a named problem)
   and each stage's status recomputed by the same functions the record was built with (plan totals vs capacity, probe
   peak vs capacity, perplexity before vs after, every resume check), the overall verdict from those. A hand-edited
   number that changes a verdict fails here even on an unsigned record.

Exit codes (documented in docs/record.md): 0 verified, signed by an allowed signer; 8 the signature intact but the
identity given not allowed to sign with its key (a mix-up, not a changed record); 7 verified and the signature good,
but the signer not checked (no allowed-signers file); 3 consistent but unsigned; 4 bad signature; 5 schema invalid;
6 a verdict does not follow from the data; 2 usage (no such file). When several apply, the first of 4, 8, 5, 6, 3, 7
is returned.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.bounds import (
    MAX_RECORD_FILE,
    InputFileError,
    TomlBoundsError,
    loads_bounded,
    read_input_text,
    special_file_kind,
)
from core.criteria import AcceptCriteria
from core.methods import trains
from core.plan.fit import UNDER_ESTIMATE_WORD, fit_of, traced_peak, traced_reserved, under_estimate
from core.record.judged import criteria_of, criteria_rows_problems
from core.record.readback import compared_peaks, judgements_of, probe_facts, probe_speed, quality_facts, resume_facts
from core.record.shape import schema_problems
from core.record.signing import SignatureCheck, check_signature
from core.record.verdicts import (
    STAGES,
    NotApplicable,
    PlanFacts,
    PlannedDevice,
    ResumeFacts,
    count,
    entry,
    evaluation_verdict,
    expected_world_size,
    flag,
    links_facts,
    node_ranks_problem,
    plan_verdict,
    probe_verdict,
    resume_contradictions,
    resume_verdict,
    stated_problems,
    subtable,
    tables,
    text,
)
from core.record.verdicts import number as num
from core.spec import ADAPTER_MODES
from core.stages.noise import RecordedRule
from core.stages.probe import wrapper_problem
from core.status import StageStatus

EXIT_VERIFIED, EXIT_USAGE, EXIT_UNSIGNED, EXIT_BAD_SIGNATURE, EXIT_SCHEMA, EXIT_VERDICT = 0, 2, 3, 4, 5, 6
EXIT_SIGNER_NOT_CHECKED = 7
#: The signature is intact over the record's bytes, but the identity given may not sign with its key.
EXIT_SIGNER_NOT_ALLOWED = 8


@dataclass
class Verification:
    """What ``verify`` found; ``exit_code`` follows the module's table."""

    signature: Any
    schema: list[str] = field(default_factory=list)
    verdicts: list[str] = field(default_factory=list)
    #: the record's ``signoff`` table as it reads (empty when there is none to read)
    signoff: dict[str, Any] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        if self.signature.status == "bad":
            return EXIT_BAD_SIGNATURE
        if self.signature.status == "signer_not_allowed":
            return EXIT_SIGNER_NOT_ALLOWED
        if self.schema:
            return EXIT_SCHEMA
        if self.verdicts:
            return EXIT_VERDICT
        if self.signature.status == "unsigned":
            return EXIT_UNSIGNED
        if not self.signature.signer_checked:
            return EXIT_SIGNER_NOT_CHECKED
        return EXIT_VERIFIED

    def lines(self) -> list[str]:
        out = [f"signature: {self.signature.status} · {self.signature.detail}"]
        out += ["schema: ok"] if not self.schema else [f"schema: {p}" for p in self.schema]
        if self.schema:
            out.append("verdicts: not recomputed (the schema check failed)")
        elif not self.verdicts:
            out.append("verdicts: every verdict follows from the record's data")
        else:
            out += [f"verdict: {p}" for p in self.verdicts]
        override = self.override()
        if override is not None:
            out.append(f"sign-off: OVERRIDE by {self.signoff.get('operator', '?')}: accepted although "
                       f"{', '.join(override['overridden']) or 'the verdict'} did not pass; reason: "
                       f"{override['reason']!r}")
        return out

    def override(self) -> dict[str, Any] | None:
        """The sign-off's override, when it has one: ``reason`` (``signoff.override``) and ``overridden`` (the stages
        it accepted although they did not pass; only the strings of ``signoff.overridden``); None without one."""
        if "override" not in self.signoff:
            return None
        stages = self.signoff.get("overridden")
        return {"reason": str(self.signoff["override"]),
                "overridden": [s for s in stages if isinstance(s, str)] if isinstance(stages, list) else []}


def verify(record_path: Path, allowed_signers: Path | None = None, identity: str | None = None) -> Verification:
    """Check signature, schema and verdicts of ``record_path``. A record that is not TOML, or nested deeper or holding
    a longer string than :mod:`core.bounds` reads, is a schema finding (exit 5).

    Raises:
        FileNotFoundError: no such record.
        core.record.signing.SigningError: ssh-keygen is missing, or ``allowed_signers`` without ``identity``.
    """
    record_path = Path(record_path)
    kind = special_file_kind(record_path)
    if kind is not None:  # a FIFO, a device, a folder named like a record: named, never opened (a FIFO would block)
        return Verification(SignatureCheck("unsigned", "not checked: the record is not a file"),
                            [f"{record_path} is {kind}, not a record file"], [])
    if not record_path.is_file():
        raise FileNotFoundError(f"record {record_path} not found")
    signature = check_signature(record_path, allowed_signers, identity)
    try:
        record = loads_bounded(read_input_text(record_path, "a gpuaccept record", MAX_RECORD_FILE))
    except TomlBoundsError as exc:  # nested too deep, a string too long: a schema finding (exit 5), never a crash
        return Verification(signature, [f"beyond what gpuaccept reads: {exc}"], [])
    except InputFileError as exc:  # larger than any record, or not UTF-8
        return Verification(signature, [f"beyond what gpuaccept reads: {exc}"], [])
    except tomllib.TOMLDecodeError as exc:
        return Verification(signature, [f"not a TOML file: {exc}"], [])
    schema, verdicts = record_problems(record)
    signoff = record.get("signoff")
    return Verification(signature, schema, verdicts, signoff if isinstance(signoff, dict) else {})


#: the tables of a record's lists that each name one thing once: (where, the keys that name a row)
UNIQUE_ROWS = (("plan.devices", ("name",)),  # probe.devices: each rank once is the probe's verdict's own rule
               ("probe.plan_comparison", ("device", "rank")), ("resume.checks", ("name",)),
               ("resume.comparison", ("step",)))


def repeated_rows(rec: dict[str, Any]) -> list[str]:
    """A row named twice in a list that names each thing once (:data:`UNIQUE_ROWS`): a schema problem, found in one
    pass over each list (issue 52: a record with every check repeated 20,000 times was called consistent)."""
    out = []
    for where, keys in UNIQUE_ROWS:
        table: Any = rec
        for part in where.split("."):
            table = table.get(part) if isinstance(table, dict) else None
        if not isinstance(table, list):
            continue
        seen: set[tuple[Any, ...]] = set()
        for row in table:
            if not isinstance(row, dict):
                continue
            name = tuple(str(row.get(k)) for k in keys)
            if name in seen:
                out.append(f"{where} names {', '.join(f'{k} {v}' for k, v in zip(keys, name))} more than once")
                break
            seen.add(name)
    return out


def record_problems(rec: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The schema check, then (only when the schema holds) every verdict recomputed: the one order ``gpuaccept
    verify`` and the sign-off (:func:`core.record.signoff.sign_record`) both apply.

    Args:
        rec: a parsed record (``tomllib.loads`` of ``record.toml``).

    Returns:
        (schema problems, verdict problems), each a list of sentences; both empty when the record verifies. The
        verdicts are not recomputed when the schema fails (the second list is then empty); a value a verdict depends
        on that is missing or of the wrong type is a schema problem.
    """
    if rec.get("kind") == "cluster":  # a several-node run: every node's record inside it (core/record/cluster.py)
        from core.record.cluster import cluster_problems

        return cluster_problems(rec, record_problems)
    if rec.get("kind") == "command":  # the user's own command (core/command/record.py)
        from core.record.command import command_schema_problems, command_verdict_problems

        schema, recompute = command_schema_problems, command_verdict_problems
    else:
        schema, recompute = schema_problems, recompute_verdicts
    problems = repeated_rows(rec) or schema(rec)  # a list padded with copies is refused before it is walked
    if problems:
        return problems, []
    try:
        return [], recompute(rec)
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        return [f"a value the verdicts depend on is missing or of the wrong type: {exc}"], []


def _plan_verdict(rec: dict[str, Any], problems: list[str]
                  ) -> tuple[dict[str, int | None], dict[str, int], tuple[PlannedDevice, ...] | None]:
    """The plan's devices read from the record's plan table, with what does not follow (appends to ``problems``).

    Schema 2: every device's phases list every component; its total is the largest phase (the peak of the step), no
    phase holds more of a component than its line, ``sum_of_components_bytes`` is the sum of the lines; its fit is
    judged by the larger of that peak and the traced one (with what a trace cannot see, ``untraced_bytes``;
    core/plan/fit.py), ``fits`` = that <= the device's capacity. Schema 1: the total is the sum of the components.

    Returns:
        (capacity by device name, the plan's tensor bytes by device name: what a probe's peak is compared with, the
        devices as the plan's verdict takes them: None when the plan is not estimated).
    """
    from core.plan.memory import COMPONENTS

    plan = rec["plan"]
    capacity: dict[str, int | None] = {}
    tensors: dict[str, int] = {}
    if plan.get("provenance") != "estimated":
        if plan.get("provenance") != "not_run":
            problems.append(f"plan.provenance is {plan.get('provenance')!r}: a plan is estimated or not_run")
        return capacity, tensors, None
    v2 = rec["schema_version"] >= 2
    peak = traced_peak(plan.get("traced")) if v2 else None
    reserved = traced_reserved(plan.get("traced")) if v2 else None
    strategy = text(entry(plan, "strategy", "plan"), "plan.strategy")
    planned: list[PlannedDevice] = []
    devices = tables(entry(plan, "devices", "plan"), "plan.devices")
    if not devices:
        problems.append("plan is estimated but plans no device")
    for i, d in enumerate(devices):
        where = f"plan.devices[{i}]"
        name = text(entry(d, "name", where), f"{where}.name")
        comps = entry(d, "components", where)
        if not isinstance(comps, dict) or sorted(comps) != sorted(COMPONENTS):
            problems.append(f"plan device {name}: components must be exactly {', '.join(COMPONENTS)}")
            comps = comps if isinstance(comps, dict) else {}
        lines = {k: count(v, f"{where}.components.{k}") for k, v in comps.items()}
        stated_total = count(entry(d, "total_bytes", where), f"{where}.total_bytes")
        if v2:
            total = _phases_total(name, d, lines, problems, where)
        else:
            total = sum(lines.values())
        if total != stated_total:
            what = "its largest phase holds" if v2 else "components sum to"
            problems.append(f"plan device {name}: {what} {total} B, total_bytes says {stated_total}")
        cap = d.get("capacity_bytes")  # absent: the capacity is unknown (TOML has no null)
        capacity[name] = None if cap is None else count(cap, f"{where}.capacity_bytes")
        untraced = entry(d, "untraced_bytes", where) if v2 else d.get("untraced_bytes", 0)  # schema 1: none
        fit = fit_of(name, capacity[name], stated_total, count(untraced, f"{where}.untraced_bytes"), peak, strategy,
                     reserved)
        tensors[name] = (fit.tensor_bytes - lines.get("overhead", 0)) if v2 else stated_total
        planned.append(PlannedDevice(name, fit.bytes, capacity[name]))
        if v2 and (d.get("fit_bytes") != fit.bytes or d.get("fit_judged_by") != fit.judged_by):
            problems.append(f"plan device {name}: the fit is judged by {fit.bytes} B ({fit.judged_by}: the larger of "
                            f"the analytic and traced peaks), the record says {d.get('fit_bytes')} "
                            f"({d.get('fit_judged_by')})")
        if cap is None:
            if d.get("fits") is not None:
                problems.append(f"plan device {name}: fits = {d['fits']} without a capacity to fit in")
            continue
        if d.get("fits") is not fit.fits:
            problems.append(f"plan device {name}: {fit.bytes} B vs capacity {cap} B means fits = {fit.fits}, the "
                            f"record says {d.get('fits')}")
    return capacity, tensors, tuple(planned)


def _names_device(finding: str, device: str, rank: Any) -> bool:
    """A finding is about ``device``: it starts with its name, or with ``rank R (device)`` under torchrun."""
    return finding.startswith(f"{device}:") or finding.startswith(f"rank {rank} ({device})")


def _ran_as_planned(spec: dict[str, Any], probe: dict[str, Any]) -> list[str]:
    """A passing probe ran what the plan was made for: the spec's attention implementation, and for LoRA the spec's
    targets (``all-linear``: every linear layer but the LM head)."""
    out: list[str] = []
    if probe.get("status") != StageStatus.PASS:
        return out
    used = probe.get("attention_implementation")
    if used and used != spec.get("attn_implementation", "sdpa"):
        out.append(f"probe passes, but the model ran with {used} attention and the plan is for "
                   f"{spec.get('attn_implementation')}")
    targets = spec.get("lora", {}).get("targets", []) if isinstance(spec.get("lora"), dict) else []
    resolved = probe.get("lora_targets_resolved")
    if spec.get("mode") in ADAPTER_MODES and resolved is not None:
        if targets == ["all-linear"]:
            if not resolved or "lm_head" in resolved:
                out.append(f"probe.lora_targets_resolved {resolved} is not all-linear's (every linear layer but the "
                           "LM head)")
        elif sorted(set(targets)) != sorted(resolved):
            out.append(f"probe.lora_targets_resolved {resolved} are not the spec's targets {targets}")
    return out


def _phases_total(name: str, d: Mapping[str, Any], lines: dict[str, int], problems: list[str], where: str) -> int:
    """The largest phase's total of a schema-2 device plan; no phase may hold more of a component than its line (the
    line is that component's largest value over the step) and ``peak_phase`` must be the largest phase."""
    phases = d.get("phases")
    if not isinstance(phases, dict) or not phases:
        problems.append(f"plan device {name}: no phases (schema 2 plans the phases of the step)")
        return sum(lines.values())
    totals: dict[str, int] = {}
    for phase, body in phases.items():
        comps = body.get("components", {}) if isinstance(body, dict) else {}
        totals[phase] = sum(count(v, f"{where}.phases.{phase}.components.{k}") for k, v in comps.items())
        for k, line in lines.items():
            if count(comps.get(k, 0), f"{where}.phases.{phase}.components.{k}") > line:
                problems.append(f"plan device {name}: {k} holds {comps.get(k)} B in the {phase} phase, above its line "
                                f"({line} B, its largest value)")
    top = max(totals, key=lambda p: totals[p])
    if totals.get(str(d.get("peak_phase")), -1) != totals[top]:
        problems.append(f"plan device {name}: peak_phase is {d.get('peak_phase')!r}, the largest phase is {top!r}")
    if d.get("sum_of_components_bytes") != sum(lines.values()):
        problems.append(f"plan device {name}: sum_of_components_bytes is {d.get('sum_of_components_bytes')}, the lines "
                        f"sum to {sum(lines.values())}")
    return totals[top]


def recompute_verdicts(rec: dict[str, Any]) -> list[str]:
    """Each stage's status from the record's own data, compared with the statuses it states; the problems found.

    The record's tables are read as the verdict engine's facts (:func:`probe_facts`, :func:`quality_facts`,
    :func:`resume_facts`, the plan's devices) and each status is the engine's (:mod:`core.record.verdicts`, the
    functions :mod:`core.record.build` wrote the record's verdicts with); what else in a table does not follow from its
    numbers is named beside it. Rules, and no stage passes without its evidence:

    - plan (estimated): every device's components sum to its total; ``fits`` = total <= capacity on that device alone;
      a device that does not fit fails the stage;
    - probe (measured): each probed device's peak (on CPU the larger of peak tensor bytes and peak RSS) within its
      share of the capacity of the planned device of the same name; a device without a capacity cannot pass; the
      strategy's wrapper, one device per rank, the planned attention implementation (schema 2), the speed criteria;
      the plan comparison repeats the plan's total and the probe's peak;
    - evaluation (measured, on a measured data split): perplexity = exp(mean NLL) >= 1 over tokens > 0; training:
      both finite and after < before; inference: measured once and finite, nothing after; its settings are the spec's;
    - resume (measured; not_applicable exactly for inference or the check switched off): pass exactly when every
      check passed and its numbers lie within its tier (below); a pass shows every check of
      :data:`core.stages.resume.RESUME_CHECKS` with its kind and the checkpoint's sha256 manifest; the tier is one
      gpuaccept applies (schema 5: ``exact``, or ``twin`` with its multiple; before,
      a relative tolerance), the one the spec, the device and the test jitter require; the comparison covers every
      step of the spec's window (c+1 to c + ``resume.compare_steps``; to the last step for records without that key),
      each difference = |reference - resumed|; a passing tolerance check within its bound (exact: a difference of 0;
      twin: its distance <= its bound >= multiple x the twin's noise; the loss bound = multiple x the noise, which
      is at least every compared step's twin difference);
    - overall: pass exactly when every stage is pass or not_applicable.

    Raises:
        core.record.verdicts.RecordValueError: a value a verdict depends on is missing or of the wrong type, named by
            its key path (a TypeError: the caller reports it).
    """
    problems: list[str] = []
    spec = rec["spec"]
    training = trains(text(entry(spec, "mode", "spec"), "spec.mode"))
    stated = {name: rec["verdict"]["stages"][name]["status"] for name in STAGES}
    computed: dict[str, StageStatus | None] = {}
    crit = criteria_of(rec)
    capacity, planned_tensors, planned = _plan_verdict(rec, problems)
    if planned is not None:
        computed["plan"] = plan_verdict(PlanFacts(planned, compared_peaks(rec), crit)).status
    elif rec["plan"].get("provenance") == "not_run":
        computed["plan"] = StageStatus.NOT_RUN
    rows = judgements_of(rec, crit, capacity, training)
    _probe_verdict(rec, capacity, planned_tensors, problems, computed, crit)
    _evaluation_verdict(rec, training, problems, computed, crit)
    _resume_verdict(rec, training, problems, computed, crit)
    if rec["schema_version"] >= 4:
        criteria_rows_problems(rec, rows, problems)
    problems += stated_problems(stated, computed, rec["verdict"]["status"],
                                {name: rec[name].get("provenance") for name in STAGES},
                                unmeasured_may_say=(StageStatus.NOT_RUN, StageStatus.CANCELLED, StageStatus.ERROR,
                                                    StageStatus.FAIL))
    return problems


# ------------------------------------------------------------------------ the record's tables as the engine's facts


def _probe_verdict(rec: dict[str, Any], capacity: dict[str, int | None], planned_tensors: dict[str, int],
                   problems: list[str], computed: dict[str, StageStatus | None], crit: AcceptCriteria) -> None:
    """The probe stage recomputed by the engine (:func:`core.record.verdicts.probe_verdict` over
    :func:`probe_facts`; sets ``computed["probe"]`` when the probe was measured), and what in its table does not
    follow (appends to ``problems``): each device against its planned device and the spec's ranks, the plan
    comparison, the speed, what it ran."""
    spec, plan, probe = rec["spec"], rec["plan"], rec["probe"]
    if probe.get("provenance") == "measured":
        facts = probe_facts(rec, crit, capacity)
        _probe_devices_problems(spec, plan, probe, capacity, problems)
        if probe.get("status") == StageStatus.PASS and probe.get("problems"):
            problems.append("probe.status is pass, but probe.problems lists why it fails: "
                            + "; ".join(map(str, probe["problems"]))[:200])
        _plan_comparison_problems(rec, probe, planned_tensors, problems)
        problems.extend(probe_speed(rec)[3])
        problems.extend(links_facts(probe)[1])
        if rec["schema_version"] >= 2:
            problems.extend(_ran_as_planned(spec, probe))
        computed["probe"] = probe_verdict(facts).status
        _same(problems, "probe table", probe.get("status"), computed["probe"])
    elif probe.get("provenance") != "not_run":
        problems.append(f"probe.provenance is {probe.get('provenance')!r}: a probe is measured or not_run")


def _probe_devices_problems(spec: dict[str, Any], plan: dict[str, Any], probe: dict[str, Any],
                            capacity: dict[str, int | None], problems: list[str]) -> None:
    """What the probed devices' own checks find (appends to ``problems``; :func:`core.record.verdicts.probe_verdict`
    fails the stage on each): no device, a wrapper other than the strategy's (named when the probe says pass), a device
    without a planned device with a capacity, devices that are not the spec's ranks, each once."""
    devices = probe.get("devices", [])
    if not devices:
        problems.append("probe is measured but lists no device")
    strategy = str(spec.get("strategy", "single"))
    for d in devices:
        name = str(d.get("device"))
        wrong = wrapper_problem(strategy, str(d.get("wrapper", "")))
        if wrong and probe.get("status") == StageStatus.PASS:
            problems.append(f"probe device {name} passes, but {wrong}")
        if capacity.get(name) is None:  # its share of the capacity (judgements_of) is not judged either
            problems.append(f"probe device {name}: no planned device of that name with a capacity, so its fit "
                            f"cannot be judged")
    wrong_ranks = node_ranks_problem(spec, len(plan.get("devices", [])), [d.get("rank", 0) for d in devices])
    if devices and wrong_ranks:
        problems.append(wrong_ranks)
    world = expected_world_size(spec, len(plan.get("devices", [])))
    if world is not None and world > 1 and strategy != "device_map":
        sizes = {d.get("world_size", 1) for d in devices}
        if sizes != {world}:
            problems.append(f"probe.devices say world size {sorted(sizes)}, the spec runs {world} ranks")
        per_host = [(d.get("host"), d.get("device")) for d in devices]
        if len(set(per_host)) != len(per_host):
            problems.append("probe.devices name one device of one host for two ranks")


def _plan_comparison_problems(rec: dict[str, Any], probe: dict[str, Any], planned_tensors: dict[str, int],
                              problems: list[str]) -> None:
    """Each row of ``probe.plan_comparison`` repeats the plan's tensor bytes and the probe's peak, its overhead is peak
    RSS minus the peak of tensors, and an under-estimate is named in ``probe.findings`` exactly when there is one."""
    devices = probe.get("devices", [])
    peaks = {(str(d.get("device")), d.get("rank", 0)): d.get("peak_bytes") for d in devices}
    peak_rss = {(str(d.get("device")), d.get("rank", 0)): d.get("peak_rss_bytes") for d in devices
                if isinstance(d.get("peak_rss_bytes"), int)}
    findings = [str(f) for f in probe.get("findings", [])]
    v2 = rec["schema_version"] >= 2
    for row in probe.get("plan_comparison", []):
        name, key = str(row.get("device")), (str(row.get("device")), row.get("rank", 0))
        if name in planned_tensors and row.get("planned_bytes") != planned_tensors[name]:
            problems.append(f"probe.plan_comparison for {name}: planned {row.get('planned_bytes')} B, the plan "
                            f"says {planned_tensors[name]}")
        if key in peaks and row.get("measured_bytes") != peaks[key]:
            problems.append(f"probe.plan_comparison for {name}: measured {row.get('measured_bytes')} B, the "
                            f"probe's peak is {peaks[key]}")
        comps = row.get("components")
        overhead = comps.get("overhead") if isinstance(comps, dict) else None
        runtime = overhead.get("measured_bytes") if isinstance(overhead, dict) else None
        tensors = peaks.get(key)
        if runtime is not None and key in peak_rss and isinstance(tensors, int) \
                and runtime != peak_rss[key] - tensors:
            problems.append(f"probe.plan_comparison for {name}: the overhead measured {runtime} B, but peak RSS "
                            f"minus the peak of tensors is {peak_rss[key] - tensors} B")
        over = under_estimate(count(row.get("planned_bytes"), "probe.plan_comparison[].planned_bytes"),
                              count(row.get("measured_bytes"), "probe.plan_comparison[].measured_bytes"))
        named = any(UNDER_ESTIMATE_WORD in f and _names_device(f, name, row.get("rank", 0)) for f in findings)
        if v2 and over is not None and not named:
            problems.append(f"probe on {name} measured {100 * over:.1f} % above the plan, and probe.findings does "
                            "not name the under-estimate")
        elif v2 and over is None and named:
            problems.append(f"probe.findings names an under-estimate on {name}, but it measured within the "
                            f"tolerance of its plan")


def _evaluation_verdict(rec: dict[str, Any], training: bool, problems: list[str],
                        computed: dict[str, StageStatus | None], crit: AcceptCriteria) -> None:
    """The evaluation stage recomputed by the engine (:func:`core.record.verdicts.evaluation_verdict` over
    :func:`quality_facts`: the criteria all met; by default training: both finite and after < before; inference:
    measured once and finite; sets ``computed["evaluation"]`` when measured), and what in its table does not follow
    (appends to ``problems``): perplexity = exp(mean NLL) >= 1 over tokens > 0, accuracy = correct targets / tokens,
    its settings the spec's, on a measured data split."""
    spec, ev = rec["spec"], rec["evaluation"]
    if ev.get("provenance") == "measured":
        facts = quality_facts(rec, crit, training)
        for when in ("before", "after") if training else ("before",):
            point = ev.get(when, {})
            if not isinstance(point, dict) or point.get("provenance") == "not_run":
                problems.append(f"evaluation.{when} was not measured")
                continue
            at = f"evaluation.{when}"
            ppl = num(entry(point, "perplexity", at), f"{at}.perplexity")
            nll = num(entry(point, "mean_nll", at), f"{at}.mean_nll")
            tokens = count(entry(point, "tokens", at), f"{at}.tokens")
            if tokens == 0:
                problems.append(f"evaluation.{when}: 0 tokens evaluated")
            if not math.isclose(ppl, math.exp(nll) if nll < 709 else math.inf, rel_tol=1e-9) and not (
                    math.isnan(ppl) and math.isnan(nll)):
                problems.append(f"evaluation {when}: perplexity {ppl} is not exp(mean NLL {nll})")
            if ppl < 1.0:
                problems.append(f"evaluation {when}: perplexity {ppl} < 1 (the mean NLL of a distribution is >= 0)")
            if "accuracy" in point or "correct_tokens" in point:
                right = count(entry(point, "correct_tokens", at), f"{at}.correct_tokens")
                acc = num(entry(point, "accuracy", at), f"{at}.accuracy")
                if tokens and not (right <= tokens and math.isclose(acc, right / tokens, rel_tol=1e-9)):
                    problems.append(f"evaluation {when}: accuracy {acc} is not correct_tokens / tokens "
                                    f"({right} / {tokens})")
        if not training and isinstance(ev.get("after"), dict) and ev["after"].get("provenance") != "not_run":
            problems.append("evaluation.after is measured, but an inference run trains nothing")
        for key, value in subtable(entry(ev, "settings", "evaluation"), "evaluation.settings").items():
            if spec.get(key) != value:
                problems.append(f"evaluation.settings.{key} = {value!r}, the spec says {spec.get(key)!r}")
        if rec["data"].get("provenance") != "measured":
            problems.append("evaluation is measured but the data table (the split it was measured on) is not")
        computed["evaluation"] = evaluation_verdict(facts).status
        _same(problems, "evaluation table", ev.get("status"), computed["evaluation"])
    elif ev.get("provenance") != "not_run":
        problems.append(f"evaluation.provenance is {ev.get('provenance')!r}: an evaluation is measured or not_run")


def _resume_verdict(rec: dict[str, Any], training: bool, problems: list[str],
                    computed: dict[str, StageStatus | None], crit: AcceptCriteria) -> None:
    """The resume stage recomputed by the engine (:func:`core.record.verdicts.resume_verdict` over
    :func:`resume_facts`; sets ``computed["resume"]``): not_applicable exactly for inference or the check switched
    off; measured: pass exactly when every check passed, every expected check is there with its kind, the numbers
    within the tier. What does not follow is appended to ``problems``: the tier, what the numbers say against a pass
    (:func:`core.record.verdicts.resume_contradictions`), the checkpoint's manifest, the comparison covering the
    spec's window, each difference."""
    spec, res = rec["spec"], rec["resume"]
    resume_spec = subtable(spec.get("resume", {}), "spec.resume")
    applies = training and flag(resume_spec.get("check", True), "spec.resume.check")  # the default: checked
    if res.get("status") == StageStatus.NOT_APPLICABLE:
        computed["resume"] = resume_verdict(NotApplicable()).status
        if applies:
            problems.append("resume is not_applicable, but the spec trains with the resume check on")
    elif not applies and res.get("provenance") == "measured":
        problems.append("resume was measured, but the spec is inference or has the resume check off")
    elif res.get("provenance") == "measured":
        rule = _resume_tier(rec, problems, crit)
        facts = resume_facts(rec, crit, rule)
        all_pass = bool(facts.checks) and all(c.passed for c in facts.checks)
        if all_pass:
            _expected_checks_problems(rec, facts, problems)
        problems.extend(resume_contradictions(facts))
        rows = tables(entry(res, "comparison", "resume"), "resume.comparison")
        if all_pass and not res.get("checkpoint_manifest"):
            problems.append("resume passed without the sha256 manifest of the checkpoint it resumed from")
        if all_pass:
            _resume_window_problems(spec, res, rows, problems)
        for i, (row, step) in enumerate(zip(rows, facts.steps)):
            stated_diff = num(entry(row, "difference", f"resume.comparison[{i}]"), f"resume.comparison[{i}].difference")
            diff = abs(step.reference - step.resumed)
            if not (math.isclose(diff, stated_diff, rel_tol=1e-9, abs_tol=1e-15) or
                    (math.isnan(diff) and math.isnan(stated_diff))):
                problems.append(f"resume step {step.step}: |{step.reference} - {step.resumed}| = {diff}, the row "
                                f"says {stated_diff}")
        computed["resume"] = resume_verdict(facts).status
        _same(problems, "resume table", res.get("status"), computed["resume"])
    elif res.get("provenance") != "not_run":
        problems.append(f"resume.provenance is {res.get('provenance')!r}: measured, not_run, or status "
                        f"not_applicable")


def _expected_checks_problems(rec: dict[str, Any], facts: ResumeFacts, problems: list[str]) -> None:
    """A passing resume of a record shows every check of :func:`core.stages.resume.expected_checks` for the spec's
    dtype and the record's version, each of its kind."""
    from core.stages.resume import expected_checks

    names = {c.name: c for c in facts.checks}
    dtype = text(entry(rec["spec"], "dtype", "spec"), "spec.dtype")
    for name, kind in expected_checks(dtype, rec["schema_version"]).items():
        if name not in names:
            problems.append(f"resume passed without its {name} check")
        elif names[name].kind != kind:
            problems.append(f"resume check {name} is of kind {names[name].kind!r}, it is a {kind} check")


def _resume_tier(rec: dict[str, Any], problems: list[str], crit: AcceptCriteria) -> RecordedRule:
    """The rule of the record's resume tier: a tier gpuaccept applies (schema 5: :func:`core.stages.noise.known_tiers`,
    with its method and multiple; before: a relative tolerance, :data:`core.stages.noise.LEGACY_RTOL`), the one the spec's
    dtype on the probed device, its noise setting, the test jitter and the criteria require (appends what is wrong to
    ``problems``; an unknown tier is judged bit-exact)."""
    from core.stages.noise import (
        EVIDENCE_SCHEMA,
        LEGACY_RTOL,
        POOLED_SCHEMA,
        RESIZED_SUFFIX,
        RecordedRule,
        required_tier,
        tier_problems,
    )

    spec, probe, res = rec["spec"], rec["probe"], rec["resume"]
    tier = res.get("tier", {})
    name = tier.get("name")
    if rec["schema_version"] < 5:
        if name not in LEGACY_RTOL:
            problems.append(f"resume.tier {name!r} is not a tier gpuaccept applied before schema 5 "
                            f"({', '.join(LEGACY_RTOL)})")
            return RecordedRule("legacy")
        rtol = LEGACY_RTOL[name]
        if num(tier.get("rtol"), "resume.tier.rtol") != rtol:
            problems.append(f"resume.tier {name} has rtol {rtol}, the record says {tier.get('rtol')}")
        return RecordedRule("legacy", rtol=rtol)
    known, wrong = tier_problems(tier, rec["schema_version"])
    problems += wrong
    if known is None:
        return RecordedRule("exact")
    probed = [str(d.get("device")) for d in probe.get("devices", [])] if probe.get("provenance") == "measured" else []
    if probed:
        env = rec.get("environment", {})
        want = required_tier(probed[0], text(entry(spec, "dtype", "spec"), "spec.dtype"), crit.resume_tier,
                             spec.get("resume", {}).get("noise", "auto"),
                             jittered=bool(env.get("test_jitter"))).name
        if want != known.name:
            problems.append(f"resume.tier is {known.name}, but {spec.get('dtype')} on {probed[0]} is {want}")
    twin_steps = res.get("twin_steps") or [1]
    return RecordedRule(known.method, multiple=known.multiple,
                        loss_multiple=known.loss_multiple if "loss_multiple" in tier else known.multiple,
                        evidence_kept=rec["schema_version"] >= EVIDENCE_SCHEMA,
                        pooled=rec["schema_version"] >= POOLED_SCHEMA, resized=str(name).endswith(RESIZED_SUFFIX),
                        twins_from_start=twin_steps[0] == 1)


def _resume_window_problems(spec: dict[str, Any], res: dict[str, Any], rows: list[Any], problems: list[str]) -> None:
    """A passing resume resumed from the spec's checkpoint and compared every step of the spec's window (c+1 to c +
    ``resume.compare_steps``; to the last step for records without that key)."""
    c = count(res.get("checkpoint_step"), "resume.checkpoint_step")
    planned_c, end = _resume_window(spec)
    if planned_c is not None and planned_c != c:
        problems.append(f"resume.checkpoint_step is {c}, the spec's resume settings resume from "
                        f"checkpoint-{planned_c}")
    want_steps = list(range(c + 1, end + 1))
    got_steps = [row.get("step") for row in rows]
    if got_steps != want_steps:
        problems.append(f"resume comparison covers steps {got_steps[:3]}..., the resumed run is steps "
                        f"{c + 1}-{want_steps[-1] if want_steps else c}")
    window = res.get("compared_steps")
    if window is not None and want_steps and window != [want_steps[0], want_steps[-1]]:
        problems.append(f"resume.compared_steps says {window}, the spec compares steps "
                        f"{want_steps[0]}-{want_steps[-1]}")


def _resume_window(spec: dict[str, Any]) -> tuple[int | None, int]:
    """(checkpoint c, the last step compared) from a record's spec table (:class:`core.spec.ResumeSettings`):
    ``resume.compare_steps`` after c; for a record written before that key existed, (None, the last step): its
    resumed run always ran to the end."""
    import dataclasses

    from core.spectables import ResumeSettings

    steps = count(spec.get("steps"), "spec.steps")
    table = spec.get("resume", {})
    if "compare_steps" not in table:
        return None, steps
    known = {f.name for f in dataclasses.fields(ResumeSettings)}
    settings = ResumeSettings(**{k: v for k, v in table.items() if k in known})
    return settings.kill_checkpoint_step(), settings.compared_until(steps)


def _same(problems: list[str], where: str, stated: Any, computed: StageStatus | None) -> None:
    if stated != computed:
        problems.append(f"{where} says status {stated}, its data says {computed}")
