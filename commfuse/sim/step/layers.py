"""The ops of a step's layers, grouped by kind: Llama blocks, or the attention, MLP, MoE and
Mamba-2 sub-layers of a `commfuse.sim.step.arch.HybridConfig`, as data (`LayerGroup`).

    from commfuse.sim.step.layers import layer_groups
    for g in layer_groups(cfg, tp=1, up=1, dp=8, ep=8, seq=4096, mb=1):
        g.kind, g.count, g.fwd, g.bwd   # every layer of a group runs the same ops

A Llama model is one group of ``n_layers`` blocks (`commfuse.sim.step.ops.block_ops`). A
hybrid model has one group per layer kind present (module doc of `commfuse.sim.step.arch`):

- ``*`` attention and ``-`` MLP: the attention and MLP halves of `block_ops` (TPSP, Ulysses,
  ZeRO-3 DP as there).
- ``E`` mixture of experts, on each rank's ``nl = mb * S / (tp * up)`` tokens (under TPSP the
  sequence shard the attention's reduce-scatter left): the router GEMM [nl, D] x [D, E]
  (local); the dispatch all-to-all fused with the experts' gate|up GEMM and the experts'
  down GEMM fused with the combine all-to-all, on the expert-parallel group ("ep": ep of the
  DP ranks, each holding E/ep experts); the shared experts as a dense MLP (named
  "shared ..."). Uniform routing in expectation, deduplicated as the ops run it: each rank
  sends one row of D elements per (token, destination rank), ``nl * r * (ep-1)/ep`` rows
  with ``r = commfuse.sim.routing.expected_ranks(E, ep, top_k)`` the distinct ranks a
  token's experts lie on, and receives as many; its local experts compute ``nl * top_k``
  rows. The fused ops are the existing all-to-all kinds with shapes that give those FLOPs,
  their bytes scaled by ``r / top_k`` (`StepOp.moved`): dispatch = ``a2a_matmul`` (ep * rows, D, 2 F_e), combine = ``matmul_a2a``
  (ep * rows, F_e, D) (`commfuse.sim.costs.op_costs`' conventions; their P2P slots split the
  GEMM's inner dimension where the expert GEMMs split rows: the same FLOPs, another shape).
  The local experts run as one GEMM of all their rows (a grouped GEMM's per-expert shapes
  are not modelled). Backward: the combine's dual (gradients arrive, a2a->GEMM for dx), the
  dispatch's (GEMM->a2a for dx), and the experts' and router's weight gradients locally.
  With ep < dp the experts are ZeRO-sharded over the other dp/ep ranks ("edp"): a plain
  all-gather of the rank's experts before their ops, again in the backward, and a plain
  reduce-scatter of their gradients. Under tp > 1 experts are replicated over the TP group
  (their gradients all-reduced there, `hybrid_grad_sync_ops`). Not modelled: the per-step
  exchange of per-peer counts (a few bytes), routing skew, token dropping.
- ``M`` Mamba-2 mixer (`commfuse.tp.mixers.mamba`): under TPSP in_proj's AG->GEMM (this rank's z,
  x, B, C, dt rows: `commfuse.sim.step.arch.MambaSpec.local`) and out_proj's GEMM->RS, backward
  their duals as for q|k|v and down; without TP two Linears (local or ZeRO-3). The conv1d,
  the scan and the gated norm are local memory-bound work (`commfuse.sim.step.work`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from commfuse.sim.routing import expected_ranks
from commfuse.sim.step.arch import expert_groups, is_hybrid, sublayers
from commfuse.sim.step.ops import (CURRENT, StepModel, StepOp, _ag_backward, _linear_local,
                                    _linear_zero3, _rs_backward, block_ops)

MLP_NAMES = ("gate|up", "down", "w_gate", "w_up", "w_down")


@dataclass(frozen=True)
class LayerGroup:
    """``count`` layers that run the same ops: ``kind`` "block" (Llama) or a pattern
    character (``*``, ``-``, ``E``, ``M``); ``fwd``, and ``bwd`` in backward order."""

    kind: str
    count: int
    fwd: tuple
    bwd: tuple


def _is_mlp(op: StepOp) -> bool:
    return any(word in MLP_NAMES for word in op.name.split())


def layer_groups(cfg, tp: int, up: int, dp: int, seq: int, mb: int, ep: int = 1,
                 backward: bool = True, dtype_bytes: float = 2, sm: StepModel = CURRENT,
                 query_split: bool = False, ep_axis: str = "dp") -> list[LayerGroup]:
    """The step's layers as groups (module doc), in the order attention, MLP, MoE, Mamba.
    ``ep_axis``: the MoE all-to-alls' group (`commfuse.sim.step.arch.expert_groups`)."""
    args = (tp, up, dp, seq, mb, backward, dtype_bytes, sm)
    if not is_hybrid(cfg):
        f, b = block_ops(cfg, *args, query_split=query_split)
        return [LayerGroup("block", cfg.n_layers, tuple(f), tuple(b))]
    s, groups = sublayers(cfg), []
    f, b = block_ops(cfg, *args, query_split=query_split)
    for kind in "*-EM":
        if kind not in s:
            continue
        if kind == "*":
            gf, gb = [o for o in f if not _is_mlp(o)], [o for o in b if not _is_mlp(o)]
        elif kind == "-":
            gf, gb = [o for o in f if _is_mlp(o)], [o for o in b if _is_mlp(o)]
        elif kind == "E":
            gf, gb = moe_ops(cfg, tp, up, dp, ep, seq, mb, backward, dtype_bytes, sm,
                             ep_axis)
        else:
            gf, gb = mamba_ops(cfg, tp, up, dp, seq, mb, backward, dtype_bytes, sm)
        groups.append(LayerGroup(kind, s.count(kind), tuple(gf), tuple(gb)))
    return groups


def layer_order(cfg, groups: list[LayerGroup]) -> list[LayerGroup]:
    """Each layer's group in the model's order (`commfuse.sim.step.arch.sublayers` for hybrids)."""
    if len(groups) == 1 and groups[0].kind == "block":
        return [groups[0]] * groups[0].count
    by_kind = {g.kind: g for g in groups}
    return [by_kind[k] for k in sublayers(cfg)]


def moe_ops(cfg, tp: int, up: int, dp: int, ep: int, seq: int, mb: int, backward: bool = True,
            a: float = 2, sm: StepModel = CURRENT, ep_axis: str = "dp") -> tuple[list, list]:
    """(forward, backward) ops of one MoE layer on a rank (module doc); ``ep_axis="tp"``:
    the all-to-alls on the TP group, the experts ZeRO-sharded over all dp ranks."""
    m, D = cfg.moe, cfg.dim
    nl = mb * seq // (tp * up)
    rows, F, E = nl * m.top_k, m.expert_ffn, m.experts
    M = ep * rows  # the fused all-to-all kinds' M: rows (and bytes) per rank = M / ep
    ax, n_ep, shard_ax, edp = expert_groups(tp, dp, ep, ep_axis)
    moved = expected_ranks(E, n_ep, m.top_k) / m.top_k  # the dedup: one row per (token, rank)
    gathers = [StepOp("gather experts", "all_gather", shard_ax, (E // ep * 3 * D * F * a,))] \
        if edp > 1 else []
    fwd = [StepOp("router", "gemm", "local", (nl, D, E))] + gathers + [
        StepOp("dispatch+experts gate|up", "a2a_matmul", ax, (M, D, 2 * F), moved=moved),
        StepOp("experts down+combine", "matmul_a2a", ax, (M, F, D), moved=moved)]
    bwd = []
    if backward:
        regather = [dataclasses.replace(g, name="regather experts") for g in gathers] \
            if sm.ag_backward == "regather" else []
        bwd = regather + [
            StepOp("combine+experts down dx", "a2a_matmul", ax, (M, D, F), moved=moved),
            StepOp("experts down dW", "gemm", "local", (F, rows, D)),
            StepOp("experts gate|up dx+dispatch", "matmul_a2a", ax, (M, 2 * F, D),
                   moved=moved),
            StepOp("experts gate|up dW", "gemm", "local", (D, rows, 2 * F)),
            StepOp("router dx", "gemm", "local", (nl, E, D)),
            StepOp("router dW", "gemm", "local", (E, nl, D))]
        bwd += [StepOp("grad RS experts", "reduce_scatter", shard_ax, g.shape)
                for g in gathers]
    if m.shared_ffn:
        shared = dataclasses.replace(cfg, pattern="", moe=None, mamba=None,
                                     ffn_hidden=m.shared_ffn)
        f, b = block_ops(shared, tp, up, dp, seq, mb, backward, a, sm)
        fwd += [dataclasses.replace(o, name="shared " + o.name) for o in f if _is_mlp(o)]
        bwd = [dataclasses.replace(o, name="shared " + o.name) for o in b if _is_mlp(o)] + bwd
    return fwd, bwd


def mamba_ops(cfg, tp: int, up: int, dp: int, seq: int, mb: int, backward: bool = True,
              a: float = 2, sm: StepModel = CURRENT) -> tuple[list, list]:
    """(forward, backward) ops of one Mamba-2 mixer on a rank: its two projections (module
    doc); the conv1d, scan and gated norm are `commfuse.sim.step.work`'s."""
    m, D, n = cfg.mamba, cfg.dim, mb * seq
    if tp == 1:
        lin = _linear_zero3 if dp > 1 else _linear_local
        fi, bi = lin("mamba in_proj", n // up, D, m.in_proj_out, backward, sm)
        fo, bo = lin("mamba out_proj", n // up, m.d_inner, D, backward, sm)
        return fi + fo, bo + bi
    h, _, rows_in = m.local(tp)
    d_in = h * m.head_dim
    gathers = [StepOp(f"gather mamba {k}", "all_gather", "dp", (v * D * a,))
               for k, v in (("in_proj", rows_in), ("out_proj", d_in))] if dp > 1 else []
    fwd = gathers[:1] + [StepOp("mamba in_proj", "ag_matmul", "tp", (n, D, rows_in))] \
        + gathers[1:] + [StepOp("mamba out_proj", "matmul_rs", "tp", (n, d_in, D))]
    if not backward:
        return fwd, []
    regathers = [dataclasses.replace(g, name=g.name.replace("gather", "regather"))
                 for g in gathers] if sm.ag_backward == "regather" else []
    bwd = (regathers[1:] + _rs_backward("mamba out_proj", n, d_in, D, "tp", sm)
           + regathers[:1] + _ag_backward("mamba in_proj", n, D, rows_in, "tp", sm))
    bwd += [StepOp(g.name.replace("gather", "grad RS"), "reduce_scatter", "dp", g.shape)
            for g in gathers]
    return fwd, bwd


def hybrid_grad_sync_ops(cfg, tp: int, up: int, dp: int, ep: int = 1, dtype_bytes: float = 2,
                         sm: StepModel = CURRENT, ep_axis: str = "dp") -> list:
    """The per-step all-reduces of a hybrid model's replicated gradients, bucketed per group
    of axes as `commfuse.sim.step.ops.grad_sync_ops` does for Llama: norms, the routers and
    Mamba's small per-head parameters everywhere replicated; the embedding and head as
    there; attention, MLP, shared-expert and Mamba projections sharded over tp (and dp);
    routed experts sharded over dp (ep x edp) but replicated over tp (all-reduced there), or
    (``ep_axis="tp"``) sharded over tp and dp."""
    from commfuse.sim.step.arch import matmul_weights

    D, V, T = cfg.dim, cfg.vocab_size, tp * up
    s = sublayers(cfg)
    vocab = ("seq",) if sm.vocab_parallel and T > 1 else ()
    V_local = V / T if vocab else V
    small = (len(s) + 1) * D  # a pre-norm per layer and the final norm
    dense = experts = 0.0
    for kind in s:
        d, e = matmul_weights(cfg, kind)
        if kind == "E":
            small += D * cfg.moe.experts  # the router
            d -= D * cfg.moe.experts
        if kind == "M":
            mm = cfg.mamba
            small += (mm.conv_dim * mm.conv_kernel + 3 * mm.heads + mm.d_inner) / tp
            d -= mm.conv_dim * mm.conv_kernel
        dense, experts = dense + d, experts + e
    params = [(small, ()), (V_local * D, vocab)]
    if not cfg.tie_embeddings:
        params.append((V_local * D / dp, vocab + ("dp",)) if dp > 1 else (V_local * D, vocab))
    sharded = ("seq",) if tp > 1 else ()
    params.append((dense / (tp * dp), sharded + (("dp",) if dp > 1 else ())))
    if ep_axis == "tp":
        params.append((experts / (tp * dp), sharded + (("dp",) if dp > 1 else ())))
    else:
        params.append((experts / dp, ("dp",) if dp > 1 else ()))
    buckets: dict[str, float] = {}
    for count, axes in params:
        need = [x for x, size in (("seq", T), ("dp", dp)) if size > 1 and x not in axes]
        if need and count:
            key = "+".join(need)
            buckets[key] = buckets.get(key, 0.0) + count * dtype_bytes
    axis = {"seq": "tp" if tp > 1 else "up", "dp": "dp", "seq+dp": "world"}
    return [StepOp(f"grad all-reduce ({k})", "all_reduce", axis[k], (b,))
            for k, b in buckets.items()]
