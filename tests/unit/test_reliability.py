"""Issue 16, item 9: the reliability suite. Property-based fuzz (hypothesis) of the three places where a user's bytes
enter gpuaccept: the spec loader, the data loader, and verify's schema check. Each must either accept the input or
refuse it with its named error (SpecError, DataError, a schema finding), never with any other exception: in the
wizard or the CLI any other exception is an "internal error" and a lost run.

Where each bullet of issue 16's "Why" is kept (fault injection included):

- a verified claim that does not hold: tests/integration/test_pipeline_tiny.py (a byte flipped before the resumed child starts
  fails ``manifest_at_load``, naming the file);
- the default kill point with a checkpoint every step: tests/unit/test_resume_logic.py and test_spec.py (kill points valid
  by construction);
- measured results lost: tests/integration/test_cli.py (SIGINT / SIGTERM / SIGHUP during the probe, and SIGTERM during training
  and during the resume check, below), tests/integration/test_run_folder.py (a real 400 KiB tmpfs, a read-only or file runs
  folder, injected ENOSPC per stage, runs started in the same second);
- bad input found late: tests/integration/test_cli.py (malformed data files before any run folder), tests/unit/test_spec.py, and the
  fuzz below;
- verify's schema check only at the top level: tests/unit/test_record_verify.py, and the fuzz below;
- children left behind, cgroup limits, OOM kills: tests/integration/test_host_limits.py.
"""

from __future__ import annotations

import datetime as dt
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.errors import DataError, SpecError
from core.spec import RunSpec

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                        HealthCheck.too_slow])

# TOML's value types as tomllib returns them
toml_scalars = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20), st.booleans(),
    st.datetimes(timezones=st.sampled_from([dt.UTC, None, dt.timezone(dt.timedelta(hours=2))])),
    st.dates(), st.times(),
)
toml_values = st.recursive(toml_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)), max_leaves=6)

SPEC_KEYS = ("mode", "model", "dtype", "precision", "attn_implementation", "padding", "batch_size", "seq_len",
             "grad_accum", "optimizer", "learning_rate", "lr_scheduler", "warmup_steps", "steps",
             "gradient_checkpointing", "devices", "strategy", "tp", "data", "heldout_fraction", "eval_max_blocks",
             "seed", "probe_steps")
SUB_KEYS = {"lora": ("r", "alpha", "dropout", "targets"),
            "resume": ("check", "checkpoint_every", "kill_after_checkpoint", "kill_at", "compare_steps",
                       "interrupted_from"),
            "torchrun": ("nproc_per_node", "nnodes", "rdzv_endpoint", "rdzv_id", "rdzv_backend")}
# plausible values first, so the fuzz also reaches the checks behind the type checks
plausible = st.one_of(st.integers(min_value=-3, max_value=40), st.sampled_from(
    ["lora", "full", "inference", "fp32", "bf16", "fp16", "pure", "amp", "cpu", "auto", "ddp", "zero3", "single",
     "boundary", "boundary+1", "checkpoint-write", "start", "checkpoint", "q_proj", "all-linear", "embedded"]),
    st.floats(min_value=-1, max_value=2), toml_values)


@st.composite
def spec_dicts(draw):
    raw = {k: draw(plausible) for k in draw(st.lists(st.sampled_from(SPEC_KEYS), max_size=8, unique=True))}
    for table, keys in SUB_KEYS.items():
        if draw(st.booleans()):
            raw[table] = draw(st.one_of(
                st.dictionaries(st.sampled_from(keys), plausible, max_size=4), toml_values))
    if draw(st.integers(0, 9)) == 0:
        raw[draw(st.text(min_size=1, max_size=10))] = draw(toml_values)  # an unknown key
    return raw


@FUZZ
@given(spec_dicts())
def test_the_spec_loader_accepts_or_names_the_setting(raw):
    try:
        spec = RunSpec.from_dict(raw)
    except SpecError as exc:
        assert exc.field and str(exc)  # names the setting and what to change
        return
    spec.validate()  # what was accepted is valid as it stands
    json.dumps(spec.to_dict())  # and can be written to the record


@FUZZ
@given(st.binary(max_size=300))
def test_any_bytes_as_a_spec_file_are_a_spec_or_a_named_error(tmp_path_factory, content):
    path = tmp_path_factory.mktemp("spec") / "spec.toml"
    path.write_bytes(content)
    try:
        RunSpec.build(path)
    except SpecError:
        pass


# ---------------------------------------------------------------------------------------------------------- data
@FUZZ
@given(st.binary(max_size=400), st.sampled_from([".txt", ".jsonl"]))
def test_any_bytes_as_a_data_file_are_documents_or_a_named_error(tmp_path_factory, content, suffix):
    from core.data import check_data

    path = tmp_path_factory.mktemp("data") / f"data{suffix}"
    path.write_bytes(content)
    try:
        check_data(str(path), 0.2)
    except DataError as exc:
        assert str(path) in str(exc) or "document" in str(exc)


texts = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=40).filter(
    lambda t: t.strip() and "\x00" not in t)


@FUZZ
@given(st.lists(texts, min_size=1, max_size=6))
def test_every_jsonl_file_json_writes_is_read_back_document_for_document(tmp_path_factory, docs):
    """Lines as ``json.dumps(..., ensure_ascii=False)`` writes them (what most tools write), with any Unicode in
    the text: U+2028, U+0085 and form feeds are not line breaks in JSON lines."""
    from core.data import load_documents

    path = tmp_path_factory.mktemp("data") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in docs), encoding="utf-8")
    assert [d.text for d in load_documents(str(path))] == docs


# ------------------------------------------------------------------------------------------------ verify's schema
def _paths(value, prefix=()):
    """Every (path, container) pair below ``value``: the places a mutation can go."""
    out = []
    if isinstance(value, dict):
        for k, v in value.items():
            out.append(prefix + (k,))
            out.extend(_paths(v, prefix + (k,)))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out.append(prefix + (i,))
            out.extend(_paths(v, prefix + (i,)))
    return out


def _set(record, path, value):
    target = record
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value


def _checked(record) -> list[str]:
    """What ``gpuaccept verify`` reports for a parsed record (core.record.verify.verify without the file and signature:
    its :func:`core.record.verify.record_problems`, the schema first, then the verdicts)."""
    from core.record.verify import record_problems

    schema, verdicts = record_problems(record)
    return schema + verdicts


@pytest.fixture(scope="module")
def parsed_record():
    import copy

    from tests.records import committed

    rec = committed("lora")
    assert _checked(copy.deepcopy(rec)) == []  # the pipeline's own record (committed) is clean
    return rec


@FUZZ
@given(data=st.data())
def test_any_value_anywhere_in_a_record_is_checked_without_a_crash(parsed_record, data):
    import copy

    record = copy.deepcopy(parsed_record)
    for _ in range(data.draw(st.integers(1, 3))):
        _set(record, data.draw(st.sampled_from(_paths(record))), data.draw(toml_values))
    _checked(record)  # any exception other than those verify reports fails the test


@FUZZ
@given(data=st.data(), bad=st.sampled_from(["nan", "inf", "naive", "local-date", "empty-key"]))
def test_a_value_no_writer_of_gpuaccept_produces_is_always_found(parsed_record, data, bad):
    """The rules that hold everywhere (docs/record.md, Values): wherever such a value is put, verify says so."""
    import copy

    record = copy.deepcopy(parsed_record)
    path = data.draw(st.sampled_from(_paths(record)))
    value = {"nan": math.nan, "inf": -math.inf, "naive": dt.datetime(2026, 12, 1, 6, 0),
             "local-date": dt.date(2026, 12, 1), "empty-key": {"": 1}}[bad]
    _set(record, path, value)
    assert _checked(record) != []
