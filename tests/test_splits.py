"""``method="commfuse"`` without ``splits``: m chosen per shape on the cost model.

The choice (`commfuse.sim.choose.best_splits`, cached by `commfuse.ops.auto.choose_splits`),
explicit ``splits`` winning, the issue's shape ranked against ``sliced`` on the simulator, and
exactness on 2 and 3 gloo ranks with a chosen m > 1 against an unsharded float64 reference.
"""

import pytest
import torch

from commfuse.ops import auto
from commfuse.ops.methods import method_spec
from commfuse.sim import simulate_op
from commfuse.sim.choose import STEP_OVERHEAD_S, SPLITS, best_splits, steps
from commfuse.sim.hardware import preset
from commfuse.testbed.spawn import run_local

ISSUE = (4096, 1024, 1024)  # S=4096, K=N=1024, float32, 2 ranks (issue #12)
# cpu-testbed scaled so that the tiny shapes below balance compute and transfers as ISSUE does
TINY_HW = preset("cpu-testbed").with_(gemm_flops=150e9 / 32768,
                                      link_bandwidth=1.238e9 / 8 / 1024, m0=0, n0=0, k0=0)


def _sim(op, method, opts, shape=ISSUE, world=2):
    """Predicted seconds, host time per schedule step included (as `auto` counts it)."""
    r = simulate_op(op, method, world, shape, 4, "cpu-testbed", timeline=False, **opts)
    return r.total_s + STEP_OVERHEAD_S["cpu"] * steps(op, method, world, opts)


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_comm_bound_shape_gets_splits_and_beats_sliced(op):
    m = best_splits(op, ISSUE, 2, 4, preset("cpu-testbed"))
    assert m > 1
    chosen = _sim(op, "commfuse", {"splits": m})
    assert chosen == min(_sim(op, "commfuse", {"splits": k}) for k in SPLITS)
    assert chosen <= _sim(op, "sliced", {"chunks": 4})
    assert chosen < _sim(op, "commfuse", {"splits": 1})


def test_compute_bound_and_tiny_shapes_keep_one():
    hw = preset("cpu-testbed")
    assert best_splits("ag_matmul", (4096, 1024, 4096), 2, 4, hw) == 1  # wide GEMM hides it
    assert best_splits("matmul_rs", (64, 16, 16), 2, 4, hw) == 1  # per-step host time wins
    assert best_splits("ag_matmul", ISSUE, 1, 4, hw) == 1


def test_resolve_picks_m_and_explicit_splits_win():
    auto.set_hardware("cpu-testbed")
    like = torch.ones(1)
    spec = method_spec("commfuse", {})
    assert spec.splits is None
    got = auto.resolve(spec, "ag_matmul", ISSUE, 2, like)
    assert got.splits == best_splits("ag_matmul", ISSUE, 2, 4, preset("cpu-testbed"),
                                     STEP_OVERHEAD_S["cpu"]) > 1
    assert auto.resolve(got, "ag_matmul", ISSUE, 2, like) == got
    for m in (1, 3):
        spec = method_spec("commfuse", {"splits": m})
        assert auto.resolve(spec, "ag_matmul", ISSUE, 2, like).splits == m
    assert method_spec("decompose", {}).splits == 1  # the baseline stays the paper's
    direct = auto.resolve(method_spec("commfuse", {"topology": "direct"}), "matmul_rs", ISSUE, 2,
                          like)
    assert direct.topology == "direct" and direct.splits >= 1
    chosen = auto.resolve(method_spec("auto", {}), "ag_matmul", ISSUE, 2, like)
    assert isinstance(chosen.splits, int)  # auto's choice is explicit, never re-chosen
    with pytest.raises(ValueError, match="splits"):
        method_spec("commfuse", {"splits": 0})


def _exact(rank, world):
    """Default commfuse (no splits) on TINY_HW: m > 1 is chosen; outputs and gradients of
    AG->GEMM and GEMM->RS against the unsharded float64 reference."""
    import commfuse

    auto.set_hardware(TINY_HW)
    s, K, N = 64, 32, 32
    g = torch.Generator().manual_seed(7)
    A = torch.randn(world * s, K, generator=g, dtype=torch.float64)
    Bs = [torch.randn(K, N, generator=g, dtype=torch.float64) for _ in range(world)]
    gy = torch.randn(world * s, N, generator=g, dtype=torch.float64)
    out, sl = [], slice(rank * s, (rank + 1) * s)
    a = A[sl].float().requires_grad_()
    b = Bs[rank].float().requires_grad_()
    _, (y,) = commfuse.fused_all_gather_matmul(a, [b], 0, method="commfuse")
    (y * gy.float()).sum().backward()
    m = _ran_with("ag_matmul", (world * s, K, N), world)
    # the loss is the sum of every rank's: dA sums every rank's gy @ B_r^T
    ref_a, ref_bs = A.clone().requires_grad_(), [x.clone().requires_grad_() for x in Bs]
    sum((ref_a @ rb * gy).sum() for rb in ref_bs).backward()
    out += [_rel(y, A @ Bs[rank]), _rel(a.grad, ref_a.grad[sl]),
            _rel(b.grad, ref_bs[rank].grad)]
    # GEMM->RS: rank r holds A_r [S, K] and B_r [K, N]; output sum_r A_r @ B_r, my rows
    As = [torch.randn(world * s, K, generator=g, dtype=torch.float64) for _ in range(world)]
    a = As[rank].float().requires_grad_()
    b = Bs[rank].float().requires_grad_()
    c = commfuse.fused_matmul_reduce_scatter(a, b, "sum", 0, method="commfuse")
    (c * gy[sl].float()).sum().backward()
    m_rs = _ran_with("matmul_rs", (world * s, K, N), world)
    refs = [x.clone().requires_grad_() for x in As + Bs]
    ref_c = sum(refs[q] @ refs[world + q] for q in range(world))
    (ref_c * gy).sum().backward()  # every rank's slice times its upstream grad, summed
    out += [_rel(c, ref_c[sl]), _rel(a.grad, refs[rank].grad),
            _rel(b.grad, refs[world + rank].grad)]
    return m, m_rs, out


def _ran_with(op, shape, world):
    """The m the op's call chose (it is in the cache only if the op asked for one)."""
    (m,) = [m for key, m in auto._SPLITS.items() if key[:3] == (op, shape, world)]
    return m


def _rel(x, ref):
    return ((x.double() - ref.detach()).norm() / ref.detach().norm()).item()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_default_commfuse_with_chosen_splits_is_exact(world):
    res = run_local(_exact, world, timeout=120)
    for m, m_rs, errs in res:
        assert m > 1 and m_rs > 1, (m, m_rs)
        assert max(errs) < 1e-5, errs
    assert len({(m, m_rs) for m, m_rs, _ in res}) == 1  # every rank chose the same


def test_search_stops_early_and_caps_the_pieces(monkeypatch):
    from commfuse.sim import choose

    tried, times = [], {1: 3.0, 2: 2.0, 4: 2.5, 8: 1.0}  # 8 would win: the search stops at 4
    fake = lambda op, shape, w, d, hw, s, cands, attention=(), moved=1.0: (
        tried.append(cands[0][1]["splits"]) or ("commfuse", {}, times[tried[-1]]))
    monkeypatch.setattr(choose, "fastest", fake)
    assert choose.best_splits("ag_matmul", ISSUE, 2, 4, None) == 2 and tried == [1, 2, 4]
    tried.clear()
    assert choose.best_splits("ag_matmul", ISSUE, choose.MAX_PIECES, 4, None) == 1
    assert tried == [1]  # W*2 pieces would exceed the cap
    tried.clear()
    times.update({2: 3.0})  # a tie keeps the smaller m
    assert choose.best_splits("ag_matmul", ISSUE, 2, 4, None) == 1 and tried == [1, 2]


def test_uneven_shards_choose_from_a_shape_every_rank_shares():
    """Under uneven column shards (``uniform_b=False``) AG->GEMM's N and GEMM->RS's K differ
    between ranks; the m (which sets the message sizes) must not, or the ranks' schedules
    would not match. With even shards (the default) the real local shape decides."""
    like = torch.empty(1)
    auto.set_hardware("cpu-testbed")
    for n_local in (1, 31, 32, 4096):
        assert auto.resolve(method_spec("commfuse", {}), "ag_matmul", (4096, 1024, n_local), 2,
                            like, uniform=False).splits == auto.choose_splits(
                                "ag_matmul", (4096, 1024, 1), 2, like, uniform=False)
        assert auto.resolve(method_spec("commfuse", {}), "matmul_rs", (4096, n_local, 1024), 2,
                            like, uniform=False).splits == auto.choose_splits(
                                "matmul_rs", (4096, 1, 1024), 2, like, uniform=False)
    # the real shape: a narrow GEMM beside a long transfer splits, a wide one need not
    real = [auto.resolve(method_spec("commfuse", {}), "ag_matmul", (4096, 1024, n), 2,
                         like).splits for n in (64, 16384)]
    assert real == [auto.choose_splits("ag_matmul", (4096, 1024, n), 2, like) for n in (64, 16384)]
    assert real[0] != real[1]
