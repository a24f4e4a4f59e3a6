"""RunSpec: what the user asks gpuaccept to accept.

A RunSpec is read from a TOML file and/or command-line flags (flags win; :meth:`RunSpec.build`; a trainer's YAML config
through core.importers.build_spec), validated on its own (:meth:`RunSpec.validate`) and against the model's config
(core.specdraft.validate_against_config). Every invalid value raises :class:`~core.errors.SpecError` naming the field
and what to change.

Each setting is declared once, on its dataclass field below or in a sub-table (core/spectables.py), with
``setting(...)`` (core/settings.py): its type and choices, TOML key, flag, Setup form field and docs row are made from
that declaration (:func:`spec_settings`). Every key is optional; the full list, generated from the declarations, is
docs/reference.md "The spec". An example::

    mode = "lora"                 # inference | full | lora | a LoRA variant (qlora, dora: core/methods/)
    model = "smollm2-135m"        # embedded | local HF directory | cached HF id | config.json (plan only)
    dtype = "bf16"
    batch_size = 4                # micro-batch per device
    seq_len = 128
    devices = "auto"              # auto | cpu | CUDA indices such as "0,1" | a box to plan for: "8x80GiB"
    strategy = "single"           # single | ddp | zero1 | zero2 | zero3 (fsdp) | device_map | tp

    [lora]
    r = 8
    targets = ["q_proj", "v_proj"] # module names, or ["all-linear"]

    [resume]
    checkpoint_every = 10         # steps between checkpoints
    kill_after_checkpoint = 2     # kill after the 2nd checkpoint, before the next one

    [accept]                      # the criteria the run is accepted by (core/criteria.py)
    max_perplexity = 40.0
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast, get_args

from core.bounds import (
    InputFileError,
    TomlBoundsError,
    check_path,
    loads_bounded,
    read_input_text,
)
from core.criteria import AcceptCriteria
from core.devicespec import (
    STRATEGY_ALIASES,
    Strategy,
    check_strategy,
    device_count,
    is_cpu,
)
from core.dtypes import DTYPES, Dtype, dtype_bytes
from core.errors import SpecError
from core.losses import Loss, loss_names, loss_of
from core.methods import METHODS, Method, method_of
from core.methods.lora import ALL_LINEAR, QUANT_TYPES, QuantType  # noqa: F401 - re-exported: the spec's values
from core.objectives import REFERENCES, Objective, Reference, objective_names, objective_of
from core.optim import Optimizer, optimizer_names, optimizer_of
from core.settings import (
    Setting,
    nest,
    setting,
    settings_of,
    table,
    tables_of,
    unknown_value,
)
from core.specparse import (
    MAX_SEED,
    MAX_STEPS,
    check_data_file,
    check_types,
    dotted_keys,
    parse_targets,
    sub_table,
    table_in,
    variant_mode,
)
from core.spectables import (
    TORCHRUN_STRATEGIES,
    TWINS,
    GaloreSettings,
    LoraSettings,
    QloraSettings,
    ResumeSettings,
    TorchrunSettings,
)

#: What a run does: ``inference`` (forward only), ``full`` fine-tuning, ``lora`` adapters, or a variant of LoRA
#: (``qlora``: the same adapters over a base stored in 4 bits by bitsandbytes and dequantised layer by layer as it runs).
#: Each is a method object (core/methods/): ``RunSpec.method``. Written out as a ``Literal`` so that mypy catches a
#: misspelt mode; tests/unit/test_methods.py keeps this list and ``core.methods.METHODS`` equal.
Mode = Literal["inference", "full", "lora", "qlora", "dora", "lora_int8", "badam"]
MODES: tuple[Mode, ...] = get_args(Mode)
#: The modes that train LoRA adapters over a frozen base: basic LoRA and its 4-bit variant (QLoRA)
ADAPTER_MODES: tuple[Mode, ...] = tuple(m for m in MODES if METHODS[m].adapters)
#: How the dtype is used (docs/reference.md "Precision"): ``pure`` loads the model in ``dtype`` (parameters,
#: gradients and optimizer states in it; LoRA adapters fp32, as peft keeps them); ``amp`` keeps fp32 parameters,
#: gradients and optimizer states and runs forward and backward under autocast in ``dtype`` (Trainer's bf16=True on an
#: fp32 model).
Precision = Literal["pure", "amp"]
PRECISIONS: tuple[Precision, ...] = get_args(Precision)
#: Attention implementations passed to ``from_pretrained(attn_implementation=...)``.
AttnImplementation = Literal["sdpa", "eager", "flash_attention_2"]
ATTN_IMPLEMENTATIONS: tuple[AttnImplementation, ...] = get_args(AttnImplementation)
#: What the batches hold: ``padded`` (some batches hold padding, so an attention mask reaches the attention kernel: SDPA
#: then repeats k and v to every head and keeps the mask, per layer) or ``packed`` (every block full: causal attention
#: without a mask). gpuaccept's own data is packed but for its last, padded block (dropped from training when packed).
Padding = Literal["padded", "packed"]
PADDINGS: tuple[Padding, ...] = get_args(Padding)
#: The optimizers are objects (core/optim/: their states, dtypes, paging and the names each trainer gives them); the
#: spec holds the name, ``RunSpec.optimizer_kind`` is the object
OPTIMIZERS: tuple[str, ...] = optimizer_names()
#: Whether a sequence longer than the model's declared ``max_position_embeddings`` is refused (``model``) or planned as
#: asked (``none``: what a trainer's config asks, its tool not capping it)
SeqLenLimit = Literal["model", "none"]
#: ZeRO / FSDP offload to the host (DeepSpeed ``offload_optimizer`` / ``offload_param``, FSDP ``cpu_offload``)
Offload = Literal["none", "optimizer", "all"]
OFFLOADS: tuple[Offload, ...] = get_args(Offload)
#: settings added after records were written, by their TOML key, with their defaults: left out of a spec's dict (and
#: hash) while at the default (``RunSpec.to_dict``)
LATER_DEFAULTS: dict[str, Any] = {
    "objective": "sft", "reference": "auto", "reference_dtype": "", "loss": "standard", "loss_chunks": 8,
    "compile": False, "optimizer_in_backward": False, "activation_offloading": False, "offload": "none",
    "seq_len_limit": "model", "untie_embeddings": False,
    "lora.modules_to_save": [], "lora.dtype": "fp32", "embedding_fp32_states": True, "qlora.bitsandbytes": "installed",
    "resume.twins": TWINS}
Scheduler = Literal["linear", "cosine", "constant"]
SCHEDULERS: tuple[Scheduler, ...] = get_args(Scheduler)
EMBEDDED_MODEL = "smollm2-135m"
#: a spec path ending so is a trainer's YAML config, read by core/importers/ (kept in step with its YAML_SUFFIXES)
YAML_SUFFIXES = (".yml", ".yaml")
EMBEDDED_DATA = "embedded"


@dataclass(frozen=True)
class RunSpec:
    """A training or inference setup to accept. Sizes are per device: ``batch_size`` is the micro-batch.

    Global batch = batch_size x grad_accum x data-parallel devices; tokens per optimizer step = global batch x seq_len.

    ``strategy`` says how the run is spread over the ``devices`` (see :func:`check_strategy`); ``"fsdp"`` is stored as
    ``"zero3"``. ``tp`` is the tensor-parallel degree (strategy ``tp`` only; 1 otherwise).
    """

    # Each field is declared once, here (core/settings.py): its flag, TOML key, form field and docs row are made from
    # its declaration; the form's fields go in increasing form_order.
    mode: Mode = setting("lora",
                         help="the method: inference, full fine-tuning, lora, or a variant of LoRA, labelled as one "
                              "(qlora: the base stored in 4 bits by bitsandbytes; the Mode screen says what each does)")
    model: str = setting(EMBEDDED_MODEL, label="Model", form_order=10, command_key="model",
                         help="smollm2-135m (embedded), a local HF model directory, a cached HF id, or a config.json")
    dtype: Dtype = setting("fp32", label="Dtype", form_order=30, command_key="dtype",
                           help="the dtype the model computes in: fp32, bf16 or fp16 (fp16 training needs CUDA; "
                                "qlora: the compute dtype of its 4-bit base)")
    precision: Precision = setting(
        "pure", label="Precision", form_order=40, group="precision",
        help="pure (default): the model loaded in --dtype, gradients and optimizer states in it (LoRA adapters fp32); "
             "amp: fp32 weights, gradients and optimizer states, autocast to --dtype (the same for fp32)")
    attn_implementation: AttnImplementation = setting(
        "sdpa", label="Attention", form_order=50,
        help="passed to from_pretrained (default sdpa); eager keeps the b·a·s·s scores for backward")
    padding: Padding = setting(
        "padded", label="Batches", form_order=60, group="training",
        help="padded (default): some batches hold padding, so SDPA gets a mask (k, v repeated to every head, the mask "
             "kept per layer); packed: full blocks only (the partial last one not trained)")
    batch_size: int = setting(4, help="micro-batch per device", label="Micro-batch / device", form_order=70)
    seq_len: int = setting(128, help="tokens per sequence", label="Sequence length", form_order=80)
    grad_accum: int = setting(1, help="gradient accumulation steps", label="Grad accumulation", form_order=90,
                              group="training")
    optimizer: str = setting(
        "adamw", label="Optimizer", form_order=100, group="training", choices=optimizer_names,
        help="adamw (torch's default: foreach on CUDA), adamw_fused (Trainer's default on CUDA), sgd (momentum 0.9), "
             "adafactor, or bitsandbytes' variants: adamw_8bit (8-bit states), paged_adamw_8bit and paged_adamw_32bit "
             "(paged states, CUDA only)")
    learning_rate: float = setting(1e-3, aliases=("--lr",), mode_default=True, label="Learning rate", form_order=120,
                                   group="training", help="the peak learning rate (default: by mode)")
    lr_scheduler: Scheduler = setting("linear", group="training",
                                      help="how the learning rate falls after the warm-up")
    warmup_steps: int = setting(0, group="training", help="optimizer steps of linear warm-up")
    steps: int = setting(40, mode_default=True, label="Training steps", form_order=110, group="training",
                         help="optimizer steps of training")
    gradient_checkpointing: bool = setting(
        False, label="Grad checkpointing", form_order=130, group="training",
        help="recompute the activations in backward instead of keeping them (less memory, more time)")
    objective: str = setting(
        "sft", choices=objective_names, group="training",
        help="sft (default), or a preference objective, planned (gpuaccept's own recipe trains sft): dpo (and IPO, "
             "APO: chosen and rejected through the policy, a reference), orpo, simpo (no reference), kto (KL rows)")
    reference: Reference = setting(
        "auto", group="training",
        help="a preference objective's reference: auto (adapters disabled under LoRA, a frozen copy in full "
             "fine-tuning), copy, adapters, precomputed (before training: none held), none")
    reference_dtype: str = setting(
        "", group="training", metavar="DTYPE",
        help="the dtype a reference copy is loaded in (fp32, bf16, fp16; empty: the model's; TRL loads it in fp32)")
    loss: str = setting(
        "standard", choices=loss_names, group="training",
        help="how the loss is made: standard (full logits), chunked (torchtune's CEWithChunkedOutputLoss), "
             "linear_chunked (LinearCrossEntropyLoss), chunked_nll (TRL's default), fused_linear (Liger), cut (Cut "
             "Cross-Entropy), litgpt_chunked")
    loss_chunks: int = setting(8, group="training", help="chunks of a chunked loss (torchtune's num_output_chunks)")
    embedding_fp32_states: bool = setting(
        True, help="bitsandbytes' 8-bit optimizers keep fp32 states for every nn.Embedding, as transformers' Trainer "
                   "registers them (torchtune and LitGPT do not: false)")
    untie_embeddings: bool = setting(
        False, help="the LM head trained apart from the embedding even where the model ties them (LitGPT's models "
                    "never tie them: the checkpoint's embedding copied into the head)")
    seq_len_limit: SeqLenLimit = setting(
        "model", help="model (default): refuse a sequence longer than the model's max_position_embeddings; none: plan "
                      "it as asked (a trainer's config: its tool does not cap the length)")
    compile: bool = setting(
        False, group="training",
        help="torch.compile each decoder layer: what a layer saves for backward is measured by AOTAutograd's "
             "partitioner on this CPU when planned (seconds)")
    optimizer_in_backward: bool = setting(
        False, group="training",
        help="step each parameter in its gradient hook and free the gradient at once (torchtune's optimizer_in_bwd; "
             "no gradient accumulation)")
    activation_offloading: bool = setting(
        False, group="training",
        help="saved activations copied to pinned host memory in forward and back in backward (torchtune, TRL)")
    offload: Offload = setting(
        "none", group="distributed",
        help="ZeRO / FSDP offload to the host: none, optimizer (states and the step on the CPU), all (the "
             "parameters too)")
    devices: str = setting(
        "auto", label="Devices", form_order=230,
        help="auto, cpu, CUDA indices such as 0 or 0,1; to plan for a box you do not have: 8x80GiB (count x "
             "capacity), 24GiB,8GiB (capacities; GiB/GB/MiB/MB), or GPUs by name such as 1xH200, 8xA100-80GB or "
             "4xRTX4090 (their memory as CUDA reports it, and what they run: workspaces, attention backend)")
    strategy: Strategy = setting(
        "single", value_aliases=STRATEGY_ALIASES, label="Strategy", form_order=240, group="distributed",
        form_choices=("single", "ddp", "zero3"),
        help="how the run is spread over the devices (fsdp = zero3; default single: each device is planned as "
             "holding the whole run)")
    tp: int = setting(1, group="distributed",
                      help="tensor-parallel degree, with --strategy tp (must divide the number of devices)")
    data: str = setting(EMBEDDED_DATA, help="embedded, or a .txt / .jsonl file", label="Data", form_order=20,
                        command_key="data")
    heldout_fraction: float = setting(0.2, command_key="heldout_fraction",
                                      help="share of the documents held out for evaluation (between 0 and 1)")
    eval_max_blocks: int = setting(32, command_key="eval_max_blocks", label="Eval blocks", form_order=115,
                                   help="held-out blocks evaluated before and after training, at most (each a "
                                        "sequence of seq_len tokens: fewer is a shorter run, a noisier perplexity)")
    alloc_conf: str = setting(
        "", flag="--alloc-conf", metavar="CONF",
        help="PYTORCH_CUDA_ALLOC_CONF for the run (e.g. expandable_segments:True): the plan simulates PyTorch's "
             "caching allocator under it and the probe runs under it; empty: the environment's")
    seed: int = setting(42, help="the run's random seed: torch's, and the Trainer's seed and data_seed (0 to "
                                 "2^32 - 1)")
    probe_steps: int = setting(3, help="real steps the probe runs and measures")
    lora: LoraSettings = table(LoraSettings, flag_prefix="lora-", group="adapter")
    qlora: QloraSettings = table(QloraSettings, group="quant")
    galore: GaloreSettings = table(GaloreSettings, group="training")
    resume: ResumeSettings = table(ResumeSettings, group="training")
    torchrun: TorchrunSettings = table(TorchrunSettings, group="distributed")
    #: what the run is accepted by (the ``[accept]`` table, :mod:`core.criteria`); not part of the setup: it is left
    #: out of :meth:`to_dict` and the spec's hash, so runs of one setup judged by other thresholds compare
    accept: AcceptCriteria = table(AcceptCriteria, doc_table="criteria", cli_group=(
        "acceptance criteria (the [accept] table; unset: the default rules; docs/reference.md \"Acceptance "
        "criteria\")"))

    def __post_init__(self) -> None:
        # "fsdp" (FSDP full shard) is ZeRO stage 3: store one name for one strategy, so specs compare and hash alike.
        if isinstance(self.strategy, str) and self.strategy in STRATEGY_ALIASES:
            object.__setattr__(self, "strategy", STRATEGY_ALIASES[self.strategy])

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(cls, toml_path: str | Path | None = None, **overrides: Any) -> RunSpec:
        """Build a spec from an optional TOML file and overrides (flags). ``None`` overrides are ignored.

        Mode-dependent defaults (steps, learning rate, checkpoint interval) apply to keys given in neither place.

        Args:
            toml_path: a TOML spec file (the layout of the module docstring), or None.
            overrides: flat keywords, each a setting's ``dest`` (:func:`spec_settings`: ``seq_len``,
                ``lora_r``, ``accept_max_perplexity``), over the file's values.

        Raises:
            SpecError: unknown key, wrong type, or invalid value (see :meth:`validate`).
        """
        raw: dict[str, Any] = {}
        if toml_path is not None and Path(toml_path).suffix.lower() in YAML_SUFFIXES:
            raise SpecError("spec", f"{toml_path} is a trainer's YAML config, not a TOML spec: read it with "
                                    "core.importers.build_spec (gpuaccept run / plan --spec do)")
        if toml_path is not None:
            path = Path(toml_path)
            check_path("spec", str(toml_path))
            try:
                raw = loads_bounded(read_input_text(path, "a TOML spec"))
            except FileNotFoundError:
                raise SpecError("spec", f"file {path} not found; give the path of a TOML spec") from None
            except InputFileError as exc:
                raise SpecError("spec", str(exc)) from None
            except IsADirectoryError:
                raise SpecError("spec", f"{path} is a folder; give the path of a TOML spec file") from None
            except UnicodeDecodeError:
                raise SpecError("spec", f"{path} is not UTF-8 text (binary, or UTF-16?); save the TOML spec as "
                                        "UTF-8") from None
            except OSError as exc:
                raise SpecError("spec", f"{path} cannot be read ({exc.strerror or exc})") from None
            except TomlBoundsError as exc:
                raise SpecError("spec", f"{path}: {exc}") from None
            except tomllib.TOMLDecodeError as exc:
                raise SpecError("spec", f"{path} is not valid TOML ({exc}); fix the file") from None
            if not raw:
                raise SpecError("spec", f"{path} holds no settings (an empty file); give at least one, e.g. "
                                        'mode = "lora", or no spec file for the defaults')
        return cls.from_file_values(raw, toml_path, **overrides)

    @classmethod
    def from_file_values(cls, raw: dict[str, Any], source: str | Path | None, **overrides: Any) -> RunSpec:
        """A spec from a file's values (``raw``, the TOML layout: a TOML spec's, or what core/importers/ made of a
        trainer's config) and the overrides (flags, as :meth:`build`'s), flags winning key by key.

        Raises:
            SpecError: as :meth:`build`; an error in a value the file gave names ``source``.
        """
        toml_path = source
        from_file = dotted_keys(raw) - dotted_keys(nest({k: v for k, v in overrides.items() if v is not None}, spec_settings()))
        for key, value in nest({k: v for k, v in overrides.items() if v is not None}, spec_settings()).items():
            if isinstance(value, dict) and key in raw:  # a table: its keys over the file's (a file's table that is
                if isinstance(raw[key], dict):         # no table is refused by from_dict)
                    raw[key] = {**raw[key], **value}
            else:
                raw[key] = value
        torchrun = raw.get("torchrun")
        if isinstance(torchrun, dict) and torchrun.get("scheduler") == "slurm":
            from core.cluster.slurm import resolve  # the step's nodes and rendezvous, from srun's variables

            raw["torchrun"] = resolve(torchrun, os.environ)
        try:
            return cls.from_dict(raw)
        except SpecError as exc:
            if exc.field in from_file or exc.field.split(".")[0] in from_file:  # a value the file gave: name the file
                raise SpecError(exc.field, f"{exc.message} (in {toml_path})") from None
            raise

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> RunSpec:
        """Build and validate a spec from a plain mapping (the TOML layout in the module docstring).

        Raises:
            SpecError: an unknown key (a table's key at the top is named with its table), a wrong type, or an invalid
                value (see :meth:`validate`).
        """
        raw = dict(raw)
        known = {f.name for f in dataclasses.fields(cls)}
        for key in raw:
            if key not in known:
                tables = [s.table for s in spec_settings() if s.table is not None and s.name == key]
                where = f"; {key} belongs in the [{tables[0]}] table" if tables else ""
                raise SpecError(key, f"unknown setting{where}; known settings are: {', '.join(sorted(known))}")
        mode = raw.get("mode", cls.mode)
        if not isinstance(mode, str) or mode not in MODES:
            raise SpecError("mode", f"{mode!r} is not a mode; choose one of {', '.join(MODES)}")
        given = {name: table_in(raw, name) for name in tables_of(spec_settings())}
        raw["mode"] = mode = variant_mode(mode, given["lora"])
        method = method_of(mode)  # its defaults (core/methods/)
        for s in spec_settings():
            if s.mode_default:  # the method's own default, for a key given nowhere
                (raw if s.table is None else given[s.table]).setdefault(s.name, getattr(method, s.name))
        lora_raw = given["lora"]
        if "targets" in lora_raw:
            lora_raw["targets"] = parse_targets(lora_raw["targets"])
        if "modules_to_save" in lora_raw:
            lora_raw["modules_to_save"] = parse_targets(lora_raw["modules_to_save"], "lora.modules_to_save")
        lora = sub_table(LoraSettings, lora_raw, "lora")
        qlora_raw = given["qlora"]
        if qlora_raw and "qlora" not in method.own_tables:
            raise SpecError("qlora", f"the [qlora] settings ({', '.join(sorted(qlora_raw))}) apply to mode qlora; "
                                     f"set mode = \"qlora\" or remove them")
        qlora = sub_table(QloraSettings, qlora_raw, "qlora")
        galore_raw = given["galore"]
        if "targets" in galore_raw:
            galore_raw["targets"] = parse_targets(galore_raw["targets"], "galore.targets")
        galore = sub_table(GaloreSettings, galore_raw, "galore")
        resume = sub_table(ResumeSettings, given["resume"], "resume")
        torchrun = sub_table(TorchrunSettings, given["torchrun"], "torchrun")
        accept = AcceptCriteria.from_table(given["accept"])
        scalars = {k: v for k, v in raw.items()}
        if "devices" in scalars and not isinstance(scalars["devices"], str):
            value = scalars["devices"]
            scalars["devices"] = ",".join(str(v) for v in value) if isinstance(value, list) else str(value)
        check_types(cls, scalars)
        spec = cls(**scalars, lora=lora, qlora=qlora, galore=galore, resume=resume, torchrun=torchrun, accept=accept)
        spec.validate()
        return spec

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check every value that can be checked without the model.

        The checks run in a fixed order (the first error is the one reported): the values on their own, what the mode
        asks (training steps, LoRA settings), the resume check, then the devices, strategy and data file; last, that
        every setting typed by a ``Literal`` holds one of its values (a setting without a check of its own, such as the
        resume check's when it is off).

        Raises:
            SpecError: naming the first invalid field and what to change.
        """
        self._check_values()
        self.method.check(self)  # what the method asks and refuses (core/methods/)
        if self.training and self.resume.check:
            self.resume.check_against(self.steps)
        self._check_devices()
        if self.data != EMBEDDED_DATA:
            check_data_file(self.data)
        unknown = unknown_value(self, spec_settings())  # the choices of each Literal setting (core/settings.py)
        if unknown is not None:
            s, value = unknown
            raise SpecError(s.key, f"{value!r} is not one of {', '.join(s.choices)}")

    def _check_values(self) -> None:
        if self.alloc_conf:
            from core.allocconf import AllocConf

            AllocConf.parse(self.alloc_conf)  # SpecError("alloc_conf", ...) naming the key
        """Each value on its own (and the dtype with the precision and attention implementation)."""
        check_path("model", self.model)  # a name or a path: one the file system can look up (core/bounds.py)
        if self.dtype not in DTYPES:
            raise SpecError("dtype", f"{self.dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
        if self.precision not in PRECISIONS:  # what a method cannot run with is its own refusal (core/methods/)
            raise SpecError("precision", f"{self.precision!r} is not a precision; choose pure (the model loaded in "
                                         f"dtype) or amp (fp32 weights, autocast to dtype)")
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise SpecError("attn_implementation", f"{self.attn_implementation!r} is not supported; choose one of "
                                                   f"{', '.join(ATTN_IMPLEMENTATIONS)}")
        if self.attn_implementation == "flash_attention_2" and self.dtype == "fp32":
            raise SpecError("attn_implementation", "flash_attention_2 runs in fp16 and bf16 only; set dtype = \"bf16\" "
                                                   "or use sdpa")
        if self.padding not in PADDINGS:
            raise SpecError("padding", f"{self.padding!r}: choose padded (some batches hold padding) or packed (every "
                                       "block full, no attention mask)")
        if self.optimizer not in OPTIMIZERS:
            raise SpecError("optimizer", f"{self.optimizer!r} is not supported; choose one of {', '.join(OPTIMIZERS)}")
        if self.lr_scheduler not in SCHEDULERS:
            raise SpecError("lr_scheduler", f"{self.lr_scheduler!r} is not supported; choose one of {', '.join(SCHEDULERS)}")
        for name in ("batch_size", "seq_len", "grad_accum", "eval_max_blocks", "probe_steps"):
            if getattr(self, name) < 1:
                raise SpecError(name, f"must be at least 1 (got {getattr(self, name)})")
        if self.seq_len < 2:
            raise SpecError("seq_len", "must be at least 2 tokens: a causal LM predicts token t+1 from tokens up to t")
        if self.warmup_steps < 0:
            raise SpecError("warmup_steps", f"must be 0 or more (got {self.warmup_steps})")
        if not 0 <= self.seed <= MAX_SEED:
            raise SpecError("seed", f"must be between 0 and 2**32 - 1 (numpy's seed range; got {self.seed})")
        if self.steps > MAX_STEPS:
            raise SpecError("steps", f"{self.steps:,} steps: an acceptance run takes at most {MAX_STEPS:,}; accept a "
                                     "shorter run of the same setup")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise SpecError("heldout_fraction", f"must be between 0 and 1, exclusive (got {self.heldout_fraction})")
        self._check_step_features()

    def _check_step_features(self) -> None:
        """The objective and its reference, the loss, the optimizer in backward and the offloads."""
        objective = self.objective_kind
        if self.reference not in REFERENCES:
            raise SpecError("reference", f"{self.reference!r}: choose one of {', '.join(REFERENCES)}")
        if self.reference not in ("auto", "none") and not objective.reference:
            raise SpecError("reference", f"objective {self.objective} uses no reference model: leave reference at auto")
        if self.reference == "none" and objective.reference:
            raise SpecError("reference", f"objective {self.objective} needs the reference's log-probabilities: choose "
                                         "auto, copy, adapters or precomputed")
        if self.reference == "adapters" and not self.adapters:
            raise SpecError("reference", "adapters disabled is the reference of a LoRA run; full fine-tuning's is a "
                                         "copy (or precomputed)")
        if self.reference_dtype and self.reference_dtype not in DTYPES:
            raise SpecError("reference_dtype", f"{self.reference_dtype!r}: choose one of {', '.join(DTYPES)}, or leave "
                                               "it empty (the model's)")
        if objective.preference and not self.training:
            raise SpecError("objective", f"{self.objective} trains; inference has no objective: use objective sft")
        if self.loss_chunks < 1:
            raise SpecError("loss_chunks", f"must be at least 1 (got {self.loss_chunks})")
        if self.optimizer_in_backward and self.grad_accum > 1:
            raise SpecError("optimizer_in_backward", "each parameter steps as soon as its gradient is made, so there "
                                                     "is nothing to accumulate (torchtune refuses it too): set "
                                                     "grad_accum = 1 or turn it off")
        if self.offload not in OFFLOADS:
            raise SpecError("offload", f"{self.offload!r}: choose one of {', '.join(OFFLOADS)}")
        if self.offload != "none" and self.strategy not in ("zero1", "zero2", "zero3"):
            raise SpecError("offload", f"offload is ZeRO's and FSDP's (strategy zero1-3), not {self.strategy}'s: "
                                       "set the strategy, or offload = \"none\"")
        if self.offload == "all" and self.strategy != "zero3":
            raise SpecError("offload", "offloading the parameters is ZeRO stage 3's (FSDP full shard): set strategy "
                                       "zero3, or offload = \"optimizer\"")

    def _check_devices(self) -> None:
        """The devices, torchrun's settings and the strategy against the number of devices (CPU ranks and nodes
        counted)."""
        count = device_count(self.devices)
        self.torchrun.check_against(count, self.strategy, self.devices)
        if is_cpu(self.devices):
            count = max(1, self.torchrun.nproc_per_node)  # CPU ranks: each a process, sharing the host's memory
        if count is not None and self.strategy in TORCHRUN_STRATEGIES:
            count *= self.torchrun.nnodes  # the ranks of every node share the work
        check_strategy(self.strategy, self.tp, count, self.devices)

    def local_world_size(self, n_devices: int) -> int:
        """Processes torchrun starts on this node for ``n_devices`` devices used here (1: no torchrun).

        Strategies ddp and zero* run one process per CUDA device (``nproc_per_node`` or the device count), or
        ``nproc_per_node`` ranks on the CPU; every other strategy runs in one process."""
        if self.strategy not in TORCHRUN_STRATEGIES:
            return 1
        return self.torchrun.nproc_per_node or n_devices

    def world_size(self, n_devices: int) -> int:
        """Processes of the whole run: :meth:`local_world_size` x ``torchrun.nnodes``."""
        return self.local_world_size(n_devices) * self.torchrun.nnodes

    # ------------------------------------------------------------------ views
    @property
    def method(self) -> Method:
        """The method object of :attr:`mode` (core/methods/): every rule that depends on the method."""
        return method_of(self.mode)

    @property
    def objective_kind(self) -> Objective:
        """The objective object of :attr:`objective` (core/objectives.py)."""
        return objective_of(self.objective)

    @property
    def loss_kind(self) -> Loss:
        """The loss object of :attr:`loss` (core/losses.py)."""
        return loss_of(self.loss)

    @property
    def reference_source(self) -> str:
        """Where a preference objective's reference comes from: ``copy``, ``adapters``, ``precomputed`` or ``none``
        (:meth:`core.objectives.Objective.reference_of`)."""
        return self.objective_kind.reference_of(self.reference, self.adapters)

    @property
    def policy_rows(self) -> int:
        """Sequences through the policy with gradients per micro-batch: ``batch_size`` x the objective's rows per
        example (2 for a preference pair)."""
        return self.batch_size * self.objective_kind.policy_rows

    @property
    def optimizer_kind(self) -> Optimizer:
        """The optimizer object of :attr:`optimizer` (core/optim/): every rule that depends on the optimizer, with its
        own settings table where it has one (GaLore's ``[galore]``)."""
        kind = optimizer_of(self.optimizer)
        return kind.configure(kind, self) if kind.configure is not None else kind

    def recipe_text(self) -> str:
        """What a training step does beyond the model and its sizes, in words: the objective and its reference, the
        loss, the optimizer, and compile, the optimizer in backward and the offloads where they are on."""
        from core.objectives import REFERENCE_WORDS

        objective = self.objective_kind
        words = [f"objective {objective.label}" + (f", reference {REFERENCE_WORDS[self.reference_source]}"
                                                   if objective.reference else ""),
                 f"loss {self.loss_kind.label}", f"optimizer {self.optimizer}"]
        words += [w for on, w in ((self.compile, "torch.compile"),
                                  (self.optimizer_in_backward, "optimizer step in backward"),
                                  (self.activation_offloading, "activations offloaded to the CPU"),
                                  (self.offload != "none", f"ZeRO/FSDP offload of the {self.offload} to the CPU"))
                  if on]
        return ", ".join(words)

    def beyond_own_recipe(self) -> tuple[str, str] | None:
        """The first setting that takes the step beyond gpuaccept's own recipe (transformers' Trainer: SFT, the
        standard cross-entropy, eager, the optimizer after backward, nothing offloaded, only adapters trained beside a
        frozen base, a tied head where the model ties it): (the setting, in words), or None. Such a step is planned;
        the recipe does not run it and the traced plan, which steps the recipe, does not trace it."""
        if self.objective_kind.preference:
            return "objective", f"a preference objective ({self.objective_kind.label})"
        for name, value, words in (("loss", self.loss != "standard", f"the loss {self.loss}"),
                                   ("compile", self.compile, "torch.compile"),
                                   ("optimizer_in_backward", self.optimizer_in_backward,
                                    "the optimizer stepped in backward"),
                                   ("activation_offloading", self.activation_offloading, "activation offloading"),
                                   ("offload", self.offload != "none", f"ZeRO / FSDP offload ({self.offload})"),
                                   ("lora.modules_to_save", bool(self.lora.modules_to_save),
                                    "modules trained in full beside LoRA"),
                                   ("untie_embeddings", self.untie_embeddings, "an LM head untied from the embedding")):
            if value:
                return name, words
        return None

    @property
    def training(self) -> bool:
        """True for full fine-tuning, LoRA and QLoRA (backward and optimizer steps run)."""
        return self.method.trains

    @property
    def adapters(self) -> bool:
        """LoRA adapters are trained over a frozen base: modes ``lora`` and ``qlora`` (:data:`ADAPTER_MODES`)."""
        return self.method.adapters

    @property
    def base_mode(self) -> Mode:
        """The mode the model's parameters are laid out by: ``lora`` for ``qlora`` (the same adapters and frozen base;
        which base parameters are stored in 4 bits is the plan's :mod:`core.plan.quant`), else :attr:`mode`."""
        return cast(Mode, self.method.layout)

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of :attr:`dtype` (the compute dtype: activations, logits before the loss)."""
        return dtype_bytes(self.dtype)

    @property
    def param_dtype(self) -> Dtype:
        """The dtype the model's parameters are loaded and kept in: :attr:`dtype` under ``pure``, fp32 under ``amp``
        (master weights; forward and backward autocast to :attr:`dtype`). LoRA adapters are fp32 either way.

        QLoRA: fp32 for every parameter not stored in 4 bits (embeddings, norms, LM head), whatever the dtype: peft's
        ``prepare_model_for_kbit_training`` casts every fp16 and bf16 parameter but the 4-bit ones to fp32
        (peft/utils/other.py, read in peft 0.21.2)."""
        fp32_rest = self.method.fp32_params and self.lora.dtype == "fp32"  # peft's prepare_model_for_kbit_training
        return "fp32" if self.precision == "amp" or fp32_rest else self.dtype

    @property
    def autocast(self) -> bool:
        """Training runs under autocast to :attr:`dtype` (Trainer's ``bf16=True`` / ``fp16=True``): every 16-bit
        training run, amp or pure (on a 16-bit model autocast leaves the base alone and computes fp32 adapters in
        :attr:`dtype`, as Trainer does)."""
        return self.training and self.dtype != "fp32"

    @property
    def all_linear(self) -> bool:
        """LoRA targets peft's ``all-linear``: every linear layer but the LM head (with the LM head too when it is
        named beside it)."""
        return self.adapters and ALL_LINEAR in self.lora.targets

    def to_dict(self) -> dict[str, Any]:
        """The setup as a TOML/JSON-ready mapping (tuples become lists): what is hashed, what a child runs, the
        record's ``spec`` table. The criteria are not in it (:meth:`to_file_dict`). A setting added after records
        were written (:data:`LATER_DEFAULTS`) is left out while at its default: every spec hashes as before."""
        out = dataclasses.asdict(self)
        out["lora"]["targets"] = list(self.lora.targets)
        out["lora"]["modules_to_save"] = list(self.lora.modules_to_save)
        for key, default in LATER_DEFAULTS.items():
            table, _, name = key.rpartition(".")
            where = out[table] if table else out
            if where.get(name) == default:
                del where[name]
        del out["lora"]["variant"]  # the mode names it: every spec hashes as before variants were a LoRA setting
        del out["accept"]
        if "qlora" not in self.method.own_tables:  # the 4-bit settings belong to QLoRA alone: other specs hash as
            del out["qlora"]                     # they always did
        out["galore"]["targets"] = list(self.galore.targets)
        if optimizer_of(self.optimizer).own_table != "galore":  # GaLore's settings belong to it alone
            del out["galore"]
        return out

    def to_file_dict(self) -> dict[str, Any]:
        """The whole spec file, the inverse of :meth:`from_dict`: the setup and, when any criterion is set, its
        ``[accept]`` table."""
        out = self.to_dict()
        if not self.accept.is_default():
            out["accept"] = self.accept.set_values()
        return out

    def spec_hash(self) -> str:
        """sha256 of the canonical JSON of :meth:`to_dict` (sorted keys): the same spec gives the same hash anywhere."""
        return canonical_sha256(self.to_dict())


@functools.cache
def spec_settings() -> tuple[Setting, ...]:
    """Every setting of :class:`RunSpec` and its tables (``[accept]`` included), in the spec's field order: what its
    flags, TOML keys, Setup form and docs tables are made from (core/settings.py)."""
    return settings_of(RunSpec)


@functools.cache
def by_dest() -> dict[str, Setting]:
    """Every setting of :func:`spec_settings` by its :attr:`~core.settings.Setting.dest` (``"lora_r"``)."""
    return {s.dest: s for s in spec_settings()}


@functools.cache
def by_key() -> dict[str, Setting]:
    """Every setting of :func:`spec_settings` by its :attr:`~core.settings.Setting.key` (``"lora.r"``)."""
    return {s.key: s for s in spec_settings()}


def canonical_sha256(mapping: dict[str, Any]) -> str:
    """sha256 of ``mapping`` as canonical JSON (sorted keys, no spaces): the spec's hash, and a record's spec table's."""
    return hashlib.sha256(json.dumps(mapping, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


