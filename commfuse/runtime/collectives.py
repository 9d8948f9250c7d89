"""The collectives behind ``none`` and ``sliced``: the backend's own, or the same bytes as P2P.

``collective="backend"`` calls torch.distributed's all-gather / reduce-scatter / all-to-all /
all-reduce. ``collective="p2p"`` moves exactly the bytes a ring or pairwise schedule moves, as
one batch of isend/irecv to every peer (the reduce-scatter sums the received chunks in rank
order when waited; the all-reduce sends the whole partial to every peer and sums all of them
in rank order: one round, bitwise the same sum on every rank). ``"auto"`` (the default)
takes the backend's on CUDA (NCCL's are the best there) and P2P elsewhere: on this project's
CPU testbed gloo's own collectives run slower than the same bytes exchanged point to point
(`none-torch` against `none` in docs/benchmarks/ops.md), and a slow baseline would flatter
every overlap method.

Every wait keeps the op's deadline: the P2P transfers' own (`commfuse.runtime.gloo`), the
backend's collectives theirs, gloo's reduce_scatter through `Guarded` (its wait ignores the
timeout). `exchange` is the small all-gather some ops make before their schedule (auto's
agreement on the method, checked mode's shapes), with the same deadline.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from commfuse.runtime import deadlines, gloo

KINDS = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")
BACKEND = {  # torch.distributed's own, by kind (the *_single names where this torch has them)
    "all_gather": getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor,
    "reduce_scatter": getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor,
    "all_to_all": dist.all_to_all_single,
}


def launch(kind: str, out: torch.Tensor, inp: torch.Tensor, group, tag: int, policy: str,
           sizes=None, in_sizes=None):
    """Start ``kind`` (out/inp laid out as torch's ``*_single`` ops) and return its work.

    Rows (dim 0) per rank may differ: ``sizes`` are the rows of each rank's part of the
    gathered side (all_gather's ``out``, reduce_scatter's ``inp``, all_to_all's ``out``) and
    ``in_sizes`` those of all_to_all's ``inp``; None means equal parts. all_reduce: ``out``
    (``inp`` itself, or a tensor of its shape) gets the sum; no sizes.
    """
    if kind not in KINDS:
        raise ValueError(f"collective kind {kind!r}: one of {', '.join(KINDS)}")
    w = group.size()
    sizes = list(sizes) if sizes is not None else [_rows(out if kind != "reduce_scatter" else inp, w)] * w
    in_sizes = list(in_sizes) if in_sizes is not None else [_rows(inp, w)] * w
    if policy == "backend" or (policy == "auto" and out.device.type == "cuda"):
        if kind == "all_reduce":
            if out is not inp:
                out.copy_(inp)
            return dist.all_reduce(out, group=group, async_op=True)
        if kind == "all_to_all":
            return BACKEND[kind](out, inp, sizes, in_sizes, group=group, async_op=True)
        if len(set(sizes)) == 1:
            return guarded(BACKEND[kind](out, inp, group=group, async_op=True), kind, out)
        return _Padded(kind, out, inp, group, sizes)
    return _P2PCollective(kind, out, inp, group, tag, sizes, in_sizes)


def guarded(work, kind: str, like: torch.Tensor):
    """``work`` of a backend collective ``kind``, in a form whose wait keeps its deadline: on
    CPU a reduce_scatter's in a `Guarded` (gloo's ignores a wait's timeout and waits for the
    group's; its all_gather, all_to_all and all_reduce keep theirs, and are waited directly,
    with no helper thread), anything else as it is (CUDA: NCCL keeps its own deadlines)."""
    return Guarded(work) if kind == "reduce_scatter" and like.device.type != "cuda" else work


class Guarded:
    """A CPU backend collective whose ``wait(timeout)`` ends by ``timeout`` (+ `GRACE_S`, so
    that the backend's own error, naming the cause, comes first where it keeps the deadline):
    the backend's wait runs on a helper thread, this one waits for it at most that long. A
    wait the backend overruns is left to finish on its (daemon) thread."""

    GRACE_S = 0.5

    def __init__(self, work):
        self.work = work

    def wait(self, timeout: timedelta | None = None) -> bool:
        if timeout is None:
            return self.work.wait()
        done, box = threading.Event(), {}

        def run() -> None:
            try:
                box["ok"] = self.work.wait(timeout)
            except BaseException as e:  # handed to the waiting thread
                box["error"] = e
            finally:
                done.set()

        threading.Thread(target=run, name="commfuse-wait", daemon=True).start()
        if not done.wait(timeout.total_seconds() + self.GRACE_S):
            raise TimeoutError(f"the backend's collective did not complete within "
                               f"{timeout.total_seconds():.3g} s")
        if "error" in box:
            raise box["error"]
        return box["ok"]


def exchange(mine: torch.Tensor, group, timeout_s: float | None) -> list[torch.Tensor]:
    """Every rank's ``mine`` (a small tensor of the same shape on each), by rank: the backend's
    all_gather, waited with a deadline (``timeout_s``; None: the group's own timeout), so a
    rank that died before it raises instead of blocking for the group's timeout."""
    every = [torch.empty_like(mine) for _ in range(group.size())]
    work = dist.all_gather(every, mine, group=group, async_op=True)
    deadlines.wait(work, group, mine.device, timeout_s)  # CUDA: the reader's sync waits
    return every


def _rows(t: torch.Tensor, w: int) -> int:
    return t.shape[0] // w if t.dim() else 0


class _Padded:
    """The backend's all_gather / reduce_scatter on uneven parts: every part padded to the
    longest with zeros, the even collective, then the real rows copied out on ``wait``."""

    def __init__(self, kind: str, out: torch.Tensor, inp: torch.Tensor, group, sizes):
        w, r, longest = group.size(), group.rank(), max(sizes)
        self.kind, self.out, self.sizes, self.r, self.longest = kind, out, sizes, r, longest
        if kind == "all_gather":
            src = inp.new_zeros((longest, *inp.shape[1:]))
            src[:sizes[r]].copy_(inp)
            self.tmp = out.new_empty((w * longest, *out.shape[1:]))
        else:
            src = inp.new_zeros((w * longest, *inp.shape[1:]))
            for p, part in enumerate(inp.split(sizes)):
                src[p * longest:p * longest + sizes[p]].copy_(part)
            self.tmp = out.new_empty((longest, *out.shape[1:]))
        self.work = guarded(BACKEND[kind](self.tmp, src, group=group, async_op=True), kind, out)

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self, timeout=None) -> bool:
        """Finish the collective; ``timeout`` (a timedelta) bounds the wait, None is the
        backend's own wait (CUDA: the stream waits, the host does not)."""
        if timeout is None:
            self.work.wait()
        else:
            gloo.wait_work(self.work, time.monotonic() + timeout.total_seconds())
        if self.kind == "all_gather":
            for p, part in enumerate(self.out.split(self.sizes)):
                part.copy_(self.tmp[p * self.longest:p * self.longest + self.sizes[p]])
        else:
            self.out.copy_(self.tmp[:self.sizes[self.r]])
        return True


class _P2PCollective:
    """A collective as one batch of P2P transfers with every peer; ``wait`` finishes it.
    Empty parts are not sent (every rank knows the sizes, so both sides skip them)."""

    def __init__(self, kind: str, out: torch.Tensor, inp: torch.Tensor, group, tag: int,
                 sizes: list[int], in_sizes: list[int]):
        w, r = group.size(), group.rank()
        self.kind, self.out, self.rank = kind, out, r
        if kind == "all_gather":  # my input to everyone, everyone's into its part of out
            outs = out.split(sizes)
            outs[r].copy_(inp)
            sends, recvs = [inp] * w, list(outs)
        elif kind == "all_to_all":  # my part p to rank p, rank q's part for me into out[q]
            outs, ins = out.split(sizes), inp.split(in_sizes)
            outs[r].copy_(ins[r])
            sends, recvs = list(ins), list(outs)
        elif kind == "all_reduce":  # my partial to everyone, theirs into buffers, summed later
            sends = [inp] * w
            recvs = [torch.empty_like(inp) if p != r else inp for p in range(w)]
        else:  # reduce_scatter: my partial of part p to rank p; theirs of mine, summed later
            ins = inp.split(sizes)
            sends = list(ins)
            recvs = [torch.empty_like(out) if p != r else ins[r] for p in range(w)]
        self.parts, self.group = recvs, group
        ops, self.what = [], []
        for p in range(w):
            if p != r:
                peer = dist.get_global_rank(group, p)
                if sends[p].numel():
                    ops.append(dist.P2POp(dist.isend, sends[p], peer, group, tag))
                    self.what.append(f"its send to rank {p}")
                if recvs[p].numel():
                    ops.append(dist.P2POp(dist.irecv, recvs[p], peer, group, tag))
                    self.what.append(f"its receive from rank {p}")
        if out.device.type == "cuda":  # one batch: NCCL groups a pair's send and receive
            self.works = gloo.post(ops, out.device) if ops else []
        else:  # one by one, so that a refused post names its peer
            self.works = [self._post(op, what) for op, what in zip(ops, self.what)]

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    @staticmethod
    def _post(op: dist.P2POp, what: str):
        try:
            return gloo.post([op], op.tensor.device)[0]
        except Exception as e:
            raise RuntimeError(f"{what}: {e}") from e

    def wait(self, timeout=None) -> bool:
        """Wait for every transfer, all within ``timeout`` (a timedelta) from now; a failure
        names the peer. None: on CPU the group's own timeout (never unbounded), on CUDA the
        backend's wait (the stream waits, the host does not)."""
        cuda = self.out.device.type == "cuda"
        if timeout is None and not cuda:
            timeout = timedelta(seconds=gloo.group_timeout(self.group, self.out.device))
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        for w, what in dict(zip(self.works, self.what)).items():  # NCCL: one work per batch
            try:
                if deadline is None:
                    w.wait()
                else:
                    gloo.wait_work(w, deadline)
            except Exception as e:
                raise RuntimeError(f"{what}: {e}") from e
        if self.kind in ("reduce_scatter", "all_reduce"):
            self._sum()
        return True

    def _sum(self) -> None:
        """``out`` = the parts' sum in rank order (own partial included: deterministic, and
        the same bits on every rank), in one pass where there are two."""
        parts, out = self.parts, self.out
        if len(parts) == 1:
            if out is not parts[0]:
                out.copy_(parts[0])
            return
        if len(parts) == 2:  # out may be one of them: exact aliasing is fine for add
            torch.add(parts[0], parts[1], out=out)
            return
        acc = parts[0].clone()
        for part in parts[1:]:
            acc.add_(part)
        out.copy_(acc)
