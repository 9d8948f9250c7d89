"""ZeRO-3 prefetch: the next units' weight all-gathers posted while this unit computes (FSDP's
forward and backward prefetch).

A *unit* is what the plan groups (`commfuse.parallel.plan`: the DP-sharded weights of one
transformer block, in the order the forward uses them; the output head alone). When a
`ShardedLinear` needs its whole weight, it *takes* it from the `Prefetcher`:

    forward   take(w, "forward")   the gather of w, if posted earlier; else posted now. Then
                                   the rest of w's unit and the next ``ahead`` units are posted
    backward  take(w, "backward")  the same in reverse unit order (the backward of block i
                                   posts block i-1's gathers)

so while block i computes (its GEMMs, attention, norms, SwiGLU), block i+1's weights travel.
A posted gather (`WeightGather`) is direct P2P on the DP group: this rank's rows to every peer,
each peer's rows into their place in one [O, I] buffer, one tag for all (`TAG`). Its consumer
waits slot by slot (own rows first, then ranks r-1, r-2, ...: the fused AG->GEMM's order), so
rows that have arrived are computed on while the rest travel; a gather that arrived whole
leaves the GEMM nothing to wait for.

Rules that keep every rank's message stream the same (gloo matches a pair's messages with one
tag in posting order, and a size mismatch aborts the receiver): what is posted, and when,
depends only on the units, ``ahead``, ``max_bytes`` and the order of takes, which every rank of
the DP group shares (the same model code, the same shapes). Every posted work is waited once,
with the op timeout or the group's (`commfuse.runtime.transport`). Nothing prefetched outlives
a pass: a take of a weight already taken in this pass, or of an earlier unit than the last
one taken, starts a new pass and first *drains* (waits for, then drops) whatever is still
posted, so a gather left over by an exception, an eval forward without backward, or an unused
weight is finished before the next pass's messages (and before weights it copied change);
the end of a backward drains too (a callback of the autograd engine). Bound: at most the
current unit and ``ahead`` more are gathered at once, and with ``max_bytes`` the units ahead
stop at the first that would pass it.

The backward's gradient reduce-scatter of a prefetched weight (`GradReduce`, direct P2P,
tag ``TAG + 1``) is posted in its backward and finished during the next weight's
(`Prefetcher.reduce_later`: at most two in flight) and all of them at the end of the
backward, before any gathers left are drained: on gloo a pair's messages leave in posting
order, so a reduce-scatter waited inside its own backward would wait behind the next block's
prefetched gathers (docs/benchmarks/prefetch.md).

In ``compute_only`` mode (`commfuse.runtime.modes`) the gathers move nothing. On CUDA, and
under torch.compile, the plans gather as they did without prefetch (not built here).
"""

from __future__ import annotations

import torch

from commfuse.errors import CommFuseError
from commfuse.runtime import executor, modes
from commfuse.schedule import Transfer

TAG = 9001  # P2P tag of every prefetched gather (the ops' schedules use small tags, vocab 7001)
PHASES = ("forward", "backward")


class WeightGather:
    """``all_gather(w_oI, 0)`` over ``group`` as direct P2P, posted on construction.

    ``full`` is the [P*o, ...] result (this rank's rows copied in at once); `wait` (slot p)
    returns the rows of rank p once they are here; `finish` waits for everything left (the
    sends too) and returns ``full``. Each work is waited once; a failed or late peer raises
    `CommFuseError` naming the weight and the peer.
    """

    def __init__(self, w_oI: torch.Tensor, group, timeout_s: float | None, name: str = "weight"):
        world, rank, o = group.size(), group.rank(), w_oI.shape[0]
        self.name, self.rank, self.o = name, rank, o
        self.full = w_oI.new_empty((world * o, *w_oI.shape[1:]))
        own = self.full[rank * o:(rank + 1) * o]
        own.copy_(w_oI.detach())  # sent from this copy: the optimizer may change w_oI meanwhile
        self.order = [(rank - k) % world for k in range(world)]  # own first, then r-1, r-2, ...
        posts = []
        for k in range(1, world):
            src = (rank - k) % world
            posts += [(Transfer("send", rank, (rank + k) % world, TAG), own),
                      (Transfer("recv", src, src, TAG), self.full[src * o:(src + 1) * o])]
        self.transport = executor.make_transport(group, w_oI.device, timeout_s)
        works = self.transport.post(posts) if posts else []
        self.recvs = {t.peer: w for (t, _), w in zip(posts, works) if t.kind == "recv"}
        self.sends = {t.peer: w for (t, _), w in zip(posts, works) if t.kind == "send"}

    @property
    def nbytes(self) -> int:
        return self.full.numel() * self.full.element_size()

    def rows(self, p: int) -> slice:
        return slice(p * self.o, (p + 1) * self.o)

    def wait(self, p: int) -> slice:
        """Wait for rank ``p``'s rows (at once for this rank's); their slice of ``full``."""
        self._wait(self.recvs, p, "receive from")
        return self.rows(p)

    def finish(self) -> torch.Tensor:
        """Wait for every transfer left; the whole weight."""
        for p in list(self.recvs):
            self._wait(self.recvs, p, "receive from")
        for p in list(self.sends):
            self._wait(self.sends, p, "send to")
        return self.full

    def _wait(self, works: dict, p: int, what: str) -> None:
        work = works.pop(p, None)  # popped first: never waited twice, even if it fails
        if work is None:
            return
        try:
            self.transport.wait(work)
        except Exception as e:
            raise CommFuseError(f"commfuse prefetch: gather of {self.name} (rank {self.rank}) "
                                f"failed waiting for its {what} rank {p}: {e}") from e


class GradReduce:
    """``dW_oI = reduce_scatter(dY_OX @ X_XI, 0)`` into ``mod.weight.grad``, posted now and
    finished later (`finish`), so its transfers overlap the backward that follows.

    The partial of every peer's rows is computed and sent at once (rank r+1's first), this
    rank's own last; `finish` waits for the peers' partials and adds them in rank order
    (deterministic), then accumulates into ``.grad``. Extra memory until then: W-1 partials
    sent and W-1 received, each of the shard's size.
    """

    def __init__(self, mod, g_OX: torch.Tensor, x_XI: torch.Tensor, timeout_s: float | None):
        group, w = mod.group, mod.weight
        world, rank, o = group.size(), group.rank(), w.shape[0]
        self.mod, self.rank = mod, rank
        self.parts: dict[int, torch.Tensor] = {}
        posts = []
        for k in range(1, world):  # the peers' partials first: they travel while we compute
            src, dst = (rank - k) % world, (rank + k) % world
            self.parts[src] = w.new_empty(w.shape)
            part = modes.gemm(g_OX[dst * o:(dst + 1) * o], x_XI)
            posts += [(Transfer("recv", src, src, TAG + 1), self.parts[src]),
                      (Transfer("send", dst, dst, TAG + 1), part)]
        # made after the partials' GEMMs: its transfers come after what it was made after
        # (on CUDA: the compute stream's point), so the sends read the finished partials
        self.transport = executor.make_transport(group, w.device, timeout_s)
        works = self.transport.post(posts) if posts else []
        self.works = {(t.kind, t.peer): wk for (t, _), wk in zip(posts, works)}
        self.sent = [b for t, b in posts if t.kind == "send"]  # alive until their sends end
        self.parts[rank] = modes.gemm(g_OX[rank * o:(rank + 1) * o], x_XI)

    def finish(self) -> None:
        for key in list(self.works):
            work = self.works.pop(key)  # popped first: never waited twice
            try:
                self.transport.wait(work)
            except Exception as e:
                raise CommFuseError(
                    f"commfuse prefetch: gradient reduce-scatter of {self.mod.what} (rank "
                    f"{self.rank}) failed waiting for its {key[0]} {key[1]}: {e}") from e
        self.sent = []
        if not self.parts:
            return
        parts, self.parts = self.parts, {}
        total = parts[0]
        for p in range(1, len(parts)):  # rank order, own partial included
            total.add_(parts[p])
        w = self.mod.weight
        if w.grad is None:
            w.grad = total
        else:
            w.grad.add_(total)


class Prefetcher:
    """Posts the weight gathers of ``units`` ahead of their use (see the module docstring).

    ``units``: lists of `commfuse.parallel.data.ShardedLinear` in forward order, the same on
    every rank of their DP group; ``ahead``: units posted beyond the current one (>= 1);
    ``max_bytes``: a limit on the gathered bytes posted for units beyond the current one
    (None: no limit but ``ahead``).
    """

    def __init__(self, units, ahead: int = 1, max_bytes: int | None = None):
        if not isinstance(ahead, int) or isinstance(ahead, bool) or ahead < 1:
            raise ValueError(f"Prefetcher: ahead must be an int >= 1, got {ahead!r}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"Prefetcher: max_bytes must be >= 0 or None, got {max_bytes!r}")
        self.units = [list(u) for u in units if u]
        self.ahead, self.max_bytes = ahead, max_bytes
        self.unit_of = {id(m): i for i, u in enumerate(self.units) for m in u}
        self.pending: dict[str, dict[int, WeightGather]] = {ph: {} for ph in PHASES}
        self.taken: dict[str, set[int]] = {ph: set() for ph in PHASES}
        self.last = {ph: -1 for ph in PHASES}  # position of the last unit taken in this pass
        self.reducing: list[GradReduce] = []  # gradient reduce-scatters posted, not finished
        self.callback_queued = False
        self.peak_pending = 0  # most gathers posted and not yet taken at once (tests)

    def modules(self) -> list:
        """Every module of every unit, in forward order."""
        return [m for u in self.units for m in u]

    def take(self, mod, phase: str) -> WeightGather:
        """``mod``'s weight gather for ``phase``: the posted one or one posted now; then the
        rest of its unit and the next units of ``phase``'s order are posted."""
        unit = self.unit_of[id(mod)]
        pos = unit if phase == "forward" else len(self.units) - 1 - unit
        if pos < self.last[phase] or id(mod) in self.taken[phase]:
            self.drain(phase)  # a new pass: what the last one left is finished first
        self.last[phase] = pos
        self.taken[phase].add(id(mod))
        if phase == "backward":
            self._end_of_backward()
        gather = self.pending[phase].pop(id(mod), None) or self._post(mod)
        step = 1 if phase == "forward" else -1
        ahead_bytes = 0
        for j in range(self.ahead + 1):
            u = unit + step * j
            if not 0 <= u < len(self.units):
                break
            todo = [m for m in self._order(u, phase) if id(m) not in self.pending[phase]
                    and id(m) not in self.taken[phase]]
            if j:
                ahead_bytes += sum(_gathered_bytes(m) for m in self.units[u])
                if self.max_bytes is not None and ahead_bytes > self.max_bytes:
                    break
            for m in todo:
                self.pending[phase][id(m)] = self._post(m)
        self.peak_pending = max(self.peak_pending, len(self.pending[phase]))
        return gather

    def reduce_later(self, mod, g_OX: torch.Tensor, x_XI: torch.Tensor) -> None:
        """Post ``mod``'s gradient reduce-scatter (`GradReduce`); the one posted before it is
        finished first (at most two in flight), the last at the end of the backward."""
        self._end_of_backward()
        while len(self.reducing) > 1:
            self.reducing.pop(0).finish()
        self.reducing.append(GradReduce(mod, g_OX, x_XI, mod.op_kwargs.get("timeout")))

    def finish_reductions(self) -> None:
        """Finish every gradient reduce-scatter posted (their ``.grad`` complete)."""
        while self.reducing:
            self.reducing.pop(0).finish()

    def drain(self, phase: str | None = None) -> None:
        """Finish and drop every gather still posted (``phase``'s, or all); a new pass."""
        if phase != "forward":
            self.finish_reductions()
        for ph in PHASES if phase is None else (phase,):
            pending, self.pending[ph] = self.pending[ph], {}
            self.taken[ph], self.last[ph] = set(), -1
            if ph == "backward":  # a backward that raised never ran its callback
                self.callback_queued = False
            for g in pending.values():
                g.finish()

    def _order(self, unit: int, phase: str) -> list:
        return self.units[unit] if phase == "forward" else self.units[unit][::-1]

    @staticmethod
    def _post(mod) -> WeightGather:
        return WeightGather(mod.weight.detach(), mod.group, mod.op_kwargs.get("timeout"),
                            getattr(mod, "what", "weight"))

    def _end_of_backward(self) -> None:
        """Drain the backward's gathers when the autograd engine finishes this backward."""
        if self.callback_queued:
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        except RuntimeError:  # not inside a backward (a direct call): the next pass drains
            return
        self.callback_queued = True

    def _backward_done(self) -> None:
        self.callback_queued = False
        self.drain("backward")  # the reductions first, then the gathers left


def _gathered_bytes(mod) -> int:
    w = mod.weight
    return w.numel() * w.element_size() * mod.group.size()
