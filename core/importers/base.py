"""What every importer shares: the result (:class:`Imported`), a format (:class:`Format`), and :class:`Reader`, which
walks a config's keys so that each is either used (as a spec setting), ignored (with why) or refused (by name)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.errors import SpecError
from core.optim import known_names, named

#: transformers ``lr_scheduler_type`` values -> the spec's scheduler (the schedule moves no memory; warmup is its own key)
HF_SCHEDULERS = {"linear": "linear", "cosine": "cosine", "constant": "constant",
                 "constant_with_warmup": "constant"}
#: keys that move no memory, read by no importer: ignored with this reason
NO_MEMORY = "moves no memory (logging, saving, data or evaluation schedule, naming)"
#: a key no importer reads: listed as unknown, never as harmless
UNKNOWN = "not read by the {} importer: if it moves memory, the plan does not know it"
#: the real run's length and warmup: the acceptance run is a short one of its own (``--steps``, ``--warmup-steps``)
RUN_LENGTH = ("the real run's length: the acceptance run trains its own few steps (the method's default; --steps and "
              "--warmup-steps set them)")


@dataclass(frozen=True)
class Imported:
    """A trainer's config read as a spec, with an account of every key.

    Attributes:
        format: the tool whose config it is (``"axolotl"``).
        path: the file read.
        sha256: of the file's bytes (what a record can name).
        settings: the spec's flat keywords (``core.spec.RunSpec.build``: ``batch_size``, ``lora_r`` ...), flags given
            on the command line included (they apply over the file before anything is refused).
        used: each config key used, with what it set (``"micro_batch_size": "batch_size = 2"``).
        ignored: each config key known to move no memory, with why.
        unknown: each config key this importer does not read: if it moves memory, the plan does not know it.
        defaults: each setting the file leaves out that the tool's own default supplied (``"batch_size": "8
            (TrainingArguments.per_device_train_batch_size)"``).
        not_modelled: each key that moves memory in a way the plan does not model, with the direction of the error.
        flags: each setting a command-line flag gave over the file (or in place of what the file could not state),
            with what it replaced.
    """

    format: str
    path: str
    sha256: str
    settings: dict[str, Any]
    used: dict[str, str]
    ignored: dict[str, str]
    unknown: dict[str, str] = field(default_factory=dict)
    defaults: dict[str, str] = field(default_factory=dict)
    not_modelled: dict[str, str] = field(default_factory=dict)
    flags: dict[str, str] = field(default_factory=dict)

    def raw(self) -> dict[str, Any]:
        """The settings as a spec file's mapping (``{"lora": {"r": 8}, ...}``: ``core.spec.RunSpec.from_dict``)."""
        from core.settings import nest
        from core.spec import spec_settings

        return nest(dict(self.settings), spec_settings())

    def summary(self) -> list[str]:
        """Lines saying what was read: the format, each key used, each default of the tool applied, each flag given
        over the file, each key not modelled (with the direction of the error), ignored (with why) or unknown."""
        counts = [f"{len(self.used)} keys used", f"{len(self.defaults)} defaults of {self.format} applied"]
        counts += [f"{len(self.flags)} set by flags"] if self.flags else []
        counts += [f"{len(self.not_modelled)} not modelled"] if self.not_modelled else []
        counts += [f"{len(self.ignored)} moving no memory", f"{len(self.unknown)} unknown"]
        out = [f"imported from {self.format} config {self.path} (sha256 {self.sha256[:12]}): {', '.join(counts)}"]
        out += [f"  used {k}: {v}" for k, v in self.used.items()]
        out += [f"  default {k} = {v}" for k, v in self.defaults.items()]
        out += [f"  flag {k}: {v}" for k, v in self.flags.items()]
        out += [f"  not modelled {k}: {v}" for k, v in self.not_modelled.items()]
        out += [f"  ignored {k}: {v}" for k, v in self.ignored.items()]
        out += [f"  unknown {k}: {v}" for k, v in self.unknown.items()]
        return out


@dataclass(frozen=True)
class Format:
    """One tool's config format: its name, a test of a config's keys, and its importer; ``positional``: the key its
    command's first positional argument after the subcommand sets (LitGPT's ``checkpoint_dir``), "" for none;
    ``out_keys``: the keys naming the folder the trainer writes its checkpoints and logs into (``output_dir``; LitGPT's
    ``out_dir``; torchtune's ``checkpointer.output_dir`` and ``metric_logger.log_dir`` besides): when the command holds
    no ``{out}``, command mode sets the first to each run's own folder, and the others where the file holds them."""

    name: str
    detect: Callable[[dict[str, Any]], bool]
    read: Callable[[dict[str, Any], Path, Mapping[str, Any]], Imported]
    positional: str = ""
    out_keys: tuple[str, ...] = ()


def leaves(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Every leaf of a nested mapping by its dotted key (``tokenizer.max_seq_len``); lists are leaves."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(leaves(value, name + "."))
        else:
            out[name] = value
    return out


class NeedsValue(SpecError):
    """A value the config leaves to the data or the command line (torchtune's ``tokenizer.max_seq_len: null``), asked
    for by name: the setting's ``dest`` and the flag that gives it."""

    def __init__(self, key: str, dest: str, flag: str, message: str) -> None:
        super().__init__(key, message)
        self.dest, self.flag = dest, flag


def flag_of(dest: str) -> str:
    """The command-line flag of the spec setting ``dest`` (``seq_len`` -> ``--seq-len``)."""
    from core.spec import by_dest

    found = by_dest().get(dest)
    return found.flags[0] if found is not None and found.flags else f"--{dest.replace('_', '-')}"


class Reader:
    """Walks one config: :meth:`value` reads a key (dotted for nested ones), :meth:`set` makes it a spec setting,
    :meth:`default` applies the tool's own default for a key the file leaves out, :meth:`ignore` says why a key moves
    no memory, :meth:`not_modelled` names what moves memory that the plan does not model, :meth:`need` asks for a
    value the file leaves to the data, :meth:`refuse` refuses what cannot be planned; :meth:`done` lists every key
    never read as unknown.

    ``overrides``: the spec settings given on the command line (flat ``dest`` keywords): they apply over the file
    before anything is refused (:meth:`refuse_unless_given`, :meth:`need`)."""

    def __init__(self, fmt: str, data: dict[str, Any], path: Path, no_memory: frozenset[str] = frozenset(),
                 overrides: Mapping[str, Any] | None = None) -> None:
        self.fmt, self.path, self.no_memory = fmt, path, no_memory
        self.leaves = leaves(data)
        self.overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
        self.settings: dict[str, Any] = {}
        self.used: dict[str, str] = {}
        self.ignored: dict[str, str] = {}
        self.defaults: dict[str, str] = {}
        self.missing: dict[str, str] = {}
        self.unmodelled: dict[str, str] = {}
        self.given_by_flag: dict[str, str] = {}
        self._seen: set[str] = set()

    def has(self, key: str) -> bool:
        return key in self.leaves and self.leaves[key] is not None

    def value(self, key: str, default: Any = None) -> Any:
        """The value of ``key`` (None counts as not given), marked as read."""
        self._seen.add(key)
        value = self.leaves.get(key)
        return default if value is None else value

    def set(self, key: str, dest: str, value: Any, how: str = "") -> None:
        """The spec setting ``dest`` = ``value``, from ``key`` (``how``: in words, when not the value as it is). A
        ``key`` the file does not hold is not "used": the value is the tool's default for it, listed as one."""
        self._seen.add(key)
        self.settings[dest] = value
        text = f"{dest} = {value!r}" + (f" ({how})" if how else "")
        if not self.has(key):
            self.defaults[dest] = f"{value!r} ({self.fmt}'s default: {key} is not in the file" + (
                f"; {how})" if how else ")")
            return
        self.used[key] = f"{self.used[key]}; {text}" if key in self.used else text

    def also(self, key: str, text: str) -> None:
        """Add ``text`` to what ``key`` set: to its "used" line when the file holds it, else to the default that stood
        in for it (:meth:`set` of a key the file does not hold)."""
        if key in self.used:
            self.used[key] += text
            return
        for dest, line in self.defaults.items():
            if f"{key} is not in the file" in line:
                self.defaults[dest] = line + text
                return
        self.used[key] = text.lstrip("; ")

    def default(self, dest: str, value: Any, source: str) -> None:
        """The spec setting ``dest`` = ``value``, the tool's own default for a key the file leaves out (``source``:
        where the tool sets it, e.g. ``"TrainingArguments.per_device_train_batch_size"``)."""
        self.settings[dest] = value
        self.defaults[dest] = f"{value!r} ({self.fmt}'s default: {source})"

    def take(self, key: str, dest: str, convert: Callable[[Any], Any] = lambda v: v, how: str = "") -> None:
        """:meth:`set` from ``key`` when it is given: ``int`` and ``float`` read as :meth:`number` reads them (a value
        of another type is refused, never coerced); any other ``convert`` that cannot read the value is refused too.

        Raises:
            SpecError: naming ``key`` and its value.
        """
        if not self.has(key):
            return
        if convert in (int, float):
            value = self.number(key, convert)
        else:
            raw = self.value(key)
            try:
                value = convert(raw)
            except (TypeError, ValueError, OverflowError):
                raise self.refuse(key, f"{shown_value(raw)} cannot be read for {dest}") from None
        self.set(key, dest, value, how)

    def given(self, dest: str) -> bool:
        """A flag on the command line gives the spec setting ``dest``."""
        return dest in self.overrides

    def run_length(self, *keys: str) -> None:
        """The real run's length and warmup keys: ignored with :data:`RUN_LENGTH`."""
        for key in keys:
            self.ignore(key, RUN_LENGTH)

    def ignore(self, key: str, why: str) -> None:
        if self.has(key):
            self._seen.add(key)
            self.ignored[key] = why

    def not_modelled(self, key: str, why: str) -> None:
        """``key`` moves memory in a way the plan does not model: ``why`` says how and the direction of the error
        ("compile usually lowers activations: this plan is an upper bound")."""
        self._seen.add(key)
        self.unmodelled[key] = why

    def refuse(self, key: str, why: str) -> SpecError:
        """The error naming ``key`` (raise it)."""
        return SpecError(f"{self.fmt}:{key}", f"{why} ({self.path.name})")

    def refuse_unless_given(self, key: str, why: str, dest: str) -> None:
        """Refuse ``key`` (raise :meth:`refuse`'s error) unless a flag gives the setting ``dest`` it would have set:
        then the file's value is not used, and said so. The caller goes on without setting ``dest``.

        Raises:
            SpecError: no flag gives ``dest``.
        """
        self._seen.add(key)
        if not self.given(dest):
            raise self.refuse(key, f"{why}; or give {flag_of(dest)} on the command line")
        self.given_by_flag[dest] = f"{flag_of(dest)} {self.overrides[dest]!r} in place of {key} ({why})"

    def need(self, key: str, dest: str, why: str) -> None:
        """A value the file leaves to the data or the command line (``why``: what the tool then does): taken from the
        flag that gives ``dest``.

        Raises:
            NeedsValue: no flag gives it, naming ``key`` and the flag.
        """
        self._seen.add(key)
        flag = flag_of(dest)
        if not self.given(dest):
            raise NeedsValue(f"{self.fmt}:{key}", dest, flag, f"{why}; give it with {flag} ({self.path.name})")
        self.given_by_flag[dest] = f"{flag} {self.overrides[dest]!r}: {key} {why}"

    def number(self, key: str, kind: type = int) -> Any:
        """The value of ``key`` as a number of ``kind``, never coerced: an integer setting takes an integer (``2.9``,
        ``true``, ``"8"`` are refused, not read as 2, 1, 8); a number takes an integer, a float or a string YAML 1.1
        leaves a float written without a dot in (``2e-4``), and it must be finite.

        Raises:
            SpecError: it is not one, naming the key and the value.
        """
        value = self.value(key)
        read = strict_number(value, kind)
        if read is None:
            what = "an integer" if kind is int else "a finite number"
            raise self.refuse(key, f"{shown_value(value)} is not {what}")
        return read

    def done(self) -> Imported:
        """The result: every leaf never read is listed as moving no memory (when the importer knows it so) or as
        unknown; the flags given apply over the file's settings. A trainer does not cap the sequence length at the
        model's declared maximum: neither does the plan of its config (``seq_len_limit = "none"``)."""
        self.settings.setdefault("seq_len_limit", "none")
        unknown: dict[str, str] = {}
        for key, value in self.leaves.items():
            if key in self._seen or key in self.ignored or value is None:
                continue
            top = key.split(".")[0]
            if key in self.no_memory or top in self.no_memory:
                self.ignored[key] = NO_MEMORY
            else:
                unknown[key] = UNKNOWN.format(self.fmt)
        settings = dict(self.settings)
        flags = dict(self.given_by_flag)
        for dest, value in self.overrides.items():
            if dest in flags:
                continue
            before = settings.get(dest)
            if dest in self.defaults and dest in settings:
                flags[dest] = f"{flag_of(dest)} {value!r} over {self.fmt}'s default {before!r}"
            elif dest in settings and before != value:
                flags[dest] = f"{flag_of(dest)} {value!r} over the file's {before!r}"
        settings.update(self.overrides)
        digest = hashlib.sha256(self.path.read_bytes()).hexdigest()
        return Imported(self.fmt, str(self.path), digest, settings, dict(self.used), dict(self.ignored), unknown,
                        dict(self.defaults), dict(self.unmodelled), flags)


def strict_number(value: Any, kind: type) -> Any:
    """``value`` as ``kind`` (int or float) when it is one without coercion, else None (see :meth:`Reader.number`)."""
    import math

    if isinstance(value, bool):
        return None
    if kind is int:
        return value if isinstance(value, int) else None
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str) and len(value) <= 64:
        try:
            number = float(value)
        except ValueError:
            return None
    else:
        return None
    return number if math.isfinite(number) else None


def shown_value(value: Any, most: int = 60) -> str:
    """A config's value as a message shows it: its repr, cut to ``most`` characters."""
    text = repr(value)
    return text if len(text) <= most else text[: most - 3] + "..."


def training_keys(r: Reader, *, batch: str, packing: str, schedule: str, optim: str) -> None:
    """What the three tools built on transformers' Trainer share, each under its own key names: the micro-batch, the
    accumulation, packing, the learning rate and its schedule, the optimizer, the seed; the real run's length and
    warmup are ignored (:data:`RUN_LENGTH`)."""
    r.take(batch, "batch_size", int)
    r.take("gradient_accumulation_steps", "grad_accum", int)
    if r.has(packing):
        r.set(packing, "padding", "packed" if r.value(packing) else "padded")
    else:
        r.default("padding", "padded", f"{packing} off: batches padded")
    r.take("learning_rate", "learning_rate", float)
    r.run_length("max_steps", "warmup_steps", "warmup_ratio")
    r.take("seed", "seed", int)
    hyper(r)
    scheduler(r, schedule)
    optimizer(r, optim)


def optimizer(r: Reader, key: str, tool: str = "trainer", implementation: str = "default") -> None:
    """The optimizer named by ``key``, as ``tool`` names it (core/optim/: ``trainer`` for ``TrainingArguments.optim``,
    which TRL, axolotl and LLaMA-Factory pass on; ``torchtune`` and ``litgpt`` class paths), in ``implementation``
    (``fused`` for a torch class with ``fused: True``).

    Raises:
        SpecError: an optimizer the planner does not model, naming those it does.
    """
    if not r.has(key):
        return
    name = str(r.value(key))
    found = named(tool, name, implementation)
    if found is None:
        r.refuse_unless_given(key, f"optimizer {name!r} is not one the planner models; use one of "
                                   f"{', '.join(known_names(tool))}", "optimizer")
        return
    r.set(key, "optimizer", found.name, f"{name}" + (f" ({implementation})" if implementation != "default" else "")
          + (f": {found.label}" if found.variant else ""))


def scheduler(r: Reader, key: str) -> None:
    if not r.has(key):
        return
    name = str(r.value(key))
    if name in HF_SCHEDULERS:
        r.set(key, "lr_scheduler", HF_SCHEDULERS[name])
    else:
        r.ignore(key, f"the schedule {name!r} moves no memory; the run uses linear")


def targets(value: Any) -> str:
    """LoRA target modules as the spec takes them (comma-separated, or all-linear)."""
    if isinstance(value, str):
        return "all-linear" if value in ("all-linear", "all") else ",".join(t.strip() for t in value.split(","))
    return ",".join(str(t) for t in value)


def deepspeed_strategy(r: Reader, key: str) -> None:
    """A DeepSpeed config (a path or an inline mapping): ZeRO stage 1/2/3 -> zero1/2/3, its offloads to the CPU ->
    the spec's ``offload``. A relative path is resolved against the working directory, as transformers' and
    accelerate's ``HfDeepSpeedConfig`` does (``os.path.exists``), which axolotl, LLaMA-Factory and TRL all hand it to;
    failing that, against the config's own folder (said so in the summary).
    The stage shards over the ranks the launcher starts, which the file does not say (:func:`sharded`).

    Raises:
        SpecError: a config that cannot be read, or a stage the planner does not model, naming the key.
    """
    value = r.value(key)
    if value in (None, ""):
        return
    if isinstance(value, str):
        value = _deepspeed_file(r, key, value)
    zero = value.get("zero_optimization", {}) if isinstance(value, dict) else {}
    stage = zero.get("stage", 0)
    if stage not in (1, 2, 3):
        raise r.refuse(key, f"ZeRO stage {stage!r}: the planner models stages 1, 2 and 3")
    offloads = [part for part in ("offload_optimizer", "offload_param")
                if (zero.get(part) or {}).get("device", "none") not in ("none", None)]
    if "offload_optimizer" in offloads and stage in (1, 2, 3):
        offload = "all" if "offload_param" in offloads and stage == 3 else "optimizer"
        how = f"ZeRO stage {stage}, {' and '.join(offloads)} to the CPU"
    else:
        offload, how = "none", f"ZeRO stage {stage}"
        if offloads:
            r.not_modelled(key, f"{offloads[0]} without offload_optimizer: the parameters' offload is planned on the "
                                "device (an upper bound)")
    sharded(r, key, f"zero{stage}", how, offload)


def _deepspeed_file(r: Reader, key: str, name: str) -> dict[str, Any]:
    """The DeepSpeed config ``name`` read from the working directory, else from beside the config file."""
    import json

    tried = [Path(name)]
    if not Path(name).is_absolute():
        tried.append(r.path.parent / name)
    for path in tried:
        if path.is_file():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise r.refuse(key, f"the DeepSpeed config {path} is not readable JSON ({exc})") from None
            if not isinstance(data, dict):
                raise r.refuse(key, f"the DeepSpeed config {path} is not a JSON object")
            if path is not tried[0]:
                r.used[key] = f"read from {path} (not found in the working directory {Path.cwd()})"
            return data
    raise r.refuse(key, f"the DeepSpeed config {name} is neither in the working directory {Path.cwd()} nor beside "
                        f"the config ({r.path.parent}); DeepSpeed configs are resolved against the working "
                        "directory, as the tool resolves them: run from where the tool runs, or give its path")


def fsdp_strategy(r: Reader, key: str, offload_key: str) -> None:
    """transformers' / accelerate's ``fsdp`` (``full_shard`` ...) -> zero3 (FSDP full shard; ``shard_grad_op``:
    zero2), with parameters offloaded to the CPU where ``offload_key`` says so."""
    value = r.value(key)
    if not value:
        return
    text = " ".join(value) if isinstance(value, list) else str(value)
    stage = "zero2" if "shard_grad_op" in text else "zero3"
    offload = "all" if bool(r.value(offload_key, False)) or "offload" in text else "none"
    if r.has(offload_key):
        r._seen.add(offload_key)
        r.used[offload_key] = ("the parameters, gradients and optimizer states to the CPU when sharded "
                               f"(offload = {offload!r})")
    sharded(r, key, stage, f"FSDP {'full shard' if stage == 'zero3' else 'shard_grad_op'}"
            + (" with the parameters offloaded to the CPU" if offload != "none" else ""), offload)


def sharded(r: Reader, key: str, strategy: str, how: str, offload: str = "none") -> None:
    """A strategy that shards over the ranks a launcher starts (accelerate, torchrun, deepspeed), whose number the
    config file does not say: planned sharded when ``--devices`` names two or more devices (or CPU ranks), else on
    one device, where one rank shards nothing (strategy single), said so."""
    from core.devicespec import device_count

    devices = r.overrides.get("devices")
    count = device_count(str(devices)) if devices is not None else None
    count = max(count or 1, int(r.overrides.get("torchrun_nproc_per_node") or 1))
    if count >= 2:
        r.set(key, "strategy", strategy, f"{how}, over the {count} devices given")
        if offload != "none":
            r.settings["offload"] = offload
        return
    r._seen.add(key)
    text = (f"{how} over the ranks its launcher starts, which the file does not say: planned on one device "
            f"(strategy single: one rank shards nothing); give --devices (e.g. 8xH100) to plan it sharded")
    r.used[key] = f"{r.used[key]}; {text}" if key in r.used else text
    if offload != "none":
        r.not_modelled(key, f"the offload to the CPU on one device (ZeRO-Offload): planned with the "
                            f"{offload_words(offload)} on the device (an upper bound); give --devices "
                            "(e.g. 2xA100-80GB) to plan it offloaded")


def offload_words(offload: str) -> str:
    """What an ``offload`` setting moves to the host, in words."""
    return "optimizer states" if offload == "optimizer" else "parameters, gradients and optimizer states"


#: keys transformers' TrainingArguments has that move no memory (logging, saving, schedules, the hub, naming)
NO_MEMORY_TRAINER = frozenset({
    "output_dir", "overwrite_output_dir", "logging_steps", "logging_strategy", "logging_dir", "logging_first_step",
    "save_steps", "save_strategy", "save_total_limit", "save_only_model", "save_safetensors", "report_to", "run_name",
    "num_train_epochs", "push_to_hub", "hub_model_id", "hub_strategy", "hub_private_repo", "hub_token",
    "max_grad_norm", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "ddp_timeout", "seed", "data_seed",
    "dataloader_num_workers", "dataloader_pin_memory", "remove_unused_columns", "log_level", "disable_tqdm",
    "resume_from_checkpoint", "ignore_data_skip", "label_names", "load_best_model_at_end", "metric_for_best_model",
    "greater_is_better", "tf32", "local_rank", "do_train", "do_predict", "optim_args"})
#: keys whose value is a hyper-parameter of the loss or the schedule, with why they move no memory
HYPER = {"beta": "a loss hyper-parameter (the preference loss's temperature): moves no memory",
         "rl_beta": "a loss hyper-parameter: moves no memory", "pref_beta": "a loss hyper-parameter: moves no memory",
         "orpo_alpha": "a loss hyper-parameter: moves no memory", "loss.beta": "a loss hyper-parameter: moves no memory",
         "tf32": "TF32 matmuls: the same tensors, another precision inside the kernels: moves no memory",
         "label_smoothing": "a loss hyper-parameter: moves no memory"}


def hyper(r: Reader) -> None:
    """The hyper-parameters of :data:`HYPER` the file holds, ignored with why."""
    for key, why in HYPER.items():
        r.ignore(key, why)


#: keys of the evaluation during training: the evaluation's forward has no gradients, and the plan is of the step
EVALUATION = ("do_eval", "eval_strategy", "evaluation_strategy", "eval_steps", "per_device_eval_batch_size",
              "eval_accumulation_steps", "eval_on_start", "val_size", "val_set_size", "eval_sample_packing",
              "eval_max_new_tokens", "eval_table_max_new_tokens", "evals_per_epoch", "eval_batch_size")
EVALUATION_WHY = "the evaluation's: the plan is of the training step"


def evaluation(r: Reader) -> None:
    """The evaluation keys of :data:`EVALUATION` the file holds, ignored with why."""
    for key in EVALUATION:
        r.ignore(key, EVALUATION_WHY)


def sharded_master(r: Reader, keys: tuple[str, ...] = ("deepspeed", "fsdp")) -> None:
    """Full fine-tuning under DeepSpeed or FSDP in a 16-bit dtype keeps fp32 master weights and fp32 optimizer states
    (DeepSpeed's bf16 optimizer; accelerate upcasts the trained parameters for FSDP's mixed precision): planned as
    precision amp, 16 B a parameter with AdamW, as DeepSpeed and FSDP hold it whether or not the run is sharded."""
    key = next((k for k in keys if r.value(k)), None)
    if key is None and str(r.overrides.get("strategy", "")).startswith("zero"):
        key = "strategy"  # the launcher's (accelerate's DeepSpeed config): given on the command line
    from core.methods import method_of

    if key is None or r.settings.get("dtype", "fp32") == "fp32" or \
            not method_of(str(r.settings.get("mode") or "full")).trains_base:
        return
    r.settings["precision"] = "amp"
    words = ("precision = 'amp' (fp32 master weights and optimizer states under "
             f"{'FSDP' if key == 'fsdp' else 'DeepSpeed or FSDP'}'s mixed precision)")
    if key == "strategy":
        r.defaults["precision"] = f"'amp': {words}"
    else:
        r.used[key] = r.used.get(key, "") + f"; {words}"


def trainer_defaults(r: Reader, tool: str, batch: bool = True, optim: bool = True) -> None:
    """The defaults transformers' Trainer applies where the file is silent: ``per_device_train_batch_size`` 8, and the
    optimizer ``adamw_torch_fused`` (``TrainingArguments.optim`` with transformers >= 4.54 and torch >= 2.8; before,
    ``adamw_torch``: foreach on CUDA)."""
    if batch and "batch_size" not in r.settings:
        r.default("batch_size", 8, f"TrainingArguments.per_device_train_batch_size, as {tool} passes it on")
    if optim and "optimizer" not in r.settings:
        r.default("optimizer", "adamw_fused", "TrainingArguments.optim = adamw_torch_fused (transformers >= 4.54 with "
                                              "torch >= 2.8; adamw_torch before: give --optimizer adamw)")


def precision(r: Reader, compute: str, model_dtype: str | None, key: str) -> None:
    """The spec's dtype and precision: ``compute`` (fp32 / bf16 / fp16) and the dtype the model's weights are loaded in
    (None: the same: pure; fp32 under a 16-bit compute dtype: amp, as Trainer's bf16=True over an fp32 model)."""
    r.set(key, "dtype", compute)
    if compute != "fp32":
        r.set(key, "precision", "amp" if model_dtype == "fp32" else "pure",
              "weights loaded in fp32, autocast" if model_dtype == "fp32" else "weights loaded in the compute dtype")
