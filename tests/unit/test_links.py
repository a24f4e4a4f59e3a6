"""Issue 39: the links between ranks. The bandwidth formulas are nccl-tests' (doc/PERFORMANCE.md), each value here
derived by hand; a slow link names the member it leaves from (or, failing that, the one it reaches); the criteria
``min_busbw_gbps`` and ``max_step_time_spread`` judge the report, and ``gpuaccept verify`` recomputes every bandwidth
from its bytes and seconds. The measurement itself runs in tests/integration/test_torchrun.py (two CPU ranks, two
torchrun "nodes")."""

from __future__ import annotations

import shutil
import tomllib

import pytest

from core.criteria import AcceptCriteria, LinkFacts, bus_factor, busbw_gbps, judge_links, missed, slow_members
from core.protocol.events import LinkCheck
from core.record.verify import recompute_verdicts
from core.stages.links import LinkReport

MiB4 = 4 * 2**20


def test_bus_bandwidth_is_nccl_tests():
    # 8 ranks: all-reduce 2 x 7/8 = 1.75, all-gather 7/8; a send between two ranks is its algorithm bandwidth
    assert (bus_factor("all_reduce", 8), bus_factor("all_gather", 8), bus_factor("send", 2)) == (1.75, 0.875, 1.0)
    # 4 MiB all-reduced over 4 ranks in 10 ms: 4194304 B / 0.01 s = 0.4194304 GB/s, x 2 x 3/4 = 0.6291456
    assert busbw_gbps("all_reduce", 4, MiB4, 0.01) == pytest.approx(0.6291456)
    assert busbw_gbps("send", 2, MiB4, 0.0) == 0.0  # nothing timed
    with pytest.raises(ValueError, match="broadcast"):
        bus_factor("broadcast", 2)


def report(pairs: list[tuple[int, int, float]], names=("node 0 (a)", "node 1 (b)"),
           best: list[float] | None = None) -> LinkReport:
    """A report of one all-reduce over 4 ranks in 10 ms and one-way sends of 4 MiB, each taking ``seconds`` at the
    median and ``best`` (default: the same) at its fastest."""
    return LinkReport.from_event(LinkCheck(
        backend="gloo", bytes=MiB4, iterations=3, members="node", names=list(names),
        collectives=[{"op": "all_reduce", "ranks": 4, "bytes": MiB4, "seconds": 0.01, "algbw_gbps": 0.4194304,
                      "busbw_gbps": busbw_gbps("all_reduce", 4, MiB4, 0.01)}],
        pairs=[{"from": a, "to": b, "seconds": s, "busbw_gbps": busbw_gbps("send", 2, MiB4, s), "best_seconds": f,
                "best_busbw_gbps": busbw_gbps("send", 2, MiB4, f)}
               for (a, b, s), f in zip(pairs, best or [s for *_, s in pairs])]))


def test_a_slow_direction_names_the_node_it_leaves_from():
    # node 1 sends in 100 ms (0.042 GB/s), node 0 in 10 ms (0.42 GB/s): below half the fastest link (0.21)
    slow = report([(0, 1, 0.01), (1, 0, 0.1)])
    assert len(slow.slow) == 1 and slow.slow[0].startswith("node 1 (b): every link out of it is slow (down to 0.0419")
    assert report([(0, 1, 0.01), (1, 0, 0.015)]).slow == []  # 1.5 times slower is not below half the fastest


def test_a_link_is_named_slow_by_its_fastest_operation_not_its_median():
    # CI's busy 2-core machine: one direction's median 2.5 x the other's, its fastest operation as fast as the other's
    busy = report([(0, 1, 0.01), (1, 0, 0.025)], best=[0.009, 0.0095])
    assert busy.slow == [] and min(c for _, c in busy.facts().pairs) == pytest.approx(MiB4 / 0.025 / 1e9)
    # a capped link (tc on node 1's side): slow in every operation, its fastest too
    capped = report([(0, 1, 0.01), (1, 0, 0.17)], best=[0.009, 0.16])
    assert capped.slow == ["node 1 (b): every link out of it is slow (down to 0.0262 GB/s; the fastest link "
                           "0.466 GB/s)"]
    # a record written before links kept their best: judged on the median, as it was written
    old = capped.to_table()
    for p in old["pairs"]:
        del p["best_seconds"], p["best_busbw_gbps"]
    assert LinkReport.from_table(old).slow == ["node 1 (b): every link out of it is slow (down to 0.0247 GB/s; the "
                                               "fastest link 0.419 GB/s)"]


def test_a_node_slow_both_ways_is_named_among_three():
    names = ["node 0 (a)", "node 1 (b)", "node 2 (c)"]
    fast, slow = 0.01, 0.1
    pairs = [(a, b, slow if 2 in (a, b) else fast) for a in range(3) for b in range(3) if a != b]
    named = slow_members(names, [(a, b, MiB4 / s / 1e9) for a, b, s in pairs])
    assert [n.split(":")[0] for n in named] == ["node 2 (c)"]
    # only what reaches node 0 is slow: it is named by what comes in, not by what it sends
    pairs = [(a, b, slow if b == 0 else fast) for a in range(3) for b in range(3) if a != b]
    named = slow_members(names, [(a, b, MiB4 / s / 1e9) for a, b, s in pairs])
    assert len(named) == 1 and named[0].startswith("node 0 (a): every link into it is slow")


def test_the_criteria_judge_the_slowest_link_and_the_spread():
    slow = report([(0, 1, 0.01), (1, 0, 0.1)])
    rows = judge_links(AcceptCriteria(min_busbw_gbps=0.1), slow.facts(), [])
    assert [(r.on, r.met) for r in rows] == [
        ("all-reduce over 4 ranks", True), ("the slowest of 2 links: node 1 (b) -> node 0 (a)", False)]
    assert missed(rows)[0].value == pytest.approx(MiB4 / 0.1 / 1e9)
    (row,) = judge_links(AcceptCriteria(min_busbw_gbps=0.1), None, [])
    assert row.met is None and "one rank" in row.why
    (row,) = judge_links(AcceptCriteria(max_step_time_spread=0.2), None,
                         [("rank 0 (cpu:0)", 1.0), ("rank 1 (cpu:1)", 1.5)])
    assert (row.value, row.met, row.on) == (0.5, False, "rank 1 (cpu:1) 1.5 s a step against rank 0 (cpu:0) 1 s")
    assert judge_links(AcceptCriteria(), slow.facts(), [("r0", 1.0), ("r1", 9.0)]) == []  # not set: no row
    assert judge_links(AcceptCriteria(max_step_time_spread=0.2), None, [("r0", 1.0)])[0].met is None


def test_the_record_table_round_trips():
    slow = report([(0, 1, 0.01), (1, 0, 0.1)])
    again = LinkReport.from_table(slow.to_table())
    assert again == slow and again.facts() == LinkFacts(
        collectives=(("all-reduce over 4 ranks", busbw_gbps("all_reduce", 4, MiB4, 0.01)),),
        pairs=(("node 0 (a) -> node 1 (b)", MiB4 / 0.01 / 1e9), ("node 1 (b) -> node 0 (a)", MiB4 / 0.1 / 1e9)))


@pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="the committed record's checks use ssh-keygen")
def test_verify_recomputes_the_links_from_their_bytes_and_seconds():
    from tests.records import path_of

    rec = tomllib.loads(path_of("lora").read_text())
    rec["probe"]["links"] = report([(0, 1, 0.01), (1, 0, 0.1)]).to_table()
    assert not [p for p in recompute_verdicts(rec) if "links" in p]
    rec["accept"]["min_busbw_gbps"] = 0.1
    rec["accept"]["not_set"].remove("min_busbw_gbps")
    problems = recompute_verdicts(rec)
    assert any("probe" in p and "fail" in p for p in problems), problems  # the record says pass; its links fail
    rec = tomllib.loads(path_of("lora").read_text())
    table = report([(0, 1, 0.01), (1, 0, 0.1)]).to_table()
    table["pairs"][1]["busbw_gbps"] = 0.42  # the slow link written up as a fast one
    table["slow"] = []
    rec["probe"]["links"] = table
    problems = recompute_verdicts(rec)
    assert any("pairs[1].busbw_gbps is 0.42, but its bytes and seconds give 0.0419" in p for p in problems), problems
    assert any("probe.links.slow is []" in p for p in problems), problems
    table = report([(0, 1, 0.01), (1, 0, 0.1)]).to_table()
    table["pairs"][1]["best_busbw_gbps"] = 0.42  # its fastest operation written up as a fast one
    rec["probe"]["links"] = table
    assert any("pairs[1].best_busbw_gbps is 0.42, but its bytes and seconds give 0.0419" in p
               for p in recompute_verdicts(rec))
    del table["pairs"][1]["best_seconds"]  # a best bandwidth with nothing to recompute it from is not taken on trust
    from core.record.verdicts import RecordValueError

    with pytest.raises(RecordValueError, match=r"pairs\[1\]\.best_seconds is missing"):
        recompute_verdicts(rec)
