"""Screen 2: the setup. Every input that moves memory, validated as it is typed."""

from __future__ import annotations

from typing import Any

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import Button, Footer, Header, Input, Label, Select, Static

from core.spec import ATTN_IMPLEMENTATIONS, DTYPES, KILL_POINTS, PADDINGS, PRECISIONS
from tui.screens.nav import NavButtons

# (flag name, label, kind, choices, modes it applies to)
FIELDS: list[tuple[str, str, str, tuple[str, ...], tuple[str, ...]]] = [
    ("model", "Model", "str", (), ("inference", "full", "lora")),
    ("data", "Data", "str", (), ("inference", "full", "lora")),
    ("dtype", "Dtype", "choice", DTYPES, ("inference", "full", "lora")),
    ("precision", "Precision", "choice", PRECISIONS, ("full", "lora")),
    ("attn_implementation", "Attention", "choice", ATTN_IMPLEMENTATIONS, ("inference", "full", "lora")),
    ("padding", "Batches", "choice", PADDINGS, ("full", "lora")),
    ("batch_size", "Micro-batch / device", "int", (), ("inference", "full", "lora")),
    ("seq_len", "Sequence length", "int", (), ("inference", "full", "lora")),
    ("grad_accum", "Grad accumulation", "int", (), ("full", "lora")),
    ("optimizer", "Optimizer", "choice", ("adamw", "sgd", "adafactor"), ("full", "lora")),
    ("steps", "Training steps", "int", (), ("full", "lora")),
    ("learning_rate", "Learning rate", "float", (), ("full", "lora")),
    ("gradient_checkpointing", "Grad checkpointing", "choice", ("off", "on"), ("full", "lora")),
    ("resume_checkpoint_every", "Checkpoint every", "int", (), ("full", "lora")),
    ("resume_kill_after_checkpoint", "Kill after ckpt #", "int", (), ("full", "lora")),
    ("resume_kill_at", "Kill point", "choice", tuple(KILL_POINTS), ("full", "lora")),
    ("resume_compare_steps", "Compare steps, 0=auto", "int", (), ("full", "lora")),
    ("lora_r", "LoRA rank r", "int", (), ("lora",)),
    ("lora_alpha", "LoRA alpha", "int", (), ("lora",)),
    ("lora_targets", "LoRA targets", "str", (), ("lora",)),
    ("devices", "Devices", "str", (), ("inference", "full", "lora")),
    ("strategy", "Strategy", "choice", ("single", "ddp", "zero3"), ("full", "lora")),
    ("torchrun_nproc_per_node", "Ranks/node, 0=auto", "int", (), ("full", "lora")),
]


# choices whose value alone says little to a newcomer: what the option does, in a few words
CHOICE_LABELS: dict[str, str] = {
    "boundary+1": "boundary+1 · inside the next step",
    "boundary": "boundary · right after a step",
    "boundary-1": "boundary-1 · before a step's last micro",
    "checkpoint-write": "checkpoint-write · mid checkpoint",
    "single": "single · one process",
    "ddp": "ddp · a replica per rank",
    "zero3": "zero3 · FSDP full shard",
    "pure": "pure · model in the dtype",
    "amp": "amp · fp32 weights, autocast",
    "sdpa": "sdpa · fused, no scores kept",
    "eager": "eager · keeps b·a·s·s scores",
    "flash_attention_2": "flash_attention_2 · CUDA",
    "padded": "padded · some hold padding",
    "packed": "packed · full blocks only",
}


def spec_field_to_input(field: str) -> str:
    """A SpecError field ("lora.r") as the input id that fixes it ("lora_r")."""
    return {"lora.r": "lora_r", "lora.alpha": "lora_alpha", "lora.targets": "lora_targets",
            "resume.kill_after_checkpoint": "resume_kill_after_checkpoint",
            "resume.checkpoint_every": "resume_checkpoint_every", "resume.kill_at": "resume_kill_at",
            "resume.compare_steps": "resume_compare_steps",
            "torchrun.nproc_per_node": "torchrun_nproc_per_node"}.get(field, field)


def shown_value(value: Any) -> str:
    """A spec value as the form shows it (booleans as on/off, target lists comma-separated)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value))
    return str(value)


def current_value(spec: Any, name: str) -> str:
    """The spec's value of a form field (``lora_r`` reads ``spec.lora.r``)."""
    if name.startswith("lora_"):
        return shown_value(getattr(spec.lora, name.removeprefix("lora_")))
    if name.startswith("resume_"):
        return shown_value(getattr(spec.resume, name.removeprefix("resume_")))
    if name.startswith("torchrun_"):
        return shown_value(getattr(spec.torchrun, name.removeprefix("torchrun_")))
    return shown_value(getattr(spec, name))


class SetupScreen(NavButtons, Screen):
    """Model, dtype, batch, sequence, accumulation, optimizer, steps, LoRA and devices; Next only when valid."""

    BINDINGS = [Binding("ctrl+n", "next", "Next")]

    def compose(self) -> ComposeResult:
        from core.spec import RunSpec

        state = self.app.state
        defaults = RunSpec.build(mode=state.mode)
        shown = {name for name, *_ in FIELDS}
        self._extra = {k: v for k, v in state.fields.items() if k not in shown}  # e.g. --heldout-fraction: kept
        self._checked_spec: Any = None
        self._checked: Any = None
        yield Header()
        yield Static(f"Step 2/7 · Setup ({state.mode})", classes="title")
        training = state.mode != "inference"
        yield Static("What moves memory: batch × sequence drive activations" + ("" if training else " and the KV cache")
                     + "; the dtype sets the bytes per number" + (" (precision: what is kept in it)" if training else "")
                     + ("; the optimizer the states per trainable parameter" if training else "")
                     + ". Model: smollm2-135m (embedded) or a model folder; Data: embedded (the Python docs as "
                       "text) or a .txt / .jsonl file.", classes="intro")
        with VerticalScroll(classes="body", id="form"):
            for name, label, kind, choices, modes in FIELDS:
                if state.mode not in modes:
                    continue
                value = shown_value(state.fields[name]) if name in state.fields else current_value(defaults, name)
                with Horizontal(classes="field"):
                    yield Label(label)
                    if kind == "choice":
                        options = choices if value in choices else (*choices, value)  # e.g. --strategy tp: kept
                        yield Select([(CHOICE_LABELS.get(c, c), c) for c in options], value=value,
                                     allow_blank=False, id=name, compact=True)
                    else:
                        yield Input(value=value, id=name, compact=True)
                yield Static("", classes="field-error", id=f"err-{name}")
                if name == "data":
                    yield Static("", id="data-info", classes="dim")
            yield Static("devices detected: looking…", id="detected")
        yield Static("", classes="error", id="form-error")
        with Horizontal(classes="nav"):
            yield Button("← Back", id="back")
            yield Button("Plan →", id="next", variant="primary")
        yield Footer(show_command_palette=False)  # no ^p palette key: at 80 columns every key shows

    def on_mount(self) -> None:
        self.validate()
        self.detect()
        self.query_one("#model", Input).focus()

    def on_screen_resume(self) -> None:
        # The plan screen's what-if keys may have changed batch size and sequence length: show them here.
        spec = self.app.state.spec
        if spec is not None:
            for name in ("batch_size", "seq_len"):
                widget = self.query_one(f"#{name}", Input)
                if widget.value != str(getattr(spec, name)):
                    widget.value = str(getattr(spec, name))

    @work(thread=True, exclusive=True, group="detect")
    def detect(self) -> None:
        from core.plan import detect_devices

        try:
            devices = self.app.state.devices_override or detect_devices("auto")
            text = "devices detected: " + "; ".join(
                f"{d.name} {d.label} "
                + (f"{d.capacity_bytes / 2**30:.1f} GiB ({d.capacity_source})" if d.capacity_bytes else "capacity unknown")
                for d in devices)
        except Exception as exc:  # noqa: BLE001 - shown, never raised into the UI
            text = f"devices detected: none ({exc})"
        self.app.call_from_thread(self.query_one("#detected", Static).update, text)

    def values(self) -> tuple[dict[str, Any], dict[str, str]]:
        """The typed values converted to spec types, and per-field conversion errors."""
        out: dict[str, Any] = {}
        errors: dict[str, str] = {}
        for name, _label, kind, _choices, modes in FIELDS:
            if self.app.state.mode not in modes:
                continue
            widget = self.query_one(f"#{name}")
            raw = str(widget.value).strip()
            if kind == "int":
                try:
                    out[name] = int(raw)
                except ValueError:
                    errors[name] = f"a whole number, e.g. 4 (got {raw!r})"
            elif kind == "float":
                try:
                    out[name] = float(raw)
                except ValueError:
                    errors[name] = f"a number, e.g. 1e-3 (got {raw!r})"
            elif name == "gradient_checkpointing":
                out[name] = raw == "on"
            else:
                out[name] = raw
        return out, errors

    def validate(self) -> Any:
        """Validate every field; show errors beside them; enable Next only when the spec is valid."""
        from core.errors import SpecError
        from core.spec import RunSpec

        for err in self.query(".field-error"):
            err.update("")
            err.display = False
        self.query_one("#form-error", Static).update("")
        values, errors = self.values()
        spec = None
        if not errors:
            try:
                spec = RunSpec.build(mode=self.app.state.mode, **{**self._extra, **values})
            except SpecError as exc:
                target = spec_field_to_input(exc.field)
                if self.query(f"#err-{target}"):
                    errors[target] = exc.message
                else:
                    self.query_one("#form-error", Static).update(str(exc))
        for name, message in errors.items():
            err = self.query_one(f"#err-{name}", Static)
            err.update(f"↑ {message}")
            err.display = True
        self.query_one("#next", Button).disabled = spec is None
        self.app.state.fields = {**self._extra, **values}
        self.app.state.spec = spec
        if spec is not None and spec != getattr(self, "_checked_spec", None):
            self.check_inputs(spec)  # the model, its limits and the data file: in a worker, as the user types
        elif spec is not None:
            self._show_inputs(spec, self._checked)
        return spec

    # ------------------------------------------------------------------ what the plan would refuse, checked here
    @work(thread=True, exclusive=True, group="inputs")
    def check_inputs(self, spec: Any) -> None:
        """Read the model's config and the data file for ``spec`` (core.pipeline.check_inputs), off the UI thread."""
        from textual.worker import get_current_worker

        result = self._inputs_result(spec)
        if not get_current_worker().is_cancelled:
            self.app.call_from_thread(self._inputs_checked, spec, result)

    @staticmethod
    def _inputs_result(spec: Any) -> Any:
        """The :class:`core.pipeline.InputsChecked`, or ``(field, message)`` naming the input to fix."""
        from core.errors import DataError, GpuAcceptError, ModelNotFoundError, SpecError
        from core.pipeline import check_inputs

        try:
            return check_inputs(spec)
        except SpecError as exc:
            return spec_field_to_input(exc.field), exc.message
        except ModelNotFoundError as exc:
            return "model", str(exc)
        except DataError as exc:
            return "data", str(exc)
        except GpuAcceptError as exc:
            return "model", str(exc)
        except Exception as exc:  # noqa: BLE001 - one line beside the field, never a traceback
            return "model", f"{type(exc).__name__}: {exc}"

    def _inputs_checked(self, spec: Any, result: Any) -> None:
        if spec != self.app.state.spec:
            return  # typed on meanwhile: the newer check decides
        self._checked_spec, self._checked = spec, result
        self._show_inputs(spec, result)

    def _show_inputs(self, spec: Any, result: Any) -> None:
        info = self.query_one("#data-info", Static)
        if isinstance(result, tuple):
            name, message = result
            target = name if self.query(f"#err-{name}") else "model"
            err = self.query_one(f"#err-{target}", Static)
            err.update(f"↑ {message}")
            err.display = True
            info.update("")
            self.query_one("#next", Button).disabled = True
        else:
            info.update(f"[dim]{result.data_summary()}; model: {result.model}"
                        + (f", up to {result.max_positions:,} tokens[/]" if result.max_positions else "[/]"))

    def on_input_changed(self, event: Input.Changed) -> None:
        self.validate()

    def on_select_changed(self, event: Select.Changed) -> None:
        self.validate()

    def action_next(self) -> None:
        spec = self.validate()
        if spec is None:
            self.app.bell()
            return
        if spec != getattr(self, "_checked_spec", None):  # Next before the worker answered: check now (fast)
            self._inputs_checked(spec, self._inputs_result(spec))
        if isinstance(self._checked, tuple):
            self.app.bell()
            return
        from tui.screens.plan import PlanScreen

        self.app.push_screen(PlanScreen())
