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
from pathlib import Path
from typing import Any

from core.command.configfile import (
    command_flags,
    config_file,
    out_config,
    out_copy,
    set_key,
    swap,
    writes_to_out,
)
from core.command.plan import RanSpec
from core.commandspec import CommandSpec, substitute
from core.errors import SpecError
from core.importers.base import leaves
from core.spec import RunSpec


def run_words(spec: CommandSpec, words: list[str], values: dict[str, str], out: Path) -> list[str]:
    """The argv of one run of the command: ``words`` (the training or the resume command's) with the placeholders of
    ``values`` and ``{out}`` = ``out`` replaced. A training command without ``{out}`` names a trainer's config instead
    (:func:`core.command.configfile.out_config`): a copy of that file with its output keys set to ``out`` is written
    beside ``out`` (``out/../<name>.gpuaccept.yaml``; the file's other paths are read from the working folder, as the
    trainer reads them) and stands in the argv where the file was named.

    Raises:
        SpecError: as :func:`core.command.configfile.out_config`."""
    argv = substitute(words, {**values, "{out}": str(out)})
    if writes_to_out(spec.words()):
        return argv
    path, fmt, data = out_config(spec.words(), spec.config, spec.workdir_path)
    target = out_copy(path, fmt, data, out)
    return [swap(word, path, target, spec.workdir_path) for word in argv]


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

    path = config_file(substitute(spec.words(), values), spec.config, spec.workdir_path)
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
        set_key(merged, key, value)
    try:
        imported = fmt.read(merged, path, {})
    except SpecError as exc:
        return RanSpec(None, f"your {fmt.name} config {path.name} (with the command's flags over it): {exc}")
    return _ran(spec, imported, given, data, placement, steps)


def _ran(spec: CommandSpec, imported: Any, given: dict[str, Any], data: dict[str, Any], placement: dict[str, Any],
         steps: int) -> RanSpec:
    """The RanSpec of ``imported``: its settings where the job ran; its sources say which key (of the file or of the
    command's flags) set each; the command's flags the importer did not read and the file does not hold (a launcher's
    or a script's own) are left out of the ignored keys."""
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
