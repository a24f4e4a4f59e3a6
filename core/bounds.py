"""Bounds on what gpuaccept reads: how deep a TOML file nests, how long its strings are, how long a path is, and what
kind of file a path names.

A spec or a record is parsed by :func:`loads_bounded`, never by ``tomllib.loads`` alone: tomllib recurses once per
level of ``[`` and ``{`` (a value such as ``a = [[[ ... ]]]`` 5,000 deep ends in ``RecursionError``), and a table nested
by dotted keys (``a.a.a. ... = 1``) parses into a mapping that every later walk of it would recurse into. The limits:

- :data:`MAX_TOML_DEPTH` levels of tables and arrays nested in one another (a spec uses 3, a record 7);
- :data:`MAX_TOML_STRING` characters in any one string or key.

A path-like setting (the model, the data file, the spec file, the runs folder, a record) is checked by
:func:`check_path` before the file system sees it: at most :data:`MAX_PATH_BYTES` bytes (Linux's ``PATH_MAX``, its
terminating NUL left out), each part between slashes at most :data:`MAX_NAME_BYTES` (``NAME_MAX``); beyond them the
kernel answers ``File name too long``. :func:`special_file_kind` names what a path is when it is not a regular file
(a directory, a FIFO, a device), from ``os.stat`` alone: a FIFO is never opened (opening one for reading blocks until
a writer comes).

The limits are documented in docs/reference.md ("Limits on input") and docs/record.md (``verify``'s exit code 5).
"""

from __future__ import annotations

import errno
import os
import re
import stat
import sys
import tomllib
from pathlib import Path
from typing import Any

from core.errors import SpecError

#: levels of tables and arrays (inline or not) nested in one another that a spec or a record may hold
MAX_TOML_DEPTH = 32
#: characters in one string or key of a spec or a record (1 MiB of characters)
MAX_TOML_STRING = 2**20
#: bytes of a path-like setting: Linux's PATH_MAX (4,096) less its terminating NUL
MAX_PATH_BYTES = 4095
#: bytes of one part of a path (between slashes): Linux's NAME_MAX
MAX_NAME_BYTES = 255

#: what the scan of a TOML text stops at outside strings and comments: a string's opening quotes, a comment, a bracket
_TOKEN = re.compile(r"\"\"\"|'''|[\"'#\[\]{}]")


class TomlBoundsError(tomllib.TOMLDecodeError):
    """A TOML text beyond gpuaccept's bounds (:data:`MAX_TOML_DEPTH`, :data:`MAX_TOML_STRING`).

    A ``tomllib.TOMLDecodeError`` (so a ``ValueError``) too: code that reports a file that is not valid TOML reports
    this one the same way, with this message.

    Attributes:
        where: the key path (``verdict.stages.plan``) or the line and column the bound was passed at.
    """

    def __init__(self, message: str, where: str, text: str = "", pos: int = 0) -> None:
        self.where = where
        if sys.version_info >= (3, 14):  # the free-form constructor is deprecated there
            super().__init__(message, text, pos)
        else:
            super().__init__(message)


def loads_bounded(text: str, *, max_depth: int = MAX_TOML_DEPTH, max_string: int = MAX_TOML_STRING) -> dict[str, Any]:
    """``tomllib.loads`` within bounds: the text is scanned for the depth of its brackets before tomllib parses it
    (its parser recurses per level), and the parsed tables for their depth and the length of every string and key.

    Args:
        text: the TOML document.
        max_depth: the most levels of tables and arrays nested in one another (the top-level table is level 0).
        max_string: the most characters in one string or key.

    Returns:
        The parsed document, as ``tomllib.loads`` returns it.

    Raises:
        TomlBoundsError: nested deeper than ``max_depth``, a string or key longer than ``max_string``, or an integer
            of more digits than Python converts (``sys.get_int_max_str_digits``); the message says where and the limit.
        tomllib.TOMLDecodeError: not valid TOML.
    """
    _check_brackets(text, max_depth)
    try:
        data = tomllib.loads(text)
    except RecursionError:  # only when the caller's own stack is deep already: the scan bounds tomllib's recursion
        raise TomlBoundsError(f"nested too deep for this process's recursion limit ({sys.getrecursionlimit()}); "
                              f"gpuaccept reads at most {max_depth} levels of tables and arrays", "the document",
                              text) from None
    except tomllib.TOMLDecodeError:
        raise
    except ValueError:  # an integer of more digits than int() converts (sys.get_int_max_str_digits)
        raise TomlBoundsError(f"an integer of more than {sys.get_int_max_str_digits():,} digits; no setting takes one "
                              "that long", "the document", text) from None
    _check_tree(data, max_depth, max_string)
    return data


def _check_brackets(text: str, max_depth: int) -> None:
    """Raise :class:`TomlBoundsError` when ``[`` and ``{`` outside strings and comments nest deeper than
    ``max_depth``. A text that is not TOML is left to tomllib to name."""
    depth, pos = 0, 0
    while (m := _TOKEN.search(text, pos)) is not None:
        token = m.group()
        if token == "#":
            end = text.find("\n", m.end())
            pos = len(text) if end < 0 else end + 1
        elif token in "[{":
            depth += 1
            if depth > max_depth:
                line = text.count("\n", 0, m.start()) + 1
                column = m.start() - text.rfind("\n", 0, m.start())
                where = f"line {line}, column {column}"
                raise TomlBoundsError(f"tables and arrays nested more than {max_depth} deep (at {where}); gpuaccept "
                                      f"reads at most {max_depth} levels: flatten the file", where, text, m.start())
            pos = m.end()
        elif token in "]}":
            depth = max(depth - 1, 0)
            pos = m.end()
        else:
            pos = _string_end(text, m.end(), token)


def _string_end(text: str, start: int, quote: str) -> int:
    """The index just after the string whose opening ``quote`` ends at ``start`` (basic strings honour backslash
    escapes, literal ones do not; a multi-line string's closing quotes may be followed by up to two more of its
    content); an unterminated one-line string ends at its line's end."""
    escapes = quote[0] == '"'
    i = start
    while True:
        j = text.find(quote, i)
        if j < 0:
            return len(text)
        if escapes:
            k = j
            while k > start and text[k - 1] == "\\":
                k -= 1
            if (j - k) % 2:  # an escaped quote
                i = j + 1
                continue
        if len(quote) == 1:
            newline = text.find("\n", start, j)
            return newline if newline >= 0 else j + 1
        end = j + 3
        for _ in range(2):
            if end < len(text) and text[end] == quote[0]:
                end += 1
        return end


def _check_tree(data: dict[str, Any], max_depth: int, max_string: int) -> None:
    """Raise :class:`TomlBoundsError` when a table or array of ``data`` sits deeper than ``max_depth`` or a string or
    key is longer than ``max_string`` characters; walked with a stack, not by recursion."""
    stack: list[tuple[Any, int, str]] = [(data, 0, "")]
    while stack:
        node, depth, path = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            where = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key
            if isinstance(key, str) and len(key) > max_string:
                raise TomlBoundsError(f"a key of {len(key):,} characters (in {shown(path or 'the top table')}); "
                                      f"gpuaccept reads keys and strings of at most {max_string:,}: shorten it",
                                      shown(path))
            if isinstance(value, str) and len(value) > max_string:
                raise TomlBoundsError(f"{shown(where)} is a string of {len(value):,} characters; gpuaccept reads "
                                      f"strings of at most {max_string:,}: shorten it", shown(where))
            if isinstance(value, (dict, list)):
                if depth + 1 > max_depth:
                    raise TomlBoundsError(f"tables and arrays nested more than {max_depth} deep (at {shown(where)}); "
                                          f"gpuaccept reads at most {max_depth} levels: flatten the file", shown(where))
                stack.append((value, depth + 1, where))


#: nodes a YAML document may expand to, every alias counted as the nodes it stands for (a trainer's config has a
#: few hundred; a "billion laughs" of nested aliases would expand to billions)
MAX_YAML_NODES = 100_000


class YamlBoundsError(ValueError):
    """A YAML text beyond gpuaccept's bounds: nested deeper than :data:`MAX_TOML_DEPTH`, expanding (aliases counted
    as what they stand for) to more than :data:`MAX_YAML_NODES` nodes, a string longer than :data:`MAX_TOML_STRING`,
    or an integer longer than Python converts (``sys.get_int_max_str_digits``)."""


def yaml_bounded(text: str, *, max_depth: int = MAX_TOML_DEPTH, max_nodes: int = MAX_YAML_NODES,
                 max_string: int = MAX_TOML_STRING) -> Any:
    """PyYAML's safe load within bounds. The document is composed into nodes first (no Python object is made) and
    walked with a stack, each alias walked again as the nodes it names, so a document that expands past
    ``max_nodes`` is refused before anything is built from it (PyYAML shares an alias's object, but every walk of the
    result, e.g. listing a config's keys, expands it); nesting and scalars are checked on the way.

    Raises:
        YamlBoundsError: a bound passed (the message names it and the limit).
        yaml.YAMLError: not valid YAML.
    """
    import yaml

    _check_yaml_nesting(text, max_depth)  # before PyYAML's composer, which recurses once per level
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except RecursionError:
        raise YamlBoundsError(f"nested too deep to read; gpuaccept reads at most {max_depth} levels") from None
    if root is None:
        return None
    seen = 0
    stack: list[tuple[Any, int]] = [(root, 0)]
    while stack:
        node, depth = stack.pop()
        seen += 1
        if seen > max_nodes:
            raise YamlBoundsError(f"the document expands to more than {max_nodes:,} values (anchors and aliases "
                                  "counted as what they stand for); a trainer's config holds a few hundred")
        if depth > max_depth:
            raise YamlBoundsError(f"mappings and lists nested more than {max_depth} deep; gpuaccept reads at most "
                                  f"{max_depth} levels: flatten the file")
        if isinstance(node, yaml.ScalarNode):
            if len(node.value) > max_string:
                raise YamlBoundsError(f"a value of {len(node.value):,} characters (line {node.start_mark.line + 1}); "
                                      f"gpuaccept reads values of at most {max_string:,}")
            continue
        children = node.value if isinstance(node, yaml.SequenceNode) else [n for pair in node.value for n in pair]
        stack.extend((child, depth + 1) for child in children)
    try:
        return yaml.safe_load(text)
    except ValueError:  # an integer of more digits than int() converts
        raise YamlBoundsError(f"an integer of more than {sys.get_int_max_str_digits():,} digits; no setting takes "
                              "one that long") from None
    except RecursionError:
        raise YamlBoundsError(f"nested too deep to read; gpuaccept reads at most {max_depth} levels") from None


def _check_yaml_nesting(text: str, max_depth: int) -> None:
    """Raise :class:`YamlBoundsError` when the text nests deeper than ``max_depth``, counted without parsing: flow
    brackets outside strings and comments (as in TOML), plus block nesting (each deeper indentation of a line that
    holds a value, and each ``- `` that opens a sequence item on it). An upper bound of what PyYAML's composer would
    recurse into, so its recursion never depends on the process's recursion limit."""
    try:
        _check_brackets(text, max_depth)
    except TomlBoundsError as exc:
        raise YamlBoundsError(f"mappings and lists {str(exc).split('tables and arrays ', 1)[-1]}") from None
    indents: list[int] = []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.lstrip(" ")
        if not stripped or stripped.startswith("#"):
            continue
        indent = len(line) - len(stripped)
        while indents and indents[-1] >= indent:
            indents.pop()
        indents.append(indent)
        dashes = len(re.match(r"(?:-\s+)*", stripped).group().split("-")) - 1  # type: ignore[union-attr]
        if len(indents) + dashes > max_depth:
            raise YamlBoundsError(f"mappings and lists nested more than {max_depth} deep (at line {number}); "
                                  f"gpuaccept reads at most {max_depth} levels: flatten the file")


def shown(value: str, most: int = 80) -> str:
    """``value`` as a message shows it: whole up to ``most`` characters, else its start, an ellipsis and its length
    (a message never repeats a megabyte the user gave)."""
    if len(value) <= most:
        return value
    return f"{value[:most // 2]}… ({len(value):,} characters)"


def check_path(field: str, value: str) -> None:
    """Refuse a path-like setting the file system would refuse as a name, before any ``stat`` of it.

    Args:
        field: the setting, as messages name it (``model``, ``data``, ``spec``, ``runs_dir``, ``record``).
        value: its value, a path (or, for the model, a name that may be one).

    Raises:
        SpecError: ``field``, when ``value`` is longer than :data:`MAX_PATH_BYTES` bytes (UTF-8), holds a part between
            slashes longer than :data:`MAX_NAME_BYTES` bytes, or holds a NUL byte; the message says the limit and
            what to change.
    """
    if "\x00" in value:
        raise SpecError(field, f"{shown(value)!r} holds a NUL byte, which no path may hold; give the path without it")
    size = len(os.fsencode(value))
    if size > MAX_PATH_BYTES:
        raise SpecError(field, f"{shown(value)} is {size:,} bytes long; a path may be at most {MAX_PATH_BYTES:,} bytes "
                               "(PATH_MAX): give a shorter path")
    longest = max(value.split("/"), key=lambda part: len(os.fsencode(part)))
    if len(os.fsencode(longest)) > MAX_NAME_BYTES:
        raise SpecError(field, f"{shown(value)}: the part {shown(longest, 40)} is {len(os.fsencode(longest)):,} bytes; "
                               f"each part of a path between slashes may be at most {MAX_NAME_BYTES} bytes (NAME_MAX): "
                               "give a shorter name")


def special_file_kind(path: str | Path) -> str | None:
    """What ``path`` is when it exists and is not a regular file, in words (``a directory``, ``a FIFO (named
    pipe)``, ``a character device``, ``a block device``, ``a socket``, ``a symbolic link loop``); ``None`` for a regular
    file, a missing path or one that cannot be looked up for another reason (the reader names those). Uses ``os.stat`` only (symbolic links followed): a FIFO is
    never opened."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        return "a symbolic link loop" if exc.errno == errno.ELOOP else None
    except ValueError:
        return None
    return _kind_of_mode(mode)


def _kind_of_mode(mode: int) -> str | None:
    """:func:`special_file_kind` of an ``st_mode``."""
    if stat.S_ISREG(mode):
        return None
    for test, words in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                        (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return words
    return "not a regular file"


#: bytes of a spec, a trainer's config, a quiz's answers or a signature gpuaccept reads (a real one is a few KiB)
MAX_SMALL_FILE = 2**20
#: bytes of a record gpuaccept reads (a real one is tens of KiB; a record of a large cluster a few MiB)
MAX_RECORD_FILE = 32 * 2**20


class InputFileError(OSError):
    """A file gpuaccept was given that it does not read: not a regular file (a FIFO, a device, a directory, a socket;
    named from ``os.stat``, never opened), larger than the cap for its kind, or not UTF-8 text. An ``OSError``, so a
    reader that reports a file it cannot read reports this one, with this message."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "cannot be read"


def read_input_text(path: str | Path, what: str, max_bytes: int = MAX_SMALL_FILE) -> str:
    """The UTF-8 text of the file ``path`` (``what``: what it should be, for the message: ``"a TOML spec"``), read
    only when it is a regular file (symbolic links followed) of at most ``max_bytes``; at most ``max_bytes + 1`` bytes
    are ever read, so a file that grows (or a link to ``/dev/zero``) cannot exhaust memory.

    Raises:
        FileNotFoundError: no such file.
        InputFileError: not a regular file, larger than ``max_bytes``, or not UTF-8 (the message names the path, what
            it is, and what to give).
    """
    path = Path(path)
    kind = special_file_kind(path)
    if kind is not None:
        raise InputFileError(f"{path} is {kind}, not a file: give {what}")
    # opened without blocking and looked at again through the descriptor: a path swapped for a FIFO after the stat
    # above would otherwise block the open until a writer came
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # FileNotFoundError as it is
    with open(fd, "rb") as f:
        status = os.fstat(fd)
        kind = _kind_of_mode(status.st_mode)
        if kind is not None:
            raise InputFileError(f"{path} is {kind}, not a file: give {what}")
        if status.st_size > max_bytes:  # the size first: nothing is read
            raise InputFileError(f"{path} is {status.st_size:,} bytes, larger than {max_bytes:,}: not {what} "
                                 "gpuaccept reads (a real one is far smaller)")
        # its size and one byte more (a read of n bytes allocates n at once); a file that grows is read up to the cap
        data = f.read(status.st_size + 1)
        if len(data) > status.st_size:
            data += f.read(max_bytes + 1 - len(data))
    if len(data) > max_bytes:
        raise InputFileError(f"{path} is larger than {max_bytes:,} bytes: not {what} gpuaccept reads (a real one is "
                             "far smaller)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise InputFileError(f"{path} is not UTF-8 text (binary, or UTF-16?): give {what}") from None
