"""The caching allocator simulation against reserved memory measured on a GPU (issue 38), on the CPU.

The project's first GPU run (benchmarks/results/gpu/2026-12-04-first-run/call2-summary.json, an H200 with torch 2.11.0
and CUDA 13.0) measured ``max_memory_allocated`` and ``max_memory_reserved`` over two steps after a warm-up step for
six cells of the embedded model's shape (SmolLM2-135M: inference, full fine-tuning pure and amp, two micro-batch
sizes; benchmarks/gpu_accuracy.py). This script traces each cell again here (core.plan.traced: fake CPU tensors, target
cuda), replays the traced steps' allocations through core/plan/allocator.py, and compares the predicted steady-state
peaks with the measured ones. Nothing is measured here: the GPU numbers are read from the committed summary.

Run: ``.venv/bin/python benchmarks/reserved_accuracy.py`` (prints a table, writes
benchmarks/results/reserved_accuracy.json).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MEASURED = ROOT / "benchmarks" / "results" / "gpu" / "2026-12-04-first-run" / "call2-summary.json"
OUT = ROOT / "benchmarks" / "results" / "reserved_accuracy.json"
#: the torch of the GPU run measured (its summary's versions step)
TORCH_MEASURED = "2.11.0"


def main() -> int:
    from benchmarks.gpu_accuracy import load_config, spec_of
    from core.plan.context import cuda_context
    from core.plan.tracer import trace_plan
    from core.plan.workspace import cublas_workspaces

    cells = [c for c in json.loads(MEASURED.read_text())["steps"]["accuracy"]["cells"] if c.get("peak_reserved_bytes")]
    rows = []
    for cell in cells:
        spec = spec_of(cell)
        # the box measured: an H200 (compute capability 9.0) with torch 2.11.0, no CUBLAS_* variables
        blocks, how = cublas_workspaces("NVIDIA H200", spec.training, TORCH_MEASURED, {})
        traced = trace_plan(spec, load_config(cell["config"]), target="cuda", workspaces=tuple(blocks),
                            workspace_method=how)
        assert traced.reserved is not None
        # in-sample: the context's module part was fit to these very cells (core/plan/context.py)
        outside = cuda_context("NVIDIA H200", spec.training).bytes
        steady = traced.reserved.steady
        row = {k: cell[k] for k in ("config", "mode", "precision", "batch_size", "seq_len")}
        row.update(
            measured_allocated_bytes=cell["peak_allocated_bytes"], measured_reserved_bytes=cell["peak_reserved_bytes"],
            measured_nvml_used_bytes=cell["nvml_used_max_bytes"], traced_tensor_bytes=traced.peak_bytes,
            predicted_allocated_bytes=steady.peak_allocated, predicted_reserved_bytes=traced.reserved.peak_reserved,
            reserved_error_pct=round(100 * (traced.reserved.peak_reserved / cell["peak_reserved_bytes"] - 1), 2),
            slack_measured_bytes=cell["peak_reserved_bytes"] - cell["peak_allocated_bytes"],
            slack_predicted_bytes=traced.reserved.peak_reserved - steady.peak_allocated,
            allocated_error_pct=round(100 * (steady.peak_allocated / cell["peak_allocated_bytes"] - 1), 2),
            traced_tensors_error_pct=round(100 * (traced.peak_bytes / cell["peak_allocated_bytes"] - 1), 2),
            predicted_nvml_used_bytes=traced.reserved.peak_reserved + outside,
            nvml_used_error_pct=round(100 * ((traced.reserved.peak_reserved + outside)
                                             / cell["nvml_used_max_bytes"] - 1), 2),
            outside_allocator_measured_bytes=cell["nvml_used_max_bytes"] - cell["peak_reserved_bytes"])
        rows.append(row)
        gib = 2**30
        print(f"{row['mode']:9} {row['precision']:4} {row['batch_size']}x{row['seq_len']:<4} allocated "
              f"{row['allocated_error_pct']:+.1f} % (tensors alone {row['traced_tensors_error_pct']:+.1f} %); NVML used "
              f"{row['nvml_used_error_pct']:+.1f} %; reserved predicted "
              f"{row['predicted_reserved_bytes'] / gib:.3f} vs measured {row['measured_reserved_bytes'] / gib:.3f} GiB "
              f"({row['reserved_error_pct']:+.1f} %); slack predicted {row['slack_predicted_bytes'] / 2**20:.0f} vs "
              f"measured {row['slack_measured_bytes'] / 2**20:.0f} MiB", flush=True)
    OUT.write_text(json.dumps({"measured_from": str(MEASURED.relative_to(ROOT)), "cells": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
