"""The command line of `gpuaccept`: its parser (:func:`build_parser`: every setting's flag made from its declaration,
core/settings.py), what an unknown argument is taken for, and the spec or command spec the flags give
(:func:`spec_from_args`, :func:`command_spec_from_args`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from core.settings import Setting
from core.spec import spec_settings

#: the title of the argument group of the setup's flags (a table may name its own: core/settings.py ``cli_group``)
SETUP_GROUP = "setup (flags override the spec file; defaults: the embedded model and text)"


def spec_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", nargs="?",
                   help="a TOML spec, or a trainer's own config (.yaml / .yml of torchtune, axolotl, LLaMA-Factory, "
                        "TRL / alignment-handbook or LitGPT, read with that tool's defaults: docs/trainers.md); "
                        "flags override its values")
    add_setting_flags(p, spec_settings())


def add_setting_flags(p: argparse.ArgumentParser, settings: tuple[Setting, ...]) -> None:
    """One flag per setting (core/settings.py), in the settings' order, under its argument group (the setup's unless
    its table names one): its spellings, ``dest``, help and metavar as declared; a boolean is
    ``--x`` / ``--no-x`` (``BooleanOptionalAction``, default None: not given); a setting with choices takes them (and
    their aliases, ``fsdp``); an int or a float is converted. Every flag's default is None: not given."""
    groups: dict[str, Any] = {}
    for s in settings:
        title = s.cli_group or SETUP_GROUP
        if title not in groups:
            groups[title] = p.add_argument_group(title)
        kwargs: dict[str, Any] = {"dest": s.dest, "help": s.help.replace("%", "%%")}
        if s.kind == "bool":
            kwargs.update(action=argparse.BooleanOptionalAction, default=None)
        elif s.choices:
            kwargs["choices"] = s.cli_choices
        elif s.kind in ("int", "float"):
            kwargs["type"] = {"int": int, "float": float}[s.kind]
        elif s.kind == "table":  # KEY=VALUE, the flag repeated for more
            kwargs["action"] = "append"
        if s.metavar is not None:
            kwargs["metavar"] = s.metavar
        groups[title].add_argument(*s.flags, **kwargs)


def command_flags(p: argparse.ArgumentParser) -> None:
    """The flags of command mode's own settings (core/commandspec.py ``CommandSpec``, each declared once there); the
    settings it shares with gpuaccept's recipe are set by the recipe's flags (``command_key``)."""
    from core.api import COMMAND_SETTINGS

    add_setting_flags(p, tuple(s for s in COMMAND_SETTINGS if s.flags))


#: the flags of gpuaccept's own recipe that mean the same in command mode: flag dest -> [command] key (each setting's
#: ``command_key``, core/settings.py)
SHARED_WITH_COMMAND = {s.dest: s.command_key for s in spec_settings() if s.command_key is not None}


def command_mode(args: argparse.Namespace) -> bool:
    """The run accepts the user's own command: ``--command`` was given, or the spec file holds a ``[command]``
    table."""
    from core.api import is_command_file

    return getattr(args, "command_train", None) is not None or bool(args.spec and is_command_file(args.spec))


def command_spec_from_args(args: argparse.Namespace) -> Any:
    """The :class:`core.commandspec.CommandSpec` of the flags (over the spec file's ``[command]`` table), through
    :mod:`core.api`.

    Raises:
        SpecError: a flag of gpuaccept's own recipe that command mode does not take (the command sets it), a bad
            ``--env``, or an invalid value."""
    from core.api import COMMAND_SETTINGS, CommandSpec, read_command_table
    from core.errors import SpecError

    flags = {s.dest: s.flags[0] for s in spec_settings()}
    for key in SPEC_KEYS:  # the criteria's flags: command_criteria_from_args
        if getattr(args, key, None) is not None and key not in SHARED_WITH_COMMAND and key not in ACCEPT_KEYS:
            raise SpecError(key, f"{flags.get(key, key)} applies to gpuaccept's own recipe, not to your own command "
                                 "(the command sets what it trains with; the kill point is placed after its "
                                 "checkpoint): remove it")
    raw: dict[str, Any] = read_command_table(Path(args.spec)) if args.spec else {}
    raw.update({v: getattr(args, k) for k, v in SHARED_WITH_COMMAND.items() if getattr(args, k, None) is not None})
    for s in COMMAND_SETTINGS:
        value = getattr(args, s.dest, None)
        if value is None or not s.flags:
            continue
        name = s.name
        if s.kind == "list":
            value = [v.strip() for v in value.split(",") if v.strip()]
        elif s.kind == "table":
            pairs = {}
            for item in value:
                k, sep, v = item.partition("=")
                if not sep or not k:
                    raise SpecError(s.key, f"{s.flags[0]} {item!r}: give KEY=VALUE")
                pairs[k] = v
            value = {**raw.get("env", {}), **pairs}
        raw[name] = value
    return CommandSpec.from_dict(raw)


def command_criteria_from_args(args: argparse.Namespace) -> Any:
    """The criteria a command is accepted by: the spec file's ``[accept]`` table, the criteria's flags over it
    (``--max-step-time``...), as command mode applies them (core/criteria.py ``COMMAND_CRITERIA``).

    Raises:
        SpecError: a criterion command mode does not apply (naming those it does), or a bad value."""
    from core.api import command_criteria, read_command_criteria

    table: dict[str, Any] = read_command_criteria(Path(args.spec)) if args.spec else {}
    table.update({s.name: getattr(args, s.dest) for s in spec_settings()
                  if s.table == "accept" and getattr(args, s.dest, None) is not None})
    return command_criteria(table)


#: the criteria's flags, by their spec keys (``accept_<criterion>``, core/criteria.py)
ACCEPT_KEYS = tuple(s.dest for s in spec_settings() if s.table == "accept")


#: every setting's flag, by its dest (``RunSpec.build``'s keyword)
SPEC_KEYS = tuple(s.dest for s in spec_settings())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpuaccept",
        description="Accept a training setup: memory plan, probe, held-out evaluation, kill-and-resume check, record.",
    )
    parser.add_argument("--version", action="version", version=f"gpuaccept {version()}",
                        help="print gpuaccept's version and exit")
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser(
        "run", help="run every stage and write record.toml",
        description="Run every stage and write record.toml. Given a trainer's config (their.yaml), it runs gpuaccept's "
                    "own recipe (transformers' Trainer + PEFT) on the settings imported from it, not that trainer; "
                    "to accept your own training script as it runs, use command mode (--command).")
    spec_flags(run)
    command_flags(run)
    run.add_argument("--headless", action="store_true", help="no wizard: one line per event on stdout (default: the wizard)")
    run.add_argument("--runs-dir", default="runs", help="where run directories are created (default: ./runs)")
    run.add_argument("--json", action="store_true",
                     help="with --headless: the event lines go to stderr, and stdout gets one JSON object, the run's "
                          "summary, when it ends (docs/record.md, \"JSON outputs\")")
    plan = sub.add_parser(
        "plan", help="the memory plan only, per component and per device",
        description="The memory plan only, per component and per device, of a TOML spec, flags, or a trainer's own "
                    "config (torchtune, axolotl, LLaMA-Factory, TRL / alignment-handbook, LitGPT) as its tool runs it: "
                    "gpuaccept plan their.yaml --devices 8xH100.")
    spec_flags(plan)
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--traced", action="store_true",
                      help="also trace one step on fake tensors (torch MemTracker; seconds) and compare it line by line")
    plan.add_argument("--max-batch", action="store_true",
                      help="also search, per device, the largest micro-batch whose plan fits (with its headroom)")
    plan.add_argument("--max-seq", action="store_true",
                      help="also search, per device, the largest sequence length whose plan fits")
    sign = sub.add_parser("sign", help="sign a record with ssh-keygen -Y sign (namespace gpuaccept-record)")
    sign.add_argument("record", help="record.toml of a run")
    sign.add_argument("--key", required=True,
                      help="private key file, or the .pub of a key held by the ssh-agent")
    sign.add_argument("--operator", help="who signs off (for a record written without a sign-off)")
    sign.add_argument("--role", default="", help="the operator's role, e.g. 'ML infra on-call'")
    sign.add_argument("--decision", choices=("accept", "reject"), help="with --operator")
    sign.add_argument("--comment", default="", help="why (optional)")
    sign.add_argument("--override", metavar="REASON",
                      help="with --decision accept on a record whose verdict is not pass: why it is accepted anyway "
                           "(kept in the sign-off; verify and diff show it)")
    verify = sub.add_parser("verify", help="check a record: signature, schema, and every verdict against its data")
    verify.add_argument("record", help="record.toml (its signature is record.toml.sig beside it), or a folder: "
                                       "every record.toml below it, one line each")
    verify.add_argument("--json", action="store_true", help="print the result as one JSON object (docs/record.md)")
    verify.add_argument("--deep", action="store_true",
                        help="RUN_DIR: also read the checkpoints the resume check compared again (their sha256 as "
                             "recorded) and compute every tensor's distances again (docs/record.md)")
    verify.add_argument("--allowed-signers", help="ssh-keygen allowed-signers file: also check who signed")
    verify.add_argument("--identity", help="with --allowed-signers: the signer's principal in that file")
    quiz = sub.add_parser("quiz", help="the onboarding check: 4-6 questions from a record's own numbers")
    diff = sub.add_parser("diff", help="records side by side: environment, spec, memory per device, speed, quality, "
                                       "resume; the first is the baseline")
    diff.add_argument("records", nargs="+", metavar="RECORD", help="record.toml files (or their run folders)")
    diff.add_argument("--json", action="store_true", help="print the comparison as one JSON object")
    diff.add_argument("--all", action="store_true", help="also the environment rows that do not differ")
    quiz.add_argument("record", help="record.toml of a run")
    quiz.add_argument("--operator", default="", help="who answers (to add the score to an unsigned record)")
    monitor = sub.add_parser("monitor", help="live memory bars of every device (NVML, or host memory without a GPU)")
    monitor.add_argument("--once", action="store_true", help="print one sample of every device and exit")
    monitor.add_argument("--json", action="store_true", help="with --once: as JSON")
    monitor.add_argument("--interval", type=float, default=0.1, help="seconds between samples (default 0.1 = 10 Hz)")
    monitor.add_argument("--record", help="also append every sample to this file as JSON lines (a trace to replay)")
    completion = sub.add_parser("completion", help="print the shell completion script (bash or zsh), made from these "
                                                   "flags: see docs/reference.md \"Shell completion\"")
    completion.add_argument("shell", choices=COMPLETION_SHELLS)
    return parser


#: the shells ``gpuaccept completion`` writes a script for (shtab's)
COMPLETION_SHELLS = ("bash", "zsh")


def version() -> str:
    """The installed distribution's version (pyproject.toml), or "unknown" for a tree run uninstalled."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gpuaccept")
    except PackageNotFoundError:
        return "unknown (not installed)"


def complete_files(parser: argparse.ArgumentParser) -> None:
    """Mark the arguments that name a file or folder, for the completion scripts (shtab completes their paths):
    a spec, a record, a key, a folder of runs."""
    import shtab

    files = {"spec", "record", "records", "key", "allowed_signers"}
    for action in all_actions(parser):
        if action.dest in files or action.dest == "runs_dir":  # shtab reads the attribute it documents
            action.complete = shtab.FILE if action.dest in files else shtab.DIRECTORY  # type: ignore[attr-defined]


def all_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    out = list(parser._actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out.extend(all_actions(sub))
    return out


def unknown_arguments(parser: argparse.ArgumentParser, command: str | None, unknown: list[str]) -> None:
    """Refuse arguments the subcommand does not take, as argparse does (its usage, one error line, exit 2), but with
    the subcommand's own usage (not the top level's) and, for a mistyped flag, the closest flags it does take
    (``--bacth-size``: did you mean --batch-size?).

    Raises:
        SystemExit: always, code 2.
    """
    import difflib

    sub = parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            sub = action.choices[command]
    flags = [s for a in sub._actions for s in a.option_strings if s.startswith("--")]
    hints = []
    for arg in unknown:
        if arg.startswith("-"):
            name = arg.split("=", 1)[0]
            close = difflib.get_close_matches(name, flags, n=3, cutoff=0.6)
            if close:  # only those nearly as close as the closest (--bacth-size: --batch-size, not --objective)
                best = difflib.SequenceMatcher(None, name, close[0]).ratio()
                close = [c for c in close if difflib.SequenceMatcher(None, name, c).ratio() >= best - 0.15]
            where = f"gpuaccept {command}" if command else "gpuaccept"
            hints.append(f"{name} (did you mean {' or '.join(close)}?)" if close else
                         f"{name} (no flag of {where} is close: see {where} --help)")
        else:
            hints.append(arg)
    sub.error(f"unrecognized arguments: {' '.join(hints)}")


def imported_config(args: argparse.Namespace) -> Any:
    """What a trainer's YAML config given as the spec was read as (``core.importers.Imported``: its format, the keys
    used and ignored), or None for a TOML spec or none."""
    from core.api import import_config
    from core.spec import YAML_SUFFIXES

    spec = getattr(args, "spec", None)
    if not spec or Path(spec).suffix.lower() not in YAML_SUFFIXES:
        return None
    return import_config(spec, {k: getattr(args, k, None) for k in SPEC_KEYS})  # the flags apply over the file


def spec_from_args(args: argparse.Namespace) -> Any:
    from core.api import build_spec  # a TOML spec or a trainer's YAML config

    return build_spec(args.spec, **{k: getattr(args, k, None) for k in SPEC_KEYS})
