"""The real schedules under NCCL's matching, on CPU (`commfuse.runtime.nccl_model`).

Virtual ranks (threads of this process, `commfuse.runtime.virtual_ranks`) run the ops through
the executor and `CudaTransport`, whose batches and collectives a model of one NCCL
communicator matches: a rank's ops run one after another in issue order, a pair's sends and
receives are matched by issue order (tags ignored), a batch completes when all its transfers
have. Every op under every method, the MoE dispatch/combine and the posted-ahead gathers run
on 2, 3 and 4 ranks to the exact unsharded
result (small integers: no rounding); schedules that NCCL could not match end in an error
that names the ranks and their pending ops, at once, never a hang. check-gpu's loopback runs
the same cases on one GPU (`commfuse.check_gpu.loopback`).
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from commfuse.check_gpu import loopback
from commfuse.errors import CommFuseError
from commfuse.ops.methods import method_spec
from commfuse.runtime import executor, nccl_model, virtual_ranks
from commfuse.runtime.cuda import CudaTransport
from commfuse.schedule import OPS, Compute, Post, Schedule, Transfer, Wait
from commfuse.schedule.moe import ExpertCounts

WORLDS = (2, 3, 4)
CPU = torch.device("cpu")


def ints(g, *shape):
    return torch.randint(-3, 4, shape, generator=g).float()


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("op", OPS)
def test_every_op_and_method_is_exact_in_nccl_order(op, world, monkeypatch):
    used = set()
    init = CudaTransport.__init__
    monkeypatch.setattr(CudaTransport, "__init__",
                        lambda self, *a, **k: (used.add(type(self)), init(self, *a, **k))[1])
    bad = {}
    for label in loopback.VARIANT_LABELS:
        err = loopback.case(op, world, loopback.spec_of(label), device="cpu", timeout_s=20)
        if err:
            bad[label] = err
    assert not bad, bad
    assert used == {CudaTransport}


def _moe_table(world: int) -> ExpertCounts:
    """2 experts per rank; zeros: an empty expert, a pair that moves nothing."""
    rows = [[(3 * p + 2 * e + 1) % 5 for e in range(2 * world)] for p in range(world)]
    rows[0][2 * (world - 1):] = [0, 0]  # rank 0 sends nothing to the last rank
    return ExpertCounts(tuple(map(tuple, rows)))


def _moe_reference(c: ExpertCounts, x, w, op: str):
    """Unsharded: dispatch -> every rank's receive layout times its experts; combine -> each
    rank's rows computed by their experts' ranks, back in its send layout."""
    W, out = c.world, []
    blocks = {}  # (p, q, e) -> rows of p for q's expert e, times that expert
    for p in range(W):
        for q in range(W):
            src = x[p] if op == "moe_dispatch" else x[q]
            at = (c.send_offsets(p)[q] if op == "moe_dispatch" else c.recv_offsets(q)[p])
            for e, n in enumerate(c.groups(p, q)):
                blocks[p, q, e] = src[at:at + n] @ w[q][e]
                at += n
    for r in range(W):
        if op == "moe_dispatch":  # source-major, local expert inside
            parts = [blocks[p, r, e] for p in range(W) for e in range(c.local)]
        else:  # destination-major (send layout), expert inside
            parts = [blocks[r, q, e] for q in range(W) for e in range(c.local)]
        out.append(torch.cat(parts))
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_moe_dispatch_and_combine_are_exact_in_nccl_order(world):
    from commfuse.ops.moe.bindings import dispatch_matmul, matmul_combine

    c, g, K, N = _moe_table(world), torch.Generator().manual_seed(world), 4, 3
    w = [ints(g, c.local, K, N) for _ in range(world)]
    bad = []
    for op, fn in (("moe_dispatch", dispatch_matmul), ("moe_combine", matmul_combine)):
        rows = [c.sent(p) if op == "moe_dispatch" else c.received(p) for p in range(world)]
        x = [ints(g, n, K) for n in rows]
        ref = _moe_reference(c, x, w, op)
        for method, opts in (("none", {}), ("sliced", {"chunks": 2}), ("commfuse", {}),
                             ("commfuse", {"splits": 2})):
            spec = method_spec(method, opts)
            outs = loopback.run(lambda r, grp: fn(x[r], w[r], c, grp, spec)[0], world, "cpu", 20)
            if loopback.compare(outs, ref):
                bad.append(f"{op} {method} {opts}")
    assert not bad, bad


@pytest.mark.parametrize("world", WORLDS)
def test_gathers_posted_ahead_are_exact_in_nccl_order(world):
    """A gather posted ahead (`PostedGather`) while other ops run: after another op's posts
    (``after_posts``, as a backward posts the next op's), or before a whole op."""
    from commfuse.ops.ag_matmul import PostedGather, ag_matmul
    from commfuse.ops.matmul_rs import matmul_rs

    g = torch.Generator().manual_seed(world)
    sizes = tuple(5 + p % 2 for p in range(world))
    a = [ints(g, n, 4) for n in sizes]
    x, b = [ints(g, sum(sizes), 4) for _ in range(world)], [ints(g, 4, 3) for _ in range(world)]
    whole, total = torch.cat(a), sum(x[r] @ b[r] for r in range(world))
    offs = [sum(sizes[:p]) for p in range(world)]
    bad = []
    for label in ("none", "sliced", "decompose", "commfuse", "commfuse-m2"):
        spec = loopback.spec_of(label)

        def rank(r, grp):
            posted = []
            ys = ag_matmul(a[r], [b[r]], sizes, grp, spec,
                           after_posts=lambda: posted.append(
                               PostedGather(a[r], sizes, grp, spec, tag_offset=100)))[1]
            ahead = PostedGather(a[r], sizes, grp, spec, tag_offset=200)
            rs = matmul_rs([(x[r], b[r])], None, sizes, grp, spec)
            return ys[0], posted[0].finish(), ahead.finish(), rs

        for r, (y, g1, g2, rs) in enumerate(loopback.run(rank, world, "cpu", 20)):
            if not (torch.equal(y, whole @ b[r]) and torch.equal(g1, whole)
                    and torch.equal(g2, whole)
                    and torch.equal(rs, total[offs[r]:offs[r] + sizes[r]])):
                bad.append(f"{label} rank {r}")
    assert not bad, bad


@pytest.mark.parametrize("world", WORLDS)
def test_zero3_weight_gather_and_gradient_reduce_scatter_in_nccl_order(world):
    """`WeightGather` and `GradReduce` (`commfuse.parallel.prefetch`) posted together, in
    the same order on every rank."""
    from commfuse.parallel.prefetch import GradReduce, WeightGather

    g = torch.Generator().manual_seed(world)
    o, X, I = 2, 3, 4
    shards = [ints(g, o, I) for _ in range(world)]
    gy, xs = [ints(g, world * o, X) for _ in range(world)], [ints(g, X, I) for _ in range(world)]
    dw = sum(gy[r] @ xs[r] for r in range(world))

    def rank(r, grp):
        mod = SimpleNamespace(group=grp, weight=torch.nn.Parameter(shards[r].clone()), what="w")
        gather = WeightGather(shards[r], grp, None)
        reduce = GradReduce(mod, gy[r], xs[r], None)
        full = gather.finish()
        reduce.finish()
        return full, mod.weight.grad

    for r, (full, grad) in enumerate(loopback.run(rank, world, "cpu", 20)):
        assert torch.equal(full, torch.cat(shards)), r
        assert torch.equal(grad, dw[r * o:(r + 1) * o]), r


class _Buffers:
    """A binding for hand-made schedules: one buffer per transfer (``size`` by tag)."""

    def __init__(self, size=lambda t: 3):
        self.size, self.bufs = size, {}

    def buffer(self, t):
        return self.bufs.setdefault(t, torch.full((self.size(t),), float(t.tag)))

    def compute(self, slot):
        pass


def _run_schedules(scheds, binding=_Buffers, timeout_s=20.0):
    def rank(grp):
        b = binding()
        executor.run(scheds[grp.rank()], b, executor.make_transport(grp, CPU, None))
        return b

    return virtual_ranks.run_ranks(len(scheds), rank, timeout_s)


def _two_ranks(steps_of):
    return [Schedule("ag_matmul", "commfuse", 2, r, "direct", 2, tuple(steps_of(r)))
            for r in range(2)]


def _deadlocks(scheds, *pending):
    t0 = time.monotonic()
    with pytest.raises(CommFuseError) as info:
        _run_schedules(scheds)
    assert time.monotonic() - t0 < 5, "the deadlock was not detected at once"
    assert isinstance(info.value.__cause__, nccl_model.Deadlock)
    text = str(info.value)
    assert "deadlock among ranks [0, 1]" in text, text
    for p in pending:
        assert p in text, text
    return text


def test_a_receive_batch_before_the_send_deadlocks_and_is_named():
    """The combine order `commfuse.schedule.moe._combine` avoids (tests/test_moe_schedule.py,
    `_runs_together(serial=True)`): each rank posts its receive alone, then its send. gloo
    runs it; NCCL runs a rank's batches in order, so neither send ever runs."""
    def steps(r):
        recv, send = Transfer("recv", 1 - r, 1 - r, 1), Transfer("send", 1 - r, 1 - r, 1)
        return [Post((recv,)), Compute(1 - r), Post((send,)), Wait(recv), Wait(send)]

    _deadlocks(_two_ranks(steps), "rank 0 waits for op #0", "rank 1 waits for op #0",
               "recv from rank 1 (matched with rank 1's op #1, queued behind its #0)")


def test_two_sides_posting_in_different_orders_deadlock():
    """Rank 0 sends, waits, then receives; rank 1 the same: each send waits for a receive
    its peer posts only after its own send completed."""
    def steps(r):
        send, recv = Transfer("send", 0, 1 - r, 0), Transfer("recv", 1, 1 - r, 1)
        return [Post((send,)), Wait(send), Post((recv,)), Wait(recv)]

    _deadlocks(_two_ranks(steps), "send to rank 1 (its peer has issued no match)")


def test_tags_are_ignored_messages_pair_in_issue_order():
    """Rank 0 sends tag 1 then tag 2; rank 1 receives tag 2 then tag 1: NCCL (unlike gloo)
    pairs them by order, so tag 2's receive gets tag 1's data; of another size, it fails."""
    def steps(r):
        if r == 0:
            ts = [Transfer("send", 0, 1, 1), Transfer("send", 0, 1, 2)]
        else:
            ts = [Transfer("recv", 0, 0, 2), Transfer("recv", 0, 0, 1)]
        return [Post((t,)) for t in ts] + [Wait(t) for t in ts]

    scheds = _two_ranks(steps)
    b = _run_schedules(scheds)[1]
    assert b.bufs[Transfer("recv", 0, 0, 2)].tolist() == [1.0] * 3
    with pytest.raises(CommFuseError, match="matched .*tags ignored.* of another size"):
        _run_schedules(scheds, lambda: _Buffers(lambda t: 2 + t.tag))


def test_a_rank_that_never_returns_times_out_on_a_daemon_thread():
    """A rank stuck outside any wait (computing forever) cannot be told from a slow one: the
    run ends at its timeout, and the stuck thread, a daemon, never holds up the exit."""
    stop = threading.Event()

    def rank(grp):
        if grp.rank() == 1:
            stop.wait(30)

    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] still running"):
        virtual_ranks.run_ranks(2, rank, timeout_s=0.2)
    assert time.monotonic() - t0 < 10
    stuck = [t for t in threading.enumerate() if t.name == "commfuse-virtual-rank-1"]
    assert stuck and all(t.daemon for t in stuck)
    stop.set()


def test_a_combine_posting_its_receives_first_deadlocks(monkeypatch):
    """The real MoE combine with every receive posted ahead, alone (what
    `commfuse.schedule.moe._combine`'s docstring rules out): deadlocks here as on NCCL."""
    from commfuse.ops.moe.bindings import matmul_combine
    from commfuse.schedule import moe

    def receives_first(rows, w, r, m=1):
        batches = [t for i in range(1, w) for j in range(m) for t in moe._pair(rows, w, r, i, m, j)]
        recvs = [t for t in batches if t.kind == "recv"]
        sends = [t for t in batches if t.kind == "send"]
        steps = [Post((t,)) for t in recvs]
        for t in sends:
            steps += [Compute(t.slot), Post((t,))]
        return steps + [Compute(r)] + [Wait(t) for t in recvs + sends]

    monkeypatch.setattr(moe, "_combine", receives_first)
    c = ExpertCounts(((1, 2, 1, 1, 2, 1), (2, 1, 1, 1, 1, 2), (1, 1, 2, 2, 1, 1)))
    x, w = [torch.ones(c.received(p), 4) for p in range(3)], [torch.ones(2, 4, 3)] * 3
    spec = method_spec("commfuse", {})
    with pytest.raises(CommFuseError, match="deadlock among ranks") as info:
        loopback.run(lambda r, grp: matmul_combine(x[r], w[r], c, grp, spec), 3, "cpu", 20)
    assert isinstance(info.value.__cause__, nccl_model.Deadlock)


@pytest.mark.parametrize("op", OPS)
def test_record_mode_batches_as_the_cuda_transport(op, monkeypatch):
    """``record`` mode on CUDA (virtual ranks) runs the CUDA transport, which posts a pair's
    send and receive in one batch, with the collectives noted: every method exact in NCCL's
    order. (gloo's transport, one batch per op, could deadlock NCCL on large messages: a
    send-only batch waiting for a receive-only one queued behind it.)"""
    from commfuse.runtime import modes

    batches = []
    issue = nccl_model.Communicator.issue

    def noted(self, rank, transfers):
        batches.append({t.kind for t, _ in transfers})
        return issue(self, rank, transfers)

    monkeypatch.setattr(nccl_model.Communicator, "issue", noted)
    bad = {}
    with modes.mode("record") as recorded:
        for label in ("none", "sliced", "commfuse", "commfuse-direct", "decompose"):
            err = loopback.case(op, 3, loopback.spec_of(label), device="cpu", timeout_s=20)
            if err:
                bad[label] = err
        cls = modes.transport_class(CPU, SimpleNamespace(commfuse_backend=object()))
    assert not bad, bad
    assert issubclass(cls, CudaTransport) and issubclass(cls, modes.Records)
    assert recorded, "the collectives of none / sliced were not recorded"
    assert any(kinds == {"send", "recv"} for kinds in batches)  # a pair's both sides batched
