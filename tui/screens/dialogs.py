"""Modal dialogs: the terms (``?``), the quit confirmation while a stage runs, and Setup's "from a config file"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.markup import escape
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Button, Footer, Input, Markdown, Static

TERMS = """\
- **Weights**: the parameters, every one × bytes of its dtype.
- **Gradients**: one per trainable parameter, made by the backward pass. Inference has none.
- **Optimizer states**: kept per trainable parameter, in that parameter's dtype (torch makes them
  `zeros_like(param)`): AdamW two moments (8 B in fp32, 4 B for a bf16 weight under `pure`; LoRA adapters are fp32),
  SGD with momentum one buffer, Adafactor factored row + column statistics.
- **Activations**: tensors the forward pass saves for the backward pass; they grow with batch × sequence length.
  Gradient checkpointing keeps about one input per layer and recomputes the rest. LoRA does *not* shrink them in
  proportion to its trainable parameters: backward still runs through every frozen layer (only the inputs of frozen
  linear layers are not kept).
- **QLoRA** (a variant of LoRA): the frozen base's linear layers stored in 4 bits (NF4: 0.5 B per parameter plus a
  constant per block of 64), each dequantised as it runs; the same adapters as LoRA are trained; embeddings and the LM
  head stay fp32. **8-bit AdamW** (bitsandbytes): two moments of 1 B per element plus a scale per 256 elements.
- **Temporaries**: short-lived buffers at the peak (the optimizer step, the logits gradient).
- **CUDA context**: memory the driver takes per process per GPU before any tensor, outside torch's allocator: thread
  stacks for every SM, loaded kernels (0.7-0.8 GiB measured on an H200).
- **KV cache**: inference keeps keys and values per layer: 2 × layers × KV heads × head dim × batch × tokens × bytes.
- **Peak allocated**: the most bytes torch's tensors held at once (`torch.cuda.max_memory_allocated`).
- **Reserved**: what torch's caching allocator holds from the driver: allocated + cached free blocks.
- **NVML used**: the whole device as the driver sees it: every process, CUDA contexts included.
- **Micro-batch / gradient accumulation**: sequences per forward pass per device; the global batch is
  micro-batch × accumulation steps × data-parallel devices.
- **DDP**: a full replica per GPU, gradients averaged. **FSDP / ZeRO-3**: weights, gradients and optimizer states
  sharded over GPUs; activations are *not* sharded.
- **Held-out split**: text never trained on; **perplexity** = exp(Σ NLL / Σ target tokens) over it.

Esc or ? closes this.
"""


class HelpScreen(ModalScreen[None]):
    """The terms of the field, as this tool uses them."""

    BINDINGS = [("escape", "dismiss", "Close"), Binding("question_mark", "dismiss", "Close", show=False)]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="dialog"):
            yield Markdown(TERMS)
            yield Button("Close", id="close")
        yield Footer(show_command_palette=False)  # its own keys: the screen's below do not act while it is open

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(None)


class ImportedKeys(ModalScreen[None]):
    """Every key of the trainer's config as the import read it (``gpuaccept plan FILE`` prints the same lines): used,
    defaults of the tool applied, flags, not modelled, moving no memory, unknown; and what it replaced in Setup."""

    BINDINGS = [Binding("escape", "dismiss", "Close"), Binding("ctrl+r", "dismiss", "Close")]

    def __init__(self, lines: list[str]) -> None:
        super().__init__()
        self.lines = lines

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="dialog"):
            yield Static(Content("\n".join(self.lines)))
        yield Footer(show_command_palette=False)

    def on_mount(self) -> None:
        self.query_one("#dialog", VerticalScroll).focus()  # ↑↓ PgUp PgDn scroll the list


class ConfirmQuit(ModalScreen[bool]):
    """Quitting while a stage runs kills every process of it; ask first."""

    BINDINGS = [("y", "yes", "Yes"), ("n", "no", "No"), ("escape", "no", "No")]

    def __init__(self, stage: str) -> None:
        super().__init__()
        self.stage = stage

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="dialog"):
            yield Static(f"The {self.stage} stage is running in a child process. Quit and kill every process of "
                         "it? What was measured so far is kept: the record is written, unsigned, in the run "
                         "directory.")
            with Horizontal(classes="nav"):
                yield Button("Quit (y)", id="yes", variant="error")
                yield Button("Stay (n)", id="no", variant="primary")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_yes(self) -> None:
        self.dismiss(True)

    def action_no(self) -> None:
        self.dismiss(False)


class ConfirmDropSignoff(ModalScreen[str]):
    """^q on the sign-off screen with a sign-off typed but not written: write it and quit, quit without it (the record
    is still written, unsigned and without a decision), or stay. Dismissed with "write", "drop" or "stay"."""

    BINDINGS = [("w", "choose('write')", "Write and quit"), ("d", "choose('drop')", "Quit without it"),
                ("escape", "choose('stay')", "Stay")]

    def __init__(self, typed: str, complete: bool) -> None:
        super().__init__()
        self.typed, self.complete = typed, complete

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="dialog"):
            if self.complete:
                text = (f"You typed a sign-off ({self.typed}) that is not in a written record yet. w writes the record "
                        "with it and quits; d quits without it (the record is written unsigned, with no decision); "
                        "Esc stays.")
            else:
                text = (f"You typed part of a sign-off ({self.typed}); a record needs both the operator and the "
                        "decision. d quits without it (the record is written unsigned, with no decision); Esc stays "
                        "to complete it.")
            yield Static(text, id="drop-text")
            with Horizontal(classes="nav"):
                if self.complete:
                    yield Button("Write and quit (w)", id="write", variant="primary")
                yield Button("Quit without (d)", id="drop", variant="error")
                yield Button("Stay (esc)", id="stay")

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        return False if parameters == ("write",) and not self.complete else True

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(str(event.button.id))

    def action_choose(self, choice: str) -> None:
        self.dismiss(choice)


@dataclass(frozen=True)
class LoadedConfig:
    """A trainer's config read for Setup: the spec it maps to and the importer's account (``core.importers.Imported``:
    its format, path, sha256, the keys used and ignored, each with why)."""

    spec: Any
    imported: Any


class ConfigDialog(ModalScreen[LoadedConfig | None]):
    """Setup's "from a config file": the path of a TRL, axolotl, LLaMA-Factory, torchtune or LitGPT YAML config, read
    as ``gpuaccept plan their.yaml`` reads it; an error (a key the planner cannot model, a file that is no config of
    these) is shown here, named, and nothing changes."""

    BINDINGS = [Binding("enter", "load", "Load", priority=True), Binding("escape", "cancel", "Cancel")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="dialog"):
            yield Static("From a config file: the YAML your team trains from (TRL, axolotl, LLaMA-Factory, torchtune, "
                         "LitGPT). What moves memory is read into Setup; each key used or ignored is listed with why.")
            yield Input(placeholder="path/to/config.yaml", id="config-path")
            yield Input(placeholder="", id="config-value").set_styles("display: none;")
            yield Static("", classes="error", id="config-error")
        yield Footer(show_command_palette=False)

    def on_mount(self) -> None:
        self.needs: Any = None  # the NeedsValue of the last load: a value the file leaves to the data, asked for
        self.query_one("#config-path", Input).focus()

    def action_load(self) -> None:
        from core.api import NeedsValue, import_config
        from core.errors import SpecError
        from core.spec import RunSpec

        path = self.query_one("#config-path", Input).value.strip()
        error = self.query_one("#config-error", Static)
        if not path:
            error.update("type the path of the config file")
            return
        given = self._given()
        if given is None:
            return
        try:
            imported = import_config(path, given)
            loaded = LoadedConfig(RunSpec.from_file_values(imported.raw(), path, **given), imported)
        except NeedsValue as exc:  # asked for here as the flag would give it: typed below the path
            self.needs = exc
            value = self.query_one("#config-value", Input)
            value.placeholder = f"{exc.dest} ({exc.flag} on the command line)"
            value.styles.display = "block"
            value.focus()
            error.update(escape(f"{exc}: type it above and press Enter"))
            return
        except SpecError as exc:
            error.update(escape(str(exc)))
            return
        self.dismiss(loaded)

    def _given(self) -> dict[str, Any] | None:
        """The value typed for what the file leaves to the data (an integer where it is one), or None after saying
        what is wrong with it; {} when none was asked for."""
        if self.needs is None:
            return {}
        text = self.query_one("#config-value", Input).value.strip()
        if not text:
            self.query_one("#config-error", Static).update(escape(f"type {self.needs.dest} (or Esc)"))
            return None
        return {self.needs.dest: int(text) if text.isdigit() else text}

    def action_cancel(self) -> None:
        self.dismiss(None)
