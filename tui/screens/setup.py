"""Screen 2: the setup. Every input that moves memory, validated as it is typed."""

from __future__ import annotations

import threading
from typing import Any

from rich.markup import escape
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import Button, Footer, Header, Input, Label, Select, Static

from core import killpoints
from core.methods import method_of
from core.optim import OPTIMIZERS
from core.settings import FormField, Setting
from core.spec import by_dest, by_key, spec_settings
from tui.screens.base import WizardScreen
from tui.screens.nav import NavButtons
from tui.screens.registry import screen_named
from tui.widgets.inputs import OrderedInput, OrderedSelect

#: held by each of Setup's worker threads while it imports and reads (device detection imports torch, the inputs check
#: transformers): importing transformers from two threads at once fails with "cannot import name 'AutoConfig' from
#: 'transformers'" (transformers 5.24's lazy module is not thread-safe while it initialises)
_IMPORTING = threading.Lock()


def fields_of(spec: Any) -> dict[str, Any]:
    """The form's values of ``spec`` (a RunSpec): each setting whose value is not its mode's default, by its dest; the
    mode itself is the screen's, not a field."""
    from core.spec import RunSpec

    defaults = RunSpec.build(mode=spec.mode)
    return {s.dest: s.value(spec) for s in spec_settings() if s.value(spec) != s.value(defaults) and s.dest != "mode"}


def merged_import(before: Any, before_mode: str, imported: Any, settings: dict[str, Any]
                  ) -> tuple[dict[str, Any], list[str], list[str]]:
    """Setup's fields after a trainer's config is read: the imported spec's values, and for each form field the file
    does not set (not in the import's ``settings``) Setup's own value where it was changed from its default and the
    imported mode takes it. Returns (the fields, what the import replaced in words ``"mode dora → lora"``, what was
    kept ``"steps 8"``); ``before`` None (the form did not validate): nothing is kept or compared."""
    from core.methods import method_of

    fields = fields_of(imported)
    replaced: list[str] = [f"mode {before_mode} → {imported.mode}"] if before_mode != imported.mode else []
    kept: list[str] = []
    if before is None:
        return fields, replaced, kept
    method = method_of(imported.mode)
    own = fields_of(before)
    for name, label, _kind, _choices, group in FIELDS:
        if not method.takes(group):
            continue
        setting = by_dest()[name]
        old, new = setting.value(before), setting.value(imported)
        if name not in settings and name in own:  # the file does not set it: Setup's value stays
            fields[name] = own[name]
            kept.append(f"{label} {shown_value(own[name])}")
        elif old != new:
            replaced.append(f"{label} {shown_value(old)} → {shown_value(new)}")
    return fields, replaced, kept


def form_fields(settings: tuple[Setting, ...]) -> list[FormField]:
    """The form's fields: each setting declared with a label (core/settings.py), in increasing ``form_order``."""
    return [s.form for s in sorted(settings, key=lambda s: s.form_order or 0) if s.form is not None]


# (flag name, label, kind, choices, the setting group it belongs to: it is shown for the methods that take that group,
# core/methods/base.py SETTING_GROUPS), made from each setting's declaration (core/spec.py, core/criteria.py); kinds:
# "int", "float", "str", "choice", "optfloat" (blank: not set) and "autoint" (blank, shown as the placeholder "auto":
# 0, which the spec reads as chosen for you)
FIELDS: list[FormField] = form_fields(spec_settings())
#: what a blank field of a kind means, shown in it
PLACEHOLDERS = {"optfloat": "not set", "autoint": "auto"}
#: the first field of the criteria: a heading goes above it
FIRST_CRITERION = next(f.name for f in FIELDS if by_dest()[f.name].doc_table == "criteria")
#: the fields whose value is on or off (a boolean setting)
_ON_OFF = frozenset(f.name for f in FIELDS if by_dest()[f.name].kind == "bool")


# choices whose value alone says little to a newcomer: what the option does, in a few words
CHOICE_LABELS: dict[str, str] = {
    **killpoints.CHOICE_LABELS,
    "single": "single · one process",
    "ddp": "ddp · a replica per rank",
    "zero3": "zero3 · FSDP full shard",
    "pure": "pure · model in the dtype",
    "amp": "amp · fp32 weights, autocast",
    "sdpa": "sdpa · fused, no scores kept",
    "eager": "eager · keeps b·a·s·s scores",
    "flash_attention_2": "flash_attention_2 · CUDA",
    "padded": "padded · some hold padding",
    "nf4": "nf4 · NormalFloat4 (QLoRA's)",
    **{name: f"{name} · {o.choice}" for name, o in OPTIMIZERS.items() if o.choice},
    "fp4": "fp4 · 4-bit float",
    "packed": "packed · full blocks only",
    "auto": "auto · the dtype's tier",
    "exact": "exact · bit for bit",
}


def spec_field_to_input(field: str) -> str:
    """A SpecError field (``"lora.r"``) as the input id that fixes it (``"lora_r"``): the setting's dest when it is on
    the form; any other field (``"lora.dropout"``, ``"spec"``) as it is."""
    found = by_key().get(field)
    return found.dest if found is not None and found.form is not None else field


def shown_value(value: Any) -> str:
    """A spec value as the form shows it (booleans as on/off, target lists comma-separated)."""
    if value is None:  # a criterion not set
        return ""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value))
    return str(value)


def current_value(spec: Any, name: str) -> str:
    """The spec's value of a form field, as shown (``lora_r`` reads ``spec.lora.r``).

    Raises:
        KeyError: ``name`` is no setting's dest (core/settings.py).
    """
    return shown_value(by_dest()[name].value(spec))


class SetupScreen(NavButtons, WizardScreen):
    """Model, dtype, batch, sequence, accumulation, optimizer, steps, LoRA and devices; Next only when valid."""

    # q types here: ^q quits; ^o is the "Your own command…" button; ^l reads a trainer's config into the form
    BINDINGS = [Binding("ctrl+n", "next", "Next"), Binding("ctrl+o", "own_command", "Own command"),
                Binding("ctrl+l", "from_config", "From config"), Binding("ctrl+r", "imported_keys", "Keys read"),
                Binding("ctrl+q", "app.quit_typed", "Quit")]
    q_types = True  # the app's q Quit is not offered here (tui.app.GpuAcceptApp.check_action)

    def compose(self) -> ComposeResult:
        from core.spec import RunSpec

        state = self.app.state
        defaults = RunSpec.build(mode=state.mode)
        shown = {name for name, *_ in FIELDS}
        self._extra = {k: v for k, v in state.fields.items() if k not in shown}  # e.g. --heldout-fraction: kept
        self._checked_spec: Any = None  # the spec the model and data were last checked with
        self._checked: Any = None  # core.prerun.InputsChecked of that check
        self._draft: Any = None  # the spec with refused fields at their defaults (core.spec.SpecDraft.stand_in)
        self._spec_errors: dict[str, str] = {}
        self._check_timer: Any = None
        self._shown: dict[str, str] = {}  # the error line shown under each field
        yield Header()
        yield Static(f"Step 2/7 · Setup ({state.mode})", classes="title")
        method = method_of(state.mode)
        training = method.trains
        yield Static("What moves memory: batch × sequence drive activations" + ("" if training else " and the KV cache")
                     + "; the dtype sets the bytes per number" + method.dtype_note
                     + ("; the optimizer the states per trainable parameter" if training else "")
                     + ". Model: smollm2-135m (embedded) or a model folder; Data: embedded (the Python docs as "
                       "text) or a .txt / .jsonl file.", classes="intro")
        if state.imported_note:  # ^l From config: where the values came from (gpuaccept plan FILE lists every key)
            yield Static(f"[dim]{escape(state.imported_note)}; ^r lists each key[/]", id="imported")
        with VerticalScroll(classes="body", id="form"):
            for name, label, kind, choices, group in FIELDS:
                if not method.takes(group):
                    continue
                value = shown_value(state.fields[name]) if name in state.fields else current_value(defaults, name)
                if name == FIRST_CRITERION:
                    yield Static("Acceptance criteria: what the run must meet to pass (blank: not set; the defaults "
                                 "are the rules without criteria)", classes="dim", id="criteria-heading")
                with Horizontal(classes="field"):
                    yield Label(label)
                    if kind == "choice":
                        options = choices if value in choices else (*choices, value)  # e.g. --strategy tp: kept
                        yield OrderedSelect([(CHOICE_LABELS.get(c, c), c) for c in options], value=value,
                                     allow_blank=False, id=name, compact=True)
                    else:
                        # paths and lists are edited, numbers replaced: the cursor goes to the end of a path
                        if kind == "autoint" and value == "0":
                            value = ""
                        yield OrderedInput(value=value, id=name, compact=True, select_on_focus=kind != "str",
                                           placeholder=PLACEHOLDERS.get(kind, ""))
                yield Static("", classes="field-error", id=f"err-{name}")
                if name == "data":
                    yield Static("", id="data-info", classes="dim")
                if name == "resume_kill_at":
                    yield Static("", id="kill-info", classes="dim")
            yield Static("devices detected: looking…", id="detected")
        yield Static("", classes="error", id="form-error")
        with Horizontal(classes="nav"):
            yield Button("← Back", id="back")
            yield Button("Plan →", id="next", variant="primary")
            yield Button("Your own command…", id="own-command")
        yield Footer(show_command_palette=False)  # no ^p palette key: at 80 columns every key shows

    def on_descendant_focus(self, event: Any) -> None:
        """Tab onto the form's last field shows the lines below it too (the devices detected): at 80×24 they were
        below the fold with no key to reach them (issue 51)."""
        form = self.query_one("#form", VerticalScroll)
        fields = [w for w in form.query("Input, Select") if w.focusable]
        if fields and event.widget is fields[-1]:
            self.call_after_refresh(form.scroll_end, animate=False)

    def on_mount(self) -> None:
        for err in self.query(".field-error"):
            err.display = False
        self.validate()
        self._start_check()  # the first check now, not after a pause
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
        try:
            with _IMPORTING:
                from core.api import detect_devices

                devices = self.app.state.devices_override or detect_devices("auto")
            text = "devices detected: " + "; ".join(
                f"{d.name} {d.label} "
                + d.capacity_text()  # the one wording (core/plan/devices.py): which capacity, 2 decimals, when read
                for d in devices)
        except Exception as exc:  # noqa: BLE001 - shown, never raised into the UI
            text = f"devices detected: none ({exc})"
        self.app.call_from_thread(self.query_one("#detected", Static).update, text)

    def _typed(self, name: str) -> str:
        """A field's value as typed: its Input's text or its Select's value, as a string."""
        widget = self.query_one(f"#{name}")
        if not isinstance(widget, (Input, Select)):
            raise TypeError(f"#{name} is a {type(widget).__name__}, not a form field")
        return str(widget.value)

    def values(self) -> tuple[dict[str, Any], dict[str, str]]:
        """The typed values converted to spec types, and per-field conversion errors."""
        out: dict[str, Any] = {}
        errors: dict[str, str] = {}
        method = method_of(self.app.state.mode)
        for name, _label, kind, _choices, group in FIELDS:
            if not method.takes(group):
                continue
            raw = self._typed(name).strip()
            if kind == "autoint" and not raw:
                out[name] = 0  # blank: auto
            elif kind in ("int", "autoint"):
                try:
                    out[name] = int(raw)
                except ValueError:
                    errors[name] = f"a whole number, e.g. 4 (got {raw!r})"
            elif kind == "float" or (kind == "optfloat" and raw):
                try:
                    out[name] = float(raw)
                except ValueError:
                    errors[name] = f"a number, e.g. 1e-3 (got {raw!r})" + (" or blank" if kind == "optfloat" else "")
            elif kind == "optfloat":
                out[name] = None  # blank: the criterion is not set
            elif name in _ON_OFF:
                out[name] = raw == "on"
            else:
                out[name] = raw
        return out, errors

    def validate(self) -> Any:
        """Validate every field; show each field's error beside it (all of them, not only the first); enable Next only
        when the spec is valid and the model and data were found. The model's config and the data file are read in a
        worker once typing pauses (:meth:`check_inputs`), with the refused fields at their defaults meanwhile."""
        from core.specdraft import draft_spec

        values, refused = self.values()
        draft = draft_spec({"mode": self.app.state.mode, **self._extra, **values}, refused)
        self._spec_errors = {spec_field_to_input(f): m for f, m in draft.errors.items()}
        typed = {name: self._typed(name) for name in refused}  # kept as typed across Back
        self.app.state.fields = {**self._extra, **values, **typed}
        self.app.state.spec = draft.spec
        self._draft = draft.stand_in
        self._show_kill_point(draft.spec)
        if draft.stand_in is not None and draft.stand_in == self._checked_spec:
            self._show_errors()
        else:
            self._show_errors(pending=True)
            self._schedule_check()
        return draft.spec

    def _show_kill_point(self, spec: Any) -> None:
        """Under the Kill point field: where the kill lands in steps for the values typed (core.spec's own words)."""
        if not self.query("#kill-info"):
            return  # inference: no resume check
        text = (f"SIGKILL {spec.resume.describe()}" if spec is not None and spec.resume.check
                else "(where the kill lands is said once the fields above are valid)")
        self.query_one("#kill-info", Static).update(f"[dim]{escape(text)}[/]")

    def next_blocked(self) -> str | None:
        """Why ^n does not go on: the fields at fault, named."""
        try:
            disabled = self.query_one("#next", Button).disabled
        except Exception:  # noqa: BLE001 - before compose
            return "the setup is being read"
        if not disabled:
            return None
        labels = {name: label for name, label, *_ in FIELDS}
        at_fault = [labels.get(name, name) for name, text in self._shown.items() if text]
        errors = self.query("#form-error")
        form = str(errors.first(Static).content) if errors else ""
        names = ", ".join(at_fault) + (f"; {form}" if form else "")
        return f"fix what is marked ↑ first: {names}" if names else "the setup is being checked"

    def _show_errors(self, pending: bool = False) -> None:
        """The spec's errors and the last inputs check's problems beside their fields; Next enabled when none.

        ``pending``: the model and data are being checked again; the last answer stays shown until the new one comes
        (Next, pressed meanwhile, checks at once)."""
        errors = dict(self._spec_errors)
        form_errors: list[str] = []
        info = ""
        checked = self._checked
        if checked is not None:
            for field, message in checked.problems:
                errors.setdefault(spec_field_to_input(field), message)
            if "model" in errors and checked.model is None:
                waits = "the sequence length" + (" and the LoRA targets" if self.query("#lora_targets") else "")
                errors["model"] += f" ({waits} are checked against the model once it is found)"
            # what was read is said only for values not refused: a refused one was checked at its default
            summary = checked.data_summary() if "data" not in self._spec_errors else ""
            model = checked.model if "model" not in self._spec_errors else None
            info = "; ".join(([summary] if summary else []) + ([f"model: {model}" + (
                f", up to {checked.max_positions:,} tokens" if checked.max_positions else "")] if model else []))
        if pending and self._draft is not None and not info:
            info = "checking the model and the data…"  # else the last answer stays: a line that keeps its height
        for name, message in list(errors.items()):
            if not self.query(f"#err-{name}"):
                form_errors.append(f"{name}: {message}")
                del errors[name]
        moved = False
        for err in self.query(".field-error").results(Static):
            if err.id is None:
                continue
            name = err.id.removeprefix("err-")
            text = f"↑ {errors[name]}" if name in errors else ""
            if self._shown.get(name, "") != text:  # only what changed: no re-layout per keystroke
                self._shown[name] = text
                err.update(text)
                err.display = bool(text)
                moved = True
        self.query_one("#form-error", Static).update("; ".join(form_errors))
        self.query_one("#data-info", Static).update(f"[dim]{escape(info)}[/]" if info else "")
        self.query_one("#data-info", Static).display = bool(info)
        if moved:  # lines came or went above the field being typed in: keep it in view once laid out
            self.call_after_refresh(self._focused_in_view)
        self.query_one("#next", Button).disabled = bool(errors or form_errors)
        self.refresh_bindings()  # ^n dimmed while Next is: pressing it says what is at fault

    def _focused_in_view(self) -> None:
        """The field being typed in, and the error line under it, in view after lines above it came or went."""
        focused = self.focused
        if focused is None:
            return
        errs = self.query(f"#err-{focused.id}") if focused.id else None
        if errs and errs.first().display and not self.can_view_entire(errs.first()):
            errs.first().scroll_visible(animate=False, immediate=True)
        if not self.can_view_entire(focused):
            focused.scroll_visible(animate=False, immediate=True)

    # ------------------------------------------------------------------ what the plan would refuse, checked here
    #: seconds of no typing before the model's config and the data file are read again
    CHECK_AFTER_S = 0.3

    def _schedule_check(self) -> None:
        if self._check_timer is not None:
            self._check_timer.stop()
        self._check_timer = self.set_timer(self.CHECK_AFTER_S, self._start_check) if self._draft is not None else None

    def _start_check(self) -> None:
        if self._check_timer is not None:
            self._check_timer.stop()
        self._check_timer = None
        if self._draft is not None:
            self.check_inputs(self._draft)

    @work(thread=True, exclusive=True, group="inputs")
    def check_inputs(self, spec: Any) -> None:
        """Read the model's config and the data file for ``spec`` (core.api.check_inputs), off the UI thread."""
        from textual.worker import get_current_worker

        result = self._inputs_result(spec)
        if not get_current_worker().is_cancelled:
            self.app.call_from_thread(self._inputs_checked, spec, result)

    @staticmethod
    def _inputs_result(spec: Any) -> Any:
        """The :class:`core.api.InputsChecked`: every problem named by the field that fixes it."""
        with _IMPORTING:
            from core.api import InputsChecked, check_inputs
        try:
            with _IMPORTING:
                return check_inputs(spec)
        except Exception as exc:  # noqa: BLE001 - one line beside the field, never a traceback
            return InputsChecked(model=None, max_positions=None, documents=None, train=0, heldout=0, data=spec.data,
                                 problems=(("model", f"{type(exc).__name__}: {exc}"),))

    def _inputs_checked(self, spec: Any, result: Any) -> None:
        if spec != self._draft:
            return  # typed on meanwhile: the newer check decides
        self._checked_spec, self._checked = spec, result
        if not self.query("#form-error"):
            return  # the screen was closed (Esc) while the check ran: nothing left to draw on
        self._show_errors()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "own-command":
            self.action_own_command()
            return
        super().on_button_pressed(event)

    def action_from_config(self) -> None:
        """The choice "from a config file": a trainer's YAML config read into the form (its mode too)."""
        from tui.screens.dialogs import ConfigDialog

        self.app.push_screen(ConfigDialog(), callback=self._load_config)

    def _load_config(self, loaded: Any) -> None:
        """Setup again, on the config's mode, with every value the file sets (or its tool's default for it); what
        the file does not set keeps Setup's value (the acceptance run's steps, evaluation size, devices ...). What it
        replaced is said beside the import, and ^r lists every key."""
        if loaded is None:
            return
        state = self.app.state
        before = self._draft if self._draft is not None else self.validate()
        fields, replaced, kept = merged_import(before, state.mode, loaded.spec, loaded.imported.settings)
        state.mode, state.fields = loaded.spec.mode, fields
        lines = loaded.imported.summary()
        more = f" and {len(replaced) - 1} more" if len(replaced) > 1 else ""
        state.imported_note = lines[0] + (f"; replaced in Setup: {replaced[0]}{more}" if replaced else "")
        state.imported_lines = [lines[0],  # what it changed in Setup first, then every key as read
                                *(["replaced in Setup:", *(f"  {r}" for r in replaced)] if replaced else []),
                                *(["kept from Setup (the file does not set them):", *(f"  {k}" for k in kept)]
                                  if kept else []), "each key of the file:", *lines[1:]]
        self.app.switch_screen(SetupScreen())

    def action_imported_keys(self) -> None:
        """^r: every key of the config as the import read it."""
        from tui.screens.dialogs import ImportedKeys

        if self.app.state.imported_lines:
            self.app.push_screen(ImportedKeys(self.app.state.imported_lines))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "imported_keys":
            return bool(self.app.state.imported_lines)
        return super().check_action(action, parameters)

    def action_own_command(self) -> None:
        """The choice "your own command": the user's script, not this recipe."""
        self.app.push_screen(screen_named("command"))

    def on_input_changed(self, event: Input.Changed) -> None:
        self.validate()

    def on_select_changed(self, event: Select.Changed) -> None:
        self.validate()

    def action_next(self) -> None:
        spec = self.validate()
        if spec is None:
            self.app.bell()
            return
        if spec != self._checked_spec:  # Next before the worker answered: check now (fast)
            self._inputs_checked(spec, self._inputs_result(spec))
        if self._checked is None or not self._checked.ok:
            self.app.bell()
            return
        self.app.push_screen(screen_named("plan"))
