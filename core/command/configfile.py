"""A command's trainer config file, read from its words: the ``--key value`` flags, the config file it names, and the
output folder taken from that file's key when the command holds no ``{out}`` (issue 37). No :class:`CommandSpec` here:
:mod:`core.commandspec` validates with these, :mod:`core.command.configplan` plans with them."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import SpecError
from core.importers.base import Format, leaves
from core.spec import YAML_SUFFIXES


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


def config_file(words: list[str], config: str, workdir: Path) -> Path | None:
    """The trainer's config file of a command: ``config`` ``"none"`` -> None; a path -> that file (relative to
    ``workdir``); ``"auto"`` -> the first of ``words`` (placeholders replaced or not) naming an existing ``.yml`` /
    ``.yaml`` file, alone or as ``--flag=file``, or None."""
    if config == "none":
        return None
    if config != "auto":
        return (workdir / Path(config).expanduser()).resolve()
    for word in words:
        for part in (word, word.partition("=")[2]):
            if Path(part).suffix.lower() in YAML_SUFFIXES and (workdir / part).is_file():
                return (workdir / part).resolve()
    return None


def writes_to_out(words: list[str]) -> bool:
    """Whether a command's words hold ``{out}`` (the run's output folder given on its command line)."""
    return any("{out}" in w for w in words)


def out_config(words: list[str], config: str, workdir: Path) -> tuple[Path, Format, dict[str, Any]]:
    """For a training command (``words``) without ``{out}``: its config file (:func:`config_file`), that file's format
    and its contents, where the format names its output folder's key (:attr:`core.importers.base.Format.out_keys`).

    Raises:
        SpecError: (``command.train``) the command names no config file of a known format, or the command sets the
            output key itself (its flag would win over the file)."""
    from core.importers import FORMATS, format_of, read_yaml

    path = config_file(words, config, workdir)
    if path is None or not path.is_file():
        raise SpecError("command.train", "the command must write into the folder gpuaccept gives each run: put {out} "
                                         "where your script takes its output folder (e.g. --output_dir {out}), or "
                                         "name a trainer's config file whose output key gpuaccept sets per run ("
                                         f"{', '.join(f.name for f in FORMATS)})")
    data = read_yaml(path)
    fmt = format_of(data)
    if fmt is None or not fmt.out_keys:
        raise SpecError("command.train", f"the command holds no {{out}} and {path.name} is not a config of "
                                         f"{', '.join(f.name for f in FORMATS)}: put {{out}} where your script takes "
                                         "its output folder")
    # every spelling the trainer's parser takes: transformers' HfArgumentParser takes --output_dir and --output-dir
    spelled = {key.replace("-", "_"): key for key in command_flags(words).values}
    set_here = [spelled[k.replace("-", "_")] for k in fmt.out_keys if k.replace("-", "_") in spelled]
    if set_here:
        raise SpecError("command.train", f"the command sets --{set_here[0]} itself, over {path.name}'s: give it "
                                         f"{{out}} (--{set_here[0]} {{out}}), or drop the flag and gpuaccept sets the "
                                         "file's key per run")
    return path, fmt, data


def out_copy(path: Path, fmt: Format, data: dict[str, Any], out: Path) -> Path:
    """Write ``data`` (the config ``path`` holds) with the format's output keys set to ``out`` (the first always, the
    others where the file holds them as a path of their own, not as an ``${output_dir}`` interpolation) to ``out/../<name>.gpuaccept.<suffix>``; its path."""
    import yaml

    copied = copy.deepcopy(data)
    held = leaves(data)
    for i, key in enumerate(fmt.out_keys):
        if i == 0 or (key in held and "${" not in str(held[key])):  # an ${output_dir} interpolation follows the first
            set_key(copied, key, str(out))
    target = out.parent / f"{path.stem}.gpuaccept{path.suffix}"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(yaml.safe_dump(copied, sort_keys=False), encoding="utf-8")
    return target


def swap(word: str, path: Path, target: Path, workdir: Path) -> str:
    """``word`` with the config ``path`` (as written: relative to ``workdir`` or absolute; alone or ``--flag=file``)
    replaced by ``target``."""
    flag, eq, value = word.partition("=")
    for head, part in (("", word), (flag + eq, value) if eq else ("", "")):
        if part and (workdir / part).resolve() == path:
            return head + str(target)
    return word


def set_key(data: dict[str, Any], key: str, value: Any) -> None:
    """``data[a][b] = value`` for the dotted key ``a.b`` (the tables made where missing)."""
    *parents, leaf = key.split(".")
    for part in parents:
        if not isinstance(data.get(part), dict):
            data[part] = {}
        data = data[part]
    data[leaf] = value
