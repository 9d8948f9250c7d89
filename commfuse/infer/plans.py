"""Which plan a prefill or a decode step of `commfuse.infer.InferenceLlama` runs.

Prefill: the fused ops (`InferenceLlama._prefill_fused`, query-split where the cost model
predicts it faster) or the interleaved prefill (`commfuse.infer.interleave`). Under "auto"
the choice is measured (`PlanTuner`, `run_prefill`). The cost model picks between the two
(`commfuse.infer.predict.prefill_choice`), but its error on the fused ops is as large as
the difference between the plans, and on the CPU testbed it picks the fused ops where the
interleaved prefill is faster (docs/benchmarks/inference.md). So the prompts themselves are
timed. Per shape bucket (the prompt length rounded up to a power of
two, and the batch size):

- the first prefill runs the model's pick, untimed (warm-up);
- the next two run each plan once, timed;
- every later one runs the faster.

A plan's time is the slowest rank's (exchanged after each timed prefill), so every rank
decides alike. No extra prefill runs: exploring costs at most one prefill on the slower plan
per bucket.

Decode: the fused ops or replicated rows with all-reduces (`decode_method`), by the cost
model (`commfuse.infer.predict.decode_choice`).
"""

from __future__ import annotations

import time

import torch

TAG = 7102  # P2P tag of the exchange of a timed prefill's seconds


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


def tuning(model, seq: int, batch: int) -> bool:
    """Whether `PlanTuner` still explores the plans of this prefill shape under "auto"."""
    plans = auto_plans(model, seq, batch, model.tok_emb.weight)
    return plans is not None and _won(model, plans, seq, batch) is None


def _won(model, plans: list[tuple[str, int]], seq: int, batch: int):
    """The label of the faster of ``plans`` in this shape's bucket, None until both ran."""
    return model.tuner.decided(PlanTuner.bucket(seq, batch), [p for p, _ in plans])


def checked_chunks(n):
    """``prefill_chunks`` as given (None or a positive int), else ValueError."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"prefill_chunks must be a positive int or None, got {n!r}")
    return n


def run_prefill(model, tokens_BS: torch.Tensor, lengths_B: torch.Tensor, cache):
    """``model``'s prefill on the plan this shape runs, timed (and recorded in
    ``model.tuner``) while `PlanTuner` explores; the logits."""
    from commfuse.infer import interleave

    B, S = tokens_BS.shape
    w = model.tok_emb.weight
    plans = auto_plans(model, S, B, w)
    if plans is None:  # no choice to measure
        chunks, timed = min(runs_chunks(model, model.method, S, B, w), S), False
    else:
        key = PlanTuner.bucket(S, B)
        plan, timed = model.tuner.next(key, [label for label, _ in plans])
        chunks = dict(plans)[plan]
    sync = (lambda: torch.cuda.synchronize(w.device)) if w.device.type == "cuda" else (
        lambda: None)
    if timed:
        sync()
        t0 = time.perf_counter()
    if chunks > 1:
        logits = interleave.prefill(model, tokens_BS, lengths_B, cache, chunks)
    else:
        logits = model._prefill_fused(tokens_BS, lengths_B, cache)
    if timed:
        sync()
        mine = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=w.device)
        every = model._gather(mine, TAG, "prefill timing exchange")
        model.tuner.record(key, plan, float(every.max()))
    return logits


def runs_chunks(model, method: str, seq: int, batch: int, like: torch.Tensor) -> int:
    """The chunks the prefill of ``batch`` prompts of ``seq`` tokens with ``method`` runs in
    (1: the fused ops): ``prefill_chunks``, or under "auto" the measured faster plan of the
    shape's bucket once `PlanTuner` has timed both, else the cost model's."""
    if model.group is None and model.prefill_chunks is None:
        return 1
    if model.prefill_chunks is not None:
        return model.prefill_chunks
    if method != "auto":
        return 1
    plans = auto_plans(model, seq, batch, like, method)
    if plans is not None:
        won = _won(model, plans, seq, batch)
        return dict(plans)[won if won is not None else plans[0][0]]
    return model_chunks(model, seq, batch, like)


def model_chunks(model, seq: int, batch: int, like: torch.Tensor) -> int:
    """The cost model's chunk count under "auto" (`commfuse.infer.predict.prefill_choice`;
    1: the fused ops, query-split where it predicts it faster)."""
    from commfuse.infer.predict import prefill_choice
    from commfuse.ops.auto import _hardware

    qs = model.runs_query_split("auto", seq, batch, like)
    return prefill_choice(model.cfg, model.world, seq, batch, _hardware(like.device.type),
                          like.element_size(), qs)


def auto_plans(model, seq: int, batch: int, like: torch.Tensor,
               method: str | None = None) -> list[tuple[str, int]] | None:
    """The plans `PlanTuner` measures for this prefill, the model's pick first: [("fused",
    1), ("interleaved", n)] in some order, n the model's best count; None where nothing is
    measured (not "auto", chunks given, tuning off, one rank, or a prompt too short to cut)."""
    method = model.method if method is None else method
    if (method != "auto" or model.prefill_chunks is not None or model.tuner is None
            or model.group is None):
        return None
    from commfuse.infer.predict import best_chunks
    from commfuse.ops.auto import _hardware

    n = best_chunks(model.cfg, model.world, seq, batch, _hardware(like.device.type),
                    like.element_size())[0]
    if n <= 1:
        return None
    plans = [("fused", 1), ("interleaved", n)]
    return plans[::-1] if model_chunks(model, seq, batch, like) > 1 else plans


def decode_method(model, B: int, like: torch.Tensor, method: str | None = None) -> str:
    """Decode's method for B rows under ``method`` (default ``model.decode_method``):
    "allreduce" or a fused-op method ("auto": the one the cost model predicts faster, the
    same on every rank)."""
    method = model.decode_method if method is None else method
    if model.group is None or method not in ("auto", "allreduce"):
        return method
    if method == "allreduce":
        return "allreduce"
    from commfuse.infer.predict import decode_choice
    from commfuse.ops.auto import _hardware

    return decode_choice(model.cfg, model.world, B, _hardware(like.device.type),
                         model.tok_emb.weight.element_size())
