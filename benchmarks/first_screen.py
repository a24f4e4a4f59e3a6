"""How long until the wizard's first screen is up, from a cold process (target: under 1 s).

Measured from just before the subprocess starts (interpreter start-up included) until the Mode screen is mounted, in a
headless Textual app; beside it, in the same run, the time a cold process takes to ``import torch`` and to import
``transformers.Trainer`` (what the wizard must not import before its first screen). Results are ratios within one run,
because this machine's absolute speed varies.

Run: ``.venv/bin/python benchmarks/first_screen.py`` (writes benchmarks/results/first_screen.json).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

RUNS = 5
FIRST_SCREEN = """
import sys, time
t0 = float(sys.argv[1])
from tui.app import GpuAcceptApp
from tui.screens.mode import ModeScreen

async def pilot(p):
    while not isinstance(p.app.screen, ModeScreen):
        await p.pause(0.005)
    print(time.time() - t0, 'torch' in sys.modules, 'transformers' in sys.modules)
    p.app.exit(0)

GpuAcceptApp().run(headless=True, auto_pilot=pilot)
"""


def timed(code: str, *args: str) -> float:
    t0 = time.time()
    subprocess.run([sys.executable, "-c", code, *args], check=True, capture_output=True)
    return time.time() - t0


def first_screen() -> tuple[float, bool, bool]:
    out = subprocess.run([sys.executable, "-c", FIRST_SCREEN, repr(time.time())], check=True, capture_output=True,
                         text=True).stdout.split()
    return float(out[0]), out[1] == "True", out[2] == "True"


def main() -> None:
    screens, torch_s, trainer_s, loaded = [], [], [], set()
    for _ in range(RUNS):  # interleaved, so a slow moment hits all three alike
        s, has_torch, has_tf = first_screen()
        screens.append(s)
        loaded |= {name for name, yes in (("torch", has_torch), ("transformers", has_tf)) if yes}
        torch_s.append(timed("import torch"))
        trainer_s.append(timed("from transformers import Trainer"))
    result = {
        "runs": RUNS,
        "first_screen_s_median": statistics.median(screens),
        "first_screen_s_max": max(screens),
        "import_torch_s_median": statistics.median(torch_s),
        "import_trainer_s_median": statistics.median(trainer_s),
        "first_screen_over_import_torch": statistics.median(screens) / statistics.median(torch_s),
        "heavy_modules_loaded_before_first_screen": sorted(loaded),
        "target": "first screen under 1 s; torch and transformers not imported",
    }
    out = Path(__file__).parent / "results" / "first_screen.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
