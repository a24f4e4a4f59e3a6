#!/usr/bin/env bash
# The project's one GPU check (run by the device tool on a lent GPU box, results under $OUT; about 5 minutes on an
# H200). The GPU box has torch (CUDA), transformers, peft, nvidia-ml-py and psutil; core/ needs nothing else here.
#   1. benchmarks/gpu_monitor_check.py: v1 vs v2 memory, NVML vs torch UUIDs, per-process list, MIG, a real trace;
#   2. benchmarks/gpu_accuracy.py: analytic and traced plans vs peak allocated / reserved / NVML used (12 cells).
set -u
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
timeout 120 python benchmarks/gpu_monitor_check.py --out "$OUT" 2>&1 | tee "$OUT/gpu_monitor_check.log"
timeout 420 python benchmarks/gpu_accuracy.py --out "$OUT" 2>&1 | tee "$OUT/gpu_accuracy.log"
