"""Mixture-of-Experts expert parallelism as schedules (data): the dispatch all-to-all feeding
the experts' first GEMM, and the experts' last GEMM feeding the combine all-to-all, with
per-peer row counts that change every step.

Experts: E in all, E_l = E/W per rank, global expert e on rank e // E_l (local index
e % E_l). `ExpertCounts.tokens[p][e]` is how many rows (token copies, one per chosen
expert) rank p routes to expert e; every rank holds the same table (`commfuse.ops.moe.counts`
exchanges and validates it once per step). ``rows[p][q]``, the rows rank p dispatches to
rank q, is the sum of ``tokens[p][e]`` over rank q's experts; the combine moves the same rows
back, rank q to rank p.

Layouts (the rows of the ops' tensors):

- send layout (dispatch input, combine output, on rank p): rows sorted by global expert, so
  slot q (the rows for rank q's experts) is contiguous, at `ExpertCounts.send_offsets`;
- receive layout (dispatch output, combine input, on rank q): source-major, slot p (the rows
  from rank p) at `ExpertCounts.recv_offsets`, sorted by local expert inside it, so each
  (source slot, local expert) group is contiguous and one GEMM with that expert's weight.

Dedup (the table's ``firsts`` / ``lasts`` / ``singles``, `commfuse.ops.moe.routing`): the
GEMMs still run on one row per (token, expert), the expanded rows above, but the transfers
move one row per (token, rank), `ExpertCounts.pairs`. Inside each (source, expert) group
the rows run middle (neither the token's first nor its last expert on that rank), first
only, single (first and last), last only, each by token; the dispatch moves a pair with
its first row's piece, the combine with its last row's (`ExpertCounts.moved_piece`), so a
piece's GEMMs need only rows moved with it or before it, and a piece may compute without
moving anything. Without dedup every row is its own pair and moves with its piece.

The one rule both sides of a transfer apply: a message from p to q exists iff it moves rows;
a slot with no rows is neither sent, received nor computed. Both read the same table, so a
send and its receive always agree on the size (gloo aborts a receiver on a mismatch).

Methods (``auto`` is the fastest of them on the simulator's cost model, `commfuse.sim.moe`):

- ``none``: one all-to-all of every slot (`all_to_all_single` with the split sizes), then the
  GEMMs (dispatch); the GEMMs, then one all-to-all (combine);
- ``sliced``: every slot cut into ``k`` near-equal chunks; chunk j of every slot moves in one
  all-to-all, overlapped with chunk j-1's GEMMs (dispatch) or chunk j+1's (combine);
- ``commfuse``: pairwise P2P. Dispatch posts every send and receive at once and computes the
  own slot first, on tokens already here, while the peers' slots arrive, then slots r-1, r-2,
  ... as each lands. Combine computes the rows for r+1 first and sends them, then r+2, ...,
  each send hiding behind the next slot's GEMMs, its own rows last; step i's receive (from
  r-i) is posted in the same batch as step i's send. ``splits`` m cuts every slot into m
  near-equal pieces (slot p*m + j is piece j of slot p, its transfer tagged i*m + j at
  pairwise step i), so a peer's rows are computed (dispatch) or sent (combine) piece by
  piece: a transfer that outlasts a slot's GEMMs is hidden behind all but its last piece's.

``tail=True`` (the backward's use: the weight grads, which need no transfer) adds one
``Compute(TAIL)`` after the last GEMM and before the final waits of ``sliced`` and
``commfuse``, so that work hides the last transfers; ``none`` keeps its collective and GEMMs
strictly one after the other.

Pure: no torch, no processes; the executor (`commfuse.runtime.executor`) runs these objects.
"""

from __future__ import annotations

from commfuse.schedule import (Compute, Post, Schedule, Step, Transfer, Wait, WaitCollective,
                               _collective_gather, _collective_reduce)
from commfuse.schedule.expert_counts import ExpertCounts, piece

__all__ = ["ExpertCounts", "OPS", "METHODS", "TAIL", "build", "chunk_count", "clip", "piece"]

OPS = ("moe_dispatch", "moe_combine")  # dispatch a2a -> GEMM, GEMM -> combine a2a
METHODS = ("none", "sliced", "commfuse")
TAIL = -1  # the slot of the extra work `build(..., tail=True)` runs before the final waits


def chunk_count(counts: ExpertCounts, chunks: int) -> int:
    """``sliced``'s k: ``chunks``, but never more than the largest slot has rows (at least
    1); a function of the table, so the same on every rank."""
    longest = max(n for row in counts.rows for n in row)
    return max(1, min(chunks, longest))


def clip(sizes, lo: int, hi: int) -> tuple[int, ...]:
    """The rows of each consecutive group of ``sizes`` that fall within rows [lo, hi)."""
    out, start = [], 0
    for n in sizes:
        out.append(max(0, min(hi, start + n) - max(lo, start)))
        start += n
    return tuple(out)


def build(op: str, method: str, counts: ExpertCounts, rank: int, *,
          chunks: int = 4, splits: int = 1, tail: bool = False) -> Schedule:
    """The schedule of ``op`` ("moe_dispatch" or "moe_combine") under ``method`` for ``rank``.

    Slots are ranks under ``commfuse`` (a transfer's slot is its peer: the dispatch sends slot
    q to q and receives slot p from p; the combine sends the rows computed for p back to p and
    receives slot q, its own rows computed by q), pieces of them with ``splits`` m > 1 (slot
    p*m + j), and chunks under ``none`` / ``sliced``. ``tail``: a ``Compute(TAIL)`` before
    the final waits (module doc).
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not isinstance(counts, ExpertCounts):
        raise TypeError(f"counts must be an ExpertCounts, got {type(counts).__name__}")
    if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1:
        raise ValueError(f"splits must be an int >= 1, got {splits!r}")
    w = counts.world
    if not 0 <= rank < w:
        raise ValueError(f"bad rank {rank} of world size {w}")
    if method in ("none", "sliced"):
        k = 1 if method == "none" else chunk_count(counts, chunks)
        steps = _collective_gather(k) if op == "moe_dispatch" else _collective_reduce(k)
        if tail and method == "sliced":
            steps = _with_tail(steps, op)
        return Schedule(op, method, w, rank, "direct", k, tuple(steps))
    if op == "moe_dispatch":  # slot (src -> dst) moves src's tokens to dst's experts
        def sizes(src, dst, j):
            return counts.moved_piece(op, src, dst, splits, j)[1], \
                piece(counts.rows[src][dst], splits, j)[1]
    else:  # the same slots, the other way: q sends slot (p -> q)'s rows back to p
        def sizes(src, dst, j):
            return counts.moved_piece(op, dst, src, splits, j)[1], \
                piece(counts.rows[dst][src], splits, j)[1]
    fn = _dispatch if op == "moe_dispatch" else _combine
    steps = fn(sizes, w, rank, splits)
    if tail:
        steps = _with_tail(steps, op)
    return Schedule(op, method, w, rank, "direct", w * splits, tuple(steps))


def _with_tail(steps: list[Step], op: str) -> list[Step]:
    """``steps`` with ``Compute(TAIL)`` after the last step that is not a wait: after the
    last GEMM (and, in the combine, its send), before the final waits, which it hides."""
    last = max((i for i, st in enumerate(steps) if not isinstance(st, (Wait, WaitCollective))),
               default=-1)
    return steps[:last + 1] + [Compute(TAIL)] + steps[last + 1:]


def _pair(sizes, w: int, r: int, i: int, m: int, j: int) -> list[Transfer]:
    """Piece j of step i's transfers: to rank r+i and from rank r-i (tag i*m + j on both
    sides), each only if that piece moves rows (``sizes(src, dst, j)``: (rows piece j of
    the message from src to dst moves, rows of its slot's chunk the GEMMs compute))."""
    dst, src = (r + i) % w, (r - i) % w
    out = []
    if sizes(r, dst, j)[0]:
        out.append(Transfer("send", dst * m + j, dst, i * m + j))
    if sizes(src, r, j)[0]:
        out.append(Transfer("recv", src * m + j, src, i * m + j))
    return out


def _dispatch(sizes, w: int, r: int, m: int = 1) -> list[Step]:
    """Every transfer posted at the start (they move while the own slot computes); then each
    peer's slot, r-1 first, piece by piece, each computed as soon as it is here (pieces in
    order: with dedup a piece's rows may repeat tokens an earlier piece brought); the sends
    waited at the end."""
    steps: list[Step] = []
    sends, recvs = [], {}
    for i in range(1, w):
        batch = [t for j in range(m) for t in _pair(sizes, w, r, i, m, j)]
        if batch:
            steps.append(Post(tuple(batch)))  # hides behind the own slot's GEMMs
        sends += [t for t in batch if t.kind == "send"]
        recvs.update((t.slot, t) for t in batch if t.kind == "recv")
    for i in range(w):
        src = (r - i) % w
        for j in range(m):
            moved, rows = sizes(src, r, j)
            if not rows:
                continue  # nothing from src in this piece: no receive, no GEMM
            if i and moved:
                steps.append(Wait(recvs[src * m + j]))  # the piece this GEMM needs
            steps.append(Compute(src * m + j))  # hides the transfers still in flight
    return steps + [Wait(t) for t in sends]


def _combine(sizes, w: int, r: int, m: int = 1) -> list[Step]:
    """The rows for r+1 computed first, piece by piece, each piece sent at once with the
    receive of the same step (from r-i, tag i*m + j) and hiding behind the next piece's
    GEMMs; then r+2, ...; the own rows last; receives, then sends, waited at the end. With
    dedup a piece sends the tokens whose last row it computed: a piece may compute without
    sending.

    Step i's receive is posted with step i's send, not before: where a rank's P2P batches
    run one after another (NCCL: one stream per group, `commfuse.runtime.cuda`), a batch of
    receives alone would hold every later batch, this rank's sends included, until its
    peers' sends land, and theirs are held behind their own receives, so no rank would ever
    send. Batch (i, j) on every rank pairs with batch (i, j) on its two peers, so the
    batches complete in the same order everywhere (as `_dispatch`'s and the pairwise ops').
    """
    steps: list[Step] = []
    recvs, sends = [], []
    for i in range(1, w):
        dst = (r + i) % w
        for j in range(m):
            if sizes(r, dst, j)[1]:
                steps.append(Compute(dst * m + j))  # the send hides behind the next GEMMs
            batch = _pair(sizes, w, r, i, m, j)
            if batch:
                steps.append(Post(tuple(batch)))
            recvs += [t for t in batch if t.kind == "recv"]
            sends += [t for t in batch if t.kind == "send"]
    for j in range(m):
        if sizes(r, r, j)[1]:
            steps.append(Compute(r * m + j))  # own rows, straight into the output
    return steps + [Wait(t) for t in recvs + sends]
