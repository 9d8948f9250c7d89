"""`auto`'s prefill plan by measurement: the fused ops or the interleaved prefill, whichever
ran faster on this group for prompts of this shape.

The cost model picks between the two (`commfuse.infer.predict.prefill_choice`), but on the
CPU testbed it times the fused ops 7-30 % too fast and the interleaved prefill 2-10 % too
fast (docs/benchmarks/2026-12-02-inference.md), so its pick lost by 4-13 %. `PlanTuner`
measures instead, on the prompts themselves. Per shape bucket (the prompt length rounded up
to a power of two, and the batch size), the first prefill runs the model's pick untimed
(warm-up), the next two each plan once, timed, and every later one the faster. A plan's
time is the slowest rank's (exchanged after each timed prefill), so every rank decides
alike. No extra prefill runs: exploring costs at most one prefill on the slower plan per
bucket.
"""

from __future__ import annotations


class PlanTuner:
    """The measured choice among a bucket's plans (any hashable values)."""

    def __init__(self):
        self.buckets: dict[tuple, dict] = {}

    @staticmethod
    def bucket(seq: int, batch: int) -> tuple[int, int]:
        """Prompts of ``seq`` tokens (rounded up to a power of two) and ``batch`` sequences."""
        return 1 << max(seq - 1, 0).bit_length(), batch

    def next(self, key: tuple, plans: list) -> tuple[object, bool]:
        """(the plan to run, whether to time it) for bucket ``key``; ``plans`` in the model's
        order of preference."""
        state = self.buckets.setdefault(key, {"runs": 0, "times": {}})
        state["runs"] += 1
        if len(plans) < 2 or state["runs"] == 1:
            return plans[0], False
        for plan in plans:
            if plan not in state["times"]:
                return plan, True
        return self.decided(key, plans), False

    def record(self, key: tuple, plan, seconds: float) -> None:
        """The slowest rank's ``seconds`` for ``plan`` in bucket ``key``."""
        self.buckets[key]["times"][plan] = seconds

    def decided(self, key: tuple, plans: list):
        """The faster plan once every one of ``plans`` was timed (ties: the model's
        order), else None."""
        times = self.buckets.get(key, {}).get("times", {})
        if any(p not in times for p in plans):
            return None
        return min(plans, key=lambda p: times[p])
