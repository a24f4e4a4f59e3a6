"""End to end on the embedded SmolLM2-135M and the embedded text, as a user runs it (minutes on a 2-core CPU)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest


@pytest.mark.slow
def test_headless_lora_acceptance_on_the_embedded_model(tmp_path):
    exe = shutil.which("gpuaccept", path=str(Path(sys.executable).parent))
    started = time.monotonic()
    out = subprocess.run([exe, "run", "--headless", "--mode", "lora"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=900)
    elapsed = time.monotonic() - started
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stdout + out.stderr
    record_path = Path(tmp_path, out.stdout.strip().splitlines()[-1].removeprefix("record: "))
    assert record_path.parent.parent == tmp_path / "runs"
    record = tomllib.loads(record_path.read_text())
    assert record["model"]["kind"] == "embedded" and record["model"]["parameters_total"] > 130_000_000
    assert record["evaluation"]["after"]["perplexity"] < record["evaluation"]["before"]["perplexity"]
    assert record["resume"]["status"] == "pass"
    assert record["verdict"]["status"] == "pass"
    assert record["data"]["heldout_documents"] > 0 and len(record["data"]["heldout_hash"]) == 64
    print(f"embedded LoRA acceptance: {elapsed:.0f} s, perplexity {record['evaluation']['before']['perplexity']:.2f}"
          f" -> {record['evaluation']['after']['perplexity']:.2f}")
