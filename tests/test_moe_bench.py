"""MoE in ``commfuse bench`` and on the simulator (`commfuse.bench.moe`, `commfuse.sim.moe`),
and commfuse's pieces per slot (``splits``) and the backward's tail in the MoE schedules.

Pure: the routings give the load they promise, seeded; the split schedules match message for
message and run together; the simulated MoE ops cost more with more bytes, nothing for a peer
that moves no rows, and auto's choice is the fastest candidate. On 2 and 3 gloo ranks (one
`run_local` each): the EP layer with commfuse in pieces equals the unsharded float64
reference (outputs and every gradient); on 2, every MoE bench workload runs every method,
forward and backward, with both routings, and every method's outputs and gradients agree.
"""

from __future__ import annotations

import random

import pytest

from commfuse.schedule import Compute, Post, Wait, WaitCollective
from commfuse.schedule.moe import TAIL, ExpertCounts, build, piece
from commfuse.sim import moe as sim
from commfuse.sim.hardware import preset

HW = preset("cpu-testbed")


def test_routings_give_the_load_they_promise():
    bal = sim.routing_counts("balanced", 100, 8, 2, 2)
    assert all(max(row) - min(row) <= 1 and sum(row) == 200 for row in bal.tokens)
    zipf = sim.route_tokens("zipf", 400, 8, 2, 2, seed=3)
    assert all(len(set(t)) == 2 for mine in zipf for t in mine)  # k distinct experts
    table = sim.counts_of(zipf, 8).tokens
    load = sorted((sum(row[e] for row in table) for e in range(8)), reverse=True)
    assert load[0] > 3 * load[-1] and load[0] > 2 * sum(load) / 8  # a hot expert, cold ones
    assert sim.route_tokens("zipf", 400, 8, 2, 2, seed=3) == zipf  # seeded
    assert sim.route_tokens("zipf", 400, 8, 2, 2, seed=4) != zipf
    flat = sim.counts_of(sim.route_tokens("zipf", 400, 8, 2, 2, zipf_s=0.0), 8).tokens
    assert max(max(r) for r in flat) < 1.5 * min(min(r) for r in flat)  # s=0: uniform
    for bad in (("skewed", 4, 8, 2, 2), ("zipf", 4, 8, 9, 2), ("zipf", 4, 7, 2, 2)):
        with pytest.raises(ValueError):
            sim.route_tokens(*bad)


def _tables():
    rng = random.Random(46)
    yield ExpertCounts(((0, 3), (5, 0)))  # every row leaves its rank
    yield ExpertCounts(((2, 0, 0, 1), (0, 0, 0, 0)))
    for _ in range(25):
        w, local = rng.randint(2, 4), rng.randint(1, 2)
        yield ExpertCounts(tuple(tuple(rng.choice((0, 1, 2, 5, 9)) for _ in range(w * local))
                                 for _ in range(w)))


@pytest.mark.parametrize("op", ["moe_dispatch", "moe_combine"])
def test_split_schedules_match_and_tail_comes_before_the_final_waits(op):
    for c in _tables():
        for m in (2, 3):
            scheds = [build(op, "commfuse", c, r, splits=m, tail=True) for r in range(c.world)]
            sends = {(r, t.peer, t.tag): t for r, s in enumerate(scheds)
                     for t in s.transfers() if t.kind == "send"}
            recvs = {(t.peer, r, t.tag): t for r, s in enumerate(scheds)
                     for t in s.transfers() if t.kind == "recv"}
            assert set(sends) == set(recvs), (c, m)
            for (src, dst, _), t in sends.items():
                r = recvs[(src, dst, _)]
                moved = c.rows[src][dst] if op == "moe_dispatch" else c.rows[dst][src]
                assert t.slot % m == r.slot % m and piece(moved, m, t.slot % m)[1] > 0
            for r, s in enumerate(scheds):
                computes = s.computes()
                assert computes.count(TAIL) == 1
                rows = [c.rows[p][r] for p in range(c.world)]
                assert sorted(x for x in computes if x != TAIL) == sorted(
                    p * m + j for p in range(c.world) for j in range(m)
                    if piece(rows[p], m, j)[1])
                at = s.steps.index(Compute(TAIL))
                assert all(isinstance(x, Wait) for x in s.steps[at + 1:])
                assert not any(isinstance(x, Post) for x in s.steps[at:])
        for method in ("none", "sliced"):
            s = build(op, method, c, 0, tail=True)
            if method == "none":
                assert TAIL not in s.computes()  # none: strictly collective, then GEMMs
            elif op == "moe_combine":
                at = s.steps.index(Compute(TAIL))
                assert all(isinstance(x, WaitCollective) for x in s.steps[at + 1:])


def test_simulated_moe_ops_cost_what_they_move():
    c = sim.routing_counts("balanced", 512, 8, 2, 2)
    for op in ("moe_dispatch", "moe_combine"):
        for method, o in (("none", {}), ("sliced", {}), ("commfuse", {}),
                          ("commfuse", {"splits": 4})):
            narrow = sim.moe_op_time(op, method, c, 256, 256, HW, **o)
            wide = sim.moe_op_time(op, method, c, 1024, 1024, HW, **o)
            assert wide > narrow, (op, method)
            fast = sim.moe_op_time(op, method, c, 256, 256, HW.with_(link_bandwidth=1e12), **o)
            assert fast < narrow
    local = ExpertCounts(((300, 200, 0, 0), (0, 0, 100, 400)))  # no row leaves its rank
    for op in ("moe_dispatch", "moe_combine"):
        for method in ("none", "sliced", "commfuse"):
            ops = [sim.MoEOp(op, method, 512, 512)]
            slow = sim.simulate_moe(ops, local, HW.with_(link_bandwidth=1e3)).total_s
            assert slow == pytest.approx(sim.simulate_moe(ops, local, HW).total_s), \
                (op, method)  # the link never carries a byte
        mine = sim.simulate_moe([sim.MoEOp(op, "commfuse", 512, 512)], local, HW)
        assert mine.total_s == pytest.approx(mine.compute_s)  # no message at all
    skew = ExpertCounts(((100, 100, 900, 900), (100, 100, 900, 900)))
    free = HW.with_(link_bandwidth=1e15, link_latency=0.0, host_collective_s=0.0)
    t = sim.simulate_moe([sim.MoEOp("moe_dispatch", "none", 512, 512)], skew, free).rank_s
    assert t[1] > 3 * t[0]  # the hot experts' rank does 9 times the rows' GEMMs


def test_auto_is_the_fastest_candidate_and_the_layer_adds_up():
    c = sim.routing_counts("zipf", 1024, 8, 2, 2)
    method, opts, best = sim.fastest("moe_dispatch", c, 512, 1024, HW, 4, 50e-6)
    for m, o in sim.CANDIDATES:
        ops = [sim.MoEOp("moe_dispatch", m, 512, 1024, o.get("chunks", 4), o.get("splits", 1))]
        assert sim.simulate_moe(ops, c, HW, 4, 50e-6).total_s >= best - 1e-12
    assert (method, opts) in [(m, o) for m, o in sim.CANDIDATES]
    rep = sim.representative(c)  # what auto decides on: balanced, about the same rows
    assert len({n for row in rep.tokens for n in row}) == 1
    assert abs(sum(map(sum, rep.tokens)) / 4096 - 1) < 0.1
    assert sim.choose("moe_dispatch", c, 512, 1024, HW, 4) == sim.choose(
        "moe_dispatch", sim.routing_counts("balanced", 1024, 8, 2, 2), 512, 1024, HW, 4)
    fwd = sim.moe_layer_time(c, (512, 512), HW, "none", backward=False)
    both = sim.moe_layer_time(c, (512, 512), HW, "none")
    auto = sim.moe_layer_time(c, (512, 512), HW, "auto", step_s=50e-6)
    assert 2 < both.total_s / fwd.total_s < 4 and fwd.compute_s < fwd.total_s
    assert auto.total_s <= sim.moe_layer_time(c, (512, 512), HW, "none", step_s=50e-6).total_s


def _exact(rank, world):
    """The EP layer with commfuse in pieces against the unsharded reference (test_moe_ops'
    case, on this module's methods)."""
    from test_moe_ops import _good_case

    import torch.distributed as dist

    failures = []
    for routing in ("zipf", "starved"):
        for method, opts in (("commfuse", {"splits": 2}), ("commfuse", {"splits": 3})):
            case = f"e2k2-{routing}-{method}{opts}"
            try:
                failures += [f"{case}: {b}" for b in _good_case(
                    rank, world, dist.group.WORLD, "e2k2", routing, method, opts)]
            except Exception as e:
                failures.append(f"{case}: {type(e).__name__}: {e}")
    return failures


def _workloads(rank, world):
    """Every MoE workload and method, both routings, forward and backward: runs, and every
    method's output and gradients equal none's."""
    import torch

    from commfuse.bench import workloads
    from commfuse.bench.moe import METHODS, MoEOptions
    from commfuse.ops.auto import set_hardware
    from commfuse.schedule import VARIANTS

    set_hardware("cpu-testbed")
    failures = []
    for routing in ("balanced", "zipf"):
        o = MoEOptions(experts=4, top_k=2, routing=routing)
        for name in workloads.MOE:
            ref = None
            for label in METHODS:
                method, opts = VARIANTS[label]
                step = workloads.build(name, world, rank, 32, 16, torch.float32, 8, o)
                try:
                    step(method, opts, False)
                    out = step.forward(method, opts)
                    out.backward(torch.ones_like(out))
                except Exception as e:
                    failures.append(f"{routing} {name} {label}: {type(e).__name__}: {e}")
                    continue
                got = [out.detach(), *(t.grad for t in step.leaves)]
                if ref is None:
                    ref = got
                elif any((a - b).abs().max() > 1e-5 for a, b in zip(got, ref)):
                    failures.append(f"{routing} {name} {label}: differs from none")
    return failures


def _all(rank, world):
    return _exact(rank, world) + (_workloads(rank, world) if world == 2 else [])


@pytest.mark.parametrize("world", [2, 3])
def test_moe_splits_exact_and_bench_workloads_run(world):
    from commfuse.testbed.spawn import run_local

    results = run_local(_all, world, timeout=240, pg_timeout_s=30)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures)
