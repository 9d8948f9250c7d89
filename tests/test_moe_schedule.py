"""MoE dispatch/combine schedules as data (`commfuse.schedule.moe`): pure, no processes.

The table's geometry, then, for every method on 1-4 ranks and many count tables (zeros,
empty ranks, empty experts): every message has exactly one matching side of the same size,
no message or GEMM for an empty slot, every transfer waited once after its post, the
overlap order each method promises, and all ranks' schedules run together to the end, also
where each rank's P2P batches run one after another in post order (NCCL).
"""

from __future__ import annotations

import random

import pytest

from commfuse.schedule import Collective, Compute, Post, Wait, WaitCollective
from commfuse.schedule.moe import METHODS, OPS, ExpertCounts, build, chunk_count, clip, piece


def _tables():
    """Count tables [W][E]: hand-picked corners, then random ones with many zeros."""
    yield ExpertCounts(((3,),))  # one rank
    yield ExpertCounts(((0, 0), (0, 0)))  # nothing moves at all
    yield ExpertCounts(((2, 0, 0, 5), (0, 0, 0, 0)))  # rank 1 sends nothing, expert 1 none
    yield ExpertCounts(((1, 1, 0), (4, 0, 0), (0, 2, 0)))  # rank 2 receives nothing
    rng = random.Random(45)
    for _ in range(60):
        w, local = rng.randint(1, 4), rng.randint(1, 3)
        zeros = rng.random()
        yield ExpertCounts(tuple(tuple(0 if rng.random() < zeros else rng.randint(1, 9)
                                       for _ in range(w * local)) for _ in range(w)))


TABLES = list(_tables())


def test_geometry():
    c = ExpertCounts(((1, 2, 0, 3), (0, 0, 4, 1)))  # 2 ranks, 2 experts each
    assert (c.world, c.experts, c.local) == (2, 4, 2)
    assert c.rows == ((3, 3), (0, 5))
    assert c.groups(0, 1) == (0, 3) and c.groups(1, 1) == (4, 1)
    assert [c.sent(p) for p in range(2)] == [6, 5]
    assert [c.received(q) for q in range(2)] == [3, 8]
    assert c.send_offsets(0) == (0, 3) and c.send_offsets(1) == (0, 0)
    assert c.recv_offsets(1) == (0, 3)  # rank 0's 3 rows, then rank 1's 5
    assert c.expert_rows(1) == (4, 4)
    # rank 1's expert 0 (global 2): 0 rows from rank 0, 4 rows at 3 from rank 1
    assert c.expert_runs(1) == (((0, 0), (3, 4)), ((0, 3), (7, 1)))


@pytest.mark.parametrize("table", [
    (), ((),), ((1, 2), (3,)), ((1, -1), (0, 0)), ((1, True), (0, 0)), ((1.0, 2), (0, 0)),
    ((1, 2, 3), (4, 5, 6)), [[1, 2], [3, 4]]])
def test_bad_tables_are_refused(table):
    with pytest.raises(ValueError):
        ExpertCounts(table)


def test_chunks_and_clip():
    assert [piece(7, 3, j) for j in range(3)] == [(0, 3), (3, 2), (5, 2)]
    assert [piece(1, 3, j) for j in range(3)] == [(0, 1), (1, 0), (1, 0)]
    assert clip((2, 0, 3, 1), 1, 5) == (1, 0, 3, 0)
    assert clip((2, 0, 3, 1), 0, 0) == (0, 0, 0, 0)
    c = ExpertCounts(((1, 2), (0, 0)))
    assert chunk_count(c, 4) == 2 and chunk_count(c, 1) == 1
    assert chunk_count(ExpertCounts(((0, 0), (0, 0))), 4) == 1


def test_build_refuses_bad_arguments():
    c = ExpertCounts(((1, 2), (3, 4)))
    for args, err in [(("moe_x", "none", c, 0), ValueError),
                      (("moe_dispatch", "decompose", c, 0), ValueError),
                      (("moe_dispatch", "none", c, 2), ValueError),
                      (("moe_dispatch", "none", ((1, 2), (3, 4)), 0), TypeError)]:
        with pytest.raises(err):
            build(*args)


def _size(op: str, c: ExpertCounts, rank: int, t) -> int:
    """Rows a transfer moves, from the layouts of its own side only."""
    src, dst = (rank, t.peer) if t.kind == "send" else (t.peer, rank)
    if op == "moe_dispatch":
        return c.rows[src][dst]  # slot dst of src's send layout = slot src of dst's receive
    return c.rows[dst][src]  # rows src's experts computed for dst's tokens


def _check_p2p(op: str, c: ExpertCounts) -> list[str]:
    """What is wrong with the commfuse schedules of every rank (empty: nothing)."""
    w, rows, bad = c.world, c.rows, []
    scheds = [build(op, "commfuse", c, r) for r in range(w)]
    moving = {(p, q) if op == "moe_dispatch" else (q, p)
              for p in range(w) for q in range(w) if p != q and rows[p][q]}
    sends = {(r, t.peer, t.tag): t for r, s in enumerate(scheds) for t in s.transfers()
             if t.kind == "send"}
    recvs = {(t.peer, r, t.tag): t for r, s in enumerate(scheds) for t in s.transfers()
             if t.kind == "recv"}
    if set(sends) != set(recvs):
        bad.append(f"unmatched messages: {set(sends) ^ set(recvs)}")
    if {k[:2] for k in sends} != moving or len(sends) != len(moving):
        bad.append(f"messages {sorted(sends)} but rows move between {sorted(moving)}")
    for (src, dst, tag), t in sends.items():
        r = recvs.get((src, dst, tag))
        if r and _size(op, c, src, t) != _size(op, c, dst, r):
            bad.append(f"size mismatch {src}->{dst}")
        if t.slot != dst or (r and r.slot != src):
            bad.append(f"slots of {src}->{dst}: {t.slot}, {r and r.slot}")
    for r, s in enumerate(scheds):
        posted, waited = [], []
        for step in s.steps:
            if isinstance(step, Post):
                assert step.transfers, "an empty post"
                posted += step.transfers
            elif isinstance(step, Wait):
                if step.transfer not in posted or step.transfer in waited:
                    bad.append(f"rank {r}: wait before post or twice: {step.transfer}")
                waited.append(step.transfer)
        if sorted(map(repr, posted)) != sorted(map(repr, waited)):
            bad.append(f"rank {r}: posted {posted} but waited {waited}")
        computes = s.computes()
        want = [p for p in range(w) if rows[p][r]]  # sources (dispatch) / owners (combine)
        if sorted(computes) != want:
            bad.append(f"rank {r}: computes {computes}, slots with rows {want}")
        if op == "moe_dispatch" and rows[r][r] and computes[0] != r:
            bad.append(f"rank {r}: own slot not first: {computes}")
        if op == "moe_combine" and rows[r][r] and computes[-1] != r:
            bad.append(f"rank {r}: own rows not last: {computes}")
        for i, step in enumerate(s.steps):  # the data a step needs is there before it
            if isinstance(step, Compute) and op == "moe_dispatch" and step.slot != r:
                if not any(isinstance(x, Wait) and x.transfer.kind == "recv" and
                           x.transfer.slot == step.slot for x in s.steps[:i]):
                    bad.append(f"rank {r}: slot {step.slot} computed before it arrived")
            if isinstance(step, Post) and op == "moe_combine":
                for t in step.transfers:
                    if t.kind == "send" and Compute(t.slot) not in s.steps[:i]:
                        bad.append(f"rank {r}: slot {t.slot} sent before it was computed")
    if not bad and not _runs_together(scheds):
        bad.append("the ranks' schedules do not run to the end together (deadlock)")
    if not bad and not _runs_together(scheds, serial=True):
        bad.append("the ranks' schedules deadlock when each rank's batches run in post order "
                   "(NCCL)")
    return bad


def _runs_together(scheds, serial: bool = False) -> bool:
    """Step every rank as far as it can: a transfer is done once both its sides are posted
    (a rendezvous, the strictest transport), a wait needs its transfer done. ``serial``
    (NCCL: a rank's P2P batches run one after another on one stream): a rank's batch is
    posted only once all of its earlier batches are done."""
    at, posted = [0] * len(scheds), set()
    queues: list[list] = [[] for _ in scheds]  # serial: each rank's batches not yet done

    def done(r, t) -> bool:
        other = "recv" if t.kind == "send" else "send"
        return (r, t.kind, t.peer, t.tag) in posted and (t.peer, other, r, t.tag) in posted

    progress = True
    while progress:
        progress = False
        for r, s in enumerate(scheds):
            q = queues[r]
            while q and all(done(r, t) for t in q[0]):
                q.pop(0)
                if q:
                    posted.update((r, t.kind, t.peer, t.tag) for t in q[0])
                progress = True
            while at[r] < len(s.steps):
                step = s.steps[at[r]]
                if isinstance(step, Post):
                    q.append(step.transfers)
                    if not serial or len(q) == 1:
                        posted.update((r, t.kind, t.peer, t.tag) for t in step.transfers)
                    if not serial:
                        q.clear()
                elif isinstance(step, Wait) and not done(r, step.transfer):
                    break
                at[r] += 1
                progress = True
    return all(a == len(s.steps) for a, s in zip(at, scheds))


def _check_collective(op: str, method: str, c: ExpertCounts) -> list[str]:
    bad = []
    scheds = [build(op, method, c, r, chunks=3) for r in range(c.world)]
    k = 1 if method == "none" else chunk_count(c, 3)
    for r, s in enumerate(scheds):
        launched = [x.slot for x in s.steps if isinstance(x, Collective)]
        if launched != list(range(k)) or s.chunks != k:
            bad.append(f"rank {r}: collectives {launched}, want chunks 0..{k - 1}")
        for i, step in enumerate(s.steps):
            if isinstance(step, Compute):
                before = s.steps[:i]
                if op == "moe_dispatch" and WaitCollective(step.slot) not in before:
                    bad.append(f"rank {r}: chunk {step.slot} computed before it arrived")
            if isinstance(step, Collective) and op == "moe_combine" and \
                    Compute(step.slot) not in s.steps[:i]:
                bad.append(f"rank {r}: chunk {step.slot} sent before it was computed")
        if sorted(s.computes()) != list(range(k)):
            bad.append(f"rank {r}: computes {s.computes()}")
    for row in c.rows:  # chunks tile every slot, on both sides alike
        for n in row:
            offs = [piece(n, k, j) for j in range(k)]
            if sum(m for _, m in offs) != n or any(o != sum(m for _, m in offs[:j])
                                                  for j, (o, _) in enumerate(offs)):
                bad.append(f"chunks of {n} rows: {offs}")
    return bad


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("method", METHODS)
def test_schedules_match_and_skip_empty_slots(op, method):
    failures = []
    for i, c in enumerate(TABLES):
        bad = _check_p2p(op, c) if method == "commfuse" else _check_collective(op, method, c)
        failures += [f"table {i} {c.tokens}: {b}" for b in bad]
    assert not failures, "\n".join(failures[:20])


def test_commfuse_order_on_four_ranks():
    """Rank 1 of 4, every slot full: dispatch posts all, computes 1, 0, 3, 2; combine
    computes 2, 3, 0, each followed by one batch of its send and the receive of the same
    step (from 0, 3, 2), then its own rows."""
    c = ExpertCounts(tuple((1,) * 4 for _ in range(4)))
    d = build("moe_dispatch", "commfuse", c, 1)
    assert d.computes() == [1, 0, 3, 2]
    assert [type(x).__name__ for x in d.steps[:4]] == ["Post"] * 3 + ["Compute"]
    cb = build("moe_combine", "commfuse", c, 1)
    assert cb.computes() == [2, 3, 0, 1]
    kinds = [type(x).__name__ for x in cb.steps]
    assert kinds[:7] == ["Compute", "Post"] * 3 + ["Compute"]
    batches = [[(t.kind, t.peer, t.tag) for t in x.transfers] for x in cb.steps
               if isinstance(x, Post)]
    assert batches == [[("send", 2, 1), ("recv", 0, 1)], [("send", 3, 2), ("recv", 3, 2)],
                       [("send", 0, 3), ("recv", 2, 3)]]


def test_serial_check_catches_a_receive_only_batch():
    """The serial stepping of `_runs_together` refuses what NCCL would hang on: every rank
    posting its receive alone, before the send its peer waits for."""
    from commfuse.schedule import Schedule, Transfer

    def sched(r):
        recv, send = Transfer("recv", 1 - r, 1 - r, 1), Transfer("send", 1 - r, 1 - r, 1)
        steps = (Post((recv,)), Compute(1 - r), Post((send,)), Wait(recv), Wait(send))
        return Schedule("moe_combine", "commfuse", 2, r, "direct", 2, steps)

    scheds = [sched(0), sched(1)]
    assert _runs_together(scheds) and not _runs_together(scheds, serial=True)


def _dedup_table(world: int, local: int, k: int, tokens: int, seed: int) -> ExpertCounts:
    """The table `commfuse.ops.moe.routing.plan` makes for random top-k routing (pure)."""
    rng = random.Random(seed)
    e_all = world * local
    tabs = [[[0] * e_all for _ in range(world)] for _ in range(4)]
    for p in range(world):
        for _ in range(tokens):
            chosen = rng.sample(range(e_all), k)
            for e in chosen:
                here = sorted(x for x in chosen if x // local == e // local)
                first, last = e == here[0], e == here[-1]
                for i, flag in enumerate((True, first, last, first and last)):
                    tabs[i][p][e] += flag
    return ExpertCounts(*(tuple(map(tuple, t)) for t in tabs))


@pytest.mark.parametrize("world,local,k", [(2, 2, 3), (3, 2, 2), (4, 4, 4), (4, 1, 2)])
def test_dedup_moves_each_pair_once_and_schedules_run(world, local, k):
    c = _dedup_table(world, local, k, 9, world * 10 + k)
    for p in range(world):  # pieces of any count tile the pairs, in both orders
        for q in range(world):
            for op in OPS:
                for n in (1, 2, 3, 5):
                    got = [c.moved_piece(op, p, q, n, j) for j in range(n)]
                    assert sum(m for _, m in got) == c.pairs[p][q]
                    assert all(o == sum(m for _, m in got[:j]) for j, (o, _) in enumerate(got))
    assert (sum(map(sum, c.pairs)) < sum(map(sum, c.rows))) == (local > 1)  # one expert per rank: no repeats
    for op in OPS:
        for m in (1, 2, 3):
            scheds = [build(op, "commfuse", c, r, splits=m) for r in range(world)]
            assert _runs_together(scheds) and _runs_together(scheds, serial=True), (op, m)
        for method in ("none", "sliced"):
            assert all(build(op, method, c, r, chunks=3).steps for r in range(world))
