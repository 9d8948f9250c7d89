"""``commfuse bench``'s Mixture-of-Experts workloads and their predictions on the simulator.

Shapes (S tokens in all, S/W per rank, width D, E experts, E/W per rank, top-k, expert
hidden width F; R the rows a rank's experts receive):

- ``moe_dispatch``  rows [S k / W, D] -> dispatch -> @ [E/W, D, 2F]   (the gate|up GEMM)
- ``moe_combine``   rows [R, F] @ [E/W, F, D] -> combine               (the down GEMM)
- ``moe``           the expert-parallel layer: router, count exchange, dispatch -> gate|up,
                    SwiGLU, down -> combine, the weighted sum (`commfuse.moe.parallel`'s
                    steps), forward and backward

Routing (`MoEOptions.routing`): the tokens' experts come from
`commfuse.sim.moe.route_tokens` (balanced, or Zipf-skewed expert popularity), seeded, so
every method of a run moves the same rows; the ``moe`` layer's router still runs (its
logits, softmax and gradient), its scores read at those experts. The simulator times the
same table (`predict`); `dedup_saving` counts what the layer's deduplicated dispatch moves
against one row per (token, expert).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from commfuse.bench.steps import grad_step
from commfuse.moe.layer import swiglu
from commfuse.moe.parallel import expert_ffn
from commfuse.ops.moe import moe_dispatch_matmul, moe_matmul_combine
from commfuse.sim import moe as sim_moe

OPS = ("moe_dispatch", "moe_combine")
LAYERS = ("moe",)
# the variants (commfuse.schedule.VARIANTS labels) that the MoE ops run
METHODS = ("none", "none-torch", "sliced", "commfuse", "commfuse-m1", "commfuse-m2",
           "commfuse-m4", "commfuse-m8", "auto")
DEFAULT_METHODS = ("none", "sliced", "commfuse", "commfuse-m4", "auto")


@dataclass(frozen=True)
class MoEOptions:
    """What an MoE workload routes: ``experts`` in all (divisible by the ranks), ``top_k``
    per token, ``routing`` "balanced" or "zipf" (popularity ~ 1/i^``zipf_s``), ``seed``."""

    experts: int = 8
    top_k: int = 2
    routing: str = "balanced"
    zipf_s: float = 1.2
    seed: int = 0

    def __post_init__(self):
        if self.routing not in sim_moe.ROUTINGS:
            raise ValueError(f"routing must be one of {sim_moe.ROUTINGS}, got {self.routing!r}")
        if not 0 < self.top_k <= self.experts:
            raise ValueError(f"top-k {self.top_k} of {self.experts} experts")

    def assignment(self, world: int, seq: int):
        return sim_moe.route_tokens(self.routing, seq // world, self.experts, self.top_k,
                                    world, self.seed, self.zipf_s)

    def label(self) -> str:
        skew = f" s={self.zipf_s:g}" if self.routing == "zipf" else ""
        return f"{self.routing}{skew}, {self.experts} experts, top-{self.top_k}"


def build(name: str, world: int, rank: int, seq: int, d: int, dtype: torch.dtype,
          ffn: int | None, opts: MoEOptions | None):
    """The step of MoE workload ``name`` (`commfuse.bench.workloads.build`'s contract);
    ``ffn``: the expert hidden width F (default D)."""
    import torch.distributed as dist

    o, f = opts or MoEOptions(), ffn or d
    if o.experts % world:
        raise ValueError(f"{o.experts} experts cannot be split over {world} ranks")
    group, local = dist.group.WORLD, o.experts // world
    chosen = torch.tensor(o.assignment(world, seq)[rank], dtype=torch.long).reshape(-1, o.top_k)
    counts = sim_moe.counts_of(o.assignment(world, seq), o.experts)
    g = torch.Generator().manual_seed(rank)
    rnd = lambda *shape: (torch.randn(*shape, generator=g) / shape[-2] ** 0.5).to(
        dtype).requires_grad_()
    w_gu, w_dn = rnd(local, d, 2 * f), rnd(local, f, d)
    if name == "moe_dispatch":
        x = rnd(counts.sent(rank), d)
        return _grad_step(lambda m, op: moe_dispatch_matmul(x, w_gu, counts, group, method=m, **op),
                          (x, w_gu))
    if name == "moe_combine":
        a = rnd(counts.received(rank), f)
        return _grad_step(lambda m, op: moe_matmul_combine(a, w_dn, counts, group, method=m, **op),
                          (a, w_dn))
    if name != "moe":
        raise ValueError(f"not an MoE workload: {name!r}")
    x, w_router = rnd(seq // world, d), rnd(d, o.experts)

    def layer(m, op):  # the router's scores at the table's experts, then the EP layer's core
        scores = (x @ w_router).float().softmax(-1).gather(1, chosen)
        weights = (scores / scores.sum(-1, keepdim=True)).to(dtype)
        return expert_ffn(x, weights, chosen, w_gu, w_dn, swiglu, group, o.experts, method=m,
                          **op)[0]
    return _grad_step(layer, (x, w_router, w_gu, w_dn))


def _grad_step(forward, leaves):
    """The workload's step; ``step.forward(method, opts)`` returns the output and
    ``step.leaves`` are the tensors that get gradients (for checks)."""
    def run(method: str, opts: dict):
        return forward(method, {k: v for k, v in opts.items() if k != "topology"})  # no rings

    step = grad_step(run)
    step.forward, step.leaves = run, leaves
    return step


def predict(name: str, world: int, seq: int, d: int, ffn: int | None, dtype_bytes: float,
            backward: bool, variant: tuple[str, dict], hw, opts: MoEOptions | None,
            step_s: float = 50e-6) -> float:
    """The simulator's seconds for MoE workload ``name`` under ``variant`` (method, options),
    on ``hw``, with the same routing table as the run."""
    o, f = opts or MoEOptions(), ffn or d
    # the layer deduplicates its dispatch (expert_ffn); the single ops run the plain table
    counts = sim_moe.counts_of(o.assignment(world, seq), o.experts, dedup=name == "moe")
    method, vopts = variant
    vopts = {k: v for k, v in vopts.items() if k in ("chunks", "splits")}
    if name == "moe":
        return sim_moe.moe_layer_time(counts, (d, f), hw, method, dtype_bytes, top_k=o.top_k,
                                      backward=backward, step_s=step_s, **vopts).total_s
    K, N = (d, 2 * f) if name == "moe_dispatch" else (f, d)
    dual = ("moe_combine" if name == "moe_dispatch" else "moe_dispatch", N, K)
    if method == "auto":
        method, vopts = sim_moe.choose(name, counts, K, N, hw, dtype_bytes, step_s)
    ops = [sim_moe.MoEOp(name, method, K, N, vopts.get("chunks", 4), vopts.get("splits", 1))]
    if backward:
        ops.append(sim_moe.MoEOp(dual[0], method, *dual[1:], vopts.get("chunks", 4),
                                 vopts.get("splits", 1), True))
    return sim_moe.simulate_moe(ops, counts, hw, dtype_bytes, step_s).total_s


def dedup_saving(world: int, seq: int, d: int, dtype_bytes: float,
                 opts: MoEOptions | None) -> dict:
    """What the ``moe`` layer's all-to-alls carry off-rank in one forward, summed over the
    ranks, for the run's routing table: ``rows`` / ``bytes`` one per (token, destination
    rank) as `commfuse.moe.parallel.expert_ffn` moves them (the dispatch's rows, and as many
    back in the combine, D wide), ``rows_plain`` / ``bytes_plain`` one per (token, expert);
    ``saving`` the fraction of bytes the dedup saves; ``expected_saving`` the same under
    uniform routing (`commfuse.sim.routing.expected_ranks`). The backward moves as much
    again."""
    from commfuse.sim.routing import expected_ranks

    o = opts or MoEOptions()
    c = sim_moe.counts_of(o.assignment(world, seq), o.experts, dedup=True)
    off = lambda table: sum(table[p][q] for p in range(world) for q in range(world) if p != q)
    rows, plain = off(c.pairs), off(c.rows)
    per_row = 2 * d * dtype_bytes  # dispatch and combine
    return {"rows": rows, "rows_plain": plain, "bytes": rows * per_row,
            "bytes_plain": plain * per_row, "saving": 1 - rows / plain if plain else 0.0,
            "expected_saving": 1 - expected_ranks(o.experts, world, o.top_k) / o.top_k}
