"""core/ is the product; it must run without the UI (harlequin-style guard, in a fresh interpreter)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import core


def test_importing_every_core_module_never_loads_textual():
    names = [f"core.{m.name}" for m in pkgutil.iter_modules([str(Path(core.__file__).parent)])]
    assert "core.pipeline" in names and "core.worker" in names
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
