"""Seeded routing tables for the MoE benchmarks and predictions: which experts each rank's
tokens go to, balanced or with Zipf-skewed expert popularity, and the `ExpertCounts` of such
an assignment, deduplicated as the ops run it (one moved row per (token, destination rank));
`expected_ranks`, the destination ranks a token reaches under uniform routing. Pure (no
torch); `commfuse.sim.moe` re-exports these names.
"""

from __future__ import annotations

import math
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
                   seed: int = 0, zipf_s: float = 1.2, dedup: bool = False) -> ExpertCounts:
    """The `ExpertCounts` of `route_tokens`' assignment (the same arguments; ``dedup`` as
    for `counts_of`)."""
    return counts_of(route_tokens(routing, tokens, experts, top_k, world, seed, zipf_s),
                     experts, dedup)


def counts_of(assignment, experts: int, dedup: bool = False) -> ExpertCounts:
    """The table of an assignment (per rank, per token, its experts; the EP group is one
    rank per entry): rows per (rank, expert), what the MoE ops take without routing. With
    ``dedup`` also, among them, the token's first and last expert on that expert's rank (by
    local index) and its only one there, as `commfuse.ops.moe.routing.plan` marks them: the
    table of the deduplicated dispatch (one moved row per (token, destination rank)) that
    `commfuse.moe.parallel.expert_ffn` runs."""
    world = len(assignment)
    local = experts // world
    tables = [[[0] * experts for _ in range(world)] for _ in range(4)]  # rows, f, l, single
    for p, mine in enumerate(assignment):
        for chosen in mine:
            by_rank: dict[int, list[int]] = {}
            for e in chosen:
                tables[0][p][e] += 1
                by_rank.setdefault(e // local, []).append(e)
            for on in by_rank.values():
                lo, hi = min(on), max(on)
                tables[1][p][lo] += 1
                tables[2][p][hi] += 1
                tables[3][p][lo] += lo == hi
    return ExpertCounts(*(tuple(tuple(row) for row in t) for t in tables[:4 if dedup else 1]))


def expected_ranks(experts: int, world: int, top_k: int) -> float:
    """Expected distinct destination ranks of a token whose ``top_k`` distinct experts are
    drawn uniformly from ``experts`` split evenly over ``world`` ranks:
    ``W * (1 - C(E - E/W, k) / C(E, k))`` (rank q is missed when all k experts lie among the
    other ranks' E - E/W). Of these, ``(W - 1) / W`` are remote on average. The deduplicated
    dispatch moves one row per such rank, not ``top_k``."""
    if experts % world or not 0 < top_k <= experts:
        raise ValueError(f"bad routing shape: top-{top_k} of {experts} experts on {world} "
                         f"ranks")
    missed = math.comb(experts - experts // world, top_k) / math.comb(experts, top_k)
    return world * (1 - missed)
