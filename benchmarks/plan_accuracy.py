"""How close the analytic plan is to the traced one, over a matrix of cells, and both to real steps where they run here.

The matrix (60 cells): 3 model shapes (the embedded SmolLM2-135M, a ~1.1B Llama with TinyLlama's shape, and Qwen2.5-0.5B
from the Qwen2 family: qkv biases, a 152k vocabulary) x

- training (48 cells): full fine-tuning / LoRA (r 8, q/v) x precision amp / pure (bf16) x gradient checkpointing off / on
  x 2 sizes (micro-batch 1 x 256 and 4 x 512 tokens);
- inference (12 cells): fp32 / bf16 x the same 2 sizes.

Each cell is planned for one CUDA device (an 80 GiB box) and traced for it (``foreach`` AdamW as torch picks on CUDA)
on fake tensors. Reported per cell: the analytic peak of tensors (the plan's total without its CUDA-context line)
against the traced peak, ``analytic / traced - 1``, and the phase each puts the peak in; per mode the median and
largest ``|analytic / traced - 1|``. Targets for training cells: median at most 5 %, largest at most 15 %; every cell
that misses is named.

The trace is not the truth either. For the embedded shape's cells, which run on this CPU, both plans are also
compared with the probe's measured peak of live tensors in real Trainer steps (the plans made for the CPU device:
per-tensor AdamW, as torch picks there). ``--no-probe`` skips that part (about 10 minutes on 2 cores).

Run: ``.venv/bin/python benchmarks/plan_accuracy.py [--no-probe]`` (writes benchmarks/results/plan_accuracy.json and
prints the table that is in benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = {"smollm2-135m": "smollm2-135m", "llama-1.1b": str(ROOT / "benchmarks/configs/llama-1.1b.json"),
          "qwen2-0.5b": str(ROOT / "benchmarks/configs/qwen2-0.5b.json")}
SIZES = ((1, 256), (4, 512))
TARGET_MEDIAN, TARGET_LARGEST = 0.05, 0.15
GiB = 2**30


@dataclasses.dataclass
class Cell:
    shape: str
    mode: str
    dtype: str
    precision: str
    checkpointing: bool
    batch: int
    seq: int
    analytic_bytes: int = 0
    traced_bytes: int = 0
    analytic_phase: str = ""
    traced_phase: str = ""
    probe_bytes: int | None = None
    probe_analytic_bytes: int | None = None
    probe_traced_bytes: int | None = None

    @property
    def name(self) -> str:
        what = self.mode if self.mode == "inference" else f"{self.mode} {self.precision}"
        return (f"{self.shape} {what} {self.dtype}{' ckpt' if self.checkpointing else ''} "
                f"{self.batch}x{self.seq}")

    @property
    def error(self) -> float:
        return self.analytic_bytes / self.traced_bytes - 1

    def spec(self, devices: str):
        from core.spec import RunSpec

        return RunSpec.build(model=SHAPES[self.shape], mode=self.mode, dtype=self.dtype, precision=self.precision,
                             gradient_checkpointing=self.checkpointing, batch_size=self.batch, seq_len=self.seq,
                             devices=devices, probe_steps=2, **({"steps": 0} if self.mode == "inference" else {}))


def cells() -> list[Cell]:
    out = []
    for shape in SHAPES:
        for mode in ("full", "lora"):
            for precision in ("amp", "pure"):
                for ckpt in (False, True):
                    for b, s in SIZES:
                        out.append(Cell(shape, mode, "bf16", precision, ckpt, b, s))
        for dtype in ("fp32", "bf16"):
            for b, s in SIZES:
                out.append(Cell(shape, "inference", dtype, "pure", False, b, s))
    return out


def plan_and_trace(cell: Cell, configs: dict) -> None:
    from core.plan.devices import detect_devices
    from core.plan.memory import plan_memory
    from core.plan.tracer import trace_plan

    spec = cell.spec("80GiB")
    plan = plan_memory(spec, configs[cell.shape], detect_devices(spec.devices))
    device = plan.devices[0]
    cell.analytic_bytes = device.total_bytes - device.lines["overhead"].bytes
    cell.analytic_phase = device.peak_phase.name
    traced = trace_plan(spec, configs[cell.shape], target="cuda")
    cell.traced_bytes, cell.traced_phase = traced.peak_bytes, traced.peak_phase


def probe(cell: Cell, configs: dict, runs: Path) -> None:
    """Real Trainer steps on this CPU (the probe stage), and both plans made for the CPU device."""
    from core.pipeline import AcceptanceRun
    from core.plan.tracer import trace_plan

    spec = cell.spec("cpu")
    run = AcceptanceRun(spec, runs, traced={"status": "not_run", "reason": "benchmark"})
    for _ in run.probe_stage():
        pass
    result = run.results["probe"]
    run.close()
    cell.probe_bytes = result.devices[0].peak_bytes
    device = run.ctx.plan.devices[0]
    cell.probe_analytic_bytes = device.total_bytes - device.lines["overhead"].bytes  # tensors: the runtime is not one
    cell.probe_traced_bytes = trace_plan(spec, configs[cell.shape], target="cpu").peak_bytes


def summary(rows: list[Cell]) -> dict:
    out = {}
    for mode in ("full", "lora", "inference"):
        errors = [abs(c.error) for c in rows if c.mode == mode]
        out[mode] = {"cells": len(errors), "median_abs_error": statistics.median(errors), "largest_abs_error": max(errors)}
    training = [abs(c.error) for c in rows if c.mode != "inference"]
    out["training"] = {"cells": len(training), "median_abs_error": statistics.median(training),
                       "largest_abs_error": max(training),
                       "target": f"median <= {TARGET_MEDIAN:.0%}, largest <= {TARGET_LARGEST:.0%}",
                       "met": statistics.median(training) <= TARGET_MEDIAN and max(training) <= TARGET_LARGEST,
                       "misses": [c.name for c in rows if c.mode != "inference" and abs(c.error) > TARGET_LARGEST]}
    return out


def table(rows: list[Cell]) -> str:
    lines = ["| cell | analytic GiB | traced GiB | analytic / traced - 1 | peak phase (analytic / traced) | probe GiB "
             "(CPU) | analytic, traced vs probe |", "|---|---|---|---|---|---|---|"]
    for c in rows:
        probe = (f"{c.probe_bytes / GiB:.3f} | {c.probe_analytic_bytes / c.probe_bytes - 1:+.2%}, "
                 f"{c.probe_traced_bytes / c.probe_bytes - 1:+.2%}") if c.probe_bytes else "— | —"
        lines.append(f"| {c.name} | {c.analytic_bytes / GiB:.3f} | {c.traced_bytes / GiB:.3f} | {c.error:+.2%} | "
                     f"{c.analytic_phase} / {c.traced_phase} | {probe} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-probe", action="store_true", help="skip the real steps on this CPU")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    from core.models import ensure_embedded_cache, load_config, resolve_model

    configs = {name: load_config(resolve_model(model)) for name, model in SHAPES.items()}
    rows = cells()
    started = time.perf_counter()
    for i, cell in enumerate(rows, 1):
        plan_and_trace(cell, configs)
        print(f"[{i}/{len(rows)}] {cell.name}: analytic {cell.analytic_bytes / GiB:.3f} GiB, traced "
              f"{cell.traced_bytes / GiB:.3f} GiB ({cell.error:+.2%})", flush=True)
    trace_s = time.perf_counter() - started
    if not args.no_probe:
        ensure_embedded_cache()
        with tempfile.TemporaryDirectory(prefix="gpuaccept-accuracy-") as tmp:
            for cell in (c for c in rows if c.shape == "smollm2-135m"):
                probe(cell, configs, Path(tmp))
                print(f"probe {cell.name}: measured {cell.probe_bytes / GiB:.3f} GiB, analytic "
                      f"{cell.probe_analytic_bytes / cell.probe_bytes - 1:+.2%}, traced "
                      f"{cell.probe_traced_bytes / cell.probe_bytes - 1:+.2%}", flush=True)
    result = {"summary": summary(rows), "seconds": {"plan_and_trace": trace_s, "all": time.perf_counter() - started},
              "cells": [dataclasses.asdict(c) | {"name": c.name, "error": c.error} for c in rows]}
    out = ROOT / "benchmarks/results/plan_accuracy.json"
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(table(rows))
    print(json.dumps(result["summary"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
