"""What ``commfuse bench`` runs: the four fused ops and the paper's layers, at a given size.

Each workload is built once per rank and returns ``step(method, opts, backward)``, which runs
one forward (and backward) pass. Shapes (batch folded into the sequence S, width D, W ranks):

- ``ag_matmul``   A [S/W, D] -> all-gather -> @ [D, F/W]      (TPSP FC1; F = 4D unless --ffn)
- ``matmul_rs``   A [S, F/W] @ [F/W, D] -> reduce-scatter     (TPSP FC2)
- ``matmul_a2a``  A [S/W, D] @ [D, 3D] -> all-to-all           (Ulysses QKV)
- ``a2a_matmul``  A [S, D/W] -> all-to-all -> @ [D, D]         (Ulysses out-proj)
- ``mlp``         TPSP MLP: AG -> FC1 -> GELU -> FC2 -> RS
- ``attn_row``    TP attention: AG -> QKV, causal attention on my heads, out-proj Flash-RS
- ``attn_qsplit`` the same with query-split attention (balanced order; its backward fused too)
- ``ulysses``     QKV -> a2a, attention on the full sequence for my heads, a2a -> out-proj
- ``moe_dispatch``, ``moe_combine``, ``moe``: expert parallelism (`commfuse.bench.moe`)
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

import commfuse
from commfuse.bench import moe as moe_workloads
from commfuse.bench.steps import Step, grad_step
from commfuse.ops import registry
from commfuse.ops.attention import query_split_attention
from commfuse.schedule import OPS

LAYERS = ("mlp", "attn_row", "attn_qsplit", "ulysses")
MOE = moe_workloads.OPS + moe_workloads.LAYERS  # named explicitly: not in a kind's default
FORWARD_ONLY: tuple[str, ...] = ()  # workloads with no backward (none now)
HEAD_DIM = 64


def build(name: str, world: int, rank: int, seq: int, d: int, dtype: torch.dtype,
          ffn: int | None = None, moe: moe_workloads.MoEOptions | None = None) -> Step:
    """Workload ``name`` of width ``d`` over ``seq`` tokens; ``ffn``: the MLP's hidden width
    (the ops ag_matmul / matmul_rs and the mlp layer; default 4d), or the experts' (the MoE
    workloads; default d); ``moe``: the MoE workloads' experts and routing."""
    if name in MOE:
        return moe_workloads.build(name, world, rank, seq, d, dtype, ffn, moe)
    if name not in OPS + LAYERS:
        raise ValueError(f"unknown workload {name!r}; choose from {OPS + LAYERS + MOE}")
    g = torch.Generator().manual_seed(rank)
    rnd = lambda *shape: (torch.randn(*shape, generator=g) / shape[0] ** 0.5).to(dtype).requires_grad_()
    s = seq // world
    if name in OPS:  # the op alone, at its shapes in its layer
        a, b = (rnd(*shape) for shape in registry.layer_shapes(name, world, seq, d, ffn))
        return grad_step(lambda m, o: registry.call(name, a, b, m, o))
    x = rnd(s, d)
    if name == "mlp":
        h = (ffn or 4 * d) // world
        w1, w2 = rnd(d, h), rnd(h, d)

        def mlp(m, o):
            _, (h,) = commfuse.fused_all_gather_matmul(x, [w1], 0, return_A=False, method=m, **o)
            return commfuse.fused_matmul_reduce_scatter(F.gelu(h), w2, "sum", 0, method=m, **o)
        return grad_step(mlp)
    heads = d // HEAD_DIM // world
    if heads < 1:
        raise ValueError(f"d_model {d} gives no attention head per rank (head dim {HEAD_DIM})")
    if name in ("attn_row", "attn_qsplit"):
        wq, wk, wv = (rnd(d, heads * HEAD_DIM) for _ in range(3))
        wo = rnd(heads * HEAD_DIM, d)

        def attn(m, o):
            _, qkv = commfuse.fused_all_gather_matmul(x, [wq, wk, wv], 0, return_A=False, method=m, **o)
            q, k, v = (t.view(seq, 1, heads, HEAD_DIM) for t in qkv)
            if name == "attn_qsplit":
                return query_split_attention(q, k, v, wo, method=m, **o)
            y = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)),
                                               is_causal=True)
            y = y.permute(2, 0, 1, 3).reshape(seq, heads * HEAD_DIM)
            return commfuse.fused_matmul_reduce_scatter(y, wo, "sum", 0, method=m, **o)
        return grad_step(attn)
    # ulysses: the QKV weight's column block p holds head group p's q, k and v
    w_qkv, w_o = rnd(d, 3 * d), rnd(d, d)

    def ulysses(m, o):
        qkv = commfuse.fused_matmul_all_to_all(x, w_qkv, method=m, **o)  # [S, 3D/W]
        q, k, v = (t.reshape(1, seq, heads, HEAD_DIM).transpose(1, 2) for t in qkv.chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(seq, heads * HEAD_DIM)
        return commfuse.fused_all_to_all_matmul(y, w_o, method=m, **o)
    return grad_step(ulysses)
