"""Issue 8, first piece: the worker under torchrun (gloo on CPU, world size 2), each rank reporting on its own."""

from __future__ import annotations

from core.childproc import check_exit, group_alive, start_child, watch
from core.spec import RunSpec


def test_the_probe_under_torchrun_reports_a_ledger_per_rank(tiny_model_dir, tmp_path):
    spec = RunSpec.build(model=str(tiny_model_dir), mode="full", steps=6, seq_len=32, batch_size=2, probe_steps=2,
                         resume_checkpoint_every=2, resume_kill_after_checkpoint=1)
    child = start_child("probe", tmp_path / "probe", {"role": "probe", "spec": spec.to_dict(),
                                                      "model_path": str(tiny_model_dir), "device": "cpu"}, nproc=2)
    events = list(watch(child))
    check_exit(child)
    ledgers = {e["rank"]: e for e in events if e["kind"] == "ledger"}
    assert sorted(ledgers) == [0, 1]
    assert (tmp_path / "probe" / "events.rank1.jsonl").is_file()  # rank 1 never writes into rank 0's file
    for rank, ledger in ledgers.items():
        assert ledger["world_size"] == 2
        assert ledger["wrapper"] == "DistributedDataParallel"  # DDP: a full replica on every rank
        assert ledger["weights_bytes"] == ledgers[0]["weights_bytes"] > 0
        assert ledger["optimizer_states_bytes"] >= 2 * ledger["weights_bytes"]  # AdamW: 2 moments, not sharded
    assert not group_alive(child.proc.pid)  # torchrun and both ranks are gone
