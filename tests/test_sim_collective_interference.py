"""``Hardware.collective_interference``: a collective progresses more slowly while its ranks
compute (gloo's collective thread shares the core with the GEMM on the CPU testbed); P2P
transfers are not affected. Pure, no processes: Hardware built here, times from the
simulator's arithmetic."""

import pytest

from commfuse import sim
from commfuse.schedule import OPS
from commfuse.sim import Hardware

# no latency, no host costs, no compute interference: a sliced op's chunks are x s of
# collective alone and c s of GEMM
HW = Hardware(gemm_flops=1e12, link_bandwidth=1e9, link_latency=0.0, mem_bandwidth=1e18)
SLOW = HW.with_(collective_interference=1.0)  # half speed beside a GEMM


def _spans(r, kind, rank=0):
    return sorted((s for s in r.timeline if s.kind == kind and s.rank == rank),
                  key=lambda s: s.start)


def test_rejects_a_negative_value():
    with pytest.raises(ValueError, match="collective_interference"):
        HW.with_(collective_interference=-0.1)


def test_sliced_all_gather_beside_a_gemm_runs_at_half_speed():
    """Transfer-bound sliced AG->GEMM (chunk collective x longer than twice the chunk GEMM c):
    chunk 0 runs alone, chunks 1-3 each beside one GEMM, so each makes c/2 of progress in
    those c seconds and takes x + c/2; the step grows by 3 c/2."""
    shape = (2 * 4 * 1000, 2000, 64)  # chunk: 1000 rows x 2000 x 4 B each way, 8 ms; GEMM 1 ms
    base = sim.simulate_op("ag_matmul", "sliced", 2, shape, 4, HW)
    slow = sim.simulate_op("ag_matmul", "sliced", 2, shape, 4, SLOW)
    x = _spans(base, "collective")[0].end - _spans(base, "collective")[0].start
    c = _spans(base, "compute")[0].end - _spans(base, "compute")[0].start
    assert x > 2 * c
    lengths = [s.end - s.start for s in _spans(slow, "collective")]
    assert lengths == pytest.approx([x] + [x + c / 2] * 3)
    assert slow.total_s == pytest.approx(base.total_s + 3 * c / 2)


def test_a_collective_that_ends_within_the_gemm_only_stretches_to_twice_its_length():
    """Compute-bound (2 x < c): each collective beside a GEMM ends at 2 x, still within the
    GEMM, so the step does not change."""
    shape = (2 * 4 * 1000, 64, 4000)
    base = sim.simulate_op("ag_matmul", "sliced", 2, shape, 4, HW)
    slow = sim.simulate_op("ag_matmul", "sliced", 2, shape, 4, SLOW)
    x = _spans(base, "collective")[0].end - _spans(base, "collective")[0].start
    assert 2 * x < _spans(base, "compute")[0].end - _spans(base, "compute")[0].start
    assert [s.end - s.start for s in _spans(slow, "collective")] == pytest.approx([x] + [2 * x] * 3)
    assert slow.total_s == pytest.approx(base.total_s)


def test_a_collective_alone_and_p2p_transfers_are_not_slowed():
    """``none`` runs its collective with nothing beside it; P2P schedules have no collective."""
    shape = (2 * 4 * 1000, 2000, 64)
    for op in OPS:
        for method, opts in (("none", {}), ("commfuse", {"splits": 4}), ("decompose", {})):
            a = sim.simulate_op(op, method, 2, shape, 4, HW, timeline=False, **opts)
            b = sim.simulate_op(op, method, 2, shape, 4, SLOW, timeline=False, **opts)
            assert b.total_s == a.total_s, (op, method)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("w", (2, 3, 4))
def test_symmetric_run_equals_the_full_run(op, w):
    hw = SLOW.with_(interference=0.3, collective_efficiency=0.8, host_collective_s=30e-6,
                    link_latency=20e-6, m0=8.0, n0=8.0, k0=32.0)
    shape = (w * 4 * 96, 512, 768)
    full = sim.simulate_op(op, "sliced", w, shape, 4, hw, timeline=False)
    sym = sim.simulate_op(op, "sliced", w, shape, 4, hw, symmetric=True, timeline=False)
    assert sym.total_s == pytest.approx(full.total_s, rel=1e-12)
