"""The timeline simulator (commfuse.sim): pure, fast, no processes."""

import json
import time

import pytest

from commfuse import sim
from commfuse.schedule import OPS
from commfuse.sim import Hardware, OpSpec

HW = Hardware(gemm_flops=100e12, link_bandwidth=100e9, link_latency=5e-6, mem_bandwidth=2e12,
              m0=64.0, n0=64.0, k0=64.0)


def test_hardware_validation_and_presets():
    with pytest.raises(ValueError):
        Hardware(gemm_flops=0, link_bandwidth=1, link_latency=0)
    with pytest.raises(ValueError):
        Hardware(gemm_flops=1, link_bandwidth=1, link_latency=0, interference=-1)
    with pytest.raises(ValueError):
        Hardware(gemm_flops=1, link_bandwidth=1, link_latency=0, link_straggler={0: 0.5})
    with pytest.raises(ValueError):
        sim.preset("nope")
    assert HW.gemm_efficiency(64, 64, 64) < HW.gemm_efficiency(4096, 4096, 4096) < 1
    for name in ("h100-nvlink", "h200-nvlink", "a100-nvlink", "ascend910b-hccs", "pcie-node",
                 "multinode-100g", "multinode-200g", "multinode-400g", "cpu-testbed"):
        r = sim.simulate_op("matmul_rs", "commfuse", 4, (4096, 1024, 1024), 2, name)
        assert r.total_s > 0


@pytest.mark.parametrize("op", OPS)
def test_none_is_compute_plus_collective(op):
    w, shape = 4, (8192, 2048, 4096)
    r = sim.simulate_op(op, "none", w, shape, 2, HW)
    c = sim.op_costs(OpSpec(op, "none", shape), w, 1, 2)
    gemm = HW.gemm_time(*c.gemm)
    coll = HW.collective_time(c.collective, c.collective_bytes, w)
    assert r.compute_s == pytest.approx(gemm, rel=1e-12)
    assert r.total_s == pytest.approx(gemm + coll, rel=1e-12)
    assert r.exposed_comm_s == pytest.approx(coll, rel=1e-9)


def test_matmul_rs_exposure_by_method():
    """Transfer per step (16 MB at 100 GB/s = 0.16 ms) < GEMM per slot (0.34 ms)."""
    w, shape = 4, (16384, 4096, 2048)
    res = {m: sim.simulate_op("matmul_rs", m, w, shape, 2, HW) for m in
           ("none", "sliced", "decompose", "commfuse")}
    c = sim.op_costs(OpSpec("matmul_rs", "commfuse", shape), w, w, 2)
    step = c.transfer_bytes / HW.link_bandwidth + HW.link_latency
    assert step < HW.gemm_time(*c.gemm)
    # commfuse: everything hidden but a latency (the final add is compute, in compute_s)
    assert res["commfuse"].exposed_comm_s < 0.01 * res["none"].exposed_comm_s
    # sliced: one chunk's collective exposed at the tail
    cs = sim.op_costs(OpSpec("matmul_rs", "sliced", shape), w, 4, 2)
    tail = HW.collective_time(cs.collective, cs.collective_bytes, w)
    assert res["sliced"].exposed_comm_s == pytest.approx(tail, rel=0.05)
    # decompose: every step's transfer exposed
    assert res["decompose"].exposed_comm_s == pytest.approx((w - 1) * step, rel=0.05)
    assert res["commfuse"].total_s < res["sliced"].total_s < res["none"].total_s


def test_deterministic():
    hw = HW.with_(interference=0.2, duplex_efficiency=0.7, link_straggler={2: 1.5})
    for op in OPS:
        a = sim.simulate_op(op, "commfuse", 4, (4096, 1024, 2048), 2, hw, topology="direct")
        b = sim.simulate_op(op, "commfuse", 4, (4096, 1024, 2048), 2, hw, topology="direct")
        assert a == b


def _send_durations(r):
    return [s.end - s.start for s in r.timeline if s.kind == "send" and s.rank == 0]


def test_contention_direct_sends_share_egress():
    rows, k, n = 2048, 4096, 1024  # same bytes per transfer in both runs
    one = sim.simulate_op("ag_matmul", "commfuse", 2, (2 * rows, k, n), 2, HW, topology="direct")
    three = sim.simulate_op("ag_matmul", "commfuse", 4, (4 * rows, k, n), 2, HW,
                            topology="direct")
    d1, d3 = _send_durations(one), _send_durations(three)
    assert len(d1) == 1 and len(d3) == 3
    assert min(d3) > 2.5 * d1[0]  # three at once on one egress: each ~3x longer


def _others(r, straggler):
    return max(t for rank, t in enumerate(r.rank_s) if rank != straggler)


def test_straggler_ring_vs_direct():
    """What the model says (not what we hoped): a slow *compute* rank delays everyone on the
    ring but nobody else under direct AG; a slow *link* hurts both alike (RS) or direct more
    (AG: the straggler's W-1 sends all start at once on its slow egress)."""
    w, shape = 8, (8 * 4096, 4096, 4096)
    t = {}
    for topo in ("ring", "direct"):
        for op in ("ag_matmul", "matmul_rs"):
            base = sim.simulate_op(op, "commfuse", w, shape, 2, HW, topology=topo).total_s
            for kind in ("compute_straggler", "link_straggler"):
                r = sim.simulate_op(op, "commfuse", w, shape, 2, HW.with_(**{kind: {1: 4.0}}),
                                    topology=topo, timeline=False)
                t[topo, op, kind] = (r.total_s / base, _others(r, 1) / base)
    assert t["direct", "ag_matmul", "compute_straggler"][1] < 1.01  # others unaffected
    assert t["ring", "ag_matmul", "compute_straggler"][1] > 2
    assert t["direct", "matmul_rs", "compute_straggler"][1] < \
        t["ring", "matmul_rs", "compute_straggler"][1]
    assert t["ring", "ag_matmul", "link_straggler"][0] <= \
        t["direct", "ag_matmul", "link_straggler"][0]
    assert t["ring", "matmul_rs", "link_straggler"][0] == pytest.approx(
        t["direct", "matmul_rs", "link_straggler"][0], rel=0.05)


def test_paper_table1():
    r = sim.paper_table1()
    print({k: round(v * 1e3, 2) for k, v in r.items() if isinstance(v, float)})
    assert r["vanilla"] == pytest.approx(122.3e-3, rel=0.02)
    assert r["vanilla_exposed"] == pytest.approx(43.8e-3, rel=0.02)
    assert r["commfuse"] < r["sliced"] < r["vanilla"]
    assert r["commfuse_exposed"] < 0.5e-3


def test_scale():
    t0 = time.process_time()  # this process's CPU time: not stretched by other processes
    r = sim.simulate_op("matmul_rs", "sliced", 1024, (1024 * 64, 4096, 4096), 2, HW,
                        timeline=False)
    specs = [OpSpec(op, "commfuse", shape) for _ in range(80) for op, shape in (
        ("ag_matmul", (8192, 4096, 3072)), ("matmul_rs", (8192, 1024, 4096)),
        ("ag_matmul", (8192, 4096, 4096)), ("matmul_rs", (8192, 4096, 4096)))]
    stack = sim.simulate_ops(specs, 4, 2, HW, timeline=False)
    assert time.process_time() - t0 < 4.0
    assert r.total_s > 0 and stack.total_s > 0


def test_trace_and_timeline(tmp_path):
    r = sim.simulate_op("matmul_rs", "commfuse", 4, (4096, 1024, 1024), 2, HW)
    kinds = {s.kind for s in r.timeline}
    assert {"compute", "reduce", "send", "recv"} <= kinds
    assert all(s.end >= s.start for s in r.timeline)
    path = tmp_path / "t.json"
    r.write_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1, 2, 3}


@pytest.mark.parametrize("method", ("none", "sliced", "decompose", "commfuse"))
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("w", (1, 2, 3, 4))
def test_every_schedule_completes(op, method, w):
    r = sim.simulate_op(op, method, w, (w * 1024, 512, 512), 2, HW, splits=2, chunks=3)
    assert r.total_s >= r.compute_s > 0


def test_simulate_layer():
    r = sim.simulate_layer("commfuse", 4, 8192, 1024, 2, HW, layers=2)
    one = sim.simulate_layer("commfuse", 4, 8192, 1024, 2, HW)
    assert r.total_s == pytest.approx(2 * one.total_s, rel=0.05)


def test_collectives_run_one_at_a_time():
    """Comm-bound: sliced's chunk collectives queue on one stream, so sliced >= all its comm."""
    slow = HW.with_(link_bandwidth=1e9)
    none = sim.simulate_op("matmul_rs", "none", 4, (8192, 2048, 2048), 2, slow)
    sliced = sim.simulate_op("matmul_rs", "sliced", 4, (8192, 2048, 2048), 2, slow, chunks=4)
    assert sliced.total_s >= none.exposed_comm_s
    assert sliced.total_s < none.total_s


SYM_HW = HW.with_(interference=0.2, duplex_efficiency=0.7, collective_efficiency=0.8,
                  host_collective_s=20e-6, host_p2p_s=10e-6)


@pytest.mark.parametrize("method,opts", [("none", {}), ("sliced", {"chunks": 3}),
                                         ("decompose", {}), ("commfuse", {"splits": 2}),
                                         ("commfuse", {"topology": "direct"})])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("w", (2, 3, 5))
def test_symmetric_run_equals_the_full_run(op, method, opts, w):
    """Rank 0 alone, by rotation symmetry, times every rank exactly as the full run does."""
    shape = (w * 768, 512, 1024)
    full = sim.simulate_op(op, method, w, shape, 2, SYM_HW, timeline=False, **opts)
    sym = sim.simulate_op(op, method, w, shape, 2, SYM_HW, symmetric=True, **opts)
    assert sym.total_s == pytest.approx(full.total_s, rel=1e-12)
    assert sym.compute_s == pytest.approx(full.compute_s, rel=1e-12)
    assert sym.rank_s == pytest.approx(full.rank_s, rel=1e-12)
    assert {s.rank for s in sym.timeline} == {0}


def test_symmetric_needs_identical_ranks():
    with pytest.raises(ValueError, match="stragglers"):
        sim.simulate_op("ag_matmul", "commfuse", 4, (4096, 512, 512), 2,
                        HW.with_(link_straggler={1: 2.0}), symmetric=True)


def test_host_costs_are_work_before_each_launch():
    w, shape, host = 4, (8192, 2048, 4096), 1e-3
    base = sim.simulate_op("matmul_rs", "none", w, shape, 2, HW)
    none = sim.simulate_op("matmul_rs", "none", w, shape, 2, HW.with_(host_collective_s=host))
    assert none.total_s == pytest.approx(base.total_s + host, rel=1e-12)  # one launch, exposed
    assert none.compute_s == base.compute_s  # host time is not compute alone
    assert any(s.kind == "host" for s in none.timeline)
    p2p = {h: sim.simulate_op("ag_matmul", "decompose", w, shape, 2, HW.with_(host_p2p_s=h))
           for h in (0.0, host)}
    assert p2p[host].total_s == pytest.approx(p2p[0.0].total_s + (w - 1) * host, rel=1e-9)
    with pytest.raises(ValueError):
        HW.with_(host_p2p_s=-1)


@pytest.mark.parametrize("method", ["none", "commfuse"])
def test_first_touch_of_fresh_buffers_is_compute(method):
    """Fresh buffers of first_touch_bytes or more cost their bytes at first_touch_bandwidth,
    as compute (in compute alone too); smaller ones, and the default (0), nothing."""
    w, d, bw = 2, 4, 1e9
    big, small = (4096, 1024, 4096), (512, 256, 512)  # AG: gathered [M, K], product [M, N]
    for shape, charged in ((big, (4096 * 1024 + 4096 * 4096) * d), (small, 0)):
        base = sim.simulate_op("ag_matmul", method, w, shape, d, HW)
        touched = sim.simulate_op("ag_matmul", method, w, shape, d,
                                  HW.with_(first_touch_bandwidth=bw, first_touch_bytes=2 ** 24))
        assert touched.compute_s == pytest.approx(base.compute_s + charged / bw, rel=1e-9)
        if method == "none":  # the gather, then the GEMM: nothing hides it
            assert touched.total_s == pytest.approx(base.total_s + charged / bw, rel=1e-9)
        else:  # beside transfers some of it may hide
            assert base.total_s <= touched.total_s <= base.total_s + charged / bw * (1 + 1e-9)
    assert HW.first_touch_time([2 ** 40]) == 0.0
    with pytest.raises(ValueError):
        HW.with_(first_touch_bandwidth=-1)


def test_first_touch_follows_the_buffers_each_method_allocates():
    """GEMM -> RS: ``none`` computes one [M, N] partial, P2P methods one partial per slot and
    receive into and sum into buffers of that size, so whether the pieces fault depends on
    the method (the result [M/W, N] is fresh under all of them)."""
    w, d, bw, (M, K, N) = 2, 4, 1e9, (4096, 1024, 4096)
    hw = HW.with_(first_touch_bandwidth=bw, first_touch_bytes=2 ** 25)  # 32 MiB
    result, slot = M / w * N * d, M / w * N * d  # 32 MiB each: charged
    charged = {("none", 1): M * N * d + result,  # the 64 MiB partial and the result
               ("commfuse", 1): 2 * slot + slot + result,  # two partials, one receive
               ("commfuse", 2): result,  # 16 MiB pieces reuse freed memory
               ("sliced", 1): result}  # four 16 MiB chunks
    for (method, splits), nbytes in charged.items():
        opts = {"splits": splits} if method == "commfuse" else {}
        base = sim.simulate_op("matmul_rs", method, w, (M, K, N), d, HW, **opts)
        touched = sim.simulate_op("matmul_rs", method, w, (M, K, N), d, hw, **opts)
        assert touched.compute_s == pytest.approx(base.compute_s + nbytes / bw, rel=1e-9), \
            (method, splits)


def test_links_of_another_hardware():
    inter = sim.preset("multinode-100g")
    mixed = HW.with_links_of(inter)
    assert mixed.gemm_flops == HW.gemm_flops and mixed.link_bandwidth == inter.link_bandwidth
    assert mixed.link_latency == inter.link_latency


def test_simulate_cli_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from commfuse.sim.cli import main_simulate

    png = tmp_path / "t.png"
    assert main_simulate(["--op", "ag_matmul", "--world", "2", "--shape", "2048,512,512",
                          "--png", str(png)]) == 0
    assert png.stat().st_size > 1000 and "wrote" in capsys.readouterr().out


def test_gpu_splits_shrink_as_the_host_cost_per_post_grows():
    """On a GPU preset (host launches ahead: ``host_async``) the host's cost per post caps the
    pieces: the m `best_splits` picks never grows with ``host_p2p_s``, and drops where the
    posts would take the host longer than the op computes; `fastest` skips such candidates."""
    from commfuse.sim import preset
    from commfuse.sim.choose import CANDIDATES, best_splits, fastest, launch_bound

    base = preset("pcie-node")
    assert base.host_async and 50e-6 <= base.host_p2p_s <= 150e-6
    shapes = [(op, shape, w) for op in ("ag_matmul", "matmul_rs")
              for shape, w in (((32768, 4096, 4096), 4), ((131072, 4096, 4096), 4),
                               ((8192, 4096, 4096), 8))]
    costs = (0.0, 60e-6, 150e-6, 1e-3, 4e-3)
    ms = {k: [best_splits(*k[:2], k[2], 2, base.with_(host_p2p_s=c), 10e-6) for c in costs]
          for k in shapes}
    for k, row in ms.items():
        assert all(a >= b for a, b in zip(row, row[1:])), (k, row)
    assert any(row[0] > row[-1] for row in ms.values()), ms
    assert ms[("ag_matmul", (131072, 4096, 4096), 4)][:3] == [4, 4, 4]  # big GEMMs: no cap
    slow = base.with_(host_p2p_s=4e-3)
    method, opts, _ = fastest("ag_matmul", (32768, 4096, 4096), 4, 2, slow, 10e-6, CANDIDATES)
    assert opts.get("splits", 1) == 1
    assert not launch_bound("ag_matmul", "commfuse", 4, {"splits": 8}, 1e-9,
                            preset("cpu-testbed"))  # charged in the simulation there instead
