"""Schedules checked as data, with no processes: every property the executor relies on."""

from collections import Counter

import pytest

from commfuse import schedule as sch
from commfuse.schedule import Compute, Post, Reduce, Wait

P2P = [(m, t) for m in ("decompose", "commfuse") for t in sch.TOPOLOGIES]
SPLITS = (1, 3)
WORLDS = (1, 2, 3, 4, 5, 8)


def all_ranks(op, method, w, **kw):
    return [sch.build(op, method, w, r, **kw) for r in range(w)]


@pytest.mark.parametrize("op", sch.OPS)
@pytest.mark.parametrize("method,topology", P2P)
@pytest.mark.parametrize("w", WORLDS)
@pytest.mark.parametrize("m", SPLITS)
def test_every_slot_computed_exactly_once(op, method, topology, w, m):
    for s in all_ranks(op, method, w, topology=topology, splits=m):
        assert sorted(s.computes()) == list(range(w * m)) and s.chunks == w * m


@pytest.mark.parametrize("op", sch.OPS)
@pytest.mark.parametrize("method,topology", P2P)
@pytest.mark.parametrize("w", WORLDS)
@pytest.mark.parametrize("m", SPLITS)
def test_every_send_matched_by_a_receive_in_the_same_order(op, method, topology, w, m):
    scheds = all_ranks(op, method, w, topology=topology, splits=m)
    sends = Counter((s.rank, t.peer, t.tag) for s in scheds for t in s.transfers() if t.kind == "send")
    recvs = Counter((t.peer, s.rank, t.tag) for s in scheds for t in s.transfers() if t.kind == "recv")
    assert sends == recvs
    assert all(n == 1 for n in sends.values())
    # per ordered pair, sends and receives are posted in the same order (NCCL matches by order)
    for src in range(w):
        for dst in range(w):
            out = [t.tag for t in scheds[src].transfers() if t.kind == "send" and t.peer == dst]
            inc = [t.tag for t in scheds[dst].transfers() if t.kind == "recv" and t.peer == src]
            assert out == inc


@pytest.mark.parametrize("op", sch.OPS)
@pytest.mark.parametrize("method,topology", P2P + [("sliced", "ring"), ("none", "ring")])
@pytest.mark.parametrize("w", WORLDS)
@pytest.mark.parametrize("m", SPLITS)
def test_every_transfer_waited_exactly_once_after_it_is_posted(op, method, topology, w, m):
    for s in all_ranks(op, method, w, topology=topology, splits=m):
        posted, waited = [], []
        for step in s.steps:
            if isinstance(step, Post):
                posted += step.transfers
            elif isinstance(step, Wait):
                assert step.transfer in posted and step.transfer not in waited
                waited.append(step.transfer)
        assert Counter(posted) == Counter(waited)


@pytest.mark.parametrize("op", sch.OPS)
@pytest.mark.parametrize("topology", sch.TOPOLOGIES)
@pytest.mark.parametrize("w", WORLDS)
@pytest.mark.parametrize("m", SPLITS)
def test_commfuse_own_slot_first_on_gather_last_on_reduce(op, topology, w, m):
    for s in all_ranks(op, "commfuse", w, topology=topology, splits=m):
        order = [slot // m for slot in s.computes()]
        own = order[:m] if op in sch.GATHER_SIDE else order[-m:]
        assert own == [s.rank] * m


def _hidden_waits_violations(s):
    """Waits that leave ready compute idle or have no compute to hide behind."""
    bad = []
    steps = list(s.steps)
    last_compute = max(i for i, st in enumerate(steps) if isinstance(st, Compute))
    for i, st in enumerate(steps):
        if not isinstance(st, Wait):
            continue
        t = st.transfer
        posted = next(j for j, x in enumerate(steps) if isinstance(x, Post) and t in x.transfers)
        if not any(isinstance(x, Compute) for x in steps[posted:i]):
            bad.append(f"{t} waited with no compute since it was posted")
        if t.kind == "send" and i < last_compute:
            bad.append(f"{t} send waited while compute remains")
        if t.kind == "recv" and i < last_compute:
            nxt = next(x for x in steps[i + 1:] if isinstance(x, (Compute, Reduce, Wait)))
            if not (isinstance(nxt, (Compute, Reduce)) and nxt.slot == t.slot):
                bad.append(f"{t} waited before {nxt}, which does not need it")
    return bad


@pytest.mark.parametrize("op", sch.OPS)
@pytest.mark.parametrize("topology", sch.TOPOLOGIES)
@pytest.mark.parametrize("w", WORLDS)
@pytest.mark.parametrize("m", SPLITS)
def test_commfuse_never_waits_while_independent_compute_remains(op, topology, w, m):
    for s in all_ranks(op, "commfuse", w, topology=topology, splits=m):
        assert _hidden_waits_violations(s) == []


@pytest.mark.parametrize("op", sch.OPS)
def test_decompose_synchronises_every_step(op):
    # the property above is what tells commfuse from decompose
    assert _hidden_waits_violations(sch.build(op, "decompose", 4, 1))


def test_flash_rs_order_matches_the_paper():
    # 4 ranks, rank A=0 computes a4 (slot 3), a3+d3, a2+c2+d2, a1+b1+c1+d1 (its own, last)
    s = sch.build("matmul_rs", "commfuse", 4, 0)
    assert s.computes() == [3, 2, 1, 0]
    reduces = [st for st in s.steps if isinstance(st, Reduce)]
    assert [r.slot for r in reduces] == [2, 1, 0] and all(r.peers == (3, 0) for r in reduces)


def test_flash_ag_order_and_ring_neighbours():
    s = sch.build("ag_matmul", "commfuse", 4, 2)
    assert s.computes() == [2, 1, 0, 3]
    assert {t.peer for t in s.transfers() if t.kind == "send"} == {3}
    assert {t.peer for t in s.transfers() if t.kind == "recv"} == {1}


def test_direct_reduce_sums_in_rank_order():
    s = sch.build("matmul_rs", "commfuse", 4, 2, topology="direct")
    assert [st.peers for st in s.steps if isinstance(st, Reduce)] == [(0, 1, 2, 3)]


@pytest.mark.parametrize("op", sch.OPS)
@pytest.mark.parametrize("chunks", [1, 3])
def test_sliced_pipelines_collectives_with_compute(op, chunks):
    s = sch.build(op, "sliced", 4, 0, chunks=chunks)
    assert s.computes() == list(range(chunks))


@pytest.mark.parametrize("kw,match", [({"op": "nope"}, "op"), ({"method": "fast"}, "method"),
                                      ({"topology": "tree"}, "topology"), ({"chunks": 0}, "chunks"),
                                      ({"splits": 0}, "splits"),
                                      ({"rank": 4}, "rank")])
def test_bad_arguments_are_named(kw, match):
    args = {"op": "ag_matmul", "method": "commfuse", "world_size": 4, "rank": 0} | kw
    with pytest.raises(ValueError, match=match):
        sch.build(args.pop("op"), args.pop("method"), args.pop("world_size"), args.pop("rank"), **args)
