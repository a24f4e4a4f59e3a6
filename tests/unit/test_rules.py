"""The rules with one home each (issue 19): dtypes, the fit rule, the signature's path, schema-then-verdicts, and the
import contract that keeps the record package free of cycles."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from core.dtypes import DTYPES, dtype_bytes, dtype_name, torch_dtype_name
from core.errors import GpuAcceptError, UnknownDtypeError
from core.plan.fit import all_fit, fit_of, fits_in
from tests.paths import REPO

ROOT = REPO


# ---------------------------------------------------------------------------------------------------------- dtypes
def test_dtype_bytes_are_torchs_element_sizes():
    torch = pytest.importorskip("torch")
    assert DTYPES == ("fp32", "bf16", "fp16")
    assert [dtype_bytes(d) for d in DTYPES] == [4, 2, 2]
    for d in DTYPES:
        assert getattr(torch, torch_dtype_name(d)).itemsize == dtype_bytes(d)
        assert dtype_name(getattr(torch, torch_dtype_name(d))) == d


def test_an_unknown_dtype_is_a_named_error_never_four_bytes():
    with pytest.raises(UnknownDtypeError, match="'float64'") as info:
        dtype_bytes("float64")
    assert info.value.dtype == "float64"
    assert isinstance(info.value, GpuAcceptError) and isinstance(info.value, ValueError)
    with pytest.raises(UnknownDtypeError, match="'fp8'"):
        torch_dtype_name("fp8")
    assert dtype_name("torch.float64") == "float64"  # kept as torch names it, so counting it names it


def test_the_quiz_skips_a_question_whose_record_has_an_unknown_dtype():
    from core.quiz import _state_bytes_per_parameter

    assert _state_bytes_per_parameter({"dtype": "bf16", "precision": "pure", "optimizer": "adamw"})[0] == 2 * 3
    with pytest.raises(ValueError):  # the quiz's makers treat ValueError as malformed data: the question is not asked
        _state_bytes_per_parameter({"dtype": "fp64", "precision": "pure", "optimizer": "adamw"})


# ---------------------------------------------------------------------------------------------------------- fit
def test_the_fit_rule():
    assert fits_in(10, 10) is True
    assert fits_in(11, 10) is False
    assert fits_in(0, 0) is True
    assert fits_in(10, None) is None
    assert all_fit([True, None]) and all_fit([]) and not all_fit([True, False, None])
    over = fit_of("cuda:0", 100, analytic=90, untraced=5, traced=96, strategy="single")  # traced 96 + 5 > 100
    assert (over.bytes, over.judged_by, over.fits) == (101, "traced", False)
    assert not all_fit([over, fit_of("cuda:1", None, 90, 5, None, "single")])
    assert fit_of("cuda:0", 100, 90, 5, 96, "zero3").fits is True  # no trace applies to a sharded step


# ---------------------------------------------------------------------------------------------------------- record
def test_the_signature_path_is_beside_the_record(tmp_path):
    from core.record.signing import signature_path

    assert signature_path(tmp_path / "record.toml") == tmp_path / "record.toml.sig"


def test_schema_first_then_the_verdicts(monkeypatch):
    from core.record import verify

    calls: list[str] = []
    monkeypatch.setattr(verify, "schema_problems", lambda rec: calls.append("schema") or list(rec["schema"]))
    monkeypatch.setattr(verify, "recompute_verdicts", lambda rec: calls.append("verdicts") or list(rec["verdicts"]))
    assert verify.record_problems({"schema": ["bad"], "verdicts": ["wrong"]}) == (["bad"], [])
    assert calls == ["schema"]  # a record that breaks its schema has no verdicts recomputed
    assert verify.record_problems({"schema": [], "verdicts": ["wrong"]}) == ([], ["wrong"])

    def broken(rec):
        raise TypeError("probe.devices[0].peak_bytes is 'x', not a count")

    monkeypatch.setattr(verify, "recompute_verdicts", broken)
    schema, verdicts = verify.record_problems({"schema": []})
    assert verdicts == [] and schema == ["a value the verdicts depend on is missing or of the wrong type: "
                                         "probe.devices[0].peak_bytes is 'x', not a count"]


def _lint_imports(tree: Path, *contracts: str) -> subprocess.CompletedProcess:
    args = [str(Path(sys.executable).parent / "lint-imports"), "--no-cache", "--no-logo"]
    for c in contracts:
        args += ["--contract", c]
    return subprocess.run(args, cwd=tree, capture_output=True, text=True, timeout=300)


def test_the_import_contract_fails_on_a_cycle_in_the_record_package(tmp_path):
    if not (Path(sys.executable).parent / "lint-imports").exists():
        pytest.skip("import-linter is not installed (pip install -e .[lint])")
    for name in ("core", "tui"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    kept = _lint_imports(tmp_path, "record-layers", "core-acyclic")
    assert kept.returncode == 0, kept.stdout + kept.stderr
    signing = tmp_path / "core" / "record" / "signing.py"
    # the cycle this package had: signing imported verify, which imports signing
    signing.write_text(signing.read_text() + "\n\ndef _cycle() -> None:\n    from core.record import verify  # noqa\n")
    broken = _lint_imports(tmp_path, "record-layers", "core-acyclic")
    assert broken.returncode != 0
    assert "core.record.signing -> core.record.verify" in broken.stdout
    assert "Contracts: 0 kept, 2 broken." in broken.stdout


def import_cycles(graph: Any) -> list[list[str]]:
    """The import cycles of ``graph`` (a grimp ImportGraph) between files: each strongly connected set of two or more
    modules, sorted (Tarjan's algorithm). grimp reads every import statement, those inside functions and under
    TYPE_CHECKING too."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            found = []
            while True:
                w = stack.pop()
                found.append(w)
                if w == v:
                    break
            if len(found) > 1:
                cycles.append(sorted(found))

    for m in sorted(graph.modules):
        if m not in index:
            visit(m)
    return sorted(cycles)


def test_no_two_files_of_core_or_tui_import_each_other_even_through_others():
    """Issue 53: the spec / settings / criteria / importers circle and the wizard's screens' are gone (the screens open
    each other by name, tui/screens/registry.py); a new one fails here, naming its files. The finder itself finds a
    cycle of three planted in a graph made by hand."""
    import grimp

    planted = grimp.ImportGraph()
    for importer, imported in (("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("e", "e")):
        planted.add_import(importer=importer, imported=imported)
    assert import_cycles(planted) == [["a", "b", "c"]]
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    graph = grimp.build_graph("core", "tui", include_external_packages=False, cache_dir=None)
    assert import_cycles(graph) == []


# ---------------------------------------------------------------------------------------------------------- spec types
def test_the_spec_fields_are_literals_written_as_strings():
    import dataclasses
    from typing import get_args

    from core.devicespec import STRATEGIES
    from core.errors import SpecError
    from core.spec import MODES, OPTIMIZERS, PRECISIONS, RunSpec
    from core.specparse import field_type
    from core.spectables import KILL_POINTS, KillAt

    assert MODES == ("inference", "full", "lora", "qlora", "dora", "lora_int8", "badam") and PRECISIONS == ("pure", "amp")
    assert OPTIMIZERS == ("adamw", "adamw_fused", "sgd", "adafactor", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit",
                          "adamw_ao_8bit", "adamw_ao_4bit", "adamw_ao_fp8", "galore_adamw")
    assert STRATEGIES == ("single", "ddp", "zero1", "zero2", "zero3", "device_map", "tp")
    assert tuple(KILL_POINTS) == get_args(KillAt) == ("boundary", "boundary-1", "boundary+1", "checkpoint-write")
    kinds = {f.name: field_type(f, RunSpec) for f in dataclasses.fields(RunSpec)}
    assert {kinds[k] for k in ("mode", "dtype", "precision", "optimizer", "strategy", "attn_implementation",
                               "padding", "lr_scheduler")} == {"str"}
    assert kinds["batch_size"] == "int" and kinds["lora"] == "LoraSettings"
    with pytest.raises(SpecError, match="^dtype: expected str, got 5$"):  # the message of a str field, as before
        RunSpec.from_dict({"dtype": 5})
    with pytest.raises(SpecError, match="^resume.kill_at: expected str, got 1$"):
        RunSpec.from_dict({"resume": {"kill_at": 1}})
    with pytest.raises(SpecError, match="^padding: 'pad': choose padded"):  # a misspelt value: its own message
        RunSpec.from_dict({"padding": "pad"})


def test_mypy_catches_a_misspelt_mode(tmp_path):
    mypy = Path(sys.executable).parent / "mypy"
    if not mypy.exists():
        pytest.skip("mypy is not installed (pip install -e .[lint])")
    snippet = tmp_path / "misspelt.py"
    snippet.write_text("from core.spec import RunSpec\n\nRunSpec(mode=\"lorra\")\nRunSpec(mode=\"lora\")\n")
    out = subprocess.run([str(mypy), "--no-incremental", "--follow-imports=silent", str(snippet)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert "misspelt.py:3: error" in out.stdout and "misspelt.py:4" not in out.stdout


def test_a_probed_device_is_judged_by_its_peak_on_cuda_and_by_rss_too_on_the_cpu():
    from core.plan.fit import measured_use_bytes

    assert measured_use_bytes("cuda:0", peak_bytes=100, peak_rss_bytes=900) == 100  # RSS is host memory, not the GPU's
    assert measured_use_bytes("cpu", peak_bytes=100, peak_rss_bytes=900) == 900
    assert measured_use_bytes("cpu", peak_bytes=1000, peak_rss_bytes=900) == 1000
