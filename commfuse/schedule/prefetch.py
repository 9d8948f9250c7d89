"""Cross-op prefetch: a gather posted ahead of the op that consumes it, as a pure plan
(`commfuse.ops.prefetch` runs it)."""

from __future__ import annotations

from dataclasses import dataclass

from commfuse.schedule import GATHER_SIDE, Collective, Post, Schedule


def last_post(s: Schedule) -> int | None:
    """Index of the last step of ``s`` that starts a transfer (Post or Collective); None if
    none does. A prefetch posted right after it queues behind none of ``s``'s own transfers."""
    starts = [i for i, step in enumerate(s.steps) if isinstance(step, (Post, Collective))]
    return starts[-1] if starts else None


def early_steps(s: Schedule) -> tuple[int, ...]:
    """The steps of a gather-side schedule that need nothing but this rank's own slice: every
    Collective (it reads the own slice) and every Post whose sends carry only own slots (its
    receives only need their buffers). They can be run before the op, in this order; the rest
    (waits, computes, forwarding posts of the ring) run when the op does. Reordering within one
    schedule keeps the messages matched: a (peer, tag) pair occurs once per schedule."""
    if s.op not in GATHER_SIDE:
        raise ValueError(f"only gather-side schedules can be posted ahead, not {s.op!r}")
    m = max(s.chunks // s.world_size, 1)
    return tuple(i for i, step in enumerate(s.steps)
                 if isinstance(step, Collective) or (isinstance(step, Post) and all(
                     t.kind == "recv" or t.slot // m == s.rank for t in step.transfers)))


@dataclass(frozen=True)
class PrefetchPlan:
    """A gather posted ahead of the op that consumes it (`commfuse.ops.prefetch`).

    ``producer``: the schedule of the op whose backward posts the prefetch (None: posted
    elsewhere); it is posted right after ``producer``'s step ``at`` (its last post), so it
    queues behind the producer's transfers and moves while the producer's last GEMMs and the
    elementwise work between the ops run. ``gather``: the consumer's schedule; its ``early``
    steps run at that point, the others (``late``) when the consumer runs, in order.
    """

    gather: Schedule
    early: tuple[int, ...]
    producer: Schedule | None = None

    @property
    def at(self) -> int | None:
        return None if self.producer is None else last_post(self.producer)

    @property
    def late(self) -> tuple[int, ...]:
        return tuple(i for i in range(len(self.gather.steps)) if i not in set(self.early))

    def describe(self) -> str:
        """What is posted when, one line per step (for reading and for tests)."""
        lines = []
        if self.producer is not None:
            lines += [f"{self.producer.op}[{i}] {step}" for i, step in
                      enumerate(self.producer.steps[:self.at + 1])]
        lines += [f"  prefetch {self.gather.op}[{i}] {self.gather.steps[i]}" for i in self.early]
        if self.producer is not None:
            lines += [f"{self.producer.op}[{i}] {step}" for i, step in
                      enumerate(self.producer.steps) if i > self.at]
        lines += [f"{self.gather.op}[{i}] {self.gather.steps[i]}" for i in self.late]
        return "\n".join(lines)


def prefetch_plan(gather: Schedule, producer: Schedule | None = None) -> PrefetchPlan:
    """The plan of posting ``gather`` (a gather-side schedule) ahead: its `early_steps`."""
    return PrefetchPlan(gather, early_steps(gather), producer)
