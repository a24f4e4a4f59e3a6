"""Each setting of the spec declared once: on its dataclass field, from which everything else is made.

A field of :class:`core.spec.RunSpec`, of one of its tables (``[lora]``, ``[qlora]``, ``[resume]``, ``[torchrun]``) or
of :class:`core.criteria.AcceptCriteria` (``[accept]``) is declared with :func:`setting` (a sub-table with
:func:`table`), and so is each field of command mode's :class:`core.commandspec.CommandSpec` (``[command]``: its
flag, or the recipe's flag of the same meaning, its type check and its form field; ``COMMAND_SETTINGS`` there)::

    r: int = setting(8, help="LoRA rank r", label="LoRA rank r", form_order=180)

and :func:`core.spec.spec_settings` (one :class:`Setting` per field, found by :func:`settings_of` walking ``RunSpec``
and its tables) is what the rest is made from:

- the spec: the field and its default (the dataclass); its type and, for a ``Literal``, its choices (from the
  annotation: :meth:`RunSpec.validate <core.spec.RunSpec.validate>` refuses a value not among them); its TOML key and
  table (``lora.r``); the flat keyword ``RunSpec.build`` takes (``lora_r``, :func:`nest`); a default that depends on
  the mode (``mode_default``: the method's attribute of the same name, core/methods/);
- the CLI flag(s) of ``gpuaccept run`` and ``plan``: spelling (``--`` + the table's ``flag_prefix`` + the name with
  dashes, unless ``flag`` says otherwise), ``aliases``, ``metavar``, help, and the argument group (tui/cli.py);
- the Setup form's field: label, kind, choices, the setting group it belongs to (core/methods/base.py
  ``SETTING_GROUPS``) and its place (``form_order``); a setting without ``label`` is not on the form
  (tui/screens/setup.py);
- the tables of docs/reference.md: ``python -m core.reference --update-docs`` rewrites them (:func:`markdown_table`),
  and tests/unit/test_settings.py fails when they differ.

Adding a setting is adding one declared field (with a ``Literal`` type for its choices): its flag, TOML key, form
field (with ``label``) and docs row follow. This module imports neither the UI nor ``core.spec`` (``core.spec`` and
``core.criteria`` import it): every function here takes the settings it works on.
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Union, get_args, get_origin, get_type_hints

from core.methods.base import SETTING_GROUPS

#: the key of a dataclass field's ``metadata`` that holds its :class:`Declaration` (or :class:`TableDeclaration`)
METADATA_KEY = "gpuaccept.setting"
#: the kinds of a form field: a number typed in (``int``, ``float``), text (``str``), a choice (``choice``), a number
#: or blank for "not set" (``optfloat``), a whole number or blank for 0, "chosen for you" (``autoint``)
FORM_KINDS = ("int", "float", "str", "choice", "optfloat", "autoint")
#: the plain kinds a setting's value has (its annotation, a ``Literal`` being the kind of its values; ``table``: a
#: ``dict[str, str]`` such as command mode's ``[command.env]``)
KINDS = ("int", "float", "str", "bool", "list", "table")
#: each kind in words, for a value of another type ("... is not a list of strings")
KIND_WORDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
              "list": "a list of strings", "table": "a table of strings"}
#: the docs tables a setting is rendered in (:func:`markdown_table`)
DOC_TABLES = ("settings", "criteria")


@dataclass(frozen=True)
class Declaration:
    """What :func:`setting` stores in a field's metadata: everything about the setting that its type and default do
    not say (see :func:`setting` for each attribute)."""

    help: str
    flag: str | None = None
    aliases: tuple[str, ...] = ()
    metavar: str | None = None
    value_aliases: Mapping[str, str] | None = None
    label: str | None = None
    form_kind: str | None = None
    form_choices: tuple[str, ...] | None = None
    form_order: int | None = None
    group: str | None = None
    mode_default: bool = False
    command_key: str | None = None
    stage: str | None = None
    doc: str | None = None
    doc_default: str | None = None
    choices: Callable[[], tuple[str, ...]] | None = None
    placeholder: str | None = None
    cli: bool = True


@dataclass(frozen=True)
class TableDeclaration:
    """What :func:`table` stores in the metadata of a spec's sub-table field (see :func:`table`)."""

    flag_prefix: str = ""
    group: str = "all"
    cli_group: str | None = None
    doc_table: str = "settings"


class FormField(NamedTuple):
    """A field of the Setup form (tui/screens/setup.py ``FIELDS``).

    Attributes:
        name: the input's id, the setting's :attr:`Setting.dest` (``lora_r``).
        label: shown left of the input.
        kind: one of :data:`FORM_KINDS`.
        choices: a choice's values, in the order offered (empty for the other kinds).
        group: the setting group (core/methods/base.py ``SETTING_GROUPS``): shown for the methods that take it.
    """

    name: str
    label: str
    kind: str
    choices: tuple[str, ...]
    group: str


@dataclass(frozen=True)
class Setting:
    """One setting, as made from its declared field by :func:`settings_of`.

    Attributes:
        key: the TOML key, table included (``"lora.r"``, ``"seq_len"``): what :class:`~core.errors.SpecError` names.
        table: the sub-table (``"lora"``), or None for a top-level key.
        name: the field's name in its dataclass (``"r"``).
        dest: the flat keyword of ``RunSpec.build``, the flag's ``dest`` and the form's input id (``"lora_r"``).
        kind: one of :data:`KINDS`.
        optional: None is a value (a criterion not set).
        choices: a ``Literal`` setting's values, in the annotation's order; empty for any other.
        value_aliases: values accepted and stored as another (``{"fsdp": "zero3"}``).
        default: the dataclass default (``None`` for a criterion not set).
        mode_default: the default depends on the mode: the method's attribute named :attr:`name` (core/methods/).
        help: what it sets, in a line (the flag's help, the docs' row).
        flags: the flag's option strings, the main spelling first.
        metavar: the flag's metavar, or None (argparse's).
        group: the setting group (core/methods/base.py ``SETTING_GROUPS``).
        cli_group: the title of its CLI argument group, or None (the setup's).
        form: its Setup form field, or None when it is not on the form.
        form_order: where the form field goes (fields in increasing order); None when not on the form.
        command_key: the ``[command]`` key its flag also sets in command mode, or None (not taken there).
        doc_table: the docs table it is a row of (:data:`DOC_TABLES`).
        stage: for a criterion, the stage it judges (``"probe"``).
        doc: the docs' wording of it (a criterion's rule); :attr:`help` unless declared.
        doc_default: the docs' wording of its default, or None (made from :attr:`default`).
        placeholder: what a blank form field shows, or None.
    """

    key: str
    table: str | None
    name: str
    dest: str
    kind: str
    optional: bool
    choices: tuple[str, ...]
    value_aliases: Mapping[str, str]
    default: Any
    mode_default: bool
    help: str
    flags: tuple[str, ...]
    metavar: str | None
    group: str
    cli_group: str | None
    form: FormField | None
    form_order: int | None
    command_key: str | None
    doc_table: str
    stage: str | None
    doc: str
    doc_default: str | None
    placeholder: str | None = None

    @property
    def cli_choices(self) -> tuple[str, ...]:
        """The values the flag accepts: each choice followed by its aliases (``zero3``, ``fsdp``); empty for a
        setting without choices."""
        out: list[str] = []
        for choice in self.choices:
            out.append(choice)
            out.extend(a for a, target in self.value_aliases.items() if target == choice)
        return tuple(out)

    def value(self, obj: Any) -> Any:
        """The setting's value in ``obj`` (a :class:`core.spec.RunSpec`): ``obj.lora.r`` for ``lora.r``."""
        holder = getattr(obj, self.table) if self.table is not None else obj
        return getattr(holder, self.name)


def setting(default: Any = dataclasses.MISSING, *, help: str, flag: str | None = None,  # noqa: A002 - argparse's word
            aliases: tuple[str, ...] = (), metavar: str | None = None,
            value_aliases: Mapping[str, str] | None = None, label: str | None = None, form_kind: str | None = None,
            form_choices: tuple[str, ...] | None = None, form_order: int | None = None, group: str | None = None,
            mode_default: bool = False, command_key: str | None = None, stage: str | None = None,
            doc: str | None = None, doc_default: str | None = None,
            choices: Callable[[], tuple[str, ...]] | None = None, placeholder: str | None = None,
            cli: bool = True, default_factory: Callable[[], Any] | None = None) -> Any:
    """Declare a setting on a dataclass field: ``name: type = setting(default, help=...)``.

    Args:
        default: the field's default (an immutable value: a tuple, not a list).
        help: what it sets, in a line: the flag's help and the docs' row (plain text; a ``%`` is escaped for argparse).
        flag: the flag's main spelling (``"--quant-type"``); default ``--`` + the table's ``flag_prefix`` + the name
            with dashes (``--lora-r``, ``--checkpoint-every``).
        aliases: further spellings of the flag (``("--lr",)``).
        metavar: the flag's metavar (``"P"``).
        value_aliases: values accepted besides the ``Literal``'s and stored as one of them (``{"fsdp": "zero3"}``):
            offered by the flag after the value they stand for; the spec stores the value.
        label: the Setup form's label; None: the setting is not on the form.
        form_kind: one of :data:`FORM_KINDS`; default by type (``Literal`` and bool: ``choice``, ``float | None``:
            ``optfloat``, else the kind: ``int``, ``float``, ``str``).
        form_choices: the form's choices when not the ``Literal``'s (a bool offers ``on``/``off``, its default first).
        form_order: where the form field goes among the others (increasing); required with ``label``.
        group: the setting group (core/methods/base.py ``SETTING_GROUPS``); default the table's (``all`` at the top).
        mode_default: the default depends on the mode: the method's attribute of the same name
            (core/methods/base.py ``Method``) when the key is given nowhere.
        command_key: the ``[command]`` key the flag also sets in command mode (core/commandspec.py), or None.
        stage: a criterion's stage (its docs row).
        doc: the docs' wording when not ``help`` (a criterion's rule).
        doc_default: the docs' wording of the default when not the value itself (``"1.0: it fits"``).
        choices: for a ``str`` setting whose values are a registry's names (the methods of core/methods/), the
            function that lists them, called when the settings are made (:func:`settings_of`): the setting then has choices as a
            ``Literal`` would give, and a method added to the registry is a new choice with no other change.
        placeholder: what the form field shows while blank (``"python train.py --output_dir {out}"``).
        default_factory: makes the default when it is mutable (a ``dict``), instead of ``default``.
        cli: the setting has a flag of its own; False for a command-mode setting that the recipe's flag of the same
            meaning sets (its ``command_key``: ``--model`` sets ``[command] model``).

    Returns:
        ``dataclasses.field(default=default, metadata={METADATA_KEY: Declaration(...)})``.

    Raises:
        ValueError: a form field without ``form_order``, an unknown ``form_kind`` or ``group``, a flag not starting
            with ``--``.
    """
    if label is not None and form_order is None:
        raise ValueError(f"the form field {label!r} needs a form_order (its place among the form's fields)")
    if form_kind is not None and form_kind not in FORM_KINDS:
        raise ValueError(f"form_kind {form_kind!r} is none of {', '.join(FORM_KINDS)}")
    if group is not None and group not in SETTING_GROUPS:
        raise ValueError(f"group {group!r} is none of {', '.join(SETTING_GROUPS)}")
    if any(not f.startswith("--") for f in (flag or "--", *aliases)):
        raise ValueError(f"flags start with --: {flag!r}, {aliases!r}")
    declared = Declaration(help=help, flag=flag, aliases=tuple(aliases), metavar=metavar,
                           value_aliases=dict(value_aliases) if value_aliases else None, label=label,
                           form_kind=form_kind, form_choices=form_choices, form_order=form_order, group=group,
                           mode_default=mode_default, command_key=command_key, stage=stage, doc=doc,
                           doc_default=doc_default, choices=choices, placeholder=placeholder, cli=cli)
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata={METADATA_KEY: declared})
    return dataclasses.field(default=default, metadata={METADATA_KEY: declared})


def table(cls: type, *, flag_prefix: str = "", group: str = "all", cli_group: str | None = None,
          doc_table: str = "settings") -> Any:
    """Declare a sub-table of the spec (``[lora]``): ``lora: LoraSettings = table(LoraSettings, flag_prefix="lora-")``.

    Args:
        cls: the table's dataclass (its fields each declared with :func:`setting`); the default is ``cls()``.
        flag_prefix: put between ``--`` and a setting's name in its flag (``"lora-"``: ``--lora-r``).
        group: its settings' setting group unless one says otherwise.
        cli_group: the title of the CLI argument group its flags are listed under; None: the setup's.
        doc_table: the docs table its settings are rows of (:data:`DOC_TABLES`).

    Returns:
        ``dataclasses.field(default_factory=cls, metadata={METADATA_KEY: TableDeclaration(...)})``.

    Raises:
        ValueError: an unknown ``group`` or ``doc_table``.
    """
    if group not in SETTING_GROUPS:
        raise ValueError(f"group {group!r} is none of {', '.join(SETTING_GROUPS)}")
    if doc_table not in DOC_TABLES:
        raise ValueError(f"doc_table {doc_table!r} is none of {', '.join(DOC_TABLES)}")
    declared = TableDeclaration(flag_prefix=flag_prefix, group=group, cli_group=cli_group, doc_table=doc_table)
    return dataclasses.field(default_factory=cls, metadata={METADATA_KEY: declared})


def _kind(hint: Any, where: str) -> tuple[str, bool, tuple[str, ...]]:
    """(kind, optional, choices) of an annotation: ``int``; ``float | None``; ``Literal["a", "b"]``; ``tuple[str, ...]``.

    Raises:
        TypeError: an annotation a setting cannot have (naming ``where``).
    """
    optional = False
    if get_origin(hint) in (Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        optional = len(args) < len(get_args(hint))
        if len(args) != 1:
            raise TypeError(f"{where}: a setting has one type (or that type | None), not {hint}")
        hint = args[0]
    if get_origin(hint) is Literal:
        values = get_args(hint)
        if not all(isinstance(v, str) for v in values):
            raise TypeError(f"{where}: a Literal setting's values are strings, not {values!r}")
        return "str", optional, tuple(values)
    if hint in (int, float, str, bool):
        return hint.__name__, optional, ()
    if get_origin(hint) is tuple and get_args(hint) == (str, ...):
        return "list", optional, ()
    if get_origin(hint) is dict and get_args(hint) == (str, str):
        return "table", optional, ()
    raise TypeError(f"{where}: {hint} is not a setting's type (int, float, str, bool, a Literal of strings, "
                    "tuple[str, ...], dict[str, str], or one of them | None)")


def value_fits(kind: str, value: Any) -> bool:
    """``value`` (read from TOML or a record) is of the setting kind ``kind`` (:data:`KINDS`): ``int`` no bool,
    ``float`` an int too, ``list`` a list (or tuple) of strings, ``table`` a table of strings (numbers taken).

    Raises:
        KeyError: ``kind`` is not one of :data:`KINDS`.
    """
    plain: dict[str, type | tuple[type, ...]] = {"int": int, "float": (int, float), "str": str, "bool": bool}
    if kind in plain:
        return isinstance(value, plain[kind]) and (kind == "bool" or not isinstance(value, bool))
    if kind == "list":
        return isinstance(value, (list, tuple)) and all(isinstance(x, str) for x in value)
    if kind == "table":
        return isinstance(value, dict) and all(isinstance(x, (str, int, float)) for x in value.values())
    raise KeyError(kind)


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _form(dest: str, declared: Declaration, kind: str, optional: bool, choices: tuple[str, ...], default: Any,
          group: str) -> FormField | None:
    if declared.label is None:
        return None
    form_choices: tuple[str, ...] = ()
    if declared.form_choices is not None:
        form_choices = tuple(declared.form_choices)
    elif choices:
        form_choices = choices
    elif kind == "bool":
        form_choices = ("on", "off") if default else ("off", "on")  # the default first
    if declared.form_kind is not None:
        form_kind = declared.form_kind
    elif form_choices:
        form_kind = "choice"
    elif kind == "float" and optional:
        form_kind = "optfloat"
    else:
        form_kind = {"list": "str"}.get(kind, kind)
    return FormField(dest, declared.label, form_kind, form_choices if form_kind == "choice" else (), group)


def settings_of(cls: type, table: str | None = None, cli_group: str | None = None) -> tuple[Setting, ...]:
    """Every setting of the dataclass ``cls`` and of its sub-tables (declared with :func:`table`), in field order;
    ``cls`` itself read as the table ``table`` when one is named (command mode's ``[command]``: keys ``command.train``,
    dests ``command_train``), its flags listed under ``cli_group``.

    Raises:
        TypeError: a field declared neither with :func:`setting` nor :func:`table`, a table inside a table, an
            annotation a setting cannot have, a ``mode_default`` the methods do not define, or two settings with one
            dest or one flag.
    """
    out = list(_walk(cls, table, TableDeclaration(cli_group=cli_group)))
    for attr in ("dest", "key"):
        seen = [getattr(s, attr) for s in out]
        twice = sorted({v for v in seen if seen.count(v) > 1})
        if twice:
            raise TypeError(f"{cls.__name__}: two settings with the {attr} {', '.join(twice)}")
    flags = [f for s in out for f in s.flags]
    twice = sorted({f for f in flags if flags.count(f) > 1})
    if twice:
        raise TypeError(f"{cls.__name__}: two settings with the flag {', '.join(twice)}")
    return tuple(out)


def _walk(cls: type, table_name: str | None, table_declared: TableDeclaration) -> list[Setting]:
    from core.methods.base import Method

    hints = get_type_hints(cls)
    out: list[Setting] = []
    for f in dataclasses.fields(cls):
        where = f"{cls.__name__}.{f.name}"
        declared = f.metadata.get(METADATA_KEY)
        if isinstance(declared, TableDeclaration):
            if table_name is not None:
                raise TypeError(f"{where}: a table inside the table [{table_name}]; the spec's tables are one deep")
            out.extend(_walk(hints[f.name], f.name, declared))
            continue
        if not isinstance(declared, Declaration):
            raise TypeError(f"{where} is not declared: give it `= setting(default, help=...)` (core/settings.py), or "
                            "`= table(cls)` for a sub-table")
        kind, optional, choices = _kind(hints[f.name], where)
        if declared.choices is not None:
            if kind != "str" or choices:
                raise TypeError(f"{where}: choices from a registry are for a plain str setting, not {hints[f.name]}")
            choices = tuple(declared.choices())
        if declared.mode_default and not any(x.name == f.name for x in dataclasses.fields(Method)):
            raise TypeError(f"{where}: mode_default, but core.methods.base.Method has no {f.name!r}")
        dest = f.name if table_name is None else f"{table_name}_{f.name}"
        default = _default(f)
        group = declared.group or table_declared.group
        flag = declared.flag or "--" + table_declared.flag_prefix + f.name.replace("_", "-")
        out.append(Setting(
            key=f.name if table_name is None else f"{table_name}.{f.name}", table=table_name, name=f.name,
            dest=dest, kind=kind, optional=optional, choices=choices, value_aliases=dict(declared.value_aliases or {}),
            default=default, mode_default=declared.mode_default, help=declared.help,
            flags=(flag, *declared.aliases) if declared.cli else (), metavar=declared.metavar, group=group,
            cli_group=table_declared.cli_group,
            form=_form(dest, declared, kind, optional, choices, default, group), form_order=declared.form_order,
            command_key=declared.command_key, doc_table=table_declared.doc_table, stage=declared.stage,
            doc=declared.doc or declared.help, doc_default=declared.doc_default, placeholder=declared.placeholder))
    return out


def tables_of(settings: tuple[Setting, ...]) -> tuple[str, ...]:
    """The sub-tables the settings are in, in their order (``("lora", "qlora", ...)``)."""
    return tuple(dict.fromkeys(s.table for s in settings if s.table is not None))


def nest(flat: Mapping[str, Any], settings: tuple[Setting, ...]) -> dict[str, Any]:
    """Flat keywords (``{"seq_len": 64, "lora_r": 4}``, as ``RunSpec.build`` and the flags give them) as the TOML
    layout (``{"seq_len": 64, "lora": {"r": 4}}``). None values are kept (the caller drops them).

    A keyword that is no setting's dest but starts with a table's name and ``_`` goes into that table under the rest of
    its name (``lora_bogus`` -> ``lora.bogus``, which the spec then refuses by name); any other is kept at the top.

    Args:
        settings: what to map by (the spec's: :func:`core.spec.spec_settings`).
    """
    dests = {s.dest: s for s in settings}
    tables = sorted(tables_of(settings), key=len, reverse=True)
    out: dict[str, Any] = {}
    for key, value in flat.items():
        found = dests.get(key)
        where, name = (found.table, found.name) if found is not None else next(
            ((t, key.removeprefix(t + "_")) for t in tables if key.startswith(t + "_")), (None, key))
        if where is None:
            out[name] = value
        else:
            out.setdefault(where, {})[name] = value
    return out


def unknown_value(obj: Any, settings: tuple[Setting, ...]) -> tuple[Setting, Any] | None:
    """The first setting (in order) whose value in ``obj`` is not among its choices (nor None where it may be), with
    that value; None when every ``Literal`` setting holds one of its values.

    Args:
        settings: what to check by (the spec's: :func:`core.spec.spec_settings`).
    """
    for s in settings:
        if not s.choices:
            continue
        value = s.value(obj)
        if value not in s.choices and not (value is None and s.optional):
            return s, value
    return None


# ---------------------------------------------------------------------------------------------------- the docs tables
def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, tuple, list)):
        return json.dumps(list(value) if isinstance(value, tuple) else value)
    return repr(value)


def default_text(s: Setting, plain: bool = False) -> str:
    """A setting's default as the docs say it: ``doc_default``, else per mode (``by mode: inference 0, full 12, ...``),
    ``not set`` (None) or the TOML value in backticks (``plain``: a string's value alone, ``auto``)."""
    if plain and isinstance(s.default, str) and s.doc_default is None:
        return s.default
    if s.doc_default is not None:
        return s.doc_default
    if s.mode_default:
        from core.methods import METHODS

        return "by mode: " + ", ".join(f"{name} `{_toml(getattr(m, s.name))}`" for name, m in METHODS.items())
    if s.default is None:
        return "not set"
    return f"`{_toml(s.default)}`"


def values_text(s: Setting) -> str:
    """What a setting takes, as the docs say it: its choices (aliases named), or its kind."""
    if s.choices:
        parts = []
        for choice in s.choices:
            aliases = [a for a, target in s.value_aliases.items() if target == choice]
            parts.append(f"`{choice}`" + "".join(f" (or `{a}`)" for a in aliases))
        return ", ".join(parts)
    words = {"int": "integer", "float": "number", "str": "text", "bool": "`true`, `false`",
             "list": "list of text (the flag: comma-separated)"}[s.kind]
    return words + (" or not set" if s.optional else "")


def flags_text(s: Setting) -> str:
    """A setting's flags as the docs say them (a boolean's ``--no-`` form too)."""
    flags = [f"`{f}`" for f in s.flags]
    if s.kind == "bool":
        flags += [f"`--no-{f.removeprefix('--')}`" for f in s.flags]
    return ", ".join(flags)


def markdown_table(which: str, settings: tuple[Setting, ...]) -> str:
    """The docs table ``which`` (:data:`DOC_TABLES`) made from the settings, ending with a newline.

    ``settings``: one row per key (TOML key, flags, values, default, what it sets); ``criteria``: one row per
    criterion (name and flag, stage, rule, default), as docs/reference.md "Acceptance criteria" shows them.

    Args:
        settings: what to render (the spec's: :func:`core.spec.spec_settings`).

    Raises:
        ValueError: ``which`` is not one of :data:`DOC_TABLES`.
    """
    rows = [s for s in settings if s.doc_table == which]
    if which == "settings":
        lines = ["| key | flag | values | default | what it sets |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| `{s.key}` | {flags_text(s)} | {_cell(values_text(s))} | {_cell(default_text(s))} | "
                  f"{_cell(s.doc)} |" for s in rows]
    elif which == "criteria":
        lines = ["| criterion (flag) | stage | rule | default |", "| --- | --- | --- | --- |"]
        lines += [f"| `{s.name}` (`{s.flags[0]}`) | {s.stage or ''} | {_cell(s.doc)} | "
                  f"{_cell(default_text(s, plain=True))} |" for s in rows]
    else:
        raise ValueError(f"no docs table {which!r}; choose one of {', '.join(DOC_TABLES)}")
    return "\n".join(lines) + "\n"


#: a generated table in a markdown file: between its BEGIN and END comments
GENERATED = re.compile(r"(<!-- BEGIN generated (\w+) table[^\n]*-->\n)(.*?)(<!-- END generated \2 table -->)",
                       re.DOTALL)


def render_docs(text: str, settings: tuple[Setting, ...]) -> str:
    """``text`` (a markdown file) with each generated table (between ``<!-- BEGIN generated NAME table ... -->`` and
    ``<!-- END generated NAME table -->``) made again by :func:`markdown_table`.

    Raises:
        ValueError: a table name that is not one of :data:`DOC_TABLES`, or no generated table in ``text``.
    """
    if not GENERATED.search(text):
        raise ValueError("no generated table (<!-- BEGIN generated NAME table --> ... <!-- END generated NAME table -->)")
    return GENERATED.sub(lambda m: m.group(1) + markdown_table(m.group(2), settings) + m.group(4), text)
