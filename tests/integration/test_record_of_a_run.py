"""What the pipeline writes afresh (the ``lora_run`` fixture: the whole pipeline once on the tiny model): its record
conforms to the schema, every verdict follows from its numbers, every number has a value rule, and only plain values
and UTC times reach the file. The tests that read a record work on the committed one (tests/records.py)."""

from __future__ import annotations

import datetime as dt

from core.record.shape import schema_problems
from core.record.verify import recompute_verdicts
from core.record.written import plain_values
from tests import records
from tests.records import key_paths as keys


def test_the_pipelines_record_conforms_and_its_verdicts_follow(lora_run):
    _, rec, _ = lora_run
    assert schema_problems(rec) == []
    assert recompute_verdicts(rec) == []


def test_every_number_and_time_the_pipeline_writes_has_a_value_rule(lora_run):
    from core.record.schema import kind_of

    _, rec, _ = lora_run

    def leaves(value, path):
        if isinstance(value, dict):
            return [leaf for k, v in value.items() for leaf in leaves(v, f"{path}.{k}" if path else k)]
        if isinstance(value, list):
            return [leaf for v in value for leaf in leaves(v, path + "[]")]
        return [(path, value)]

    numbers = [(p, v) for p, v in leaves(rec, "")
               if isinstance(v, (int, float, dt.datetime)) and not isinstance(v, bool)]
    assert len(numbers) > 100
    # the spec table is held to the spec's own field types instead (core.record.schema._spec_problems)
    assert [p for p, _ in numbers if kind_of(p) is None and not p.startswith("spec.")] == []


def test_the_pipelines_record_holds_only_plain_values_and_utc_times(lora_run):
    _, rec, _ = lora_run
    plain_values(rec)  # tomllib gives back what was written: no None could have been written

    def times(value):
        if isinstance(value, dict):
            return [t for v in value.values() for t in times(v)]
        if isinstance(value, list):
            return [t for v in value for t in times(v)]
        return [value] if isinstance(value, dt.datetime) else []

    found = times(rec)
    assert len(found) >= 2 and all(t.utcoffset() == dt.timedelta(0) for t in found)


def test_the_committed_records_have_every_key_a_fresh_run_writes(lora_run):
    """The fixture records (tests/data/records) cannot drift from what the pipeline writes: a fresh run of the same
    spec has the same keys, schema version and spec (but for the model's path), and the same verdicts."""
    _, fresh, _ = lora_run
    committed = records.committed("lora")
    assert keys(committed) == keys(fresh)
    assert committed["schema_version"] == fresh["schema_version"]
    def spec(rec: dict) -> dict:
        return {k: v for k, v in rec["spec"].items() if k not in ("model", "hash")}

    assert spec(committed) == spec(fresh)
    assert committed["verdict"]["status"] == fresh["verdict"]["status"] == "pass"
    for name in ("full", "inference", "qlora"):
        other = records.committed(name)
        assert other["schema_version"] == fresh["schema_version"] and schema_problems(other) == []
        assert recompute_verdicts(other) == []
