"""The plan of a command made from the trainer's config file it names, for a job measured from outside (issue 37).

A command that reports no transformers Trainer says nothing of what it holds. When its training command names a
trainer's YAML config that an importer reads (:mod:`core.importers`: TRL, axolotl, LLaMA-Factory, torchtune, LitGPT),
the plan is made from that file, with the command's own flags set over its keys: these tools' command lines mirror
their config keys (``--train.max_seq_length 64`` sets ``train.max_seq_length``, ``--model_name_or_path {model}``
``model_name_or_path``; LitGPT's first positional argument is ``checkpoint_dir``). The plan is then compared with
what the job measured on each device, as the plan of what a Trainer ran is.

``command.config`` chooses the file: ``auto`` (the first word of the training command naming an existing ``.yml`` /
``.yaml`` file, alone or as ``--flag=file``), ``none``, or a path (relative to ``command.workdir``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.command.plan import RanSpec
from core.command.spec import CommandSpec, substitute
from core.errors import SpecError
from core.spec import YAML_SUFFIXES, RunSpec


@dataclass(frozen=True)
class CommandFlags:
    """A command line's ``--key value`` settings (dotted keys, values typed: :func:`typed`) and its positional words,
    after the program and its subcommand."""

    values: dict[str, Any]
    positionals: list[str]


def typed(text: str) -> Any:
    """A flag's value as its config's YAML would hold it: ``"64"`` -> 64, ``"1e-3"`` -> 0.001, ``"true"`` -> True,
    anything else the text."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return {"true": True, "false": False}.get(text.lower(), text)


def command_flags(words: list[str]) -> CommandFlags:
    """The settings and positional words of ``words`` (a command, placeholders replaced): ``--key value`` and
    ``--key=value``; a ``--key`` followed by another flag or by nothing is true. The first word (the program) and a
    second that is no flag (a subcommand: ``finetune_full``, ``sft``, or a script) are skipped."""
    rest = words[2:] if len(words) > 1 and not words[1].startswith("-") else words[1:]
    values: dict[str, Any] = {}
    positionals: list[str] = []
    i = 0
    while i < len(rest):
        word = rest[i]
        if word.startswith("--") and len(word) > 2:
            key, eq, value = word[2:].partition("=")
            if not eq:
                has_value = i + 1 < len(rest) and not rest[i + 1].startswith("--")
                value = rest[i + 1] if has_value else "true"
                i += has_value
            values[key] = typed(value)
        else:
            positionals.append(word)
        i += 1
    return CommandFlags(values, positionals)


def config_file(spec: CommandSpec, values: dict[str, str]) -> Path | None:
    """The trainer's config file of the command (see the module docstring), or None."""
    if spec.config == "none":
        return None
    if spec.config != "auto":
        return (spec.workdir_path / spec.config).resolve()
    for word in substitute(spec.words(), values):
        for part in (word, word.partition("=")[2]):
            if Path(part).suffix.lower() in YAML_SUFFIXES and (spec.workdir_path / part).is_file():
                return (spec.workdir_path / part).resolve()
    return None


def _set(data: dict[str, Any], key: str, value: Any) -> None:
    """``data[a][b] = value`` for the dotted key ``a.b`` (the tables made where missing)."""
    *parents, leaf = key.split(".")
    for part in parents:
        if not isinstance(data.get(part), dict):
            data[part] = {}
        data = data[part]
    data[leaf] = value


def spec_from_config(spec: CommandSpec, values: dict[str, str], placement: dict[str, Any], steps: int
                     ) -> RanSpec | None:
    """The RunSpec the command's config file describes, with its flags over it; None when the command names none.

    Args:
        values: the placeholders' values of the run planned (``{out}`` included), to read the command's words.
        placement: the spec's placement keywords of where the job ran as measured (``{"devices": "cpu"}``).
        steps: the optimizer steps it ran (the plan reads none of the schedule; the spec needs one).

    A config that cannot be planned gives a RanSpec with no spec and the importer's reason.
    """
    from core.importers import FORMATS, format_of, read_yaml

    path = config_file(spec, values)
    if path is None:
        return None
    try:
        data = read_yaml(path)
    except SpecError as exc:
        return RanSpec(None, f"your config {path}: {exc}")
    fmt = format_of(data)
    if fmt is None:
        return RanSpec(None, f"the command names {path.name}, which is not a config of "
                             f"{', '.join(f.name for f in FORMATS)}: nothing says what the job holds")
    words = substitute(spec.words(), values)
    flags = command_flags(words)
    merged = copy.deepcopy(data)
    given = {k: v for k, v in flags.values.items() if v != str(path) and k != "config"}
    if fmt.positional and flags.positionals:
        given[fmt.positional] = flags.positionals[0]
    for key, value in given.items():
        _set(merged, key, value)
    try:
        imported = fmt.read(merged, path)
    except SpecError as exc:
        return RanSpec(None, f"your {fmt.name} config {path.name} (with the command's flags over it): {exc}")
    return _ran(spec, imported, given, data, placement, steps)


def _ran(spec: CommandSpec, imported: Any, given: dict[str, Any], data: dict[str, Any], placement: dict[str, Any],
         steps: int) -> RanSpec:
    """The RanSpec of ``imported``: its settings where the job ran; its sources say which key (of the file or of the
    command's flags) set each; the command's flags the importer did not read and the file does not hold (a launcher's
    or a script's own) are left out of the ignored keys."""
    from core.importers.base import leaves

    in_file = set(leaves(data))
    sources = {k: f"{imported.format} config {'--' + k + ' on the command line' if k in given else k}: {v}"
               for k, v in imported.used.items()}
    ignored = {k: v for k, v in imported.ignored.items() if k in in_file or k not in given}
    settings = dict(imported.settings)
    model = settings.get("model") or spec.model
    local = spec.workdir_path / Path(str(model)).expanduser() if model else None
    if local is not None and local.exists():
        settings["model"] = str(local.resolve())
    settings.update(placement, steps=max(steps, 1), resume_check=False)
    made_from = (f"your {imported.format} config {imported.path} (sha256 {imported.sha256[:12]}) with the command's "
                 "flags over it")
    try:
        planned = RunSpec.build(**settings)
    except SpecError as exc:
        return RanSpec(None, f"{made_from} is not a setup the planner models ({exc})", sources, made_from=made_from,
                       ignored=ignored)
    return RanSpec(planned, "", sources, made_from=made_from, ignored=ignored)
