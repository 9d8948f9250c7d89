"""The GEMMs and collectives of one training step of a whole model, timed: `simulate_step`
(the lower layer of the step model; `commfuse.sim.step.train` adds the rest of the step).

    from commfuse.parallel.config import ParallelDims
    from commfuse.sim.step import simulate_step
    r = simulate_step("70b", ParallelDims(tp=8, dp=128, method="commfuse"), "h100-nvlink",
                      seq=4096, batch=1024, inter_hw="multinode-400g")
    r.step_s, r.mfu, r.exposed_comm_s, r.breakdown

The step's ops (`commfuse.sim.step.ops`) are timed one by one and summed along the step.
The approximation, stated: each fused op is simulated alone on its own group (tp, up or dp
ranks) as if nothing else ran, and ops follow each other with no overlap between them (the
engine would let a rank start op i+1 while its peers finish op i: a little more overlap than
here). Ops on different groups do not share links or compute here, which is exact as long as
they run one after the other, as they do in the plans. A group within one node
(``node_size`` consecutive ranks; TP/UP ranks are neighbours, DP strides over them, as
`ParallelDims.build_mesh` lays them out) uses ``hw``; one that spans nodes uses ``hw`` with
``inter_hw``'s links. Plain collectives take the ring model's time (`Hardware.collective_time`,
all-reduce = reduce-scatter + all-gather), local GEMMs `Hardware.gemm_time`.

The step is `commfuse.sim.step.ops.StepModel` (default: the current one; ``previous()`` the
step before issue #12). With ``grad_sync="bucketed"`` the gradient all-reduces run during the
backward: exposed is the larger of the last bucket's time and the all-reduces' total less the
backward's time (one micro-batch's; the links are not shared with the backward's own
transfers here). The step's limit (``limit_s``): the same compute and the same bytes with no
dependency between them, max(compute alone, each link's wire time) per rank.

Scale: layers are identical, so each distinct (op, shape, method, group size, hardware) is
simulated once (`OpTimer` memoizes across layers, micro-batches and plans), and without
stragglers the engine runs rank 0 only (``symmetric``, exact by rotation symmetry): an 80-layer
step on 1024 ranks costs a few dozen single-rank simulations.
"""

from __future__ import annotations

from dataclasses import dataclass

import math

from commfuse.sim.choose import best_splits, choice
from commfuse.sim.attention import attention_s
from commfuse.sim.costs import OpSpec
from commfuse.sim.hardware import Hardware
from commfuse.sim.hardware import resolve as resolve_hw
from commfuse.sim.step.arch import check_layout, expert_groups, is_hybrid, model_flops_per_token
from commfuse.sim.step.layers import hybrid_grad_sync_ops, layer_groups, layer_order
from commfuse.sim.step.ops import (CURRENT, FUSED, StepModel, StepOp, embed_ops,
                                    grad_sync_ops, head_ops, local_attention_ops, model_config,
                                    tp_attention_ops, wire_bytes)
from commfuse.sim.simulate import simulate_ops
from commfuse.trace import Span, write_trace


class OpTimer:
    """Times `StepOp`s (seconds: total, compute alone), each distinct one once.

    A fused op runs the given method; method "auto" takes `commfuse.sim.choose.choice`'s pick
    of `commfuse.sim.choose`'s candidates for that shape (``auto_step_s`` per schedule step added, as `auto` does), and
    "commfuse" without ``splits`` the m `commfuse.sim.choose.best_splits` picks, as the ops do."""

    def __init__(self, dtype_bytes: float = 2, auto_step_s: float = 10e-6):
        self.dtype_bytes, self.auto_step_s = dtype_bytes, auto_step_s
        self.cache: dict = {}
        self.simulations = 0  # distinct fused-op simulations run

    def time(self, op: StepOp, method: str, opts: dict, world: int, hw: Hardware):
        """(total s, compute-alone s, label) of one ``op`` on a group of ``world`` ranks."""
        if op.kind == "gemm":
            if op.attention and hw.attention_efficiency[0]:
                head_dim, _, factor = op.attention[:3]
                t = attention_s(hw, range(op.shape[0]), 1, head_dim, factor)
            else:
                t = hw.gemm_time(*op.shape)
            return t, t, ""
        key = (op.kind, op.shape, op.attention, op.moved, method, tuple(sorted(opts.items())), world,
               repr(hw))
        if key not in self.cache:
            self.cache[key] = self._time(op, method, opts, world, hw)
        return self.cache[key]

    def _time(self, op, method, opts, world, hw):
        if op.kind not in FUSED:  # a plain collective on `world` ranks
            kind = "reduce_scatter" if op.kind == "all_reduce" else op.kind
            t = hw.collective_time(kind, op.shape[0], world) * (2 if op.kind == "all_reduce"
                                                                 else 1)
            return t, 0.0, op.kind
        if world == 1:
            t = hw.gemm_time(*op.shape)
            return t, t, "local"
        if method == "auto":
            method, opts, _ = choice(op.kind, op.shape, world, self.dtype_bytes, hw,
                                     self.auto_step_s, attention=op.attention, moved=op.moved)
        elif method == "commfuse" and opts.get("splits") is None:
            topology = opts.get("topology", "ring")
            opts = {**opts, "splits": best_splits(op.kind, op.shape, world, self.dtype_bytes, hw,
                                                  self.auto_step_s, topology,
                                                  attention=op.attention,
                                                  moved=op.moved)}
        sym = not (hw.compute_straggler or hw.link_straggler)
        spec = OpSpec(op.kind, method, op.shape, attention=op.attention, moved=op.moved,
                      **_spec_opts(opts))
        r = simulate_ops([spec], world, self.dtype_bytes, hw, timeline=False, symmetric=sym)
        self.simulations += 1
        return r.total_s, r.compute_s, " ".join([method] + [f"{k}={v}" for k, v in opts.items()])


def query_split_wins(cfg, tp: int, seq: int, mb: int, method: str, opts: dict, hw,
                     timer: OpTimer, backward: bool = True) -> bool:
    """Whether query-split TP attention is predicted faster than row-parallel attention +
    out-projection for ``mb`` sequences of ``seq`` tokens on ``tp`` ranks: their forward and
    backward (`commfuse.sim.step.ops.tp_attention_ops`) and q|k|v's re-gather after them,
    which the backward before it posts ahead (`prefetch_credit`), as the step does by
    default; ``backward=False``: their forward alone (a prefill)."""
    n, qkv = mb * seq, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    regather = StepOp("q|k|v dW", "ag_matmul", "tp", (n, cfg.dim, qkv // tp))

    def time(op: StepOp, part: int = 0) -> float:
        return timer.time(op, method, opts, 1 if op.axis == "local" else tp, hw)[part] * op.count

    def total(query_split: bool) -> float:
        f, b = tp_attention_ops(cfg, tp, seq, mb, query_split)
        if not backward:
            return sum(time(op) for op in f)
        hide = prefetch_credit(b + [regather], tp).get(regather, [])
        return sum(time(op) for op in f + b) + max(
            time(regather, 1), time(regather) - sum(time(g, 1) for g in hide))
    return total(True) < total(False)


def resolve_query_split(parallel, cfg, seq: int, mb: int, dtype_bytes: float, hw,
                        timer: OpTimer) -> bool:
    """``parallel.query_split``, or where it is None (the plan's default) what the TP plan
    runs: query-split under method "auto" where `query_split_wins` with the re-gather
    prefetch on (as `commfuse.ops.auto.choose_query_split` decides: the prefetch setting never
    changes the choice), else row-parallel. As there, only on CPU (the attention blocks'
    fused kernels): a model of NCCL's P2P (``hw.serial_p2p``, the GPU presets) is a GPU, where
    auto never query-splits."""
    if parallel.query_split is not None:
        return bool(parallel.query_split)
    return parallel.method == "auto" and not hw.serial_p2p and query_split_wins(
        cfg, parallel.tp, seq, mb, parallel.method, parallel.method_opts, hw, timer)


def _spec_opts(opts: dict) -> dict:
    return {k: v for k, v in opts.items() if k in ("topology", "chunks", "splits")}


@dataclass(frozen=True)
class StepResult:
    """Predicted times (seconds) of one training step, and where they go."""

    step_s: float  # the whole step: micro_batches x (forward + backward) + gradient sync
    compute_s: float  # the same with free communication (fused ops' compute alone, GEMMs)
    exposed_comm_s: float  # step_s - compute_s
    limit_s: float  # no dependencies: max(compute_s, wire time of each link's bytes)
    comm_s: float  # the wire time of every byte the step moves (all links, one after another)
    sync_exposed_s: float  # of the gradient sync, the part not hidden behind the backward
    micro_batches: int  # forward+backward passes per step on each DP replica
    tokens: int  # tokens per step (global batch x sequence)
    mfu: float  # model FLOPs utilisation (see `simulate_step`)
    breakdown: dict  # axis -> seconds per step: "tp", "up", "dp", "world", "local"
    rows: tuple  # (StepOp, times per step, total s, compute s, label) of each distinct op
    timeline: tuple  # Spans of one micro-batch and the gradient sync (timeline=True)
    simulations: int  # fused-op simulations this call ran (the rest came from the memo)

    def write_trace(self, path: str) -> None:
        write_trace(self.timeline, path)


def simulate_step(model, parallel, hw="h100-nvlink", *, seq: int, batch: int | None = None,
                  micro_batch: int = 1, dtype_bytes: float = 2, backward: bool = True,
                  inter_hw=None, node_size: int = 8, timeline: bool = False,
                  timer: OpTimer | None = None, step_model: StepModel = CURRENT,
                  ep: int | None = None, ep_axis: str = "dp") -> StepResult:
    """Time one training step of ``model`` (a `LlamaConfig`, a
    `commfuse.sim.step.arch.HybridConfig` or a name in `MODELS`) under
    ``parallel`` (a `commfuse.parallel.config.ParallelDims`: tp, up, dp, method and its options;
    method "auto" allowed) on ``hw`` (a `Hardware` or a preset name).

    ``batch`` global sequences of ``seq`` tokens per step (default dp * micro_batch), in
    micro-batches of ``micro_batch`` sequences per DP replica. ``inter_hw``: the links of groups
    that span nodes of ``node_size`` ranks (None: ``hw``'s everywhere). ``backward=False``:
    forward only. ``step_model``: which step (`StepModel`; default the current one).
    ``ep``: expert-parallel ranks of an MoE model, taken from the DP ranks (default
    ``parallel.ep`` where it has one, else 1; `commfuse.sim.step.layers`); ``ep_axis="tp"``: the
    TP group is the expert-parallel group (ep = tp, `commfuse.sim.step.arch.expert_groups`).
    MFU = flops_per_token * tokens / step_s / (ranks * hw.gemm_flops), with
    `commfuse.models.llama.flops_per_token` (6N + 12*L*H*Q*T, PaLM appendix B, as
    ``commfuse train`` reports it; `commfuse.sim.step.arch.flops_per_token` for MoE and Mamba
    layers: the active weights, and the scan), the preset's dense peak in the denominator.
    """
    cfg, hw = model_config(model), resolve_hw(hw)
    tp, up, dp = parallel.tp, parallel.up, parallel.dp
    ep = ep or getattr(parallel, "ep", 1) or 1
    batch = dp * micro_batch if batch is None else batch
    parallel.check_model(cfg, seq, batch)
    check_layout(cfg, tp, up, dp, ep, ep_axis)
    _, _, shard_ax, edp = expert_groups(tp, dp, ep, ep_axis)
    if micro_batch < 1 or batch % (dp * micro_batch):
        raise ValueError(f"global batch {batch} is not a whole number of micro-batches of "
                         f"{micro_batch} sequences on each of dp={dp} replicas")
    timer = timer or OpTimer(dtype_bytes)
    if timer.dtype_bytes != dtype_bytes:
        raise ValueError(f"timer times {timer.dtype_bytes}-byte elements, not {dtype_bytes}")
    before = timer.simulations
    inner, world = tp * up, tp * up * dp
    inter = resolve_hw(inter_hw) if inter_hw is not None else hw
    group = {"local": (1, hw), "tp": (tp, hw), "up": (up, hw), "dp": (dp, hw),
             "world": (world, hw), "ep": (ep, hw), "edp": (edp, hw)}
    for axis, span in (("tp", inner), ("up", inner), ("dp", inner * dp), ("world", world),
                       ("ep", inner * ep), ("edp", inner * dp)):
        if span > node_size:
            group[axis] = (group[axis][0], hw.with_links_of(inter))
    sm, mb = step_model, micro_batch
    groups = layer_groups(cfg, tp, up, dp, seq, mb, ep, backward, dtype_bytes, sm,
                          query_split=tp > 1 and resolve_query_split(parallel, cfg, seq, mb,
                                                                     dtype_bytes, hw, timer),
                          ep_axis=ep_axis)
    bwd = [op for g in groups for op in g.bwd]
    hf, hb = head_ops(cfg, tp, up, dp, seq, mb, backward, dtype_bytes, sm)
    ef, eb = embed_ops(cfg, tp, up, seq, mb, backward, dtype_bytes, sm)
    hf, hb = ef + hf, hb + eb  # embedding first in the forward, last in the backward
    per_mb = [(op, g.count) for g in groups for op in g.fwd + g.bwd] + [(op, 1)
                                                                        for op in hf + hb]
    sync = (hybrid_grad_sync_ops(cfg, tp, up, dp, ep, dtype_bytes, sm, ep_axis) if is_hybrid(cfg)
            else grad_sync_ops(cfg, tp, up, dp, dtype_bytes, sm)) if backward else []
    n_mb = batch // (dp * mb)
    times, breakdown, wire = {}, {}, {}
    credit = {}
    if sm.regather_prefetch and getattr(parallel, "regather_prefetch", 1):
        for g in groups:
            credit.update(prefetch_credit(list(g.bwd), tp))
    total = compute = backward_s = 0.0
    bucketed = sm.grad_sync == "bucketed"
    for op, reps in per_mb + [(op, 1 / n_mb) for op in sync]:
        w, h = group[op.axis]
        if op not in times:
            times[op] = timer.time(op, parallel.method, parallel.method_opts, w, h)
        t, c, _ = times[op]
        if op in credit:  # prefetched: its transfers overlapped the compute before it
            t = max(c, t - sum(timer.time(g, parallel.method, parallel.method_opts, 1, h)[1]
                               * g.count for g in credit[op]))
        k = reps * n_mb * op.count
        wire[repr(h)] = wire.get(repr(h), 0.0) + k * wire_bytes(op, w, dtype_bytes) / h.link_bandwidth
        if op in sync and bucketed:
            continue  # its exposed part is added below
        if op in bwd or op in hb:
            backward_s += reps * op.count * t
        total, compute = total + k * t, compute + k * c
        breakdown[op.axis] = breakdown.get(op.axis, 0.0) + k * t
    sync_exposed = sum(times[op][0] for op in sync)
    if sync and bucketed:
        sync_exposed = bucketed_exposed([_buckets(op, group[op.axis], sm.bucket_mb)
                                         for op in sync], backward_s)
        total += sync_exposed
        breakdown[sync[-1].axis] = breakdown.get(sync[-1].axis, 0.0) + sync_exposed
    rows = tuple((op, reps * n_mb * op.count, *times[op])
                 for op, reps in per_mb + [(op, 1 / n_mb) for op in sync])
    spans = _timeline(layer_order(cfg, groups), hf, hb, sync, times,
                      sync_exposed if bucketed else None) if timeline else ()
    mfu = model_flops_per_token(cfg, seq) * batch * seq / total / (world * hw.gemm_flops)
    limit = max([compute, *wire.values()])
    return StepResult(total, compute, total - compute, limit, sum(wire.values()), sync_exposed,
                      n_mb, batch * seq, mfu, breakdown, rows, spans, timer.simulations - before)


def prefetch_credit(bwd: list[StepOp], world: int = 2) -> dict[StepOp, list[StepOp]]:
    """The TP re-gathers (``ag_matmul`` "... dW" ops) posted ahead (`commfuse.ops.prefetch`)
    and the local ops whose compute their transfers overlap: those between the GEMM->RS
    backward that posts them and them (the attention backward before q|k|v's; nothing
    modelled before gate|up's, whose SwiGLU backward is elementwise). Query-split's backward
    posts q|k|v's from inside, after its last post: what follows of its attention backward
    is counted as its last of ``world`` ring steps. A prefetched op takes max(compute alone,
    its time less that compute)."""
    out = {}
    for i, op in enumerate(bwd):
        if op.kind == "ag_matmul" and op.axis == "tp" and op.name.endswith(" dW"):
            j, hide = i - 1, []
            while j >= 0 and bwd[j].kind == "gemm":
                hide.append(bwd[j])
                j -= 1
            if j >= 0 and bwd[j].kind == "ag_matmul":  # a GEMM->RS's backward posted it
                out[op] = hide + _attention_tail(bwd[j], world)
    return out


def _attention_tail(op: StepOp, world: int) -> list[StepOp]:
    """The attention backward in the last of ``world`` ring steps of a query-split backward
    ``op`` (none for other ops), as a local op of the step."""
    if not op.attention:
        return []
    head_dim, order, _, mb = op.attention
    heads = op.shape[2] / 2 / head_dim  # dO | dW_o columns: X = heads x head_dim
    return [local_attention_ops(op.shape[0] // mb, head_dim, mb * heads / world, order)[1]]


def _buckets(op: StepOp, group, bucket_mb: float) -> list[float]:
    """Seconds of each bucket of an all-reduce ``op`` cut into ``bucket_mb`` MiB buckets."""
    (w, h), size = group, bucket_mb * 2 ** 20
    n = max(1, math.ceil(op.shape[0] / size))
    sizes = [size] * (n - 1) + [op.shape[0] - size * (n - 1)]
    return [2 * h.collective_time("reduce_scatter", b, w) for b in sizes]


def bucketed_exposed(buckets: list[list[float]], backward_s: float) -> float:
    """Exposed seconds of bucketed all-reduces posted during a backward of ``backward_s``
    (``buckets``: each all-reduce's bucket times, in posting order): the last bucket of each
    is posted when the backward ends, so at least the longest last bucket shows; the rest
    hides as long as all of them fit in the backward."""
    if not buckets:
        return 0.0
    return max(max(b[-1] for b in buckets), sum(map(sum, buckets)) - backward_s)


def _timeline(layers, hf, hb, sync, times, sync_exposed=None) -> tuple:
    """Rank 0's predicted micro-batch (every layer forward, head, every layer backward; each of
    ``layers`` a `commfuse.sim.step.layers.LayerGroup`) and the gradient sync: each op as a span on
    its group's lane, its exposed part on "exposed". A bucketed sync (``sync_exposed`` given)
    is drawn on its own lane, ending ``sync_exposed`` after the backward, its exposed part on
    "exposed"."""
    order = [(f"L{i} fwd ", op) for i, g in enumerate(layers) for op in g.fwd]
    order += [("head ", op) for op in hf + hb]
    order += [(f"L{i} bwd ", op) for i, g in reversed(list(enumerate(layers))) for op in g.bwd]
    order += [("", op) for op in sync] if sync_exposed is None else []
    spans, t = [], 0.0
    for prefix, op in order:
        total, comp, label = times[op]
        d = total * op.count
        lane = "compute" if op.kind == "gemm" else (op.axis if op.kind in FUSED else "collective")
        name = f"{prefix}{op.name} ({op.kind}{', ' + label if label and op.kind in FUSED else ''})"
        spans.append(Span(0, lane, name, t, t + d))
        if op.kind in FUSED and total > comp:
            spans.append(Span(0, "exposed", f"{prefix}{op.name} exposed", t + comp * op.count,
                              t + d))
        t += d
    if sync_exposed is not None and sync:
        end = t + sync_exposed  # the buckets run back to back, the last ending here
        for op in reversed(sync):
            start = end - times[op][0]
            spans.append(Span(0, "grad sync", f"{op.name} (bucketed)", start, end))
            end = start
        spans.append(Span(0, "exposed", "grad sync exposed", t, t + sync_exposed))
    return tuple(spans)
