"""Trainers someone else wrote, accepted end to end on the CPU in command mode (issue 37), each installed by the test
set-up into a virtual environment of its own (never into gpuaccept's: it reads gpuaccept's packages, torch among them,
through a ``.pth`` file, and holds the trainer and what the trainer adds):

- TRL's ``trl sft``, built on transformers' Trainer: gpuaccept measures it from inside (the hook);
- LitGPT's ``litgpt finetune_full``, built on Lightning Fabric, not on Trainer: measured from outside, planned from
  the config file its command names, its steps read from Lightning's CSV log, its checkpoints its own
  ``step-*/lit_model.pth``, its resume its own ``--resume``, its evaluation the team's script on gpuaccept's held-out
  split (``{heldout_data}``).

Each record names the trainer's config file by its sha256; each trainer also fails the resume check when resumed from
the wrong checkpoint folder, with the evidence.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
GPUACCEPT = str(Path(sys.executable).parent / "gpuaccept")
TRAINERS = ROOT / "tests" / "data" / "trainers"
CONFIG = TRAINERS / "trl_sft.yaml"
#: the TRL this test accepts (its version is pinned here: a new one is a new acceptance)
TRL = "trl==1.16.0"
#: LitGPT and what it needs beyond gpuaccept's packages, pinned. LitGPT itself goes in without its declared
#: requirements: it pins huggingface_hub < 1.4 while the transformers beside it (which torchmetrics imports when it is
#: there) needs >= 1.31; LitGPT's fine-tuning runs with gpuaccept's (LitGPT uses the hub only to download).
LITGPT = "litgpt==0.5.13"
LITGPT_NEEDS = ("lightning==2.6.6", "jsonargparse[signatures]==4.41.0")
LITGPT_CONFIG = TRAINERS / "litgpt_full.yaml"


def own_env(root: Path, *installs: tuple[str, ...]) -> Path:
    """A virtual environment in ``root`` over gpuaccept's packages (a ``.pth`` to its site-packages), with each
    ``pip install`` argument list of ``installs`` run in turn; its ``bin`` folder."""
    env = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    python = env / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "gpuaccept-base.pth").write_text(sysconfig.get_paths()["purelib"] + "\n", encoding="utf-8")
    for words in installs:
        done = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *words],
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            pytest.fail(f"{' '.join(words)} could not be installed into its own environment: {done.stderr[-2000:]}")
    return env / "bin"


@pytest.fixture(scope="session")
def trl_env(tmp_path_factory) -> Path:
    """TRL's own environment; its ``trl``."""
    bin_dir = own_env(tmp_path_factory.mktemp("trl-env"), (TRL,))
    assert not Path(sysconfig.get_paths()["purelib"], "trl").exists(), "TRL leaked into gpuaccept's environment"
    return bin_dir / "trl"


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
    assert (rec["command"]["program_package"]["name"], rec["command"]["program_package"]["version"]) == \
        tuple(TRL.split("=="))
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


# ------------------------------------------------------------------------------------------------------------ LitGPT
@pytest.fixture(scope="session")
def litgpt(tmp_path_factory) -> dict[str, Path]:
    """LitGPT's own environment, a tiny untied Llama converted to LitGPT's checkpoint format by LitGPT's converter, and
    an instruction dataset (LitGPT's JSON format) of the documents of gpuaccept's training split: its ``litgpt``,
    ``python``, ``model`` folder and ``data`` file."""
    from core.data import check_data
    from tests.conftest import make_tiny_llama

    root = tmp_path_factory.mktemp("litgpt")
    bin_dir = own_env(root, ("--no-deps", LITGPT), LITGPT_NEEDS)
    assert not Path(sysconfig.get_paths()["purelib"], "litgpt").exists(), "LitGPT leaked into gpuaccept's environment"
    hf = make_tiny_llama(root / "hf", tie=False)
    model = root / "tiny-llama"
    subprocess.run([str(bin_dir / "python"), str(TRAINERS / "litgpt_convert.py"), str(hf), str(model)], check=True,
                   capture_output=True, timeout=300)
    data = root / "train.json"
    docs = check_data("embedded", 0.2).train
    data.write_text(json.dumps([{"instruction": f"Explain {d.doc_id}.", "input": "", "output": d.text[:600]}
                                for d in docs]), encoding="utf-8")
    return {"litgpt": bin_dir / "litgpt", "python": bin_dir / "python", "model": model, "data": data}


def accept_litgpt(lit: dict[str, Path], runs: Path, *extra: str) -> tuple[int, dict, Path, str]:
    """``gpuaccept run --headless`` over ``litgpt finetune_full``; its exit code, the record, its path and the
    output."""
    done = subprocess.run(
        [GPUACCEPT, "run", "--headless", "--runs-dir", str(runs), "--model", str(lit["model"]),
         "--command", f"{lit['litgpt']} finetune_full {{model}} --config {LITGPT_CONFIG} "
                      f"--data.json_path {lit['data']}",
         "--resume-command", "{command} --resume {checkpoint}/lit_model.pth",
         "--checkpoints", "step-*", "--metrics", "logs/csv/version_0/metrics.csv",
         "--checkpoint-files", "lit_model.pth,model_config.yaml",
         "--eval", f"{lit['python']} {TRAINERS / 'litgpt_perplexity.py'} {{checkpoint}} {{heldout_data}}", *extra],
        capture_output=True, text=True, timeout=900, cwd=runs.parent)
    path = next(runs.glob("*/record.toml"))
    return done.returncode, tomllib.loads(path.read_text(encoding="utf-8")), path, done.stdout + done.stderr


def test_litgpt_finetune_full_is_accepted_end_to_end_measured_from_outside(litgpt, tmp_path):
    rc, rec, path, said = accept_litgpt(litgpt, tmp_path / "runs")
    stages = {name: s["status"] for name, s in rec["verdict"]["stages"].items()}
    assert rc == 0 and stages == {"plan": "pass", "probe": "pass", "evaluation": "pass", "resume": "pass"}, \
        (stages, said[-3000:])
    assert rec["ran"]["view"] == "outside"
    # planned from the config file the command names, its flags over it (the checkpoint folder is the positional
    # argument), and compared with the job's sampled RSS
    plan = rec["plan"]
    assert f"your litgpt config {LITGPT_CONFIG}" in plan["method"]
    assert (plan["spec"]["mode"], plan["spec"]["batch_size"], plan["spec"]["seq_len"]) == ("full", 2, 64)
    assert plan["spec"]["model"] == str(litgpt["model"]) and "on the command line" in plan["sources"]["checkpoint_dir"]
    assert plan["ignored"]["train.max_steps"].startswith("the real run's length")
    # the command holds no {out}: each run wrote into its own folder through a copy of the config with out_dir set
    reference = path.parent / "reference"
    assert yaml.safe_load((reference / "litgpt_full.gpuaccept.yaml").read_text())["out_dir"] == str(reference / "out")
    assert (reference / "out" / "step-000006" / "lit_model.pth").is_file()
    [row] = plan["comparison"]
    assert row["device"] == "cpu" and row["measured_bytes"] == rec["probe"]["devices"][0]["measured_bytes"]
    ev = rec["evaluation"]
    assert ev["metric"] == "perplexity" and ev["after"]["value"] < ev["before"]["value"]
    assert ev["checkpoint"] == "step-000006"
    package = rec["command"]["program_package"]  # the trainer and its version, as its interpreter says
    assert (package["name"], package["version"]) == tuple(LITGPT.split("=="))
    config = next(s for s in rec["command"]["scripts"] if s["path"] == str(LITGPT_CONFIG))
    assert config["sha256"] == hashlib.sha256(LITGPT_CONFIG.read_bytes()).hexdigest()
    resume = {c["name"]: c for c in rec["resume"]["checks"]}
    assert rec["resume"]["tier"]["name"] == "cpu-fp32-exact"
    assert (rec["resume"]["checkpoint_step"], rec["resume"]["kill_step"]) == (2, 3)
    assert resume["global_steps"]["status"] == resume["loss"]["status"] == "pass"
    assert all(r["difference"] == 0 for r in rec["resume"]["comparison"])
    verify = subprocess.run([GPUACCEPT, "verify", str(path)], capture_output=True, text=True, timeout=120)
    assert verify.returncode == 3, verify.stdout


def test_litgpt_resumed_from_a_wrong_checkpoint_folder_fails_the_resume_check_with_evidence(litgpt, tmp_path):
    """The resume command's path goes one folder too far up and lands in the uninterrupted run's later checkpoint
    (step 4), not the one the killed run wrote (step 2): LitGPT resumes at step 5 and the check says so."""
    wrong = "{command} --resume {checkpoint}/../../../reference/out/step-000004/lit_model.pth"
    rc, rec, _, said = accept_litgpt(litgpt, tmp_path / "runs", "--resume-command", wrong, "--eval", "none")
    assert rc == 1 and rec["verdict"]["stages"]["resume"]["status"] == "fail", said[-3000:]
    failed = {c["name"]: c for c in rec["resume"]["checks"] if c["status"] == "fail"}
    assert list(failed) == ["global_steps"], list(failed)  # from step 4 on it continued as the uninterrupted run
    assert failed["global_steps"]["evidence"].startswith("resumed steps 5-6, expected 3-6")
