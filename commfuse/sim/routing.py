"""Seeded routing tables for the MoE benchmarks and predictions: which experts each rank's
tokens go to, balanced or with Zipf-skewed expert popularity, and the `ExpertCounts` of such
an assignment. Pure (no torch); `commfuse.sim.moe` re-exports these names.
"""

from __future__ import annotations

import random

from commfuse.schedule.moe import ExpertCounts

ROUTINGS = ("balanced", "zipf")


def route_tokens(routing: str, tokens: int, experts: int, top_k: int, world: int,
                 seed: int = 0, zipf_s: float = 1.2) -> list[list[tuple[int, ...]]]:
    """Each rank's tokens' experts (``tokens`` per rank, ``top_k`` distinct experts of
    ``experts`` each, best first), the same on every caller for a given seed:

    - ``"balanced"``: token t of rank p takes experts (t k + p + j) mod E, j < k: every expert
      gets as close to ``tokens * top_k / experts`` rows from each rank as integers allow;
    - ``"zipf"``: expert popularity ~ 1 / i^``zipf_s`` for the i-th of a seeded shuffle of the
      experts; each token draws its k experts without replacement in proportion to it.
    """
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    if not (0 < top_k <= experts) or tokens < 0 or experts % world:
        raise ValueError(f"bad routing shape: {tokens} tokens, top-{top_k} of {experts} "
                         f"experts on {world} ranks")
    if routing == "balanced":
        return [[tuple((t * top_k + p + j) % experts for j in range(top_k))
                 for t in range(tokens)] for p in range(world)]
    rng = random.Random(seed)
    order = list(range(experts))
    rng.shuffle(order)
    weight = [0.0] * experts
    for i, e in enumerate(order):
        weight[e] = 1.0 / (i + 1) ** zipf_s
    out = []
    for _ in range(world):
        mine = []
        for _ in range(tokens):
            pool, chosen = list(range(experts)), []
            for _ in range(top_k):
                e = rng.choices(pool, [weight[x] for x in pool])[0]
                pool.remove(e)
                chosen.append(e)
            mine.append(tuple(chosen))
        out.append(mine)
    return out


def routing_counts(routing: str, tokens: int, experts: int, top_k: int, world: int,
                   seed: int = 0, zipf_s: float = 1.2) -> ExpertCounts:
    """The `ExpertCounts` of `route_tokens`' assignment (the same arguments)."""
    return counts_of(route_tokens(routing, tokens, experts, top_k, world, seed, zipf_s),
                     experts)


def counts_of(assignment, experts: int) -> ExpertCounts:
    """The table of an assignment (per rank, per token, its experts)."""
    table = []
    for mine in assignment:
        hist = [0] * experts
        for chosen in mine:
            for e in chosen:
                hist[e] += 1
        table.append(tuple(hist))
    return ExpertCounts(tuple(table))
