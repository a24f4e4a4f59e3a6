"""No module of core/ or tui/ imports another module's private name (``from core.x import _name``): what two modules
share is public, under a name of its own (issue 36: ``core.commandspec.SETTING_TYPES``, once ``_TYPES``).

Import statements only, those inside functions too (read from the source, nothing imported); a private name reached
as an attribute (``module._name``) is not seen. ``KNOWN`` lists the imports that were there when the check came in:
it may only shrink, and an entry that is gone fails the check until it is removed from the list.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OURS = ("core", "tui")

#: (importing file, module imported from, private name): the imports of private names that are still to be made public
KNOWN = {
    ("core/command/pipeline.py", "core.pipeline", "_reserve"),
    ("core/record/command.py", "core.record.schema", "_walk"),
    ("core/record/diff.py", "core.record.summary", "_json_number"),
}


def private_imports(root: Path = ROOT) -> set[tuple[str, str, str]]:
    """Every ``from core.x import _name`` / ``from tui.x import _name`` in core/ and tui/ under ``root``, and every
    ``import`` of a private module of ours, as (file, module, name)."""
    found: set[tuple[str, str, str]] = set()
    for package in OURS:
        for path in sorted((root / package).rglob("*.py")):
            name = path.relative_to(root).as_posix()
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=name)):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in OURS:
                    module = node.module or ""
                    found |= {(name, module, a.name) for a in node.names if _private(a.name)}
                    found |= {(name, module, part) for part in module.split(".") if _private(part)}
                elif isinstance(node, ast.Import):
                    found |= {(name, a.name, part) for a in node.names if a.name.split(".")[0] in OURS
                              for part in a.name.split(".") if _private(part)}
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_imports_another_modules_private_name():
    new = sorted(private_imports() - KNOWN)
    assert new == [], ("private names imported from another module (make the name public, or move what both use "
                       f"to where both belong): {new}")


def test_the_known_private_imports_are_still_there():
    gone = sorted(KNOWN - private_imports())
    assert gone == [], f"no longer imported: remove them from KNOWN (the list may only shrink): {gone}"


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    """The walk finds a private name imported inside a function body (as core/record/command.py imported ``_TYPES``)
    and a private module of ours, and leaves a private name of another library alone."""
    for package in OURS:
        (tmp_path / package).mkdir()
    (tmp_path / "core" / "a.py").write_text("def f():\n    from core.b import _hidden, shown\n    return _hidden\n",
                                            encoding="utf-8")
    (tmp_path / "tui" / "c.py").write_text("import core._inner\nfrom torch.utils import _pytree\n", encoding="utf-8")
    assert private_imports(tmp_path) == {("core/a.py", "core.b", "_hidden"), ("tui/c.py", "core._inner", "_inner")}
