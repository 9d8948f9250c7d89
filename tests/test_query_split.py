"""Query-split attention (`commfuse.ops.attention`): the balanced order and the block kernels
without processes; outputs and gradients against the unsharded reference on 2, 3 and 4 gloo
ranks, every method, both orders, even and uneven lengths."""

import pytest
import torch
import torch.nn.functional as F

from commfuse.ops import attn_blocks
from commfuse.ops.attention import balanced_split, query_split_attention
from commfuse.testbed.spawn import run_local

METHODS = [("none", {}), ("sliced", {"chunks": 2}), ("sliced", {"chunks": 3}), ("decompose", {}),
           ("commfuse", {}), ("commfuse", {"topology": "direct"}), ("commfuse", {"splits": 2}),
           ("auto", {})]


@pytest.mark.parametrize("total,world", [(16, 2), (8192, 2), (29, 3), (7, 4), (3, 2), (0, 2)])
def test_balanced_split_is_a_permutation_of_equal_causal_cost(total, world):
    sizes, pos = balanced_split(total, world)
    assert sorted(pos) == list(range(total)) and sum(sizes) == total
    slots = [pos[sum(sizes[:p]):sum(sizes[:p + 1])] for p in range(world)]
    cost = [sum(q + 1 for q in slot) for slot in slots]  # keys a causal query row sees
    assert max(cost) - min(cost) <= 2 * total  # about one row; contiguous: ~(S/W)^2 apart
    if total == 16:
        assert slots == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6),
                                       (torch.bfloat16, 1e-2)])
def test_merge_of_two_blocks_is_attention_over_their_union(dtype, tol):
    """``merge`` of two key blocks' (o, lse) equals one softmax over both blocks' keys, also
    where one block outweighs the other by far (lse tens apart)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g, dtype=torch.float64) for _ in range(3))
    k[..., 3:, :] *= 0.1
    k[0, 0, :3] *= 40.0  # head 0: one block far outweighs the other
    ref = F.scaled_dot_product_attention(q, k, v)
    lse_ref = torch.logsumexp(q @ k.transpose(-1, -2) * 8 ** -0.5, -1)
    parts = [attn_blocks.block(q.to(dtype), k[:, :, sl].to(dtype), v[:, :, sl].to(dtype), False)
             for sl in (slice(0, 3), slice(3, 5))]
    o, lse = attn_blocks.merge(*parts[0], *parts[1])
    assert o.dtype == dtype and lse.dtype == attn_blocks.lse_dtype(dtype)
    torch.testing.assert_close(o.double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), lse_ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5),
                                       (torch.bfloat16, 2e-2)])
def test_runs_of_blocks_match_causal_attention_with_gradients(monkeypatch, fused, dtype, tol):
    if not fused:  # the plain-torch formulas other devices run
        monkeypatch.setattr(attn_blocks, "fused_kernels", lambda t: False)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 37, 8, generator=g, dtype=dtype) for _ in range(3))
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=True)
    go = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    ref.backward(go)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    outs, dqs = [], []
    for a, n in [(20, 17), (0, 5), (5, 15)]:  # any order of runs
        o, lse = attn_blocks.run_forward(q[:, :, a:a + n], k, v, a, True)
        outs.append((a, o))
        dqs.append((a, attn_blocks.run_backward(go[:, :, a:a + n].to(dtype), q[:, :, a:a + n],
                                                k, v, o, lse, a, True, dk, dv)))
    cat = lambda parts: torch.cat([t for _, t in sorted(parts, key=lambda x: x[0])], 2)
    rel = lambda x, y: ((x.double() - y).norm() / y.norm()).item()
    errs = [rel(cat(outs), ref.detach()), rel(cat(dqs), ref_in[0].grad),
            rel(dk, ref_in[1].grad), rel(dv, ref_in[2].grad)]
    assert max(errs) < tol, errs


def test_bad_order_or_sizes_raise_before_communicating():
    import torch.distributed as dist

    q = torch.randn(8, 1, 2, 4)
    with pytest.raises(ValueError, match="order must be"):
        query_split_attention(q, q, q, torch.randn(8, 4), order="zigzag")
    assert not dist.is_initialized()


def _exact(rank, world, lengths, dtype, tol):
    """Every method, both orders, each length: max norm-relative error per case (> tol kept)."""
    bad = {}
    for S in lengths:
        for order in ("balanced", "contiguous"):
            for causal in (True, False) if S == lengths[0] else (True,):
                for method, opts in METHODS:
                    err = _case(rank, world, S, order, causal, method, opts, dtype)
                    if not err < tol:
                        bad[f"S={S} {order} causal={causal} {method} {opts}"] = err
    return bad


def _case(rank, world, S, order, causal, method, opts, dtype):
    g = torch.Generator().manual_seed(S)
    B, H, d, D = 2, 2, 8, 16
    leaves = [[torch.randn(*shape, generator=g, dtype=torch.float64)
               for shape in [(S, B, H, d)] * 3 + [(H * d, D)]] for _ in range(world)]
    if order == "balanced":
        sizes, pos = balanced_split(S, world)
    else:
        from commfuse.ops.binding import even_sizes
        sizes, pos = even_sizes(S, world), list(range(S))
    rows = [pos[sum(sizes[:p]):sum(sizes[:p + 1])] for p in range(world)]
    grads_out = [torch.randn(len(r), B, D, generator=g, dtype=torch.float64) for r in rows]
    ref_leaves = [[t.clone().requires_grad_() for t in ls] for ls in leaves]
    full = 0  # every rank's head group through attention and its wo rows, summed
    for q, k, v, wo in ref_leaves:
        o = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)),
                                           is_causal=causal)
        full = full + o.permute(2, 0, 1, 3).reshape(S, B, H * d) @ wo
    sum((full[r] * go).sum() for r, go in zip(rows, grads_out)).backward()
    mine = [t.to(dtype).requires_grad_() for t in leaves[rank]]
    out = query_split_attention(*mine, causal=causal, order=order, method=method, **opts)
    (out * grads_out[rank].to(dtype)).sum().backward()
    rel = lambda x, y: ((x.double() - y).norm() / max(y.norm(), 1e-30)).item()
    return max([rel(out, full[rows[rank]].detach())] +
               [rel(m.grad, ref.grad) for m, ref in zip(mine, ref_leaves[rank])])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_query_split_is_exact_with_gradients_every_method_and_order(world):
    lengths = [8 * world, 8 * world + 3, world + 1]  # even, uneven, chunks of 0 or 1 rows
    for bad in run_local(_exact, world, lengths, torch.float64, 1e-12, timeout=600):
        assert not bad, bad


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_query_split_low_precision(dtype, tol):
    for bad in run_local(_exact, 2, [21], dtype, tol, timeout=300):
        assert not bad, bad


def test_simulator_times_balanced_slots_equal_and_no_slower():
    from commfuse.sim import OpSpec, preset, simulate_ops
    from commfuse.sim.attention import layer_specs, slot_attention_s

    hw = preset("cpu-testbed")
    cost = {order: [slot_attention_s(hw, OpSpec("matmul_rs", "commfuse", (4096, 512, 1024),
                                                attention=(64, order, 1.0)), 2, slot, 0, 0)
                    for slot in range(2)] for order in ("balanced", "contiguous")}
    # equal work; slot 0 (chunks 0 and 3) is two kernel runs, slot 1 (chunks 1, 2) one
    assert cost["balanced"][0] == pytest.approx(cost["balanced"][1], rel=0.02)
    assert cost["contiguous"][1] > 2 * cost["contiguous"][0]
    assert sum(cost["balanced"]) == pytest.approx(sum(cost["contiguous"]), rel=0.05)
    for backward in (False, True):
        t = {wl: simulate_ops(layer_specs(wl, "commfuse", 2, 2048, 1024, backward), 2, 4, hw,
                              timeline=False) for wl in ("attn_row", "attn_qsplit")}
        assert t["attn_qsplit"].compute_s == pytest.approx(t["attn_row"].compute_s, rel=0.05)
        assert t["attn_qsplit"].total_s < t["attn_row"].total_s  # the model's claim, measured in docs
