"""Expert parallelism: the fused MoE ops (`commfuse.ops.moe`), the count exchange and the EP
layer (`commfuse.moe`) against the unsharded float64 reference layer.

In-process: the grouped GEMM against one GEMM per expert, the reference layer against a dense
formula. On 2, 3 and 4 gloo ranks, one `run_local` per group size runs every case (each rank
checks its share and reports the failing case ids): outputs and every gradient (input, router,
each expert's weights) for every method, balanced, Zipf-skewed and starved routing (a rank
with no tokens, a rank and an expert that receive none), float64 and float32 (grouped GEMM);
then bad counts, which must raise on every rank before any token moves.
"""

from __future__ import annotations

import math

import pytest
import torch

from commfuse.moe import MoEConfig, MoELayer
from commfuse.ops.moe import gemm
from commfuse.testbed.spawn import run_local

METHODS = (("none", {}), ("none", {"collective": "backend"}), ("sliced", {"chunks": 2}),
           ("sliced", {}), ("commfuse", {}), ("auto", {}))
CONFIGS = {  # name: (experts per rank, config fields, dtype)
    "e2k2": (2, dict(dim=8, ffn=6, top_k=2), torch.float64),
    "e1k1-sigmoid": (1, dict(dim=8, ffn=6, top_k=1, score="sigmoid", normalize=False),
                     torch.float64),
    "e3k2-f32": (3, dict(dim=16, ffn=8, top_k=2), torch.float32),  # grouped GEMM's shapes
}
ROUTINGS = ("balanced", "zipf", "starved")


def test_grouped_gemm_equals_one_gemm_per_expert():
    g = torch.Generator().manual_seed(0)
    sizes = (3, 0, 5, 1)
    for k, n, dtype in ((16, 8, torch.float32), (5, 3, torch.float32), (16, 8, torch.float64)):
        x = torch.randn(sum(sizes), k, generator=g, dtype=dtype)
        w = torch.randn(len(sizes), k, n, generator=g, dtype=dtype)
        for weights in (w, w.transpose(1, 2).contiguous().transpose(1, 2)):
            out = torch.full((sum(sizes), n), float("nan"), dtype=dtype)
            gemm.grouped(x, weights, sizes, out)
            ref = torch.cat([x[s:s + m] @ weights[e] for e, (s, m) in enumerate(
                zip([0, 3, 3, 8], sizes))])
            torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        aligned = k * x.element_size() % 16 == 0 and dtype != torch.float64
        assert gemm.grouped_ok(x, w) == (aligned and hasattr(torch, "_grouped_mm"))
    split = (((0, 2), (6, 1)), ((2, 0), (6, 0)), ((2, 4), (7, 2)))  # expert 1 got nothing
    whole = (((0, 3), (3, 0)), ((3, 0), (3, 0)), ((3, 2), (5, 4)))  # expert-major already
    for runs, k, dtype, tol in ((split, 5, torch.float64, 1e-12), (whole, 5, torch.float64, 1e-12),
                                (split, 16, torch.float32, 1e-5), (whole, 16, torch.float32, 1e-5)):
        gy = torch.randn(sum(sizes), 8, generator=g, dtype=dtype)
        x = torch.randn(sum(sizes), k, generator=g, dtype=dtype)
        gw = gemm.weight_grads(x, gy, runs, 3)
        for e, pieces in enumerate(runs):
            idx = [i for s, m in pieces for i in range(s, s + m)]
            torch.testing.assert_close(gw[e], x[idx].t() @ gy[idx], rtol=tol, atol=tol)
        assert not gw[1].any()


@pytest.mark.parametrize("fields", [dict(top_k=2), dict(top_k=3, score="sigmoid"),
                                    dict(top_k=1, normalize=False)])
def test_reference_layer_is_the_dense_formula(fields):
    torch.manual_seed(0)
    c = MoEConfig(dim=8, ffn=6, experts=4, **fields)
    layer = MoELayer(c, dtype=torch.float64)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    logits = x @ layer.router.weight.t()
    s = logits.softmax(-1) if c.score == "softmax" else logits.sigmoid()
    top = s.topk(c.top_k, -1)
    gates = torch.zeros_like(s).scatter(-1, top.indices, top.values)
    if c.normalize:
        gates = gates / top.values.sum(-1, keepdim=True)
    every = torch.stack([torch.nn.functional.silu(x @ layer.w_gate_up[e, :, :6]) *
                         (x @ layer.w_gate_up[e, :, 6:]) @ layer.w_down[e]
                         for e in range(4)], -2)  # [2, 5, E, D]: each expert on every token
    torch.testing.assert_close(layer(x), (gates.unsqueeze(-1) * every).sum(-2),
                               rtol=1e-12, atol=1e-12)


def test_config_is_validated():
    for bad in (dict(experts=0), dict(top_k=9), dict(score="relu"), dict(normalize=1),
                dict(dim=True)):
        with pytest.raises(ValueError):
            MoEConfig(**bad)


def _tokens(routing: str, world: int) -> list[int]:
    return [6, 0, 9, 3][:world] if routing == "starved" else [6 + r for r in range(world)]


def _setup(config: str, routing: str, world: int):
    """(layer, every rank's tokens, upstream grads, tokens per rank) of a case, the same on
    every rank: the router's weight on a constant first feature biases expert popularity."""
    local, fields, _ = CONFIGS[config]
    c = MoEConfig(experts=local * world, **fields)
    g = torch.Generator().manual_seed(hash((config, routing, world)) % 2**31)
    torch.manual_seed(g.initial_seed())
    layer = MoELayer(c, dtype=torch.float64)
    bias = torch.zeros(c.experts, dtype=torch.float64)
    if routing == "zipf":  # popularity 1/(e+1)^1.5, Zipf-like
        bias = 2 * -1.5 * torch.log(torch.arange(1, c.experts + 1, dtype=torch.float64))
    if routing == "starved":  # rank W-1's experts, and expert 0 where enough others remain
        bias[-local:] = -30
        if c.experts - local - 1 >= c.top_k:
            bias[0] = -30
    with torch.no_grad():
        layer.router.weight.mul_(0.5)[:, 0] = bias
    sizes = _tokens(routing, world)
    x = torch.randn(sum(sizes), c.dim, generator=g, dtype=torch.float64)
    x[:, 0] = 1
    return layer, x, torch.randn(sum(sizes), c.dim, generator=g, dtype=torch.float64), sizes


def _close(name, got, ref, tol) -> list[str]:
    err = (got.double() - ref).abs().max().item() if ref.numel() else 0.0
    scale = 1 + (ref.abs().max().item() if ref.numel() else 0.0)
    return [] if err <= tol * scale and not math.isnan(err) else [f"{name} off by {err:.3g}"]


def _good_case(rank, world, group, config, routing, method, opts) -> list[str]:
    import torch.distributed as dist

    from commfuse.moe import ExpertParallelMoE

    local, _, dtype = CONFIGS[config]
    layer, x, gy, sizes = _setup(config, routing, world)
    ref_x = x.clone().requires_grad_()
    (layer(ref_x) * gy).sum().backward()
    ep = ExpertParallelMoE(layer.to(dtype), group, method=method, timeout=30, **opts)
    layer.double()
    mine = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
    x_r = x[mine].to(dtype).requires_grad_()
    y_r = ep(x_r)
    (y_r * gy[mine].to(dtype)).sum().backward()
    router = ep.router.weight.grad.clone()
    dist.all_reduce(router, group=group)  # replicated: every rank's tokens' share
    experts = slice(rank * local, (rank + 1) * local)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    with torch.no_grad():
        ref_y = layer(x[mine])
    bad = (_close("output", y_r, ref_y, tol) + _close("input grad", x_r.grad, ref_x.grad[mine], tol)
           + _close("router grad", router, layer.router.weight.grad, tol)
           + _close("w_gate_up grad", ep.w_gate_up.grad, layer.w_gate_up.grad[experts], tol)
           + _close("w_down grad", ep.w_down.grad, layer.w_down.grad[experts], tol))
    counts, c = ep.last_counts, layer.config
    if routing == "starved" and (sizes[1] or counts.received(world - 1) or any(
            counts.sent(p) == 0 for p in range(world) if sizes[p]) or (
            c.experts - local - 1 >= c.top_k and counts.expert_rows(0)[0])):
        bad.append(f"not starved as meant: {counts.tokens}")
    if dtype == torch.float32 and hasattr(torch, "_grouped_mm") and not gemm.grouped_ok(
            x_r.new_empty(4, layer.config.dim), ep.w_gate_up.detach()):
        bad.append("the grouped GEMM was not used")
    return bad


def _bad_cases(rank, world, group):
    """(case id, the function every rank runs, the error text every rank must raise)."""
    import torch.distributed as dist

    from commfuse.ops.moe import moe_dispatch_matmul, moe_matmul_combine
    from commfuse.ops.moe.counts import exchange_counts
    from commfuse.schedule.moe import ExpertCounts

    last, e = world - 1, 2 * world
    hist = [1] * e

    def table(shift=0):
        return ExpertCounts(tuple(tuple([1 + shift * (p == 0 and q == 0) for q in range(e)])
                                  for p in range(world)))

    w = torch.zeros(2, 4, 3, dtype=torch.float64)
    return [
        ("hist-rows", lambda: exchange_counts(hist, group, rows=e + (rank == last)),
         f"rank {last}'s counts sum to {e} but its tensor has {e + 1} rows"),
        ("hist-experts", lambda: exchange_counts(hist + [0] * (rank == 0), group, rows=e),
         "different numbers of experts"),
        ("hist-negative", lambda: exchange_counts(
            torch.tensor([-1] + hist[1:]) if rank == last else torch.tensor(hist), group,
            rows=e), f"rank {last}: negative counts"),
        ("hist-float", lambda: exchange_counts(
            torch.ones(e) if rank == 0 else torch.ones(e, dtype=torch.long), group, rows=e),
         "rank 0: counts that are not a 1-D list of ints"),
        ("hist-indivisible", lambda: exchange_counts([1] * (world + 1), group, rows=world + 1),
         "not divisible by the group size"),
        ("op-disagree", lambda: moe_dispatch_matmul(
            torch.zeros(e + (rank == 0), 4, dtype=torch.float64), w, table(rank == 0), group,
            check=True), "tables differ between ranks"),
        ("op-rows", lambda: moe_matmul_combine(
            torch.zeros(e + (rank == last), 4, dtype=torch.float64), w, table(), group,
            check=True), f"rank {last} has {e + 1}, the table gives it {e}"),
        ("op-rows-local", lambda: moe_dispatch_matmul(
            torch.zeros(e + 1, 4, dtype=torch.float64), w, table(), group),
         f"give this rank {e}"),
        ("barrier", lambda: dist.barrier(group=group) or (_ for _ in ()).throw(
            ValueError("ok: the group still works")), "ok: the group still works"),
    ]


def _all_cases(rank, world):
    """Every case of one group size on this rank; returns the failing ones' ids and why."""
    import torch.distributed as dist

    from commfuse.ops.moe.counts import CountsError

    group, failures = dist.group.WORLD, []
    for config in CONFIGS:
        methods = METHODS if CONFIGS[config][2] == torch.float64 else (
            ("none", {}), ("sliced", {}), ("commfuse", {}))
        for routing in ROUTINGS:
            for method, opts in methods:
                case = f"{config}-{routing}-{method}{opts or ''}"
                try:
                    failures += [f"{case}: {b}" for b in _good_case(
                        rank, world, group, config, routing, method, opts)]
                except Exception as e:
                    failures.append(f"{case}: {type(e).__name__}: {e}")
    for case, fn, text in _bad_cases(rank, world, group):
        try:
            fn()
            failures.append(f"{case}: no error")
        except (CountsError, ValueError) as e:
            if text not in str(e):
                failures.append(f"{case}: {type(e).__name__}: {e}")
        except Exception as e:
            failures.append(f"{case}: {type(e).__name__}: {e}")
    return failures


@pytest.mark.parametrize("world", [2, 3, 4])
def test_expert_parallel_layer_equals_reference(world):
    results = run_local(_all_cases, world, timeout=240, pg_timeout_s=30)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures)


class _CountingTransport:
    """A transport that adds the off-rank rows each op sends to ``sent[op]``."""

    def __init__(self, inner, sent, op, rank):
        self.inner, self.sent, self.op, self.rank = inner, sent, op, rank

    def post(self, transfers):
        self.sent[self.op[0]] += sum(b.shape[0] for t, b in transfers if t.kind == "send")
        return self.inner.post(transfers)

    def launch(self, kind, out, inp, tag, **parts):
        sizes = parts["in_sizes"]
        self.sent[self.op[0]] += sum(sizes) - sizes[self.rank]
        return self.inner.launch(kind, out, inp, tag, **parts)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _dedup_traffic(rank, world):
    """Per method: (off-rank rows the dispatch and the combine sent, in the forward and in
    the backward, this rank's distinct off-rank (token, rank) pairs, its off-rank (token,
    expert) rows, host reads during forward + backward)."""
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from commfuse.moe.parallel import expert_ffn
    from commfuse.ops.moe import bindings

    group, k, local = dist.group.WORLD, 3, 2
    experts = local * world
    g = torch.Generator().manual_seed(rank)
    T = 40 + rank
    ex = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(T)])
    wts = torch.rand(T, k, generator=g, dtype=torch.float64).requires_grad_()
    x = torch.randn(T, 8, generator=g, dtype=torch.float64).requires_grad_()
    w_in = torch.randn(local, 8, 6, generator=g, dtype=torch.float64).requires_grad_()
    w_out = torch.randn(local, 6, 8, generator=g, dtype=torch.float64).requires_grad_()
    dest = ex // local
    pairs = len({(t, int(q)) for t in range(T) for q in dest[t] if q != rank})
    rows = int((dest != rank).sum())
    real_run, real_transport, real_tolist = bindings._run, bindings.executor.make_transport, \
        torch.Tensor.tolist
    sent, op, host = {}, [None], [0]

    class Syncs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in ("_local_scalar_dense", "nonzero", "_unique2",
                                               "masked_select", "bincount"):
                host[0] += 1
            return func(*args, **(kwargs or {}))

    def run(name, *args, **kw):
        op[0] = f"{'backward ' * backward[0]}{name}"
        sent.setdefault(op[0], 0)
        return real_run(name, *args, **kw)

    def tolist(t):
        host[0] += 1
        return real_tolist(t)

    # the first call per layer also checks that the ranks count the same experts
    expert_ffn(x, wts, ex, w_in, w_out, torch.nn.functional.silu, group, experts, timeout=30)
    bindings._run = run
    bindings.executor.make_transport = lambda *a, **kw: _CountingTransport(
        real_transport(*a, **kw), sent, op, rank)
    torch.Tensor.tolist = tolist
    out = {}
    try:
        for method, opts in (("none", {}), ("sliced", {"chunks": 3}), ("commfuse", {}),
                             ("commfuse", {"splits": 2})):
            sent.clear()
            host[0], backward = 0, [False]
            with Syncs():
                y, _ = expert_ffn(x, wts, ex, w_in, w_out, torch.nn.functional.silu, group,
                                  experts, method=method, timeout=30, **opts)
                backward[0] = True
                y.sum().backward()
            out[f"{method}{opts}"] = (dict(sent), pairs, rows, host[0])
    finally:
        bindings._run, bindings.executor.make_transport = real_run, real_transport
        torch.Tensor.tolist = real_tolist
    return out


def test_dispatch_moves_each_token_once_per_rank_with_one_host_read():
    """top-3 of 6 experts on 3 ranks: the dispatch and the combine (forward and backward)
    move at most one row per distinct (token, other rank), fewer than the (token, expert)
    rows, for every method; forward + backward read the device once (the counts) after
    the layer's first call."""
    results = run_local(_dedup_traffic, 3, timeout=120, pg_timeout_s=30)
    for case in results[0]:
        pairs = sum(r[case][1] for r in results)  # every rank's distinct (token, other rank)
        rows = sum(r[case][2] for r in results)
        assert pairs < rows, case
        for op in ("moe_dispatch", "moe_combine", "backward moe_dispatch", "backward moe_combine"):
            sent = sum(r[case][0][op] for r in results)  # off-rank rows, over the group
            assert sent <= pairs, (case, op, sent, pairs, rows)
        assert [r[case][3] for r in results] == [1, 1, 1], case
