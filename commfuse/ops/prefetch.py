"""Cross-op overlap in the backward: an AG->GEMM's re-gather posted ahead of its backward.

AG->GEMM (`commfuse.ops.gather_scatter.AllGatherMatmul`) saves only this rank's shard of A
and gathers A again in its backward. That data exists from the forward on, so the gather can
start before the backward reaches the op: while the elementwise and attention backward between
the ops computes, the link carries it (TPSP block, backward order):

    down GEMM->RS bwd  [its transfers posted] -> post gate|up's re-gather
    SwiGLU bwd                                    (the re-gather moves meanwhile)
    gate|up AG->GEMM bwd: wait for it slot by slot, dW GEMMs per slot, then the RS of dx
    out-proj GEMM->RS bwd [its transfers posted] -> post q|k|v's re-gather
    SDPA + RoPE bwd                               (the re-gather moves meanwhile)
    q|k|v AG->GEMM bwd: as above

A `Prefetcher` links the ops of one model. In the forward each AG->GEMM that will need its
re-gather records a `Ticket` (`record`); the next fused op given the same prefetcher (the
GEMM->RS after it) claims that ticket (`claim`). In the backward, that op posts the ticket's
gather right after its own last post (`commfuse.schedule.prefetch.last_post`), so the prefetch never
queues ahead of its transfers; the AG->GEMM's backward then runs the rest of the gather
(`take`), computing the weight gradients per slot in the same slot order as without prefetch
(bit-identical gradients). The plan of what is posted when is
`commfuse.schedule.prefetch.PrefetchPlan`.

Every rank decides the same: what is recorded, claimed and posted follows the forward and the
autograd graph (requires_grad, the op order), the same on every rank, never timing or local
data. Bounded: at most ``depth`` gathers are posted and not yet consumed; posting one more
first waits out the oldest. A posted gather that is never consumed (its op's backward does not
run: no grad reached it, ``inputs=`` cut it off, the backward failed) is waited out (`drain`,
every wait with the op's deadline) before the next post and by `drain`, which the model calls
at each forward: its transfers were posted by every rank, so they complete and nothing is left
in flight to desync the next step. Prefetched gathers use P2P tags of their own
(``TAG_BASE``), so they never match another op's messages. Under torch.compile the ops run as
custom ops and nothing is recorded (no prefetch); on CUDA it is off too, for now.
"""

from __future__ import annotations

from collections import deque

import torch

from commfuse.ops.ag_matmul import PostedGather

TAG_BASE = 1 << 20  # prefetched gathers' tags: TAG_BASE + (n % TAG_WINDOWS) * TAG_STRIDE + tag
TAG_WINDOWS, TAG_STRIDE = 16, 1 << 14


class Ticket:
    """One AG->GEMM's re-gather as its forward leaves it: this rank's shard (dim first), the
    rows per rank, group and method; once posted, the running `PostedGather`."""

    def __init__(self, prefetcher: "Prefetcher", a_sMK: torch.Tensor, sizes, group, spec):
        self.prefetcher = prefetcher
        self.a_sMK, self.sizes, self.group, self.spec = a_sMK, sizes, group, spec
        self.posted: PostedGather | None = None
        self.state = "new"  # -> "posted" -> "taken" | "drained"; "taken" also if never posted

    def post(self) -> None:
        """The claiming op's backward, after its last post: `Prefetcher.post`."""
        self.prefetcher.post(self)

    def take(self) -> PostedGather | None:
        """The AG->GEMM's backward: `Prefetcher.take`."""
        return self.prefetcher.take(self)


def posting(ticket: "Ticket | None", backward):
    """Run ``backward(after_posts)``, the claiming op's fused backward, posting ``ticket``'s
    gather where its prefetcher says: right after that backward's last post (``at="posts"``,
    passed as ``after_posts``) or after it (``"end"``); nothing without a ticket."""
    at = None if ticket is None else ticket.prefetcher.at
    out = backward(ticket.post if at == "posts" else None)
    if at == "end":
        ticket.post()
    return out


class Prefetcher:
    """Links the fused ops of one model for the backward prefetch (module doc).

    ``depth``: gathers posted ahead and not yet consumed, at most (0: off; the ops then run
    exactly as without a prefetcher). ``at``: where the claiming op's backward posts it,
    "posts" (right after its own last post: the default) or "end" (when its backward is done;
    kept to measure the choice, see docs/benchmarks/prefetch.md)."""

    AT = ("posts", "end")

    def __init__(self, depth: int = 1, at: str = "posts"):
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
            raise ValueError(f"prefetch depth must be an int >= 0, got {depth!r}")
        if at not in self.AT:
            raise ValueError(f"prefetch point must be one of {self.AT}, got {at!r}")
        self.depth, self.at = depth, at
        self.last: Ticket | None = None  # recorded in the forward, not yet claimed
        self.inflight: deque[Ticket] = deque()  # posted, not yet taken
        self.posts = 0  # gathers posted so far (their tag window), the same count on every rank

    # forward
    def record(self, a_sMK: torch.Tensor, sizes, group, spec) -> Ticket | None:
        """An AG->GEMM's forward: the ticket of its backward's gather (None when off)."""
        if self.depth == 0 or torch.compiler.is_compiling() or a_sMK.device.type != "cpu":
            return None  # CUDA: the streams' ordering of a gather split over two ops is not
            # verified on a GPU yet (the same choice on every rank: they share the device type)
        self.last = Ticket(self, a_sMK, sizes, group, spec)
        return self.last

    def claim(self) -> Ticket | None:
        """The next fused op's forward: the ticket its backward will post (None: nothing)."""
        ticket, self.last = self.last, None
        return ticket

    # backward
    def post(self, ticket: Ticket) -> None:
        """Post ``ticket``'s gather now (once; a second backward through it does nothing)."""
        if ticket.state != "new":
            return
        while len(self.inflight) >= self.depth:  # bounded: the oldest is waited out first
            self._abandon(self.inflight.popleft())
        offset = TAG_BASE + (self.posts % TAG_WINDOWS) * TAG_STRIDE
        self.posts += 1
        ticket.posted = PostedGather(ticket.a_sMK, ticket.sizes, ticket.group, ticket.spec,
                                     offset)
        ticket.state = "posted"
        self.inflight.append(ticket)

    def take(self, ticket: Ticket) -> PostedGather | None:
        """The AG->GEMM's backward: its gather if it was posted (and not waited out), to
        `PostedGather.finish`; None: gather as usual."""
        posted = ticket.posted if ticket.state == "posted" else None
        ticket.state, ticket.posted = "taken", None
        if posted is not None:
            self.inflight.remove(ticket)
        return posted

    def drain(self) -> None:
        """Wait out every gather posted and not taken (each transfer once, with its deadline)
        and forget the unclaimed ticket. Call it where every rank is at the same point (the
        model's forward). Nothing to do under torch.compile (nothing is posted there)."""
        if torch.compiler.is_compiling():
            return
        self.last = None
        while self.inflight:
            self._abandon(self.inflight.popleft())

    @staticmethod
    def _abandon(ticket: Ticket) -> None:
        posted, ticket.posted, ticket.state = ticket.posted, None, "drained"
        posted.abandon()
