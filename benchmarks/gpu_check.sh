#!/usr/bin/env bash
# The project's one GPU check, in one call of at most 8 minutes on one H200 (benchmarks/README.md says what it measures).
#
#   here, once:  make gpu-wheels             # .whl/: textual, tomli-w and what textual needs; the SmolLM2 tokenizer
#   GPU box:     bash benchmarks/gpu_check.sh             # results under $OUT (default benchmarks/results/gpu)
#   here / CI:   bash benchmarks/gpu_check.sh --dry-run   # every step that needs no CUDA; GPU cells "not_run"
#
# The box has torch (CUDA), transformers, peft, accelerate, nvidia-ml-py, psutil, safetensors and tokenizers; the
# carried wheels are installed into a temporary target put first on PYTHONPATH (nothing is installed system-wide).
# Exit status: 0 when no step failed (a step not run for want of a GPU or of time is not a failure), 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results/gpu}
CARRIED=${CARRIED:-.whl}
DEADLINE_S=${DEADLINE_S:-450}
mkdir -p "$OUT"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
{
  echo "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname): $*"
  if ! ls "$CARRIED"/*.whl >/dev/null 2>&1 || [ ! -f "$CARRIED/smollm2/tokenizer.json" ]; then
    echo "gpu_check: $CARRIED/ has no wheels or no smollm2/tokenizer.json: run 'make gpu-wheels' here and carry $CARRIED"
    exit 2
  fi
  if ! "$PYTHON" -c "import torch, transformers, peft" >/dev/null 2>&1; then
    echo "gpu_check: $PYTHON cannot import torch, transformers and peft; give the interpreter that has them:"
    echo "  PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh --dry-run   (here; the GPU box's python3 has them)"
    exit 2
  fi
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
    "$CARRIED"/*.whl || { echo "gpu_check: installing the carried wheels failed"; exit 2; }
  echo "carried wheels installed into $WORK/site: $(cd "$WORK/site" && ls -d *.dist-info | tr '\n' ' ')"
  export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$PYTHON" benchmarks/gpu_check.py --out "$OUT" --work "$WORK" --carried "$CARRIED" --deadline-s "$DEADLINE_S" "$@"
} 2>&1 | tee "$OUT/gpu_check.log"
