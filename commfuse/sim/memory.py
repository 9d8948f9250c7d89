"""Peak device memory of one rank in a training step: `step_memory`.

    from commfuse.sim.memory import step_memory
    m = step_memory("8b", tp=1, up=1, dp=8, seq=8192, mb=2)
    m.peak_gib, m.parts  # GiB; bytes per part

What a rank holds (bytes; ``a`` per activation element, `TrainSetup` for the rest):

- **model state**: its parameters x (param_bytes + grad_bytes + optimizer_bytes). Block
  matmul weights are sharded over tp (TPSP) and over dp (ZeRO-3 / FSDP); the head's and the
  embedding's rows over T = tp * up when vocabulary-parallel, and over dp under FSDP (the
  head also under ZeRO-3 unless tied); norms are replicated except under FSDP. The gradient
  shards are counted although the step frees them before its forward (``zero_grad``): the
  caching allocator keeps their blocks, which are smaller than the activations that follow
  and so are not reused; the peak a framework reports (torch's ``max_memory_reserved``, which
  torchtitan's benchmarks read) includes them.
- **activations** kept for the backward by every block (`commfuse.sim.work.block_saved_bytes`
  under the AC mode) on the rank's ``nl`` tokens, plus the final norm's (float32 input and
  normed output).
- **the loss**: float32 logits on the rank (n x V / T): at the start of the backward the
  saved log-softmax, the NLL's gradient and the log-softmax's gradient, 12 bytes per logit.
- **one block's backward**, the other candidate for the peak: its activations recomputed (the
  "none" amount, under AC) and its input and weight gradients.
- **gathered weights**: under FSDP the root's (embedding and head, kept from forward to
  backward) and one block's unsharded weights (the next one's prefetched: two); under the
  fused methods the largest op's buffer of the README's table (AG->GEMM: the gathered operand;
  GEMM->RS: (2W-1) partial outputs, (W+1) for the ring schedules; all-to-all: the exchanged
  blocks).

Peak = model state + activations + max(loss, one block's backward) + gathered weights.
Not counted: the CUDA context and NCCL's buffers (outside torch's allocator), fragmentation.
"""

from __future__ import annotations

from dataclasses import dataclass

from commfuse.sim import work
from commfuse.sim.model_ops import CURRENT, StepModel, model_config

GIB = 2 ** 30


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per part and the peak of one rank (module doc)."""

    parts: dict  # name -> bytes: params, grads, optimizer, activations, loss, block backward,
    #              gathered weights, op buffers
    peak_bytes: float
    capacity_gib: float  # the device's (0: unknown)

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    @property
    def fits(self) -> bool:
        return not self.capacity_gib or self.peak_gib <= self.capacity_gib


def rank_params(cfg, tp: int, up: int, dp: int, setup: work.TrainSetup,
                sm: StepModel = CURRENT) -> float:
    """Parameters one rank keeps (module doc)."""
    L, D, V = cfg.n_layers, cfg.dim, cfg.vocab_size
    T = tp * up
    block = sum(i * o for _, i, o in work.block_linears(cfg))
    vocab_t = T if sm.vocab_parallel and T > 1 else 1
    emb = V * D / vocab_t / (dp if setup.fsdp else 1)
    head = 0.0 if cfg.tie_embeddings else V * D / vocab_t / dp
    norms = (2 * L + 1) * D / (dp if setup.fsdp else 1)
    return L * block / (tp * dp) + emb + head + norms


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


def step_memory(model, tp: int, up: int, dp: int, seq: int, mb: int, method: str = "none",
                setup: work.TrainSetup = work.TrainSetup(), dtype_bytes: float = 2,
                capacity_gib: float = 0.0, sm: StepModel = CURRENT) -> MemoryEstimate:
    """Peak memory of one rank training ``model`` under (tp, up, dp) with micro-batches of
    ``mb`` sequences of ``seq`` tokens (module doc). ``method``: the fused ops' method (their
    buffers); ``capacity_gib``: the device's memory, for `MemoryEstimate.fits`."""
    from commfuse.sim.model_ops import block_ops

    cfg, a = model_config(model), dtype_bytes
    T, n = tp * up, mb * seq
    nl = n / T
    p = rank_params(cfg, tp, up, dp, setup, sm)
    parts = {"params": p * setup.param_bytes, "grads": p * setup.grad_bytes,
             "optimizer": p * setup.optimizer_bytes}
    parts["activations"] = (cfg.n_layers * work.block_saved_bytes(cfg, setup.ac, a)
                            + (work.F32 + a) * cfg.dim) * nl
    vocab_t = T if sm.vocab_parallel and T > 1 else 1
    parts["loss"] = 12.0 * n * cfg.vocab_size / T  # vocab-parallel: n x V/T; else n/T x V
    block_w = sum(i * o for _, i, o in work.block_linears(cfg)) / tp
    recomputed = work.block_saved_bytes(cfg, "none", a) * nl if setup.ac != "none" else 0.0
    parts["block backward"] = recomputed + 2 * a * cfg.dim * nl + block_w * a
    gathered = 0.0
    if dp > 1 and setup.fsdp and (method in ("none", "auto") or T > 1):  # FSDP's gathers
        root = cfg.vocab_size * cfg.dim / vocab_t * (1 if cfg.tie_embeddings else 2)
        gathered = (root + 2 * block_w) * a
    parts["gathered weights"] = gathered
    fwd, _ = block_ops(cfg, tp, up, dp, seq, mb, False, a, sm)
    group = {"tp": tp, "up": up, "dp": dp}
    if gathered:  # FSDP's gathers are the weights above
        group.pop("dp")
    parts["op buffers"] = max([_op_buffer(op, group[op.axis], method, a) for op in fwd
                               if op.axis in group and group[op.axis] > 1] or [0.0])
    peak = (parts["params"] + parts["grads"] + parts["optimizer"] + parts["activations"]
            + max(parts["loss"], parts["block backward"]) + gathered + parts["op buffers"])
    return MemoryEstimate(parts, peak, capacity_gib)
