"""The GPU check (benchmarks/gpu_check.sh) cannot rot unseen: its dry run here, and its parts on real records."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.paths import REPO

ROOT = REPO  # the repository's top


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def llama_parameters(c: dict) -> int:
    """Parameters of a Llama config, counted from its shapes (q, k, v, o, gate, up, down, two norms per layer)."""
    h, i, layers, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    head = c.get("head_dim") or h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head
    per_layer = h * c["num_attention_heads"] * head * 2 + h * kv * 2 + 3 * h * i + 2 * h
    return v * h * (1 if c.get("tie_word_embeddings", True) else 2) + layers * per_layer + h


@pytest.fixture(scope="module")
def carried(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("whl")
    # bitsandbytes' 41 MiB CUDA wheel is left out here: the tests would download it at every run; the flag's
    # counterpart (the platform wheel's pip command) is checked on its own below
    assert _module("gpu_wheels").main(["--dest", str(dest), "--no-bitsandbytes"]) == 0
    return dest


def test_the_carried_folder_is_pure_python_wheels_at_the_tested_versions_and_the_tokenizer(carried):
    import importlib.metadata

    wheels = sorted(p.name for p in carried.glob("*.whl"))
    gpu_wheels = _module("gpu_wheels")
    assert len(wheels) == len(gpu_wheels.WHEELS)
    assert all(name.endswith("-py3-none-any.whl") for name in wheels), wheels  # any CPython 3, any platform
    assert f"textual-{importlib.metadata.version('textual')}-py3-none-any.whl" in wheels
    assert (carried / "smollm2" / "tokenizer.json").stat().st_size > 1_000_000
    assert not list((carried / "smollm2").glob("*.safetensors"))  # the weights never travel
    assert sum(p.stat().st_size for p in carried.rglob("*") if p.is_file()) < 16 * 2**20  # well under 64 MiB


@pytest.fixture(scope="module")
def bare_tree(tmp_path_factory) -> tuple[Path, Path]:
    """The tree as it travels to a GPU box (every file git tracks or would track, as ``git archive`` gives them, with
    what is not committed yet) and a Python that has every package gpuaccept needs but not gpuaccept itself: a venv
    whose site-packages reads this venv's through a ``.pth`` line (so the editable install's finder, itself a ``.pth``
    there, is not run)."""
    import shutil
    import sysconfig

    tree = tmp_path_factory.mktemp("tree")
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tree / name)
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    probe = subprocess.run([str(python), "-c", "import torch, transformers\ntry:\n import core\nexcept ImportError:"
                            "\n print('no gpuaccept')"], capture_output=True, text=True, cwd=tmp_path_factory.getbasetemp())
    assert probe.stdout.strip() == "no gpuaccept", probe.stdout + probe.stderr
    return tree, python


@pytest.mark.slow
def test_the_dry_run_runs_every_step_that_needs_no_cuda_and_marks_every_gpu_cell_not_run(carried, bare_tree,
                                                                                       tmp_path):
    """From the tree as it travels, with a Python that has the packages but not gpuaccept (the GPU box's case: its
    first run failed in every stage child with "No module named 'core'"), every step that needs no CUDA runs, a real
    acceptance on the CPU among them, and passes."""
    tree, python = bare_tree
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": str(python), "CARRIED": str(carried), "TMPDIR": str(tmp_path)}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run"], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    # the device tool brings back at most 8 files, each at most 16 MiB, none nested here
    assert len(files) <= 8 and all((out / f).is_file() and (out / f).stat().st_size < 16 * 2**20 for f in files)
    assert {"summary.json", "summary.md", "gpu_check.tar.gz", "gpu_check.log", "wizard.txt"} <= set(files), files
    summary = json.loads((out / "summary.json").read_text())
    steps = summary["steps"]
    assert summary["dry_run"] is True and summary["cuda"] is False
    assert list(steps) == ["versions", "models", "nvml", "fork", "acceptance_lora", "acceptance_fault",
                           "acceptance_full", "acceptance_qlora", "acceptance_command", "acceptance_inference",
                           "wizard", "acceptance_cpu", "accuracy"]
    # the real acceptance on the CPU: every stage child found gpuaccept in the tree, and the resume passed under the
    # test jitter, its twin measuring the noise
    cpu = steps["acceptance_cpu"]
    assert cpu["status"] == "measured" and cpu["verdict"] == "pass", cpu
    assert cpu["tier"] == "cpu-fp32-twin-noise" and cpu["test"] == {"test_jitter": 1e-3}
    assert all(t["status"] == "pass" and t["noise"] > 0 for t in cpu["tolerance"]), cpu["tolerance"]
    assert cpu["verify"]["exit"] == 3, cpu["verify"]  # unsigned, every verdict follows from its numbers
    assert steps["fork"]["status"] == "measured" and steps["fork"]["server"]["cuda_initialized"] is False
    # the carried textual was the one imported, from the temporary target, not this venv's
    assert steps["versions"]["textual_from"].endswith("/site") and str(tmp_path) in steps["versions"]["textual_from"]
    # the model directories: the shapes of their configs, the 1.2B one with the tokenizer's vocabulary
    small_config = json.loads((carried / "smollm2" / "config.json").read_text())
    big_config = json.loads((ROOT / "benchmarks" / "configs" / "llama-1.1b.json").read_text())
    big_config["vocab_size"] = small_config["vocab_size"]
    models = steps["models"]["models"]
    assert models["smollm2-135m"]["parameters"] == llama_parameters(small_config)
    assert models["llama-1.2b"]["parameters"] == llama_parameters(big_config)
    assert models["smollm2-135m"]["bytes_on_disk"] >= 2 * models["smollm2-135m"]["parameters"]  # bf16 weights
    # the dry run plans the 1.2B shape only (the GPU run writes its weights by the same code as the small one's)
    assert models["llama-1.2b"]["bytes_on_disk"] == 0 and models["llama-1.2b"]["built_on"].startswith("meta")
    for name in ("nvml", "acceptance_lora", "acceptance_fault", "acceptance_full", "acceptance_inference",
                 "acceptance_qlora", "wizard", "acceptance_command", "accuracy"):
        assert steps[name]["status"] == "not_run" and steps[name]["why"], (name, steps[name])
    for mode in ("lora", "full", "inference", "qlora"):  # each acceptance's arguments planned (flags parse, it fits)
        step = steps[f"acceptance_{mode}"]
        assert step["plan_fits"] is True and step["plan_total_bytes_estimated"] > 2 * 2**30, step
        assert ["--mode", mode] == step["arguments"][:2]
    assert "examples/train_hf.py" in steps["acceptance_command"]["command"]  # the spec it would run was accepted
    assert all(c["status"].startswith("not_measured") and c["analytic_vs_allocated_pct"] is None
               for c in steps["accuracy"]["cells"])
    assert steps["wizard"]["saved"] == ["probe-live.svg", "probe-live.txt", "probe-done.svg", "probe-done.txt"]
    assert steps["wizard"]["verdict"].startswith("PASS")
    assert steps["wizard"]["live"] == "holding memory, mid-step"  # the host backend reads the child: a real picture
    wizard = (out / "wizard.txt").read_text()
    assert "Probe" in wizard and "peak of live tensors" in wizard and "host memory" in wizard
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        members = {m.name: m.size for m in tar.getmembers()}
    assert "logs/wizard.log" in members and "accuracy/gpu_accuracy.json" in members
    assert not any(name.startswith(("models/", "site/")) for name in members)
    assert max(members.values()) <= 2 * 2**20
    table = (out / "summary.md").read_text()
    assert all(f"| {name} | {steps[name]['status']} |" in table for name in steps)


def test_without_the_carried_files_it_stops_at_once_and_says_what_to_run(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "CARRIED": str(tmp_path / "none")}
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert "make gpu-wheels" in done.stdout


def test_a_record_gives_the_summary_its_numbers(lora_record):
    record = lora_record
    facts = _module("gpu_check").record_facts(record)
    assert facts["verdict"] == record["verdict"]["status"] == "pass"
    assert facts["stages"] == {k: v["status"] for k, v in record["verdict"]["stages"].items()}
    rows = record["probe"]["plan_comparison"]
    assert [r["measured_bytes"] for r in facts["plan_vs_probe"]] == [r["measured_bytes"] for r in rows]
    assert facts["step_time_s"] == record["probe"]["step_time_s"] > 0
    assert facts["perplexity"]["after"] == record["evaluation"]["after"]["perplexity"]
    assert facts["resume"]["status"] == "pass"


def test_weights_are_dropped_from_a_run_directory_and_the_record_kept(tmp_path):
    ckpt = tmp_path / "train" / "checkpoint-4"
    ckpt.mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(b"\0" * (2**20 + 1))
    (ckpt / "optimizer.pt").write_bytes(b"\0" * (2**20 + 1))
    (ckpt / "rng_state.pth").write_bytes(b"\0" * 100)  # small: kept in the archive as evidence
    (tmp_path / "record.toml").write_text("x = 1\n")
    _module("gpu_check").drop_weights(tmp_path)
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["record.toml", "rng_state.pth"]


def test_the_accuracy_step_keeps_the_allocator_predictions_per_cell_and_tabulates_them(tmp_path, monkeypatch):
    """The caching allocator's predicted allocated / reserved / NVML used and their errors against the measured peaks
    (benchmarks/gpu_accuracy.py) survive into the check's summary and its table, not only the archived JSON: a fake
    measured cell predicting 3 GiB reserved where 2.5 GiB was measured is +20 % (gpu_accuracy's error_pct)."""
    gpu_check, error_pct = _module("gpu_check"), _module("gpu_accuracy").error_pct
    gib = 2**30
    measured = {"peak_allocated_bytes": 2 * gib, "peak_reserved_bytes": 5 * gib // 2, "nvml_used_max_bytes": 4 * gib}
    cell = {"config": "smollm2-135m", "mode": "lora", "precision": "bf16", "batch_size": 4, "seq_len": 256,
            "status": "measured", "measured": measured, "analytic_tensor_bytes": 2 * gib, "traced_peak_bytes": 2 * gib,
            "analytic_vs_allocated_pct": 0.0, "traced_vs_allocated_pct": 0.0, "analytic_total_vs_nvml_pct": 0.0,
            "predicted_allocated_bytes": 3 * gib // 2, "predicted_reserved_bytes": 3 * gib,
            "predicted_nvml_used_bytes": 5 * gib}
    cell |= {"predicted_vs_allocated_pct": error_pct(cell["predicted_allocated_bytes"], measured["peak_allocated_bytes"]),
             "predicted_vs_reserved_pct": error_pct(cell["predicted_reserved_bytes"], measured["peak_reserved_bytes"]),
             "predicted_vs_nvml_pct": error_pct(cell["predicted_nvml_used_bytes"], measured["nvml_used_max_bytes"])}
    check = gpu_check.Check(tmp_path / "out", tmp_path / "work", deadline_s=60, dry_run=False)

    def child(name, cmd, limit_s, extra_env=None):  # what benchmarks/gpu_accuracy.py would have written
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True)
        (out / "gpu_accuracy.json").write_text(json.dumps({"cuda": True, "cells": [cell]}))
        return 0, ""

    monkeypatch.setattr(check, "child", child)
    step = gpu_check.step_accuracy(check)
    (kept,) = step["cells"]
    assert step["status"] == "measured"
    assert (kept["predicted_vs_allocated_pct"], kept["predicted_vs_reserved_pct"], kept["predicted_vs_nvml_pct"]) \
        == (-25.0, 20.0, 25.0)
    assert (kept["predicted_reserved_bytes"], kept["peak_reserved_bytes"]) == (3 * gib, 5 * gib // 2)
    assert (kept["predicted_allocated_bytes"], kept["predicted_nvml_used_bytes"]) == (3 * gib // 2, 5 * gib)
    table = gpu_check.summary_table({"dry_run": False, "cuda": True, "seconds": 1.0, "steps": {"accuracy": step}})
    assert ("| smollm2-135m lora bf16 4x256 | 1.500 / 2.000 (-25.0 %) | 3.000 / 2.500 (+20.0 %) | "
            "5.000 / 4.000 (+25.0 %) |") in table


def test_a_step_with_too_little_time_left_is_not_run_and_says_so(tmp_path):
    gpu_check = _module("gpu_check")
    check = gpu_check.Check(tmp_path / "out", tmp_path / "work", deadline_s=5, dry_run=True)
    result = check.run_step("acceptance_full", lambda c: {"status": "measured"}, needs_s=120)
    assert result["status"] == "not_run" and "out of time" in result["why"]
    failing = check.run_step("nvml", lambda c: 1 / 0)
    assert failing["status"] == "failed" and "ZeroDivisionError" in failing["why"]


def test_the_carried_bitsandbytes_is_the_tested_version_for_any_cpython_on_x86_64_linux(monkeypatch, tmp_path):
    """``make gpu-wheels`` asks pip for bitsandbytes' platform wheel at the version installed here (its CUDA kernels
    are in the manylinux wheel), beside the pure-Python ones; the pip commands are read, not run (41 MiB)."""
    import importlib.metadata

    gpu_wheels = _module("gpu_wheels")
    ran: list[list[str]] = []
    monkeypatch.setattr(gpu_wheels.subprocess, "run",
                        lambda cmd, **kw: ran.append(cmd) or subprocess.CompletedProcess(cmd, 0, "", ""))
    gpu_wheels.download(tmp_path)
    pure, platform = ran
    assert "--implementation" in pure and not any(a.startswith("bitsandbytes==") for a in pure)
    assert platform[platform.index("--platform") + 1] == "manylinux_2_24_x86_64"
    assert f"bitsandbytes=={importlib.metadata.version('bitsandbytes')}" in platform
    ran.clear()
    gpu_wheels.download(tmp_path, platform_wheels=False)
    assert len(ran) == 1


def test_the_reaper_of_command_mode_starts_from_the_tree_as_it_travels(bare_tree, tmp_path):
    """On the H200 the reaper (which ends every process of a user's job if gpuaccept is killed) failed at once from the
    uninstalled tree: "No module named 'core'" in reaper.log. It now imports gpuaccept from where its parent did."""
    tree, python = bare_tree
    code = ("import sys, time; from pathlib import Path; from core.command.reaper import start_reaper; "
            "p = start_reaper(Path(sys.argv[1])); time.sleep(3); print(p.poll()); p.kill()")
    done = subprocess.run([str(python), "-c", code, str(tmp_path)], cwd=tree, capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.strip() == "None", done.stdout + done.stderr + (tmp_path / "reaper.log").read_text()
    assert "No module named" not in (tmp_path / "reaper.log").read_text()
