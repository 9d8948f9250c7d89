"""Gradient sync of replicated parameters, bucketed and started during the backward (DDP-style).

A parameter replicated over some mesh axes (the norms; the embedding under DP; the output head
tied or under DP-less layouts; every Ulysses weight; see `commfuse.parallel.config.sharded_axes`)
holds on each rank only its contribution to the gradient; the sum over those axes is the
gradient. `GradSync` groups such parameters into buckets of at most ``bucket_mb`` per process
group, in the reverse of their registration order (roughly the order the backward finishes
them: output head and final norm first, embedding last). A post-accumulate-grad hook on every
parameter counts the bucket down; when its last gradient has landed, the bucket is flattened
into one buffer and its all-reduce is *posted* (``async_op=True``), so it travels while the
backward computes the earlier layers. `finish` (``ParallelLlama.sync_grads``) posts what the
hooks did not (a parameter that got no gradient counts as zero), waits for every bucket with
the group's timeout and copies the sums back into ``.grad``.

Rules that keep every rank's collectives in the same order (gloo matches them by order):
buckets are posted strictly in index order (a ready bucket waits for the ones before it), and
each bucket is posted once per sync round.

Gradient accumulation (several backward passes before one sync): inside ``no_sync()`` the hooks
post nothing and `finish` syncs everything after the last backward. Without it, a second
backward that touches an already posted bucket marks it stale: `finish` waits for the stale
all-reduce and all-reduces the accumulated gradient again (correct, one extra transfer).

In ``compute_only`` measurement mode (`commfuse.runtime.modes`) the hooks post nothing.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from commfuse.errors import CommFuseError
from commfuse.runtime import deadlines, modes
from commfuse.runtime.transport import group_timeout

DEFAULT_BUCKET_MB = 25.0  # as torch DDP


class _Bucket:
    def __init__(self, index: int, key: str, group, params: list[nn.Parameter]):
        self.index, self.key, self.group, self.params = index, key, group, params
        self.ready: set[int] = set()
        self.flat: torch.Tensor | None = None
        self.work = None
        self.stale = False

    def post(self) -> None:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.flat = torch.cat([p.grad.detach().flatten() for p in self.params])
        self.work = dist.all_reduce(self.flat, group=self.group, async_op=True)


class GradSync:
    """Buckets of replicated parameters, all-reduced as their gradients become ready.

    ``groups``: ``[(key, process group, parameters)]``, one entry per set of mesh axes a
    parameter is replicated on (deduplicated parameters: a tied weight appears once).
    ``timeout_s``: a bucket's wait limit (default: its group's own timeout); past it,
    `finish` raises `commfuse.CommFuseError` naming the bucket.
    """

    def __init__(self, groups, bucket_mb: float = DEFAULT_BUCKET_MB,
                 timeout_s: float | None = None):
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb!r}")
        self.timeout_s, self.enabled = timeout_s, True
        self.buckets: list[_Bucket] = []
        self.log: list[tuple[int, bool]] = []  # this round's posts: (bucket, by a hook)
        limit = bucket_mb * 2 ** 20
        for key, group, params in groups:
            current, size = [], 0
            for p in reversed(params):  # the backward finishes the last-registered first
                nbytes = p.numel() * p.element_size()
                if current and size + nbytes > limit:
                    self.buckets.append(_Bucket(len(self.buckets), key, group, current))
                    current, size = [], 0
                current.append(p)
                size += nbytes
            if current:
                self.buckets.append(_Bucket(len(self.buckets), key, group, current))
        self._next = 0  # the first bucket not posted yet this round
        self._handles = []
        for b in self.buckets:
            for p in b.params:
                self._handles.append(p.register_post_accumulate_grad_hook(
                    lambda p, b=b: self._ready(b, p)))

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside post nothing (gradient accumulation); `finish` syncs all."""
        saved, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = saved

    def _ready(self, bucket: _Bucket, p: nn.Parameter) -> None:
        if not self.enabled or modes.current() == "compute_only":
            return
        if bucket.work is not None:  # a later backward changed a posted bucket's gradient
            bucket.stale = True
            return
        bucket.ready.add(id(p))
        while (self._next < len(self.buckets)
               and len(self.buckets[self._next].ready) == len(self.buckets[self._next].params)):
            # posted now, this all-reduce travels while the backward computes earlier layers
            self._post(self.buckets[self._next], by_hook=True)

    def _post(self, bucket: _Bucket, by_hook: bool) -> None:
        if bucket.index == 0:  # a new round
            self.log.clear()
        bucket.post()
        self.log.append((bucket.index, by_hook))
        self._next = bucket.index + 1

    def pending(self) -> list[int]:
        """Indices of the buckets posted and not yet waited for (this round)."""
        return [b.index for b in self.buckets if b.work is not None]

    @torch.no_grad()
    def finish(self) -> None:
        """Post what is left, wait for every bucket, copy the sums into ``.grad``."""
        try:
            while self._next < len(self.buckets):
                self._post(self.buckets[self._next], by_hook=False)
            for b in self.buckets:
                self._wait(b)
                if b.stale:  # re-sync the accumulated gradient (every rank does the same)
                    b.post()
                    self._wait(b)
                offset = 0
                for p in b.params:
                    p.grad.copy_(b.flat[offset:offset + p.numel()].view_as(p.grad))
                    offset += p.numel()
        finally:
            self.reset()

    def _wait(self, b: _Bucket) -> None:
        t = self.timeout_s if self.timeout_s is not None else group_timeout(b.group, b.flat.device)

        def error(e: Exception) -> CommFuseError:
            return CommFuseError(f"gradient sync: all-reduce of bucket {b.index} ({b.key}: "
                                 f"{len(b.params)} parameters, {b.flat.numel()} elements) did "
                                 f"not complete within {t:.1f} s: {e}")

        try:  # CPU: the host waits; CUDA: the stream does (a timeout_s: the watchdog's)
            deadlines.wait(b.work, b.group, b.flat.device, self.timeout_s, error=error)
        except CommFuseError:
            raise
        except Exception as e:
            raise error(e) from e

    def reset(self) -> None:
        """Forget this round's posts (after `finish`, or to drop a failed round)."""
        for b in self.buckets:
            b.ready.clear()
            b.work, b.flat, b.stale = None, None, False
        self._next = 0

    def remove(self) -> None:
        """Unregister the hooks."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
