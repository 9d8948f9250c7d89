"""Peak device memory of one rank in a training step: `step_memory`.

    from commfuse.sim.step.memory import step_memory
    m = step_memory("8b", tp=1, up=1, dp=8, seq=8192, mb=2)
    m.peak_gib, m.parts  # GiB; bytes per part

What a rank holds (bytes; ``a`` per activation element, `TrainSetup` for the rest; ``n``
tokens per micro-batch on the DP replica, ``nl = n / T`` of them on the rank between blocks,
T = tp * up):

- **model state**: its parameters x (param_bytes + grad_bytes + optimizer_bytes). Block
  matmul weights are sharded over tp (TPSP) and over dp (ZeRO-3 / FSDP); the head's and the
  embedding's rows over T when vocabulary-parallel, and over dp under FSDP (the head also
  under ZeRO-3 unless tied); norms are replicated except under FSDP. The gradient shards
  are counted although the step frees them before its forward (``zero_grad``): the caching
  allocator keeps their blocks, which are smaller than the activations that follow and so
  are not reused.
- **activations** kept for the backward by every block (`commfuse.sim.step.work.block_saved_bytes`
  under the AC mode) on the rank's ``nl`` tokens, plus the final norm's (float32 input and
  normed output).
- **gathered weights** (FSDP, `fsdp_gathered_bytes`): the root's (embedding and head, kept
  from forward to backward) and two blocks' unsharded weights at TP-local size: the one
  running and the next one, prefetched (torchtitan also keeps the last block gathered from
  its forward to its backward, the same count).

Then the larger of two phases, which never overlap:

- **the loss** (`loss_bytes`): the cross-entropy's float32 logits. Vocabulary-parallel (T >
  1), as torch's ``loss_parallel`` runs it under torchtitan: 16 B per logit of the rank's
  n x V/T, in its fused backward (the saved log-softmax, the one-hot scatter, exp and their
  sum; its forward holds 14: the bf16 logits, the float32 copy, the shifted logits and
  their exp), plus the head's input gathered over the sequence (n x D, saved by its
  column-parallel GEMM). Otherwise 12 B per logit (the saved log-softmax, the NLL's
  gradient and the log-softmax's gradient) on n x V / T. (This repository's
  `commfuse.parallel.vocab` cross-entropy holds 14 B per logit in its forward and does not
  save the gathered input: the term is an upper bound for it.)
- **one block's backward** (`block_backward_bytes`): its activations recomputed (the
  "none" amount, under AC) at TP-local size; under TP the two gathered sequences its
  column-parallel GEMMs (q|k|v, gate|up) saved for their weight gradients (n x D each: the
  recompute runs them again; this repository's AG->GEMM saves its shard and gathers it
  again, one at a time, so the term is an upper bound for it); the input and weight
  gradients; under FSDP the float32 copy of the block's gradients that the reduce-scatter
  sends; and the running op's buffer (**op buffers**, the README's table: AG->GEMM the
  gathered operand; GEMM->RS (2W-1) partial outputs, (W+1) for the ring schedules;
  all-to-all the exchanged blocks).

Allocated = model state + activations + gathered weights + max(loss, block backward + op
buffers). **Allocator reserve**: what torch's caching allocator holds beyond that, because
freed blocks of one phase's sizes cannot serve the next phase's requests (torch's
``max_memory_reserved``, which torchtitan reports, counts them). `ALLOCATOR_RESERVE` is the
share of reserved memory left unallocated: peak = allocated / (1 - ALLOCATOR_RESERVE).
Not counted: the CUDA context and NCCL's buffers (outside torch's allocator), pipeline
parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

from commfuse.sim.step import work
from commfuse.sim.step.arch import expert_groups, is_hybrid, sublayers
from commfuse.sim.step.ops import CURRENT, StepModel, model_config

GIB = 2 ** 30
# Bytes per logit the cross-entropy holds at its peak (module doc): plain (log_softmax then
# nll_loss, float32), and torch's vocabulary-parallel loss_parallel (its fused backward).
LOSS_BYTES_PER_LOGIT = 12
LOSS_PARALLEL_BYTES_PER_LOGIT = 16
# Share of torch's reserved memory that the caching allocator holds unallocated at the peak
# (fragmentation: freed blocks of one phase's sizes that the next phase's requests do not
# fit). GMLake (Guo et al., ASPLOS 2024, arXiv 2401.08156), training eight LLMs on
# A100-80GB, reduced the caching allocator's fragmentation by 15 % on average (up to 33 %)
# by stitching free blocks; taken from there, not fitted to docs/planning.md's rows
# (torchtitan's 8B rows alone would call for 0.12-0.13).
ALLOCATOR_RESERVE = 0.15


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per part and the peak of one rank (module doc)."""

    parts: dict  # name -> bytes: params, grads, optimizer, activations, gathered weights,
    #              loss, block backward, op buffers, allocator reserve
    peak_bytes: float
    capacity_gib: float  # the device's (0: unknown)

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    @property
    def allocated_bytes(self) -> float:
        """The peak without the allocator's reserve (what ``max_memory_allocated`` reads)."""
        return self.peak_bytes - self.parts["allocator reserve"]

    @property
    def fits(self) -> bool:
        return not self.capacity_gib or self.peak_gib <= self.capacity_gib


def rank_params(cfg, tp: int, up: int, dp: int, setup: work.TrainSetup,
                sm: StepModel = CURRENT, ep: int = 1, ep_axis: str = "dp") -> float:
    """Parameters one rank keeps (module doc); an MoE layer's routed experts E/ep of them,
    sharded over the other dp/ep ranks (all dp ranks with ``ep_axis="tp"``)."""
    edp = expert_groups(tp, dp, ep, ep_axis)[3] if dp % ep == 0 or ep_axis == "tp" else dp
    D, V = cfg.dim, cfg.vocab_size
    T = tp * up
    vocab_t = T if sm.vocab_parallel and T > 1 else 1
    emb = V * D / vocab_t / (dp if setup.fsdp else 1)
    head = 0.0 if cfg.tie_embeddings else V * D / vocab_t / dp
    norms = (sublayer_norms(cfg) + 1) * D / (dp if setup.fsdp else 1)
    layers = 0.0
    for g, count in _kinds(cfg):
        dense, expert = work.rank_weights(cfg, g, tp, ep)
        layers += count * (dense / dp + expert / edp)
    return layers + emb + head + norms


def _kinds(cfg) -> list[tuple[str, int]]:
    """(kind, layers) of ``cfg``: ("block", n_layers), or a hybrid's pattern characters."""
    if not is_hybrid(cfg):
        return [("block", cfg.n_layers)]
    s = sublayers(cfg)
    return [(k, s.count(k)) for k in "*-EM" if k in s]


def sublayer_norms(cfg) -> int:
    """The layers' RMSNorms: two per Llama block, one per hybrid sub-layer."""
    return len(sublayers(cfg)) if is_hybrid(cfg) else 2 * cfg.n_layers


def _op_buffer(op, world: int, method: str, a: float) -> float:
    """Extra bytes of one fused op (README: memory per forward call), or the weight a plain
    all-gather builds."""
    if op.kind == "all_gather":
        return op.shape[0]
    if op.kind not in ("ag_matmul", "matmul_rs", "matmul_a2a", "a2a_matmul"):
        return 0.0
    M, K, N = op.shape
    if op.kind == "ag_matmul":
        return M * K * a
    if op.kind == "matmul_rs":
        ring = method in ("commfuse", "decompose")
        return (world + 1 if ring else 2 * world - 1) * (M / world) * N * a
    if op.kind == "matmul_a2a":
        return 2 * M * N / world * a
    if op.kind == "a2a_matmul":
        return 2 * M * K / world * a
    return 0.0


def fsdp_gathered_bytes(cfg, tp: int, up: int, a: float = 2,
                        sm: StepModel = CURRENT, ep: int = 1) -> tuple[float, float]:
    """(root, one block): bytes of the weights FSDP holds unsharded on a rank at TP-local
    size: the root's embedding and head (vocabulary rows over T when vocabulary-parallel)
    and one block's matmul weights (over tp; the largest layer kind of a hybrid, its
    experts E/ep). The peak holds the root and two blocks."""
    vocab_t = tp * up if sm.vocab_parallel and tp * up > 1 else 1
    root = cfg.vocab_size * cfg.dim / vocab_t * (1 if cfg.tie_embeddings else 2)
    block = max(sum(work.rank_weights(cfg, k, tp, ep)) for k, _ in _kinds(cfg))
    return root * a, block * a


def loss_bytes(cfg, tp: int, up: int, n: int, a: float = 2, sm: StepModel = CURRENT) -> float:
    """What the loss phase holds on a rank for ``n`` tokens (module doc): the float32 logits
    of the cross-entropy and, vocabulary-parallel, the head's gathered input."""
    T = tp * up
    if sm.vocab_parallel and T > 1:  # n x V/T logits; the head's input gathered to n x D
        return LOSS_PARALLEL_BYTES_PER_LOGIT * n * cfg.vocab_size / T + a * cfg.dim * n
    return LOSS_BYTES_PER_LOGIT * n * cfg.vocab_size / T  # n/T x V, or n x V on one rank


def block_backward_bytes(cfg, tp: int, up: int, dp: int, n: int, setup: work.TrainSetup,
                         a: float = 2, kind: str = "block", ep: int = 1) -> float:
    """What one block's (one layer of ``kind``'s) recompute and backward hold on a rank for
    ``n`` tokens, besides the running op's buffer (module doc)."""
    nl, D = n / (tp * up), cfg.dim
    block_w = sum(work.rank_weights(cfg, kind, tp, ep))
    held = work.saved_bytes(cfg, kind, "none", a) * nl if setup.ac != "none" else 0.0
    gathered = {"block": 2, "*": 1, "-": 1, "M": 1}.get(kind, 0)
    if kind == "E" and cfg.moe.shared_ffn:
        gathered = 1
    if tp > 1:  # the gathered inputs of q|k|v and gate|up, kept for their weight gradients
        held += gathered * a * D * n
    held += 2 * a * D * nl + block_w * a  # input gradients; the weight gradients (bf16)
    if setup.fsdp and dp > 1:  # the reduce-scatter's float32 copy of them
        held += block_w * setup.grad_bytes
    return held


def step_memory(model, tp: int, up: int, dp: int, seq: int, mb: int, method: str = "none",
                setup: work.TrainSetup = work.TrainSetup(), dtype_bytes: float = 2,
                capacity_gib: float = 0.0, sm: StepModel = CURRENT,
                ep: int = 1, ep_axis: str = "dp") -> MemoryEstimate:
    """Peak memory of one rank training ``model`` under (tp, up, dp) with micro-batches of
    ``mb`` sequences of ``seq`` tokens (module doc). ``method``: the fused ops' method (their
    buffers); ``capacity_gib``: the device's memory, for `MemoryEstimate.fits`; ``ep``:
    expert-parallel ranks (MoE; `commfuse.sim.step.layers`), ``ep_axis`` their group
    (`commfuse.sim.step.arch.expert_groups`)."""
    from commfuse.sim.step.layers import layer_groups

    cfg, a = model_config(model), dtype_bytes
    T, n = tp * up, mb * seq
    nl = n / T
    p = rank_params(cfg, tp, up, dp, setup, sm, ep, ep_axis)
    parts = {"params": p * setup.param_bytes, "grads": p * setup.grad_bytes,
             "optimizer": p * setup.optimizer_bytes}
    parts["activations"] = (sum(c * work.saved_bytes(cfg, k, setup.ac, a)
                                for k, c in _kinds(cfg)) + (work.F32 + a) * cfg.dim) * nl
    gathered = 0.0
    if dp > 1 and setup.fsdp and (method in ("none", "auto") or T > 1):  # FSDP's gathers
        root, block = fsdp_gathered_bytes(cfg, tp, up, a, sm, ep)
        gathered = root + 2 * block  # the running block and the next, prefetched
    parts["gathered weights"] = gathered
    parts["loss"] = loss_bytes(cfg, tp, up, n, a, sm)
    parts["block backward"] = max(block_backward_bytes(cfg, tp, up, dp, n, setup, a, k, ep)
                                  for k, _ in _kinds(cfg))
    fwd = [op for g in layer_groups(cfg, tp, up, dp, seq, mb, ep, False, a, sm, ep_axis=ep_axis)
           for op in g.fwd]
    group = {"tp": tp, "up": up, "dp": dp, "ep": ep, "edp": expert_groups(tp, dp, ep, ep_axis)[3]}
    if gathered:  # FSDP's gathers are the weights above
        group.pop("dp")
    parts["op buffers"] = max([_op_buffer(op, group[op.axis], method, a) for op in fwd
                               if op.axis in group and group[op.axis] > 1] or [0.0])
    allocated = (parts["params"] + parts["grads"] + parts["optimizer"] + parts["activations"]
                 + gathered + max(parts["loss"], parts["block backward"] + parts["op buffers"]))
    peak = allocated / (1 - ALLOCATOR_RESERVE)
    parts["allocator reserve"] = peak - allocated
    return MemoryEstimate(parts, peak, capacity_gib)
