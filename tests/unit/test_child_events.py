"""The child's typed events (core.protocol.events): written by EventWriter.write, parsed once by read_events.

Every kind round-trips with values that could be confused (ranks, None, optional keys); lines written in the format
run folders already hold parse; an unknown kind and malformed lines are named errors, never skipped.
"""

from __future__ import annotations

import json
import math

import pytest

from core.events import lead_events
from core.protocol import events as ce
from core.protocol.events import EventWriter, read_events

LEDGER = dict(device="cpu:1", host="node7", global_rank=3, world_size=4, node_rank=1, weights_bytes=1000,
              weights_loaded_bytes=2000, gradients_bytes=30, optimizer_states_bytes=60, step_time_s=0.25,
              tokens_per_s=2048.5, steps=3, rss_start_bytes=7, rss_after_load_bytes=8, peak_rss_bytes=9,
              wrapper="DistributedDataParallel", torch_threads=1)

#: one event of every kind, each field a value distinct from the others and from its default
ONE_OF_EACH: list[ce.ChildEvent] = [
    ce.Started(role="interrupted", pid=4242, pgid=4240, device="cpu:1", torch="2.13.0+cpu", host="node7",
               global_rank=3, local_rank=1, world_size=4, node_rank=1),
    ce.DeviceUuid(device="cuda:2", uuid="GPU-0c4e"),
    ce.ModelBuilt(attention="sdpa", parameter_dtypes={"float32": 1234, "bfloat16": 56},
                  lora_targets=["q_proj", "v_proj"], lora_modules=60),
    ce.DataInfo(train_documents=70, heldout_documents=9, train_blocks=800, heldout_blocks=61,
                heldout_blocks_evaluated=60, heldout_selection="the first 60 held-out blocks", train_hash="aa",
                heldout_hash="bb", split_method="sha256 of the title", disjoint_check="by sha256 of content"),
    ce.ChildError(error="RuntimeError: out of memory"),
    ce.Placement(devices={"cpu:1": {"parameters": 10, "bytes": 40, "trainable": 2}}),
    ce.DeviceMap(layers={"cuda:0": ["model.embed_tokens", "model.layers.0-11"], "cuda:1": ["lm_head"]}),
    ce.ProbeStep(step=2, total=3, seconds=1.5),
    ce.Ledger(**LEDGER, local_rank=1, peak_tracked_tensor_bytes=500, tracked_method="live tensors"),
    ce.Ledgers(ledgers=[ce.Ledger(**LEDGER, local_rank=1, peak_allocated_bytes=11, peak_reserved_bytes=12),
                        ce.Ledger(**{**LEDGER, "global_rank": 0}, local_rank=0,
                                  per_device=[{"device": "cuda:0", "weights_bytes": 1, "peak_allocated_bytes": 2,
                                               "peak_reserved_bytes": 3}])]),
    ce.LinkCheck(backend="gloo", bytes=4194304, iterations=3, members="node", names=["node 0 (a)", "node 1 (b)"],
                 collectives=[{"op": "all_reduce", "ranks": 4, "bytes": 4194304, "seconds": 0.01,
                               "algbw_gbps": 0.42, "busbw_gbps": 0.63}],
                 pairs=[{"from": 1, "to": 0, "seconds": 0.02, "busbw_gbps": 0.21}]),
    ce.EvalProgress(when="after", done=17, total=32),
    ce.Evaluation(when="after", perplexity=20.25, mean_nll=3.0081, nll_sum=3008.1, tokens=1000, blocks=8,
                  seconds=10.5, metric="token-weighted perplexity", correct=412),
    ce.Trainable(names=["a.lora_A.weight", "a.lora_B.weight"], parameters=64),
    ce.Step(step=26, epoch=1.5, learning_rate=None, loss=2.75, sample_ids=[5, 3, 9], rng={"cpu": "ab", "numpy": "cd"}),
    ce.CheckpointSaved(step=20, path="/runs/x/output/checkpoint-20"),
    ce.Trained(seconds=81.5, global_step=30, output_dir="/runs/x/output"),
    ce.KillPoint(step=25, where="micro", micro_done=1, micro_in_step=4),
    ce.RngRestored(digest={"cpu": "ef", "python": "01"}, checkpoint="/runs/x/checkpoint-20"),
    ce.ManifestChecked(when="before_load", files=7, bad=["optimizer.pt"]),
]


def test_every_kind_has_an_example_here():
    assert {type(e) for e in ONE_OF_EACH} == set(ce.KINDS.values())
    assert len(ce.KINDS) == 20


@pytest.mark.parametrize("event", ONE_OF_EACH, ids=lambda e: e.KIND)
def test_a_line_of_each_kind_round_trips_from_a_single_process(tmp_path, event):
    writer = EventWriter(tmp_path / "events.jsonl")
    writer.write(event)
    writer.close()
    (got,), _ = read_events(tmp_path / "events.jsonl")
    assert type(got) is type(event)
    assert got.t > 1.7e9  # the writer stamps the time; the event's own t is not written
    assert got.rank is None  # a single process: no rank in the line
    # Started and Ledger carry their local rank in the payload; every other kind has none from one process
    assert got.local_rank == (event.local_rank if isinstance(event, (ce.Started, ce.Ledger)) else None)
    assert ce.payload(got) == ce.payload(event)


@pytest.mark.parametrize("event", ONE_OF_EACH, ids=lambda e: e.KIND)
def test_a_line_of_each_kind_round_trips_under_torchrun(tmp_path, event):
    writer = EventWriter(tmp_path / "events.jsonl", rank=5, local_rank=1)
    writer.write(event)
    writer.close()
    assert not (tmp_path / "events.jsonl").exists()  # rank 5 writes its own file
    (got,), _ = read_events(tmp_path / "events.rank5.jsonl")
    assert (got.rank, got.local_rank, got.leads) == (5, 1, False)
    assert ce.payload(got) == ce.payload(event)


def test_the_line_on_disk_keeps_the_format_of_run_folders(tmp_path):
    writer = EventWriter(tmp_path / "events.jsonl", rank=3, local_rank=1)
    writer.write(ONE_OF_EACH[0])
    writer.write(ce.ModelBuilt(attention="eager", parameter_dtypes={"float32": 5}))
    writer.write(ce.Step(step=1, epoch=0.25, learning_rate=None, loss=1.0, sample_ids=[], rng=None))
    writer.close()
    started, built, step = (json.loads(line) for line in (tmp_path / "events.rank3.jsonl").read_text().splitlines())
    assert list(started) == ["kind", "t", "role", "pid", "pgid", "device", "torch", "host", "global_rank", "local_rank",
                             "world_size", "node_rank", "rank"]
    assert (started["kind"], started["rank"], started["local_rank"], started["global_rank"]) == ("started", 3, 1, 3)
    assert "lora_targets" not in built and "lora_modules" not in built  # not LoRA: the keys are left out, as before
    assert step["learning_rate"] is None and step["rng"] is None  # written as null: the key is always there
    assert list(step) == ["kind", "t", "step", "epoch", "learning_rate", "loss", "sample_ids", "rng", "rank",
                          "local_rank"]


def test_lines_written_before_the_typed_events_still_parse(tmp_path):
    """Lines as run folders hold them (written by EventWriter.emit before these classes existed)."""
    lines = [
        '{"kind": "started", "t": 1764000000.5, "role": "train", "pid": 11, "pgid": 11, "device": "cpu", '
        '"torch": "2.13.0+cpu", "host": "h", "global_rank": 0, "local_rank": 0, "world_size": 1, "node_rank": 0}',
        '{"kind": "evaluation", "t": 1764000001.0, "when": "before", "perplexity": NaN, "mean_nll": 3.2, '
        '"nll_sum": 32.0, "tokens": 10, "blocks": 1, "seconds": 0.5, "metric": "m"}',
        '{"kind": "step", "t": 1764000002.0, "step": 1, "epoch": 0.1, "learning_rate": 0.0002, "loss": 3, '
        '"sample_ids": [4, 2], "rng": {"cpu": "x"}, "rank": 1, "local_rank": 1}',
    ]
    (tmp_path / "events.jsonl").write_text("\n".join(lines) + "\n")
    started, evaluation, step = read_events(tmp_path / "events.jsonl")[0]
    assert isinstance(started, ce.Started) and started.t == 1764000000.5 and started.local_rank == 0
    assert started.leads and started.rank is None
    assert isinstance(evaluation, ce.Evaluation) and math.isnan(evaluation.perplexity)
    assert isinstance(step, ce.Step) and step.loss == 3 and step.sample_ids == [4, 2] and not step.leads
    assert lead_events([started, evaluation, step]) == [started, evaluation]


def test_a_trailing_partial_line_waits_for_the_next_read(tmp_path):
    path = tmp_path / "events.jsonl"
    whole = '{"kind": "error", "t": 1.0, "error": "ValueError: x"}\n'
    path.write_text(whole + '{"kind": "err')
    got, offset = read_events(path)
    assert [e.error for e in got] == ["ValueError: x"] and offset == len(whole)
    with open(path, "a") as fh:
        fh.write('or", "t": 2.0, "error": "KeyError: y"}\n')
    again, end = read_events(path, offset)
    assert [e.error for e in again] == ["KeyError: y"] and end == path.stat().st_size


def test_an_unknown_kind_is_a_named_error(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"kind": "error", "t": 1.0, "error": "E: x"}\n{"kind": "halfway", "t": 2.0}\n')
    with pytest.raises(ce.EventFormatError, match=r"at byte 45: unknown event kind 'halfway'") as info:
        read_events(path)
    assert str(path) in str(info.value)
    with pytest.raises(ce.EventFormatError, match="unknown event kind None"):
        ce.parse_event({"t": 1.0})


@pytest.mark.parametrize(("line", "words"), [
    ("not json", "not JSON"),
    ("[1, 2]", "must be a JSON object, got list"),
    ('{"kind": "probe_step", "t": 1.0, "step": 1, "total": 3}', "probe_step event: missing key(s) seconds"),
    ('{"kind": "probe_step", "t": 1.0, "step": 1, "total": 3, "seconds": 1.0, "loss": 2.0}',
     "probe_step event: unexpected key(s) loss"),
    ('{"kind": "probe_step", "t": 1.0, "step": "1", "total": 3, "seconds": 1.0}', "step = '1' is not int"),
    ('{"kind": "probe_step", "t": 1.0, "step": true, "total": 3, "seconds": 1.0}', "step = True is not int"),
    ('{"kind": "probe_step", "t": 1.0, "step": 1.0, "total": 3, "seconds": 1.0}', "step = 1.0 is not int"),
    ('{"kind": "step", "t": 1.0, "step": 1, "epoch": 0.1, "learning_rate": "high", "loss": 1.0, "sample_ids": []}',
     "learning_rate = 'high' is not"),
    ('{"kind": "manifest", "t": 1.0, "when": "before_load", "files": 3, "bad": "optimizer.pt"}', "bad = "),
    ('{"kind": "error", "t": "now", "error": "x"}', "t = 'now' is not float"),
    ('{"kind": "ledgers", "t": 1.0, "ledgers": [{"device": "cpu"}]}', "ledger event: missing key(s) host"),
])
def test_a_malformed_line_is_a_named_error(line, words):
    with pytest.raises(ce.EventFormatError) as info:
        ce.parse_line(line)
    assert words in str(info.value)


def test_the_envelope_is_not_part_of_the_payload_but_of_as_dict():
    step = ce.Step(step=3, epoch=1.0, learning_rate=1e-4, loss=0.5, sample_ids=[1], rng=None, t=9.0, rank=2,
                   local_rank=0)
    assert "t" not in ce.payload(step) and "rank" not in ce.payload(step)
    assert ce.as_dict(step) == {**ce.payload(step), "rank": 2, "local_rank": 0}
    assert step.leads  # local rank 0 of a node leads it, whatever its global rank


def test_the_watcher_hands_out_typed_events(tmp_path):
    """childproc.poll_events parses once at the boundary: every consumer gets typed events."""
    from core.stages.childproc import ChildJob, poll_events

    job = ChildJob(name="t", job_dir=tmp_path, job={})
    for rank in (None, 1):
        writer = EventWriter(job.events_path, rank=rank, local_rank=rank)
        writer.write(ce.ProbeStep(step=1, total=2, seconds=0.5))
        writer.close()
    got = poll_events(job)
    assert [(type(e), e.rank) for e in got] == [(ce.ProbeStep, None), (ce.ProbeStep, 1)]
    assert poll_events(job) == [] and job.events == got
