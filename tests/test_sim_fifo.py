"""``Hardware.fifo_per_peer``: gloo sends a rank's messages to one peer through one thread and
one connection (commfuse.runtime.gloo), so pieces posted together arrive one after another,
not all at the end; the `cpu-testbed` preset, and so ``auto`` on CPU, time schedules that way.
Pure, no processes: Hardware built here, times from the simulator's arithmetic."""

import pytest

from commfuse import sim
from commfuse.schedule import OPS
from commfuse.sim import Hardware
from commfuse.sim.choose import best_splits, fastest

# a link of 1 GB/s with no latency, no duplex loss, no host costs and free copies: arrivals
# are bytes / rate
LINK = Hardware(gemm_flops=1e12, link_bandwidth=1e9, link_latency=0.0, mem_bandwidth=1e18)
FIFO = LINK.with_(fifo_per_peer=True)


def _recv_ends(r, rank=0):
    return sorted(s.end for s in r.timeline if s.kind == "recv" and s.rank == rank)


@pytest.mark.parametrize("symmetric", [False, True])
def test_pieces_to_one_peer_arrive_one_after_another(symmetric):
    m, rows, k = 4, 1000, 250  # each piece: 1000 x 250 x 4 B = 1 MB, 1 ms on the link
    shape = (2 * m * rows, k, 64)
    fair = sim.simulate_op("ag_matmul", "commfuse", 2, shape, 4, LINK, splits=m,
                           symmetric=symmetric)
    fifo = sim.simulate_op("ag_matmul", "commfuse", 2, shape, 4, FIFO, splits=m,
                           symmetric=symmetric)
    assert _recv_ends(fair) == pytest.approx([4e-3] * m)  # fair shares: all at the end
    assert _recv_ends(fifo) == pytest.approx([1e-3, 2e-3, 3e-3, 4e-3])  # one at a time
    assert fifo.total_s < fair.total_s  # the first pieces' GEMMs start early


def test_transfers_to_different_peers_still_share_the_egress():
    """One connection per peer: the direct topology's sends to 3 peers run at once, each at a
    third of the egress, as without the FIFO (only a peer's own messages queue)."""
    shape = (4 * 1000, 250, 64)
    for hw in (LINK, FIFO):
        r = sim.simulate_op("ag_matmul", "commfuse", 4, shape, 4, hw, topology="direct")
        assert _recv_ends(r) == pytest.approx([3e-3] * 3)


SYM_HW = FIFO.with_(link_latency=20e-6, interference=0.3, duplex_efficiency=0.75,
                    collective_efficiency=0.8, host_collective_s=30e-6, host_p2p_s=20e-6,
                    m0=8.0, n0=8.0, k0=32.0)


@pytest.mark.parametrize("method,opts", [("decompose", {}), ("commfuse", {"splits": 4}),
                                         ("commfuse", {"topology": "direct", "splits": 2})])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("w", (2, 3, 4))
def test_symmetric_run_equals_the_full_run(op, method, opts, w):
    """Under symmetry a transfer's channel is its receiver's offset from its sender: rank 0
    alone still times every rank as the full run does."""
    shape = (w * 4 * 96, 512, 768)
    full = sim.simulate_op(op, method, w, shape, 4, SYM_HW, timeline=False, **opts)
    sym = sim.simulate_op(op, method, w, shape, 4, SYM_HW, symmetric=True, **opts)
    assert sym.total_s == pytest.approx(full.total_s, rel=1e-12)


# transfer-bound AG->GEMM: the gathered half moves in 2.0 s, the GEMM takes 0.5 s
TESTBED = Hardware(gemm_flops=2 * 2048 * 4096 * 1024 / 0.5, link_bandwidth=1024 * 4096 * 4 / 2.0,
                   link_latency=50e-6, mem_bandwidth=5e9, interference=0.3,
                   duplex_efficiency=1.0, host_p2p_s=3e-3)


def test_chooser_takes_finer_splits_when_the_transfer_dominates():
    """With pieces that arrive one after another, all but the last piece's GEMM hides behind
    the transfer: finer splits win where the transfer is much longer than the GEMM. With fair
    sharing the model saw almost no gain (every piece arriving near the end)."""
    shape = (2048, 4096, 1024)
    fifo = TESTBED.with_(fifo_per_peer=True)
    t, fair = ({m: sim.simulate_op("ag_matmul", "commfuse", 2, shape, 4, hw, splits=m,
                                   timeline=False).total_s for m in (1, 2, 4, 8)}
               for hw in (fifo, TESTBED))
    assert t[8] < t[4] < t[2] < t[1]
    # m=8: the first post's host time (the other 7 overlap the transfer, as does the copy of
    # the own rows, in their slots' compute), the transfer, then the last piece's GEMM
    assert t[8] == pytest.approx(3e-3 + 2.0 + 0.5 / 16, rel=1e-3)
    assert fair[1] - fair[8] < 0.25 * (t[1] - t[8])
    assert best_splits("ag_matmul", shape, 2, 4, fifo) == 8
    method, opts, _ = fastest("ag_matmul", shape, 2, 4, fifo)
    assert (method, opts.get("splits")) == ("commfuse", 8)


def test_cpu_testbed_preset_models_gloo_fifo():
    assert sim.preset("cpu-testbed").fifo_per_peer
    assert not any(sim.preset(n).fifo_per_peer for n in sim.PRESETS if n != "cpu-testbed")


def test_ag_p2p_copies_its_own_rows_in_their_compute_after_the_posts():
    """The P2P AG binding sends its own rows from the input and copies each own sub-slice
    into the gathered buffer in that slot's compute (a collective writes them itself):
    ``copy_time`` of M/W x K elements, on compute alone too, and nothing before the posts."""
    hw = LINK.with_(mem_bandwidth=1e9)
    shape = (2 * 1000, 250, 64)  # own rows: 1000 x 250 x 4 B = 1 MB, copied in 2 ms
    p2p = sim.simulate_op("ag_matmul", "commfuse", 2, shape, 4, hw, splits=2)
    assert min(s.start for s in p2p.timeline if s.kind == "recv") == 0.0
    gemm = 2 * 500 * 250 * 64 / 1e12  # one sub-slice's GEMM
    spans = {s.label: s.end - s.start for s in p2p.timeline if s.rank == 0 and s.kind == "compute"}
    own, peer = (spans[f"0:ag_matmul slot {slot}"] for slot in (0, 2))
    assert own == pytest.approx(gemm + 1e-3) and peer == pytest.approx(gemm)
    none = sim.simulate_op("ag_matmul", "none", 2, shape, 4, hw)
    assert not any("copy" in s.label for s in none.timeline)
    assert p2p.compute_s - none.compute_s == pytest.approx(2e-3, rel=0.05)
