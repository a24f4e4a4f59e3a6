"""core/ is the product; it must run without the UI (harlequin-style guard, in a fresh interpreter)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import core


def _core_modules() -> list[str]:
    """Every module of core/, its packages by stage included (core.plan.memory, core.child.worker, ...)."""
    return [m.name for m in pkgutil.walk_packages([str(Path(core.__file__).parent)], prefix="core.")]


def test_importing_every_core_module_never_loads_textual():
    names = _core_modules()
    assert {"core.pipeline", "core.child.worker", "core.plan.memory", "core.stages.resume",
            "core.record.verify", "core.monitor.nvml"} <= set(names)
    code = "import sys\n" + "".join(f"import {n}\n" for n in names) + "print('textual' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_cli_start_path_does_not_import_torch():
    code = "import sys, tui.cli; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"


def test_the_wizard_start_path_imports_neither_torch_nor_transformers():
    code = ("import sys, tui.app, tui.screens.mode, tui.screens.setup, tui.screens.dialogs; "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"


def _imports_torch_at_module_level(path: Path) -> list[int]:
    """Line numbers of module-level imports of torch (under if/try at the top too; ``if TYPE_CHECKING:`` excepted)."""
    import ast

    hits: list[int] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torch" for a in node.names):
                hits.append(node.lineno)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
                hits.append(node.lineno)
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)

    visit(ast.parse(path.read_text(encoding="utf-8")).body)
    return hits


def test_only_the_child_package_imports_torch_at_module_level():
    root = Path(core.__file__).parent
    found = {str(p.relative_to(root.parent)): _imports_torch_at_module_level(p) for p in root.rglob("*.py")}
    outside = {path: lines for path, lines in found.items() if lines and not path.startswith("core/child/")}
    assert outside == {}, f"torch imported at module level outside core/child/: {outside}"
    assert found["core/child/measure.py"], "the check must see the child's own module-level import"


def test_importing_every_core_module_outside_the_child_never_loads_torch():
    names = [n for n in _core_modules() if not n.startswith("core.child.")]
    code = "import sys\n" + "".join(f"import {n}\n" for n in names) + "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
