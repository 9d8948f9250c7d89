"""A whole training step as a framework runs it: `simulate_train_step` (the upper layer of the
step model, on `commfuse.sim.step.timing`).

    from commfuse.parallel.config import ParallelDims
    from commfuse.sim.step import simulate_train_step
    r = simulate_train_step("8b", ParallelDims(dp=8, method="none", world_size=8),
                            "h100-hbm2e-500w", seq=8192, local_batch=2)
    r.tokens_per_s_per_device, r.peak_memory_gib, r.fits, r.breakdown

It starts from `commfuse.sim.step.timing.simulate_step` (the GEMMs and collectives of
`commfuse.sim.step.ops`, each op timed on its group and summed along the step) and adds what
moves a real step (`commfuse.sim.step.work` says how each is counted):

- **fused attention** in place of the step's attention GEMMs, where the preset has
  `Hardware.attention_efficiency` (the GPU presets);
- **memory-bound work**: the block's elementwise kernels forward, backward and recomputed,
  the cross-entropy on float32 logits, and the optimizer step (with gradient clipping), by
  bytes over the memory bandwidth; under FSDP also its copies (the gathered weights copied
  out of the all-gather buffer, the gradients into the reduce-scatter's in float32);
- **recompute** under ``setup.ac`` (selective: every second matmul's GEMM; full: the block's
  whole forward, its TP/UP collectives included, and attention's);
- **FSDP prefetch** (``setup.fsdp``, where every DP op of a block is FSDP's: method ``none``,
  or the plain weight gathers of TP/UP x DP): as FSDP2 runs it, one all-gather of the
  block's weights (model dtype) in the forward, again in the backward, and one
  reduce-scatter of its gradients (``setup.grad_bytes`` per element: float32 in FSDP2's
  mixed precision), each on the DP group's links, in place of the step's per-op transfers. A
  block's transfers run behind the neighbouring block's compute: per micro-batch and
  direction, exposed = one block's transfers (the first gather, the last reduce-scatter) +
  whatever the other blocks' transfers exceed their compute by; the compute they run beside
  is slowed by `Hardware.interference`.
- the step's **peak memory** (`commfuse.sim.step.memory.step_memory`) and whether it fits the
  preset's `Hardware.memory_gib`.

TPS/device = tokens per step / step time / devices, as torchtitan logs it; MFU as
`simulate_step` (6N + 12 L H Q T FLOPs per token over the datasheet peak).
"""

from __future__ import annotations

from dataclasses import dataclass

from commfuse.sim.step import work
from commfuse.sim.step.arch import expert_groups, is_hybrid
from commfuse.sim.hardware import resolve as resolve_hw
from commfuse.sim.step.layers import hybrid_grad_sync_ops, layer_groups
from commfuse.sim.step.memory import MemoryEstimate, rank_params, step_memory
from commfuse.sim.step.ops import CURRENT, FUSED, StepModel, grad_sync_ops, head_ops, model_config
from commfuse.sim.step.timing import (OpTimer, StepResult, model_flops_per_token, resolve_query_split,
                               simulate_step)


@dataclass(frozen=True)
class TrainStepResult:
    """One training step, predicted: time, throughput, memory (`simulate_train_step`)."""

    step_s: float
    tokens: int  # per step, all ranks
    devices: int
    mfu: float
    memory: MemoryEstimate
    breakdown: dict  # part -> seconds per step (module doc); they sum to step_s
    base: StepResult  # `simulate_step`'s step (GEMMs and collectives only)
    setup: work.TrainSetup

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.tokens / self.step_s / self.devices

    @property
    def peak_memory_gib(self) -> float:
        return self.memory.peak_gib

    @property
    def fits(self) -> bool:
        return self.memory.fits


ATTENTION_OPS = ("attention", "attention bwd")  # the step's attention GEMMs (ops.py)


def base_sync_ops(cfg, tp: int, up: int, dp: int, ep: int, a: float, sm: StepModel,
                  ep_axis: str = "dp") -> list:
    """The step's gradient all-reduces, as `simulate_step` runs them."""
    if is_hybrid(cfg):
        return hybrid_grad_sync_ops(cfg, tp, up, dp, ep, a, sm, ep_axis)
    return grad_sync_ops(cfg, tp, up, dp, a, sm)


def _prefetchable(op, label: str, setup: work.TrainSetup, dp: int) -> bool:
    """Whether ``op`` (on the DP axis) is one FSDP runs as a block's gather or reduce-scatter,
    ahead of the GEMM: a plain weight gather or its gradient's reduce-scatter, or a ZeRO-3
    op whose method (auto: the one chosen) is "none"."""
    if not (setup.fsdp and dp > 1 and op.axis in ("dp", "edp")):
        return False
    return op.kind in ("all_gather", "reduce_scatter") or \
        (op.kind in FUSED and label.split(" ")[0] == "none")


def simulate_train_step(model, parallel, hw="h100-nvlink", *, seq: int,
                        local_batch: int | None = None, batch: int | None = None,
                        micro_batch: int | None = None,
                        setup: work.TrainSetup = work.TrainSetup(), dtype_bytes: float = 2,
                        inter_hw=None, node_size: int = 8, timer: OpTimer | None = None,
                        step_model: StepModel = CURRENT,
                        ep: int | None = None, ep_axis: str = "dp") -> TrainStepResult:
    """Predict one training step of ``model`` under ``parallel`` (a `ParallelDims`) on ``hw``
    (module doc). ``local_batch``: sequences per DP replica per step (torchtitan's
    ``local_batch_size``; the global batch is dp times it), or ``batch`` global sequences
    (default: one per DP replica); ``micro_batch``: sequences per forward/backward (default
    the whole local batch). ``ep``, ``ep_axis``: expert parallelism (MoE,
    `commfuse.sim.step.arch.expert_groups`). The other arguments are
    `simulate_step`'s. Each layer kind (`commfuse.sim.step.layers.LayerGroup`: Llama blocks, or
    a hybrid's attention, MLP, MoE and Mamba layers) is counted with its own work
    (`commfuse.sim.step.work`)."""
    cfg, hw = model_config(model), resolve_hw(hw)
    tp, up, dp = parallel.tp, parallel.up, parallel.dp
    ep = ep or getattr(parallel, "ep", 1) or 1
    if local_batch is not None and batch is not None and batch != local_batch * dp:
        raise ValueError(f"batch {batch} is not local_batch {local_batch} x dp {dp}")
    if local_batch is not None and local_batch < 1:
        raise ValueError(f"local_batch must be >= 1, got {local_batch}")
    batch = batch if batch is not None else dp * (local_batch or 1)
    mb = micro_batch or batch // dp
    timer = timer or OpTimer(dtype_bytes)
    base = simulate_step(cfg, parallel, hw, seq=seq, batch=batch, micro_batch=mb,
                         dtype_bytes=dtype_bytes, inter_hw=inter_hw, node_size=node_size,
                         timer=timer, step_model=step_model, ep=ep, ep_axis=ep_axis)
    a, T, n_mb = dtype_bytes, tp * up, base.micro_batches
    nl = mb * seq // T
    rows = {row[0]: row for row in base.rows}  # op -> (op, per step, total s, compute s, label)
    # the layers' ops as simulate_step timed them (TP attention per query slice or not)
    groups = layer_groups(cfg, tp, up, dp, seq, mb, ep, True, a, step_model,
                          query_split=tp > 1 and resolve_query_split(parallel, cfg, seq, mb, a,
                                                                     hw, timer), ep_axis=ep_axis)
    edp = expert_groups(tp, dp, ep, ep_axis)[3]  # the ZeRO shards of each rank's experts
    hf, hb = head_ops(cfg, tp, up, dp, seq, mb, True, a, step_model)
    sync = base_sync_ops(cfg, tp, up, dp, ep, a, step_model, ep_axis)
    parts = {"ops": base.step_s}
    attn = work.attention_times(hw, cfg, seq, mb, T)
    per_mb, per_step, fsdp = 0.0, 0.0, []
    attn_s = scan_s = recompute_s = 0.0
    for g in groups:
        L, fwd, bwd = g.count, list(g.fwd), list(g.bwd)
        # fused attention in place of the attention GEMMs
        attn_ops = [op for op in fwd + bwd if op.kind == "gemm" and op.name in ATTENTION_OPS]
        g_attn = attn if len(attn_ops) == 2 else None  # else timed inside a fused op: kept
        attn_fwd_s = sum(rows[op][2] * op.count for op in fwd if op in attn_ops)  # one layer's
        if g_attn is not None:
            for op in attn_ops:
                parts["ops"] -= rows[op][1] * rows[op][2]
            attn_fwd_s = g_attn[0]
            attn_s += (g_attn[0] + g_attn[1]) * L * n_mb

        # memory-bound work (and a Mamba layer's scan)
        ew = work.elementwise_bytes(cfg, g.kind, a) * nl
        ew_b = work.elementwise_bytes(cfg, g.kind, a, backward=True) * nl
        per_mb += L * (ew * (1 + (setup.ac != "none")) + ew_b)
        ew_s, ew_b_s = work.mem_time(hw, ew), work.mem_time(hw, ew_b)
        if g.kind == "M":
            scan = work.scan_time(hw, cfg, seq, mb * seq, T, a)
            scan_b = work.scan_time(hw, cfg, seq, mb * seq, T, a, backward=True)
            # selective AC saves the scan's output (work.saved_bytes): only full reruns it
            scan_s += L * n_mb * (scan * (1 + (setup.ac == "full")) + scan_b)
            ew_s, ew_b_s = ew_s + scan, ew_b_s + scan_b
        dense_w, expert_w = work.rank_weights(cfg, g.kind, tp, ep)
        if setup.fsdp and dp > 1:  # copy-out of 2 gathers (a in, a out), copy-in of the grads
            sharded = dense_w + (expert_w if edp > 1 else 0.0)
            per_step += L * sharded * (2 * 2 * a + (a + setup.grad_bytes)) * n_mb

        # recompute
        recompute = 0.0
        if setup.ac == "selective":
            recompute = L * n_mb * sum(hw.gemm_time(*s) for s in work.recomputed_gemms(
                cfg, g.kind, tp, up, ep, mb * seq))
        elif setup.ac == "full":
            layer_fwd = sum(rows[op][2] * op.count if op.axis != "dp" else rows[op][3] * op.count
                            for op in fwd if op not in attn_ops)
            recompute = L * n_mb * (layer_fwd + attn_fwd_s)
        recompute_s += recompute
        fsdp.append((g, attn_ops, g_attn, dense_w, expert_w, ew_s, ew_b_s,
                     recompute / (L * n_mb)))
    per_mb += work.LOSS_BYTES_PER_LOGIT * mb * seq * cfg.vocab_size / T
    params = rank_params(cfg, tp, up, dp, setup, step_model, ep, ep_axis)
    per_step += work.OPTIMIZER_BYTES * params
    if attn_s:
        parts["attention"] = attn_s
    parts["memory-bound"] = work.mem_time(hw, per_mb * n_mb + per_step) + scan_s
    if setup.ac != "none":
        parts["recompute"] = recompute_s

    # FSDP prefetch: DP transfers behind the neighbouring layers' compute
    dp_ops = [op for g in groups for op in g.fwd + g.bwd if op.axis in ("dp", "edp")]
    if dp_ops and all(_prefetchable(op, rows[op][4], setup, dp) for op in dp_ops):
        hw_dp = hw
        if tp * up * dp > node_size and inter_hw is not None:
            hw_dp = hw.with_links_of(resolve_hw(inter_hw))
        exposed = slowed = 0.0
        L_all = sum(g.count for g in groups)
        for g, attn_ops, g_attn, dense_w, expert_w, ew_s, ew_b_s, recompute in fsdp:
            L = g.count  # routed experts: gathered over their edp ZeRO shards
            gather = hw_dp.collective_time("all_gather", dense_w * a, dp)
            scatter = hw_dp.collective_time("reduce_scatter", dense_w * setup.grad_bytes, dp)
            if expert_w and edp > 1:
                gather += hw_dp.collective_time("all_gather", expert_w * a, edp)
                scatter += hw_dp.collective_time("reduce_scatter", expert_w * setup.grad_bytes,
                                                 edp)
            for ops, comm, extra in ((g.fwd, gather, ew_s),
                                     (g.bwd, gather + scatter, ew_b_s + recompute)):
                comp = extra
                for op in ops:
                    total, compute, label = rows[op][2:]
                    if g_attn is not None and op in attn_ops:
                        comp += g_attn[0] if op.name == "attention" else g_attn[1]
                    elif op.axis in ("dp", "edp"):
                        parts["ops"] -= rows[op][1] * (total - compute)
                        comp += compute * op.count
                    else:
                        comp += total * op.count
                # one layer's transfers exposed per pass (the first gather, the last
                # reduce-scatter), the rest where they exceed the neighbouring compute
                exposed += comm * L / L_all + max(0.0, (L - L / L_all) * (comm - comp))
                slowed += hw.interference * min(comm, comp) * (L - L / L_all)
        # the root (embedding, head, norms): FSDP2 gathers it once before the forward and
        # keeps it to the end of the backward, then reduce-scatters its gradients, both
        # exposed; the step's per-op head transfers on DP and its DP all-reduce of the
        # replicated gradients (there are none under FSDP) are taken out
        for op in hf + hb:
            if op.axis == "dp" and rows[op][2] > rows[op][3]:
                parts["ops"] -= rows[op][1] * (rows[op][2] - rows[op][3])
        if all(op.axis == "dp" for op in sync):
            parts["ops"] -= base.sync_exposed_s
        root = rank_params(cfg, tp, up, 1, setup, step_model, ep, ep_axis) - sum(
            g.count * d for g, _, _, d, *_ in fsdp) - sum(
            g.count * work.rank_weights(cfg, g.kind, tp, ep)[1] for g in groups)
        exposed += (hw_dp.collective_time("all_gather", root * a, dp)
                    + hw_dp.collective_time("reduce_scatter", root * setup.grad_bytes, dp)) \
            / n_mb
        parts["dp exposed"] = exposed * n_mb
        parts["dp interference"] = slowed * n_mb

    step_s = sum(parts.values())
    world = tp * up * dp
    mfu = model_flops_per_token(cfg, seq) * batch * seq / step_s / (world * hw.gemm_flops)
    mem = step_memory(cfg, tp, up, dp, seq, mb, parallel.method, setup, dtype_bytes,
                      hw.memory_gib, step_model, ep, ep_axis)
    return TrainStepResult(step_s, batch * seq, world, mfu, mem, parts, base, setup)
