"""What the wizard holds between screens. Screens read and write it; core computes everything in it."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:  # the wizard's first screen must appear at once: core's modules are imported where they are used
    from core.api import AcceptanceRun, CommandRun, CommandSpec, PlanContext
    from core.spec import RunSpec


@dataclass
class WizardState:
    """The user's choices and the pipeline objects built from them.

    Attributes:
        mode: inference | full | lora | qlora | command (your own command), chosen on the first screen.
        fields: setup values as typed (flag names of RunSpec.build), applied over the mode's defaults.
        spec: the validated RunSpec, once the setup is valid.
        ctx: the plan context (core.prerun.PlanContext) for ``spec``.
        traced: the traced plan of ``spec`` (core.plan.traced.traced_table) once the plan screen's trace has finished.
        run: the core.pipeline.AcceptanceRun created when the probe starts (it owns the run directory); in command
            mode the core.command.pipeline.CommandRun created when the command's run starts.
        running: the name of the stage whose worker runs now, or None.
        cancel: set to stop a running stage; the stage kills its child's process group.
        probe_anyway: the user chose "Probe anyway" on a plan that does not fit (the plan stage still fails).
        signoff_draft: the export screen's fields as typed (operator, role, decision, comment, key), kept when the
            user goes back and returns.
    """

    runs_root: Path = Path("runs")
    devices_override: list[Any] | None = None
    mode: str = "lora"
    fields: dict[str, Any] = field(default_factory=dict)
    spec: RunSpec | None = None
    ctx: PlanContext | None = None
    traced: dict[str, Any] | None = None
    #: the recipe's stage screens read it through :meth:`recipe_run`, the export screen as either kind
    run: AcceptanceRun | CommandRun | None = None
    running: str | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    children: set[int] = field(default_factory=set)  # pids of the stages' child processes (each leads its group)
    record_path: Path | None = None
    signature_path: Path | None = None  # record.toml.sig once the export screen signed the record
    probe_anyway: bool = False
    probe_bar_peaks: dict[str, int | None] | None = None  # the live bars' probe peaks when the probe ended
    signoff_draft: dict[str, str] = field(default_factory=dict)
    #: traced plans already made in this session, by ``traced_key`` (b / B / s / S back to a traced setting: no retrace)
    traced_cache: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: command mode: the form's values as typed ([command] keys; prefilled from --command and a [command] spec) and
    #: the CommandSpec once they are valid
    command_fields: dict[str, Any] = field(default_factory=dict)
    command_spec: CommandSpec | None = None
    #: command mode's criteria (core/criteria.py ``command_criteria``: from the [accept] table and the flags); None:
    #: the default rules
    command_criteria: Any = None
    #: Setup's line saying which trainer's config the form was read from (^l From config), "" for none
    imported_note: str = ""
    #: every line of the import's account (core.importers.Imported.summary) and what it replaced in Setup (^r shows it)
    imported_lines: list[str] = field(default_factory=list)


    def recipe_run(self) -> AcceptanceRun:
        """The recipe's run, which the probe, evaluation and resume screens show.

        Raises:
            RuntimeError: there is none (a stage screen shown before the probe made it, or in command mode): a fault of
                the wizard's screen order, never of the user's input.
        """
        if self.run is None or self.command_run():
            raise RuntimeError(f"a stage screen of the recipe was shown with {type(self.run).__name__} as the run")
        return cast("AcceptanceRun", self.run)  # or a test's stand-in with its attributes

    def command_run(self) -> bool:
        """The run is a user's command (core.command.pipeline.CommandRun, told by its CommandSpec), not gpuaccept's
        recipe."""
        from core.api import CommandSpec

        return self.run is not None and isinstance(self.run.spec, CommandSpec)


#: a stage's name as the screens say it (the record's names are ``plan``, ``probe``, ``train_eval``, ``resume``)
STAGE_WORDS = {"train_eval": "train + evaluate"}


def stage_words(stage: str) -> str:
    """``train_eval`` → ``train + evaluate``; other stage names as they are."""
    return STAGE_WORDS.get(stage, stage)
