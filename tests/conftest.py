"""Shared fixtures: a tiny randomly initialised Llama with the embedded model's tokenizer, and test isolation."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Under ``make test`` (two pytest-xdist workers on a 2-core machine) every torch process runs one thread: two workers,
# each starting child processes, on two cores; torch's default (a thread per core in each process) oversubscribes the
# cores and OpenMP's waiting threads slow every run. Set before torch is imported; child processes inherit it. The
# processes of one run (the resume check's bit-exact tier) all get the same count.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# Snapshots and colours must not depend on the developer's terminal.
os.environ.pop("NO_COLOR", None)
os.environ.pop("TEXTUAL_THEME", None)
os.environ.pop("SSH_AUTH_SOCK", None)  # the export screen names the ssh-agent's keys: none in tests


def make_tiny_llama(path: Path, *, tie: bool = True, seed: int = 0, hidden: int = 32, intermediate: int = 64) -> Path:
    """Save a tiny random Llama (hidden 32, 2 layers unless given) with the embedded SmolLM2 tokenizer to ``path``.

    The vocabulary must match the tokenizer (49,152), so the embedding dominates its ~1.6M parameters.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from core.models import ensure_embedded_cache

    src = ensure_embedded_cache()
    tok = AutoTokenizer.from_pretrained(src)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tie,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


#: the settings a traced step never reads (core/plan/traced.py and the meta model it builds read the model, mode, dtype,
#: precision, attention, padding, micro-batch, sequence length, accumulation, optimizer, learning rate, checkpointing,
#: seed and LoRA settings): the schedule, the data, the evaluation and the resume check
UNTRACED_SETTINGS = ("steps", "probe_steps", "warmup_steps", "lr_scheduler", "data", "heldout_fraction",
                     "eval_max_blocks", "resume", "torchrun")


def _memoise_traces() -> None:
    """Trace each step once per test process: a pipeline's plan stage traces its step on fake tensors in a child
    process (core.plan.traced.trace_in_child, ~6 s of which 5 are imports); the trace of equal traced settings on the
    same model is the same (fake tensors, no data), so a later pipeline of a test gets the earlier one's. The trace
    itself, its child process and their failures are tested by tests/unit/test_traced.py, tests/integration/test_cli.py
    (``plan --traced``), test_host_limits.py (its orphaned child) and every first trace of a spec; the pipelines started
    as ``gpuaccept`` processes and the end-to-end pair trace for themselves."""
    import copy
    import json

    import core.plan.traced as traced

    original = traced.trace_in_child
    if getattr(original, "_gpuaccept_memo", False):
        return
    done: dict[str, object] = {}

    def trace_in_child(spec, config, target, cancelled=None, timeout_s=600.0, workspaces=(), workspace_method=""):
        key = json.dumps([target, {k: v for k, v in spec.to_dict().items() if k not in UNTRACED_SETTINGS},
                          list(workspaces)], sort_keys=True, default=str)  # the config is spec.model's
        if key not in done:  # a failure raises, and is not kept
            done[key] = original(spec, config, target, cancelled, timeout_s, workspaces, workspace_method)
        return copy.deepcopy(done[key])

    trace_in_child._gpuaccept_memo = True  # type: ignore[attr-defined]
    traced.trace_in_child = trace_in_child


_memoise_traces()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def lora_run(tiny_model_dir, tmp_path_factory):
    """The whole pipeline once on the tiny model (LoRA, accumulation 2, cosine with warmup): spec, record, events."""
    import tomllib

    from core.events import RunFinished
    from core.pipeline import run_pipeline
    from core.spec import RunSpec
    from tests.records import LORA

    spec = RunSpec.build(model=str(tiny_model_dir), **LORA)
    events = list(run_pipeline(spec, runs_root=tmp_path_factory.mktemp("runs")))
    assert isinstance(events[-1], RunFinished)
    record = tomllib.loads(Path(events[-1].record_path).read_text())
    return spec, record, events


@pytest.fixture
def lora_record() -> dict:
    """The committed record of ``lora_run``'s spec (tests/records.py): for the tests that read a record, no run."""
    from tests.records import committed

    return committed("lora")


# ------------------------------------------------------------------------------------------ unit vs integration
#: the processes that make a test an integration test: gpuaccept's child (the worker, the traced plan), torchrun's
#: ranks, the console script, a terminal. A short helper process (``python -c`` for an import check, ``ssh-keygen``)
#: keeps a test a unit test.
INTEGRATION_PROCESSES = ("core.child.worker", "core.child.checkpoint_eval", "core.plan.tracer", "torch.distributed.run")  # run with python -m
_started: dict[str, list[str]] = {}
_current: list[str | None] = [None]


def _integration_process(argv: list[str]) -> bool:
    """``python -m core.child.worker ...``, ``torchrun ...``, ``gpuaccept ...``, ``tmux ...`` (a module's name inside a
    ``python -c`` import check does not count)."""
    modules = {argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "-m"}
    programs = {Path(a).name for a in argv[:1]}
    return bool(modules & set(INTEGRATION_PROCESSES) or programs & {"torchrun", "tmux", "gpuaccept"})


def _watch_processes() -> None:
    """Note, per test, every integration process it starts, from its own threads too (tests/unit/conftest.py fails a
    unit test that does)."""
    import subprocess
    import threading

    original = subprocess.Popen.__init__
    if getattr(original, "_gpuaccept_watch", False):
        return

    def init(self, args, *rest, **kwargs):
        argv = [str(a) for a in args] if isinstance(args, (list, tuple)) else [str(args)]
        # a thread belongs to the test that started it: a worker thread of an earlier test that starts a process
        # late is that test's, never the one running now
        owner = getattr(threading.current_thread(), "_gpuaccept_test", _current[0])
        if owner is not None and _integration_process(argv):
            _started.setdefault(owner, []).append(" ".join(argv[:6]))
        return original(self, args, *rest, **kwargs)

    init._gpuaccept_watch = True  # type: ignore[attr-defined]
    subprocess.Popen.__init__ = init  # type: ignore[method-assign]

    start = threading.Thread.start

    def start_owned(self, *args, **kwargs):
        self._gpuaccept_test = getattr(threading.current_thread(), "_gpuaccept_test", _current[0])
        return start(self, *args, **kwargs)

    threading.Thread.start = start_owned  # type: ignore[method-assign]


_watch_processes()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _current[0] = item.nodeid  # session fixtures set up for this test count as this test's


def started_integration_processes(nodeid: str) -> list[str]:
    """The integration processes the test ``nodeid`` started (its fixtures' set-up included)."""
    return _started.get(nodeid, [])


# ---------------------------------------------------------------------------------------- two workers (make test)
#: the longest file, started first so that nothing waits for it at the end
FIRST = "test_e2e_embedded.py"
#: long tests spread over the workers early (after the two longest chains), so that none is left for the end
EARLY = ("test_command_mode.py", "test_tmux.py", "test_third_party.py")


def _xdist_group(item: pytest.Item) -> str | None:
    """The group a test runs in under ``--dist loadgroup``: ``lora_run`` for the tests sharing that one pipeline run,
    its file for a test with a module-scoped fixture (which then runs once) or a snapshot (syrupy judges a snapshot
    file unused unless one worker ran all its tests), none for the rest (spread one by one)."""
    names = getattr(item, "fixturenames", ())
    if "lora_run" in names:
        return "lora_run"
    if "snapshot" in names:
        return item.path.name
    info = getattr(item, "_fixtureinfo", None)
    scopes = {defs[-1].scope for defs in info.name2fixturedefs.values() if defs} if info is not None else set()
    return item.path.name if "module" in scopes else None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """Under ``pytest -n 2 --dist loadgroup --no-loadscope-reorder`` (``make test``): the end-to-end pair first, the
    ``lora_run`` group next (the two longest chains start at once, one on each worker), then the rest in collection
    order, each test on whichever worker is free unless a module fixture or ``lora_run`` ties it to a group."""
    groups = {item.nodeid: _xdist_group(item) for item in items}
    items.sort(key=lambda item: (item.path.name != FIRST, groups[item.nodeid] != "lora_run",
                                 item.path.name not in EARLY))  # stable
    for item in items:
        if groups[item.nodeid] is not None:
            item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))
