"""``Hardware.serial_p2p``: NCCL runs every P2P batch of a group on one stream, so a rank's
batches run one after another (commfuse.runtime.cuda); the GPU presets, and so ``auto`` on
CUDA, time schedules that way. Pure, no processes."""

import pytest

from commfuse import sim
from commfuse.schedule import VARIANTS
from commfuse.sim import Hardware
from commfuse.sim.choose import fastest

HW = Hardware(gemm_flops=100e12, link_bandwidth=100e9, link_latency=5e-6, mem_bandwidth=2e12,
              m0=64.0, n0=64.0, k0=64.0)
SHAPE = (8 * 2048, 4096, 1024)


def _recvs(r, rank=0):
    return sorted((s.start, s.end) for s in r.timeline if s.kind == "recv" and s.rank == rank)


@pytest.mark.parametrize("symmetric", [False, True])
def test_direct_batches_run_one_after_another(symmetric):
    concurrent = sim.simulate_op("ag_matmul", "commfuse", 8, SHAPE, 2, HW, topology="direct",
                                 symmetric=symmetric)
    serial = sim.simulate_op("ag_matmul", "commfuse", 8, SHAPE, 2, HW.with_(serial_p2p=True),
                             topology="direct", symmetric=symmetric)
    c, s = _recvs(concurrent), _recvs(serial)
    assert len(c) == len(s) == 7
    assert c[1][0] < c[0][1]  # gloo's model: the up-front receives overlap
    assert all(b[0] >= a[1] for a, b in zip(s, s[1:]))  # NCCL's: each starts when the last ends
    assert s[0][1] < c[0][1]  # the first slice arrives sooner (it has the link to itself)


def test_symmetric_run_equals_full_run_with_serial_batches():
    hw = HW.with_(serial_p2p=True)
    for op in ("ag_matmul", "matmul_rs", "matmul_a2a", "a2a_matmul"):
        for topo in ("ring", "direct"):
            full = sim.simulate_op(op, "commfuse", 4, SHAPE, 2, hw, topology=topo, timeline=False)
            sym = sim.simulate_op(op, "commfuse", 4, SHAPE, 2, hw, topology=topo,
                                  timeline=False, symmetric=True)
            assert sym.total_s == pytest.approx(full.total_s, rel=1e-9)


def test_gpu_presets_serialise_and_auto_times_them_so():
    for name in ("h100-nvlink", "h200-nvlink", "a100-nvlink", "pcie-node", "multinode-100g"):
        assert sim.preset(name).serial_p2p
    assert not sim.preset("cpu-testbed").serial_p2p
    hw = sim.preset("h100-nvlink")
    direct = [VARIANTS["commfuse-direct"]]
    _, _, t = fastest("ag_matmul", SHAPE, 8, 2, hw, step_s=0.0, candidates=direct)
    serial = sim.simulate_op("ag_matmul", "commfuse", 8, SHAPE, 2, hw, topology="direct").total_s
    concurrent = sim.simulate_op("ag_matmul", "commfuse", 8, SHAPE, 2,
                                 hw.with_(serial_p2p=False), topology="direct").total_s
    assert t == pytest.approx(serial, rel=1e-9) and serial != pytest.approx(concurrent, rel=1e-6)
