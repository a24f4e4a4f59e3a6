"""Plan accuracy on a real GPU: analytic and traced plans against measured peak allocated, reserved and NVML used.

Matrix: inference / full fine-tuning / LoRA (r 8, q/v) x two micro-batch sizes (4 x 256 and 8 x 512) x two configs in
benchmarks/configs/ (the embedded model's shape, SmolLM2-135M, and a ~1.1B Llama shape), random-initialised (memory per
component does not depend on the values), bf16; training in both precisions (pure: the model in bf16, LoRA adapters
fp32; amp: fp32 weights), under bf16 autocast as Trainer runs it.

Each cell runs in its own child process (a fresh CUDA context, so peaks do not leak between cells), forked from
gpuaccept's fork server (core/forkserver.py: torch and transformers imported once, CUDA initialised after the fork)
while the parent traces the cell's plan on the CPU: build the model on the GPU, one warm-up step (creates the optimizer states), ``torch.cuda.reset_peak_memory_stats()``, two measured
steps; it reports ``max_memory_allocated``, ``max_memory_reserved`` and the largest NVML "used" (v2 memory info,
sampled at 50 Hz during the measured steps) of the device. The parent makes the analytic plan (core.plan.memory) and the
traced plan (core.plan.traced, fake CPU tensors, target cuda) of the same cell and writes both errors in percent:

- analytic tensors (plan total without the overhead line) vs peak allocated;
- traced peak vs peak allocated (target: within 3 %; analytic within 10 %);
- analytic total with overhead vs NVML used (the overhead line is an estimate of the CUDA context + workspace).

The step is the traced step: the loss from ``labels`` inside the model, no attention mask (full blocks), AdamW with
torch's default (foreach on CUDA), ``zero_grad(set_to_none=True)``; inference is one forward under ``no_grad`` with the
KV cache.

Run on a GPU box: ``python benchmarks/gpu_accuracy.py --out DIR`` (writes DIR/gpu_accuracy.json and prints a table;
needs torch with CUDA, transformers, peft, nvidia-ml-py; not textual). Without CUDA it plans and traces every cell and
says that nothing was measured (``--cells N`` limits the matrix for a quick try).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CONFIGS = {"smollm2-135m": ROOT / "benchmarks" / "configs" / "smollm2-135m.json",
           "llama-1.1b": ROOT / "benchmarks" / "configs" / "llama-1.1b.json"}
SIZES = ((4, 256), (8, 512))
MODES = ("inference", "full", "lora")


def cells() -> list[dict]:
    """Every cell, those not yet measured on a GPU first (the first GPU run measured the small model's inference and
    full fine-tuning cells), so that a run that ends at its deadline measures what is least known."""
    every = [{"config": name, "mode": mode, "precision": precision, "batch_size": b, "seq_len": s}
             for name in CONFIGS for mode in MODES for precision in (("pure",) if mode == "inference" else ("pure", "amp"))
             for b, s in SIZES]
    measured_before = {("smollm2-135m", "inference"), ("smollm2-135m", "full")}
    return sorted(every, key=lambda c: ((c["config"], c["mode"]) in measured_before, c["config"] != "llama-1.1b",
                                        c["batch_size"]))


def spec_of(cell: dict):
    from core.spec import RunSpec

    return RunSpec.build(None, model=str(CONFIGS[cell["config"]]), mode=cell["mode"], dtype="bf16",
                         precision=cell.get("precision", "pure"), batch_size=cell["batch_size"],
                         seq_len=cell["seq_len"], devices="0")


def load_config(name: str):
    from transformers import AutoConfig

    values = json.loads(CONFIGS[name].read_text())
    return AutoConfig.for_model(values.pop("model_type"), **values)


# ----------------------------------------------------------------------------------------------- child: measure one
def measure(cell: dict) -> dict:
    import torch

    from core.plan.tracer import (
        _optimizer,  # the traced plan's own optimizer choice (AdamW, foreach as torch picks)
    )

    spec = spec_of(cell)
    config = load_config(cell["config"])
    device = torch.device("cuda", 0)
    nvml = _Nvml(0)
    from transformers import AutoModelForCausalLM

    from core.dtypes import torch_dtype_name
    from core.methods.lora import lora_config

    dtype = getattr(torch, torch_dtype_name(spec.param_dtype))  # pure: bf16; amp: fp32 master weights
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=spec.attn_implementation)
    if spec.mode == "lora":
        from peft import get_peft_model

        model = get_peft_model(model, lora_config(spec.lora))
    ids = torch.randint(0, config.vocab_size, (spec.batch_size, spec.seq_len), device=device)
    if spec.training:
        model.train()
        model.config.use_cache = False
        optimizer = _optimizer(spec, model, foreach=True)
    else:
        model.eval()
        model.requires_grad_(False)
        optimizer = None

    def step() -> None:
        if optimizer is None:
            with torch.no_grad():
                out = model(input_ids=ids, labels=ids)
                del out
            return
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        del out
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up: optimizer states, cuBLAS handles, autotuning
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    nvml.start()
    t0 = time.perf_counter()
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / 2
    nvml_used = nvml.stop()
    return {
        "peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
        "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
        "nvml_used_max_bytes": nvml_used,
        "step_s": seconds,
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }


class _Nvml:
    """The largest NVML "used" (v2 memory info) of one device while sampling at 50 Hz; None when NVML is unavailable."""

    def __init__(self, index: int) -> None:
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            uuid = _cuda_uuid(index)
            handle = None
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                got = pynvml.nvmlDeviceGetUUID(h)
                got = got.decode() if isinstance(got, bytes) else got
                if uuid is None or got.replace("GPU-", "") == uuid.replace("GPU-", ""):
                    handle = h
                    break
            self._read = (lambda: int(pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2).used)) \
                if handle is not None else None
        except Exception:  # noqa: BLE001 - NVML missing: the NVML column says so
            self._read = None

    def start(self) -> None:
        if self._read is None:
            return

        def loop() -> None:
            while not self._stop.is_set():
                used = self._read()
                self.peak = used if self.peak is None else max(self.peak, used)
                time.sleep(0.02)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self) -> int | None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            used = self._read()
            self.peak = used if self.peak is None else max(self.peak, used)
        return self.peak


def _cuda_uuid(index: int) -> str | None:
    import torch

    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    return None if uuid is None else str(uuid)


# ------------------------------------------------------------------------------------------------ parent: the matrix
def plan_cell(cell: dict, cuda: bool) -> dict:
    from core.plan.devices import DeviceInfo
    from core.plan.memory import plan_memory
    from core.plan.traced import workspaces_of
    from core.plan.tracer import trace_plan

    spec = spec_of(cell)
    config = load_config(cell["config"])
    device = DeviceInfo("cuda:0", "cuda", _gpu_name() if cuda else "GPU", None, "not needed for accuracy")
    plan = plan_memory(spec, config, [device]).devices[0]
    blocks, how = workspaces_of(spec, device, config)  # cuBLAS's and cuDNN's workspaces here (core/plan/workspace.py)
    traced = trace_plan(spec, config, target="cuda", workspaces=blocks, workspace_method=how)
    tensors = plan.total_bytes - plan.lines["overhead"].bytes
    reserved = traced.reserved
    assert reserved is not None
    return {"analytic_total_bytes": plan.total_bytes, "analytic_tensor_bytes": tensors,
            "analytic_components": {k: line.bytes for k, line in plan.lines.items()},
            "traced_peak_bytes": traced.peak_bytes, "traced_components": traced.components,
            "traced_s": round(traced.seconds, 2),
            # the caching allocator's replay (core/plan/allocator.py): the steady state's peaks, and NVML used as
            # reserved + the overhead line
            "predicted_allocated_bytes": reserved.steady.peak_allocated,
            "predicted_reserved_bytes": reserved.peak_reserved,
            "predicted_nvml_used_bytes": reserved.peak_reserved + plan.lines["overhead"].bytes,
            "workspace_method": how}


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0)


class _Child:
    """One cell's measurement in a child process: forked from the fork server, else a fresh interpreter."""

    def __init__(self, cell: dict, log: Path) -> None:
        from core import forkserver
        from core.interpreter import child_env

        self.log = log
        env = {**child_env(), "TRANSFORMERS_VERBOSITY": "error"}
        argv = ["--one", json.dumps(cell)]
        self.proc = forkserver.start(None, argv, log, env, cwd=str(ROOT), path=str(Path(__file__).resolve()))
        if self.proc is None:
            with open(log, "ab") as fh:
                self.proc = subprocess.Popen([sys.executable, __file__, *argv], stdout=fh, stderr=subprocess.STDOUT,
                                             env=env, start_new_session=True)

    def result(self) -> tuple[int | None, dict | None]:
        try:
            code = self.proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            return None, None
        lines = [line for line in self.log.read_text(errors="replace").splitlines() if line.startswith("{")]
        return code, (json.loads(lines[-1]) if code == 0 and lines else None)

    def tail(self) -> list[str]:
        return self.log.read_text(errors="replace").strip().splitlines()[-3:]


def measure_in_child(cell: dict) -> _Child:
    import tempfile

    return _Child(cell, Path(tempfile.mkdtemp(prefix="gpu-accuracy-")) / "cell.log")


def error_pct(estimate: int, measured: int | None) -> float | None:
    return None if not measured else round(100.0 * (estimate - measured) / measured, 2)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", help="folder for gpu_accuracy.json (default: benchmarks/results/ when a GPU measured; "
                                      "nothing is written without one unless --out is given)")
    parser.add_argument("--cells", type=int, default=0, help="only the first N cells (0: all)")
    parser.add_argument("--deadline-s", type=float, default=0.0,
                        help="start no cell once this many seconds have passed less the slowest cell so far (0: none)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(json.loads(args.one))))
        return 0
    import torch

    cuda = torch.cuda.is_available()
    rows = []
    started, slowest = time.monotonic(), 0.0
    for cell in cells()[: args.cells or None]:
        if args.deadline_s and time.monotonic() - started + slowest > args.deadline_s:
            rows.append({**cell, "status": "not_run (out of time)"})
            continue
        cell_started = time.monotonic()
        child = measure_in_child(cell) if cuda else None  # on the GPU while the plan is traced here
        row = {**cell, **plan_cell(cell, cuda)}
        if child is not None:
            code, m = child.result()
            if m is not None:
                row.update(measured=m, status="measured",
                           analytic_vs_allocated_pct=error_pct(row["analytic_tensor_bytes"], m["peak_allocated_bytes"]),
                           traced_vs_allocated_pct=error_pct(row["traced_peak_bytes"], m["peak_allocated_bytes"]),
                           analytic_total_vs_nvml_pct=error_pct(row["analytic_total_bytes"], m["nvml_used_max_bytes"]),
                           predicted_vs_allocated_pct=error_pct(row["predicted_allocated_bytes"],
                                                                m["peak_allocated_bytes"]),
                           predicted_vs_reserved_pct=error_pct(row["predicted_reserved_bytes"],
                                                               m["peak_reserved_bytes"]),
                           predicted_vs_nvml_pct=error_pct(row["predicted_nvml_used_bytes"], m["nvml_used_max_bytes"]))
            else:
                row.update(status="error", error=child.tail(), exit=code)
        else:
            row["status"] = "not_measured (no CUDA device here: planned and traced only)"
        rows.append(row)
        slowest = max(slowest, time.monotonic() - cell_started)
        _print_row(row)
    if not cuda and not args.out:
        print("no CUDA device: nothing measured, nothing written (the GPU path is unverified here)")
        return 0
    out = Path(args.out or ROOT / "benchmarks" / "results")
    out.mkdir(parents=True, exist_ok=True)
    result = {"cuda": cuda, "torch": torch.__version__, "cells": rows,
              "targets": "traced within 3 %, analytic within 10 % of peak allocated"}
    (out / "gpu_accuracy.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _print_row(row: dict) -> None:
    gib = 2**30
    head = f"{row['config']:<13} {row['mode']:<9} {row.get('precision', ''):<4} {row['batch_size']}x{row['seq_len']:<4}"
    est = f"analytic {row['analytic_tensor_bytes'] / gib:7.3f}  traced {row['traced_peak_bytes'] / gib:7.3f}"
    if row.get("status") == "measured":
        m = row["measured"]
        print(f"{head} {est}  allocated {m['peak_allocated_bytes'] / gib:7.3f}  reserved "
              f"{m['peak_reserved_bytes'] / gib:7.3f}  analytic {row['analytic_vs_allocated_pct']:+6.1f}%  traced "
              f"{row['traced_vs_allocated_pct']:+6.1f}%  predicted allocated {row['predicted_vs_allocated_pct']:+6.1f}% "
              f"reserved {row['predicted_vs_reserved_pct']:+6.1f}% NVML used {row['predicted_vs_nvml_pct']:+6.1f}%",
              flush=True)
    else:
        print(f"{head} {est}  {row['status']}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
