"""The use cases of gpuaccept, as the two front ends call them: the wizard (``tui/``) and the headless CLI
(``tui/cli.py``) import core through this module only, and through the modules of core's vocabulary (the spec and its
settings, the training methods, the kill points, the errors, the events, the statuses); an import contract keeps them
from every other module of core (``[tool.importlinter]`` in pyproject.toml, "the front ends call core through
core.api").

The use cases, each a function of this module:

- **plan**: :func:`plan` (the memory plan of a spec), :func:`plan_report` (what ``gpuaccept plan`` prints and the Plan
  screen shows: the plan, each device's fit, the traced plan or why there is none, the fit search), :func:`trace`
  (the traced plan in this process), :func:`traced_table` (in a child process: the wizard's), :func:`search` (the
  largest micro-batch or sequence length that fits), :func:`check_inputs` (what the setup form checks as it is
  typed), :func:`detect_devices`, :func:`runnable_reason`;
- **run**: :func:`run` (every stage of gpuaccept's recipe, one event at a time), :func:`run_command` (command mode);
  the wizard runs the stages one screen at a time on an :class:`~core.pipeline.AcceptanceRun` (a
  :class:`~core.command.pipeline.CommandRun` with :func:`~core.command.pipeline.every_stage`);
- **records**: :func:`read_record`, :func:`verify`, :func:`verify_deep`, :func:`verify_folder`, :func:`diff`, :func:`sign_record` (sign-off
  and signature, ``gpuaccept sign``), :func:`sign` (the signature of a written record, the export screen's);
- **the quiz**: :func:`build_quiz`, :func:`add_quiz_answers`;
- **the monitor**: :func:`default_backend` and :class:`~core.monitor.sampler.Sampler`.

The types those use cases take and give (:class:`~core.prerun.PlanContext`, :class:`~core.plan.search.Largest`,
:class:`~core.plan.fit.Fit`, ...) and the few helpers that put their numbers into words the same way on every screen
(:func:`~core.plan.memory.component_label`, :func:`~core.plan.search.headroom_text`, ...) are re-exported from
where they are defined: :data:`REEXPORTED` names each one's home.

Nothing heavy is imported here: this module is imported before the wizard's first screen, so every use case imports
what it needs when it is called, and a re-exported name is imported from its home when it is first asked for (PEP 562's
module ``__getattr__``). torch and transformers are never imported by importing it.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names of REEXPORTED, for type checkers; at run time each is imported when first asked for
    from core.command.pipeline import CommandRun as CommandRun
    from core.command.pipeline import every_stage as every_stage
    from core.commandspec import COMMAND_SETTINGS as COMMAND_SETTINGS
    from core.commandspec import CommandSpec as CommandSpec
    from core.commandspec import is_command_file as is_command_file
    from core.commandspec import read_command_criteria as read_command_criteria
    from core.commandspec import read_command_table as read_command_table
    from core.criteria import COMMAND_CRITERIA as COMMAND_CRITERIA
    from core.criteria import AcceptCriteria as AcceptCriteria
    from core.criteria import command_criteria as command_criteria
    from core.events import Event
    from core.importers import NeedsValue as NeedsValue
    from core.importers import build_spec as build_spec
    from core.importers import import_config as import_config
    from core.monitor.health import HEALTH_COLUMNS as HEALTH_COLUMNS
    from core.monitor.health import health_table as health_table
    from core.monitor.nvml import default_backend as default_backend
    from core.monitor.sampler import Sampler as Sampler
    from core.pipeline import AcceptanceRun as AcceptanceRun
    from core.pipeline import StagedRun as StagedRun
    from core.plan.devices import DeviceInfo as DeviceInfo
    from core.plan.devices import judged_capacity as judged_capacity
    from core.plan.fit import Fit as Fit
    from core.plan.fit import all_fit as all_fit
    from core.plan.fit import fit_verdicts as fit_verdicts
    from core.plan.fit import fits_in as fits_in
    from core.plan.memory import MemoryPlan as MemoryPlan
    from core.plan.memory import component_label as component_label
    from core.plan.memory import overhead_name as overhead_name
    from core.plan.search import Largest as Largest
    from core.plan.search import headroom_text as headroom_text
    from core.plan.traced import relative_text as relative_text
    from core.prerun import InputsChecked as InputsChecked
    from core.prerun import PlanContext as PlanContext
    from core.prerun import traced_summary as traced_summary
    from core.quiz import Question as Question
    from core.quiz import build_quiz as build_quiz
    from core.record.diff import Comparison as Comparison
    from core.record.diff import format_comparison as format_comparison
    from core.record.signing import SigningError as SigningError
    from core.record.signing import agent_keys as agent_keys
    from core.record.signing import can_sign as can_sign
    from core.record.signing import fingerprint as fingerprint
    from core.record.signing import signature_path as signature_path
    from core.record.signoff import SignoffRefused as SignoffRefused
    from core.record.signoff import checked_signoff as checked_signoff
    from core.record.signoff import make_signoff as make_signoff
    from core.record.signoff import needs_override as needs_override
    from core.record.signoff import verdict_in_words as verdict_in_words
    from core.record.summary import folder_exit_code as folder_exit_code
    from core.record.summary import folder_summary as folder_summary
    from core.record.summary import format_folder as format_folder
    from core.record.summary import records_below as records_below
    from core.record.summary import run_summary as run_summary
    from core.record.summary import verification_summary as verification_summary
    from core.record.verify import Verification as Verification
    from core.spec import RunSpec

#: What this module re-exports, by name: the module that defines it (imported when the name is first asked for). The
#: types the use cases take and give, the run objects the wizard drives stage by stage, and the helpers that word a
#: number the same way on every screen and command line.
REEXPORTED: dict[str, str] = {
    # the plan: its context, devices, fit, search and traced plan, and their words
    "PlanContext": "core.prerun", "InputsChecked": "core.prerun", "traced_summary": "core.prerun",
    "MemoryPlan": "core.plan.memory", "component_label": "core.plan.memory", "overhead_name": "core.plan.memory",
    "DeviceInfo": "core.plan.devices", "judged_capacity": "core.plan.devices",
    "Fit": "core.plan.fit", "fit_verdicts": "core.plan.fit", "all_fit": "core.plan.fit", "fits_in": "core.plan.fit",
    "Largest": "core.plan.search", "headroom_text": "core.plan.search",
    "relative_text": "core.plan.traced",
    # the runs the wizard drives one stage (one screen) at a time
    "StagedRun": "core.pipeline", "AcceptanceRun": "core.pipeline",
    "CommandRun": "core.command.pipeline", "every_stage": "core.command.pipeline",
    # a signal stops the parent's own computation (the data read, the plan) at once (core/interrupt.py)
    "interrupt": "core.interrupt",
    "CommandSpec": "core.commandspec", "read_command_table": "core.commandspec", "is_command_file": "core.commandspec",
    "COMMAND_SETTINGS": "core.commandspec", "read_command_criteria": "core.commandspec",
    "command_criteria": "core.criteria", "COMMAND_CRITERIA": "core.criteria", "AcceptCriteria": "core.criteria",
    # a trainer's YAML config read as a spec (TRL, axolotl, LLaMA-Factory, torchtune, LitGPT), and the value it leaves
    # to the data, asked for by name
    "import_config": "core.importers", "NeedsValue": "core.importers", "build_spec": "core.importers",
    # records: verify, compare, summarise, sign off and sign
    "Verification": "core.record.verify", "Comparison": "core.record.diff", "format_comparison": "core.record.diff",
    "verification_summary": "core.record.summary", "run_summary": "core.record.summary",
    "records_below": "core.record.summary", "folder_exit_code": "core.record.summary",
    "folder_summary": "core.record.summary", "format_folder": "core.record.summary",
    "SigningError": "core.record.signing", "fingerprint": "core.record.signing", "agent_keys": "core.record.signing",
    "can_sign": "core.record.signing", "signature_path": "core.record.signing",
    "SignoffRefused": "core.record.signoff", "make_signoff": "core.record.signoff",
    "checked_signoff": "core.record.signoff", "needs_override": "core.record.signoff",
    "verdict_in_words": "core.record.signoff",
    # the quiz and the monitor
    "Question": "core.quiz", "build_quiz": "core.quiz",
    "Sampler": "core.monitor.sampler", "default_backend": "core.monitor.nvml",
    # the health preflight on the Probe screen
    "health_table": "core.monitor.health", "HEALTH_COLUMNS": "core.monitor.health",
}


def __getattr__(name: str) -> Any:
    """A name of :data:`REEXPORTED`, imported from its home now (its first use), not when this module is imported."""
    home = REEXPORTED.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


# ------------------------------------------------------------------------------------------------------------- plan
def plan(spec: RunSpec, devices_override: list[DeviceInfo] | None = None) -> PlanContext:
    """The memory plan of ``spec``: the model resolved and its config read (no weights), the spec checked against it,
    the devices detected (or ``devices_override``: a box planned for, a test's host) and the plan made per device
    (:func:`core.prerun.make_plan`).

    Raises:
        SpecError, ModelNotFoundError: named errors for bad input.
    """
    from core.prerun import make_plan

    return make_plan(spec, devices_override)


def check_inputs(spec: RunSpec) -> InputsChecked:
    """What a plan or a run would refuse about the spec's model and data, read without weights or a run folder (the
    setup form checks it as it is typed; :func:`core.prerun.check_inputs`). Never raises: each problem is named by
    the field that fixes it."""
    from core.prerun import check_inputs as checked

    return checked(spec)


def detect_devices(devices: str = "auto", cpu_ranks: int = 1) -> list[DeviceInfo]:
    """The devices a ``devices`` setting names, with the capacity each is planned against
    (:func:`core.plan.devices.detect_devices`; CUDA through torch, so it may import torch)."""
    from core.plan.devices import detect_devices as detected

    return detected(devices, cpu_ranks)


def runnable_reason(spec: RunSpec, ctx: PlanContext, allow_unfit: bool = False) -> str | None:
    """Why ``spec`` cannot run on this machine (a screen says it before Next), or None; ``allow_unfit``: a plan that
    does not fit is not a reason (it can be probed anyway). :func:`core.prerun.runnable_reason`."""
    from core.prerun import runnable_reason as reason

    return reason(spec, ctx, allow_unfit)


def trace(spec: RunSpec, ctx: PlanContext) -> dict[str, Any]:
    """The traced plan of ``spec`` (one step on fake tensors, in this process: it imports torch, seconds) beside the
    analytic plan's first device, JSON-ready (:func:`core.plan.traced.comparison_json`); ``{"status": "not_run",
    "reason": ...}`` when the spec is not traceable (QLoRA, an 8-bit optimizer, a strategy that shards the step).

    Raises:
        GpuAcceptError: the trace failed.
    """
    from core.plan.traced import comparison_json, untraceable_reason
    from core.plan.tracer import trace_against

    reason = untraceable_reason(ctx.plan, spec)
    if reason is not None:
        return {"status": "not_run", "reason": reason}
    traced, difference = trace_against(spec, ctx.config, ctx.plan)
    return comparison_json(traced, difference, ctx.plan.devices[0].device.name)


def traced_table(spec: RunSpec, ctx: PlanContext, cancelled: Callable[[], bool] | None = None) -> dict[str, Any]:
    """The traced plan as :func:`trace` gives it, made in a child process (the wizard stays live; ``cancelled`` is
    polled and kills it); never raises: a trace that failed or was cancelled is ``{"status": "error" | "cancelled",
    "reason": ...}`` (:func:`core.plan.traced.traced_table`)."""
    from core.plan.traced import traced_table as table

    return table(spec, ctx, cancelled)


def search(spec: RunSpec, ctx: PlanContext, axis: str, *, traced: bool = False) -> list[Largest]:
    """Per device of ``ctx``, the largest ``axis`` value (``batch_size``: the micro-batch, or ``seq_len``) whose plan
    fits it, the rest of ``spec`` unchanged, with the value that leaves the headroom
    (:func:`core.plan.search.largest_fitting`). A sequence length stops at the model's declared
    ``max_position_embeddings``. ``traced``: the value found is checked as the fit is then judged, by the larger of
    the analytic and traced peaks (a trace per value tried, in this process: it imports torch).

    Raises:
        ValueError: ``axis`` is not a search axis.
    """
    from core.plan.search import largest_fitting

    limit = None
    if axis == "seq_len":
        from core.models import declared_max_positions

        limit = declared_max_positions(ctx.source, ctx.config)
    peak: Callable[[Any], int] | None = None
    if traced:
        from core.plan.tracer import trace_plan

        kind = ctx.devices[0].kind

        def peak(candidate: Any) -> int:
            return trace_plan(candidate, ctx.config, target=kind).peak_bytes

    return largest_fitting(spec, ctx.config, ctx.devices, axis, limit, peak)


@dataclass(frozen=True)
class PlanReport:
    """The plan of a spec with what is judged from it: what ``gpuaccept plan`` prints (and its exit status) and the
    Plan screen shows, made by :func:`plan_report`.

    Attributes:
        spec: the spec planned.
        ctx: its plan context (the resolved model, its config, the devices, the plan).
        traced: the traced plan (:func:`trace`), or ``{"status": "not_run", "reason": ...}``; None when not asked for.
        fits: per device, the fit verdict, judged by the larger of the analytic and traced peaks
            (:func:`core.plan.fit.fit_verdicts`).
        largest: the fit search (:func:`search`) by axis, ``batch_size`` before ``seq_len``; only the axes asked for.
    """

    spec: RunSpec
    ctx: PlanContext
    traced: dict[str, Any] | None
    fits: list[Fit]
    largest: dict[str, list[Largest]]

    @property
    def plan(self) -> MemoryPlan:
        """The memory plan (``ctx.plan``)."""
        plan: MemoryPlan = self.ctx.plan
        return plan

    @property
    def all_fit(self) -> bool:
        """Every device fits (a device of unknown capacity does not count against it: :func:`core.plan.fit.all_fit`)."""
        from core.plan.fit import all_fit

        return all_fit(self.fits)

    @property
    def fit_unknown(self) -> bool:
        """A device's capacity is unknown, so its fit is not judged."""
        return any(f.fits is None for f in self.fits)

    def to_json(self) -> dict[str, Any]:
        """``gpuaccept plan --json``: the plan's JSON, each device with its fit (``fit_bytes``, ``fit_judged_by``,
        ``fits``), then ``traced`` when a trace was asked for and ``largest_fitting`` (each row with its headrooms)
        when a search was."""
        out: dict[str, Any] = self.ctx.plan.to_json()
        for device, fit in zip(out["devices"], self.fits):
            device.update(fit_bytes=fit.bytes, fit_judged_by=fit.judged_by, fits=fit.fits)
        if self.traced is not None:
            out["traced"] = self.traced
        if self.largest:
            out["largest_fitting"] = {axis: [dataclasses.asdict(x) | {
                "headroom_bytes": x.headroom_bytes, "recommended_headroom_bytes": x.recommended_headroom_bytes}
                for x in rows] for axis, rows in self.largest.items()}
        return out


def plan_report(spec: RunSpec, *, traced: bool = False, max_batch: bool = False, max_seq: bool = False,
                devices_override: list[DeviceInfo] | None = None) -> PlanReport:
    """The plan of ``spec`` (:func:`plan`), then, as asked, its traced plan (``traced``: :func:`trace`, in this
    process), each device's fit judged by the larger of the analytic and traced peaks, and the largest micro-batch
    (``max_batch``) and sequence length (``max_seq``) that fit each device (:func:`search`, checked with traces when
    ``traced``). ``gpuaccept plan`` prints it; the Plan screen shows it (its trace comes later, from
    :func:`traced_table`).

    Raises:
        SpecError, ModelNotFoundError: named errors for bad input; GpuAcceptError: the trace failed.
    """
    from core.plan.fit import fit_verdicts

    ctx = plan(spec, devices_override)
    table = trace(spec, ctx) if traced else None
    fits = fit_verdicts(ctx.plan, table)
    axes = [axis for axis, asked in (("batch_size", max_batch), ("seq_len", max_seq)) if asked]
    largest = {axis: search(spec, ctx, axis, traced=traced) for axis in axes}
    return PlanReport(spec=spec, ctx=ctx, traced=table, fits=fits, largest=largest)


# -------------------------------------------------------------------------------------------------------------- run
def run(spec: RunSpec, runs_root: Path = Path("runs"), cancelled: Callable[[], bool] | None = None,
        devices_override: list[DeviceInfo] | None = None) -> Generator[Event, None, Path | None]:
    """Every stage of gpuaccept's recipe in order (plan, probe, train + evaluate, kill and resume, record), as one
    generator of events that returns the record's path (:func:`core.pipeline.run_pipeline`); ``cancelled`` stops the
    running stage, and the record is written in every case.

    Raises:
        GpuAcceptError: bad input, before the run folder is made.
    """
    from core.pipeline import run_pipeline

    return run_pipeline(spec, runs_root, cancelled, devices_override)


def run_command(spec: CommandSpec, runs_root: Path = Path("runs"), cancelled: Callable[[], bool] | None = None,
                criteria: AcceptCriteria | None = None) -> Generator[Event, None, Path | None]:
    """Every stage of command mode (the user's own command run, measured, planned from what ran, evaluated, killed
    and resumed; then the record), as :func:`run` does for the recipe
    (:func:`core.command.pipeline.run_command_pipeline`).

    Raises:
        GpuAcceptError: bad input, before the run folder is made.
    """
    from core.command.pipeline import run_command_pipeline

    return run_command_pipeline(spec, runs_root, cancelled, criteria)


# ---------------------------------------------------------------------------------------------------------- records
def check_path(field: str, value: str) -> None:
    """A path given by the user that the file system cannot take (too long a path or name) is bad input, named with
    its limit (:func:`core.bounds.check_path`).

    Raises:
        SpecError: naming ``field``.
    """
    from core.bounds import check_path as checked

    checked(field, value)


def read_record(path: Path) -> dict[str, Any]:
    """A record (any TOML file) read and parsed within gpuaccept's bounds of nesting and string length
    (:func:`core.bounds.loads_bounded`).

    Raises:
        OSError: it cannot be read; UnicodeDecodeError, tomllib.TOMLDecodeError (both ValueErrors): not UTF-8 TOML,
            or beyond the bounds.
    """
    from core.bounds import MAX_RECORD_FILE, loads_bounded, read_input_text

    # a FIFO, a device or a file past any record's size is an OSError naming it (core.bounds.InputFileError)
    return loads_bounded(read_input_text(path, "a gpuaccept record", MAX_RECORD_FILE))


def verify(record: Path, allowed_signers: Path | None = None, identity: str | None = None) -> Verification:
    """Check a record's signature, schema and every verdict against its own numbers (:func:`core.record.verify.verify`;
    its ``exit_code`` is ``gpuaccept verify``'s).

    Raises:
        FileNotFoundError: no such record; SigningError: ssh-keygen is missing.
    """
    from core.record.verify import verify as verified

    return verified(record, allowed_signers, identity)


def verify_deep(run_dir: Path, allowed_signers: Path | None = None, identity: str | None = None
                ) -> tuple[Verification, list[str]]:
    """``gpuaccept verify --deep RUN_DIR``: :func:`verify` of ``run_dir/record.toml``, then the resume check's tensor
    distances computed again from the checkpoint files the record names (:func:`core.record.deep.deep_check`): what
    differs is added to the verdict's findings (exit 6). Returns (the verification, the notes: what was recomputed
    and what was not).

    Raises:
        FileNotFoundError: no record.toml in ``run_dir``; SigningError: ssh-keygen is missing.
    """
    from core.record.deep import deep_check
    from core.record.verify import verify as verified

    result = verified(run_dir / "record.toml", allowed_signers, identity)
    if result.schema:  # a record that is not one: nothing below it is read
        return result, ["deep: not run (the schema check failed)"]
    found = deep_check(read_record(run_dir / "record.toml"), run_dir)
    result.verdicts += found.problems
    return result, [f"deep: {n}" for n in found.notes]


def verify_folder(folder: Path, allowed_signers: Path | None = None, identity: str | None = None
                  ) -> list[dict[str, Any]]:
    """Every record.toml below ``folder`` verified, one row each (record, box, verdict, signature, what verify found:
    :func:`core.record.summary.folder_rows`); :func:`folder_exit_code`, :func:`folder_summary` and
    :func:`format_folder` read the rows."""
    from core.record.summary import folder_rows

    return folder_rows(folder, allowed_signers, identity)


def diff(records: list[Path]) -> Comparison:
    """Records side by side, the first the baseline: whether they are comparable (the same spec) and what changed
    (:func:`core.record.diff.compare`; :func:`format_comparison` words it).

    Raises:
        ValueError: fewer than two records, or one is not a gpuaccept record; FileNotFoundError: a missing one.
    """
    from core.record.diff import compare

    return compare(records)


def sign_record(record: Path, key: Path, signoff: dict[str, Any] | None = None) -> Path:
    """``gpuaccept sign``: put ``signoff`` into the record (when given) and sign its bytes, changing nothing unless all of
    it can be done (:func:`core.record.signoff.sign_record`); the signature's path.

    Raises:
        SigningError: the record does not verify, the sign-off contradicts the verdict, or the key cannot sign.
    """
    from core.record.signoff import sign_record as signed

    return signed(record, key, signoff)


def sign(record: Path, key: Path) -> Path:
    """Sign the bytes of a written record with ``key`` into ``record.toml.sig`` (:func:`core.record.signing.sign`; the
    export screen's, after it wrote the record with its sign-off).

    Raises:
        SigningError: the record is missing or already signed, or ssh-keygen refused.
    """
    from core.record.signing import sign as signed

    return signed(record, key)


# ------------------------------------------------------------------------------------------------------------- quiz
def add_quiz_answers(record: Path, questions: list[Question], chosen: list[int], operator: str
                     ) -> tuple[dict[str, Any], Path]:
    """Add the quiz's answers to an unsigned record as one more ``onboarding`` attempt, timed now (UTC): the table
    added (its ``score``, ``questions_asked``, ``operator``) and the record's path
    (:func:`core.quiz.onboarding_table`, :func:`core.quiz.add_onboarding`).

    Raises:
        GpuAcceptError: no operator, not one answer per question, a signed or unreadable record.
    """
    from core.quiz import add_onboarding, onboarding_table
    from core.record.written import utc_now

    table = onboarding_table(questions, chosen, operator, utc_now())
    return table, add_onboarding(record, table)


__all__ = [
    "REEXPORTED", "PlanReport", "plan", "plan_report", "check_inputs", "detect_devices", "runnable_reason", "trace",
    "traced_table", "search", "run", "run_command", "check_path", "read_record", "verify", "verify_deep", "verify_folder", "diff",
    "sign_record", "sign", "add_quiz_answers", *REEXPORTED,
]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(REEXPORTED))
