"""Trainers someone else wrote, accepted end to end on the CPU in command mode (issue 37): TRL's ``trl sft``, installed
by the test set-up into a virtual environment of its own (never into gpuaccept's: it reads gpuaccept's packages, torch
and transformers among them, through a ``.pth`` file, and holds TRL and what TRL adds). TRL is built on transformers'
Trainer, so gpuaccept measures it from inside (the hook); the config file's sha256 and TRL's version are in the record.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPUACCEPT = str(Path(sys.executable).parent / "gpuaccept")
CONFIG = ROOT / "tests" / "data" / "trainers" / "trl_sft.yaml"
#: the TRL this test accepts (its version is pinned here: a new one is a new acceptance)
TRL = "trl==1.16.0"


@pytest.fixture(scope="session")
def trl_env(tmp_path_factory) -> Path:
    """A virtual environment with TRL, over gpuaccept's packages (a ``.pth`` to its site-packages); its ``trl``."""
    env = tmp_path_factory.mktemp("trl-env") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    python = env / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "gpuaccept-base.pth").write_text(sysconfig.get_paths()["purelib"] + "\n", encoding="utf-8")
    done = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", TRL],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        pytest.fail(f"{TRL} could not be installed into its own environment: {done.stderr[-2000:]}")
    assert not Path(sysconfig.get_paths()["purelib"], "trl").exists(), "TRL leaked into gpuaccept's environment"
    return env / "bin" / "trl"


def accept(trl: Path, model: Path, runs: Path, *extra: str) -> tuple[int, dict, Path]:
    """``gpuaccept run --headless`` over ``trl sft``; its exit code, the record (parsed) and its path."""
    done = subprocess.run(
        [GPUACCEPT, "run", "--headless", "--runs-dir", str(runs), "--model", str(model),
         "--command", f"{trl} sft --config {CONFIG} --model_name_or_path {{model}} --output_dir {{out}} "
                      "--dataset_name {train_data_dir}", *extra],
        capture_output=True, text=True, timeout=900, cwd=runs.parent,
        env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    path = next(runs.glob("*/record.toml"))
    return done.returncode, tomllib.loads(path.read_text(encoding="utf-8")), path


def test_trl_sft_is_accepted_end_to_end_measured_from_inside(trl_env, tiny_model_dir, tmp_path):
    rc, rec, path = accept(trl_env, tiny_model_dir, tmp_path / "runs")
    stages = {name: s["status"] for name, s in rec["verdict"]["stages"].items()}
    assert rc == 0 and stages == {"plan": "pass", "probe": "pass", "evaluation": "pass", "resume": "pass"}, stages
    assert rec["ran"]["view"] == "inside" and rec["ran"]["libraries"]["trl"] == TRL.split("==")[1]
    assert rec["plan"]["spec"]["mode"] == "lora" and rec["plan"]["spec"]["lora"]["r"] == 4  # planned from what ran
    config = next(s for s in rec["command"]["scripts"] if s["path"] == str(CONFIG))
    assert config["sha256"] == hashlib.sha256(CONFIG.read_bytes()).hexdigest()
    resume = {c["name"]: c["status"] for c in rec["resume"]["checks"]}
    assert resume["trainer_state"] == resume["global_steps"] == resume["loss"] == "pass"
    verify = subprocess.run([GPUACCEPT, "verify", str(path)], capture_output=True, text=True, timeout=120)
    assert verify.returncode == 3, verify.stdout  # unsigned, every verdict follows from the record's numbers


def test_trl_resumed_from_a_wrong_checkpoint_folder_fails_the_resume_check_with_evidence(trl_env, tiny_model_dir,
                                                                                       tmp_path):
    """The resume command points at the uninterrupted run's later checkpoint (a stale folder, as a copy-pasted path
    does), not the one the killed run wrote: the resumed run starts at step 4, not 2, and the check says so."""
    wrong = "{command} --resume_from_checkpoint {out}/../../reference/out/checkpoint-4 --run_name {checkpoint}"
    rc, rec, _ = accept(trl_env, tiny_model_dir, tmp_path / "runs", "--resume-command", wrong, "--eval", "none")
    assert rc == 1 and rec["verdict"]["stages"]["resume"]["status"] == "fail"
    failed = {c["name"]: c for c in rec["resume"]["checks"] if c["status"] == "fail"}
    assert "global_steps" in failed, list(failed)
    assert "the resumed Trainer began at global step 4" in failed["global_steps"]["evidence"]
