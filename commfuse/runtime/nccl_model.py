"""NCCL's ordering of one communicator, modelled in one process: virtual ranks as threads.

What NCCL (through ProcessGroupNCCL) does, and this model does alike:

- One stream per communicator: a rank's P2P batches and collectives run one after another in
  issue order; an op starts only when every op that rank issued before it has completed.
- P2P is matched by issue order per ordered pair of ranks, tags ignored: the n-th send from a
  to b meets the n-th receive on b from a. A pair that disagrees on the size or dtype is an
  error here (on NCCL: a hang or corrupt data).
- A batch (``batch_isend_irecv``, one NCCL group) completes when every op in it has; a
  transfer completes once the batches holding its two sides both run (a rendezvous: no send
  completes into a buffer before its receive runs, the strictest NCCL may be).
- A collective completes when it runs on every rank: the n-th collective of each, which must
  be of the same kind and sizes.

A schedule that NCCL cannot match deadlocks here too; instead of hanging, the model sees every
rank blocked in a wait (or returned) with nothing able to run, and each waiting rank raises
`Deadlock`, which names the ranks, the op each is running and what it waits for. A wait also
ends after ``timeout_s`` (a rank that computes forever).

The ranks that issue to a `Communicator` are `commfuse.runtime.virtual_ranks`' threads. A
*mover* moves the data once both sides run: on CPU (`CpuMover`) every copy runs at once;
check-gpu's loopback copies on a side stream after both sides' streams
(`commfuse.check_gpu.loopback`).
"""

from __future__ import annotations

import threading
import time
from collections import deque

import torch

TIMEOUT_S = 60.0


class Deadlock(RuntimeError):
    """Every rank of a communicator waits (or has returned) and no op can run."""


class CpuMover:
    """Data movement on the host: every copy runs when both sides run (CPU compute is done
    when it is issued, so there is nothing to order)."""

    def mark(self):
        return None

    def run(self, fn, readies, tensors):
        fn()

    def query(self, done) -> bool:
        return True

    def after(self, dones) -> None:
        pass


class Op:
    """A batch of transfers or a collective on one rank's stream; the work its issuer waits."""

    def __init__(self, comm: "Communicator", rank: int, index: int, what: str):
        self.comm, self.rank, self.index, self.what = comm, rank, index, what
        self.sides: list[_Side] = []
        self.coll: tuple | None = None  # (kind, out, inp, sizes, in_sizes)
        self.done, self.dones = False, []  # dones: the movers' marks of its copies
        self.ready = comm.mover.mark()  # the issuing stream's point (NCCL waits for it)

    def __repr__(self) -> str:
        return f"rank {self.rank}'s op #{self.index} ({self.what})"

    def is_completed(self) -> bool:
        return self.done and all(self.comm.mover.query(d) for d in self.dones)

    def wait(self, timeout=None) -> bool:
        self.comm.wait(self)
        self.comm.mover.after(self.dones)
        return True


class _Side:
    """One side of a transfer: its op, kind, peer, buffer, and the side it is matched with."""

    def __init__(self, op: Op, kind: str, peer: int, buf: torch.Tensor):
        self.op, self.kind, self.peer, self.buf = op, kind, peer, buf
        self.other: _Side | None = None
        self.done = False

    def __repr__(self) -> str:
        return f"{self.kind} {'to' if self.kind == 'send' else 'from'} rank {self.peer}"


class Communicator:
    """The matching state of one communicator of ``world`` virtual ranks (module doc)."""

    def __init__(self, world: int, timeout_s: float = TIMEOUT_S, mover=None):
        self.world, self.timeout_s, self.mover = world, timeout_s, mover or CpuMover()
        self.cv = threading.Condition()
        self.streams: list[deque[Op]] = [deque() for _ in range(world)]
        self.issued = [0] * world
        self.unmatched: dict[tuple, deque[_Side]] = {}  # (kind, src, dst) -> sides in order
        self.blocked: list[Op | None] = [None] * world
        self.returned = [False] * world
        self.failure: Exception | None = None

    # issuing
    def issue(self, rank: int, transfers) -> Op:
        """Queue one batch of ``(transfer, buffer)`` (`commfuse.schedule.Transfer`) on
        ``rank``'s stream and match its sides with the peers' in pair order."""
        with self.cv:
            op = self._op(rank, ", ".join(f"{t.kind} slot {t.slot} "
                                          f"{'to' if t.kind == 'send' else 'from'} {t.peer}"
                                          for t, _ in transfers))
            for t, buf in transfers:
                side = _Side(op, t.kind, t.peer, buf)
                op.sides.append(side)
                src, dst = (rank, t.peer) if t.kind == "send" else (t.peer, rank)
                other = "recv" if t.kind == "send" else "send"
                waiting = self.unmatched.get((other, src, dst))
                if waiting:
                    self._pair(side, waiting.popleft())
                else:
                    self.unmatched.setdefault((t.kind, src, dst), deque()).append(side)
            self._progress()
            self._raise_failure()
            return op

    def collective(self, rank: int, kind: str, out, inp, sizes=None, in_sizes=None) -> Op:
        """Queue collective ``kind`` (laid out as `commfuse.runtime.collectives.launch`'s)."""
        w = self.world
        part = lambda t: t.shape[0] // w if t.dim() else 0  # noqa: E731
        sizes = list(sizes) if sizes is not None else [part(inp if kind == "reduce_scatter"
                                                            else out)] * w
        in_sizes = list(in_sizes) if in_sizes is not None else [part(inp)] * w
        with self.cv:
            op = self._op(rank, f"{kind} {sizes}")
            op.coll = (kind, out, inp, sizes, in_sizes)
            self._progress()
            self._raise_failure()
            return op

    def _op(self, rank: int, what: str) -> Op:
        self._raise_failure()
        op = Op(self, rank, self.issued[rank], what)
        self.issued[rank] += 1
        self.streams[rank].append(op)
        return op

    def _pair(self, a: _Side, b: _Side) -> None:
        a.other, b.other = b, a
        if a.buf.shape != b.buf.shape or a.buf.dtype != b.buf.dtype:
            self._fail(RuntimeError(
                f"NCCL model: {a.op}'s {a} is matched (pair order, tags ignored) with "
                f"{b.op}'s {b}, of another size: {tuple(a.buf.shape)} {a.buf.dtype} against "
                f"{tuple(b.buf.shape)} {b.buf.dtype}"))

    # running
    def _head(self, rank: int) -> Op | None:
        return self.streams[rank][0] if self.streams[rank] else None

    def _progress(self) -> None:
        """Run every op that can run, until none can (called with the lock held)."""
        moved = True
        while moved and self.failure is None:
            moved = False
            for r in range(self.world):
                head = self._head(r)
                if head is None:
                    continue
                if head.coll is None:
                    for s in head.sides:
                        if not s.done and s.other is not None and \
                                self._head(s.other.op.rank) is s.other.op:
                            self._move(s)
                    if all(s.done for s in head.sides):
                        self._complete(head)
                        moved = True
                elif all(h is not None and h.coll is not None for h in map(self._head,
                                                                            range(self.world))):
                    self._collective([self._head(q) for q in range(self.world)])
                    moved = True
        self.cv.notify_all()

    def _move(self, s: _Side) -> None:
        send, recv = (s, s.other) if s.kind == "send" else (s.other, s)
        done = self.mover.run(lambda: recv.buf.copy_(send.buf), (send.op.ready, recv.op.ready),
                              (send.buf, recv.buf))
        for side in (send, recv):
            side.done = True
            side.op.dones.append(done)

    def _complete(self, op: Op) -> None:
        self.streams[op.rank].popleft()
        op.done = True

    def _collective(self, ops: list[Op]) -> None:
        kinds = {(op.coll[0], str(op.coll[2].dtype)) for op in ops}
        if len(kinds) > 1 or not _agree(ops):
            self._fail(RuntimeError(f"NCCL model: ranks run different collectives at once: "
                                    f"{'; '.join(map(repr, ops))}"))
            return
        readies = [op.ready for op in ops]
        tensors = [t for op in ops for t in op.coll[1:3]]
        done = self.mover.run(lambda: _compute(ops), readies, tensors)
        for op in ops:
            op.dones.append(done)
            self._complete(op)

    # waiting
    def wait(self, op: Op) -> None:
        """Block ``op``'s rank until ``op`` completes; `Deadlock` if it never can."""
        deadline = time.monotonic() + self.timeout_s
        with self.cv:
            self.blocked[op.rank] = op
            try:
                self._progress()
                while not op.done:
                    self._raise_failure()
                    if self._stuck():
                        self._fail(Deadlock(self.describe()))
                        self._raise_failure()
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"NCCL model: {op} did not complete within "
                                           f"{self.timeout_s:g} s\n{self.describe()}")
                    self.cv.wait(min(left, 1.0))
            finally:
                self.blocked[op.rank] = None

    def rank_returned(self, rank: int) -> None:
        """``rank``'s thread has ended: it will issue nothing more."""
        with self.cv:
            self.returned[rank] = True
            self.cv.notify_all()

    def _stuck(self) -> bool:
        return all(self.returned[r] or (self.blocked[r] is not None and not self.blocked[r].done)
                   for r in range(self.world))

    def _raise_failure(self) -> None:
        """Raise the communicator's failure, if any, in this rank (a fresh exception each)."""
        if self.failure is not None:
            raise type(self.failure)(str(self.failure))

    def _fail(self, error: Exception) -> None:
        self.failure = error
        self.cv.notify_all()

    def describe(self) -> str:
        """Every rank's state: what it waits for and the ops on its stream not yet run."""
        lines = [f"NCCL model: deadlock among ranks {list(range(self.world))} "
                 f"(a rank's ops run in issue order; sends and receives are matched by order "
                 f"per pair of ranks, tags ignored):"]
        for r in range(self.world):
            state = "has returned" if self.returned[r] else f"waits for op #{self.blocked[r].index}"
            pending = []
            for op in self.streams[r]:
                if op.coll is not None:
                    pending.append(f"#{op.index} {op.what}")
                    continue
                left = [f"{s} ({self._match(s)})" for s in op.sides if not s.done]
                pending.append(f"#{op.index} [{op.what}] pending: {', '.join(left)}")
            lines.append(f"  rank {r} {state}; its stream: " + ("; ".join(pending) or "empty"))
        return "\n".join(lines)

    def _match(self, s: _Side) -> str:
        if s.other is None:
            return "its peer has issued no match"
        o = s.other.op
        head = self._head(o.rank)
        return f"matched with rank {o.rank}'s op #{o.index}" + (
            ", running" if head is o else f", queued behind its #{head.index}")


def _agree(ops: list[Op]) -> bool:
    """The ranks' collectives fit together (sizes as every rank sees them)."""
    kind = ops[0].coll[0]
    if kind == "all_reduce":
        return len({tuple(op.coll[2].shape) for op in ops}) == 1
    if kind == "all_to_all":  # p's in_sizes[q] rows go to q, which expects sizes[p]
        return all(op_p.coll[4][q] == op_q.coll[3][p] for p, op_p in enumerate(ops)
                   for q, op_q in enumerate(ops))
    return len({tuple(op.coll[3]) for op in ops}) == 1


def _compute(ops: list[Op]) -> None:
    """Every rank's result of one collective, sums in rank order (what the P2P path does)."""
    kind = ops[0].coll[0]
    if kind == "all_gather":
        whole = torch.cat([op.coll[2] for op in ops])
        for op in ops:
            op.coll[1].copy_(whole)
    elif kind == "all_to_all":
        parts = [op.coll[2].split(op.coll[4]) for op in ops]
        for q, op in enumerate(ops):
            op.coll[1].copy_(torch.cat([parts[p][q] for p in range(len(ops))]))
    else:  # reduce_scatter / all_reduce
        split = kind == "reduce_scatter"
        parts = [op.coll[2].split(op.coll[3]) if split else [op.coll[2]] * len(ops) for op in ops]
        sums = []
        for q in range(len(ops)):
            acc = parts[0][q].clone()
            for p in range(1, len(ops)):
                acc.add_(parts[p][q])
            sums.append(acc)
        for op, s in zip(ops, sums):
            op.coll[1].copy_(s)
