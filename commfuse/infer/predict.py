"""The simulator's prediction of a prefill and of a decode step (`commfuse.sim`'s op timer on
the blocks' ops of a forward, as `commfuse.sim.step.simulate_step` builds them).

Prefill of S tokens is the blocks' forward over S rows (the fused ops, the attention GEMMs),
the head once (one token per sequence). A decode step is the same ops over B rows (the new
tokens), its attention B x H query rows against ``context`` keys, and the head. What is not
modelled: norms, RoPE, the cache writes, sampling and Python overhead (the measured times
include them), and the one small all-reduce of the last hidden states.
"""

from __future__ import annotations

from commfuse.models.config import LlamaConfig
from commfuse.sim.model_ops import StepOp, block_ops
from commfuse.sim.step import OpTimer


def _blocks_s(cfg: LlamaConfig, tp: int, method: str, rows: int, hw, dtype_bytes: float,
              attention: StepOp | None = None, timer: OpTimer | None = None) -> float:
    timer = timer or OpTimer(dtype_bytes)
    fwd, _ = block_ops(cfg, tp, 1, 1, rows, 1, backward=False, dtype_bytes=dtype_bytes)
    total = 0.0
    for op in fwd:
        if attention is not None and op.name == "attention":
            op = attention
        total += timer.time(op, method, {}, tp if op.axis == "tp" else 1, hw)[0] * op.count
    head = StepOp("head", "gemm", "local", (1, cfg.dim, cfg.vocab_size))
    return cfg.n_layers * total + timer.time(head, method, {}, 1, hw)[0]


def prefill_s(cfg: LlamaConfig, tp: int, method: str, prompt_tokens: int, hw,
              dtype_bytes: float = 4, timer: OpTimer | None = None) -> float:
    """Predicted seconds of the prefill of one prompt of ``prompt_tokens`` tokens."""
    return _blocks_s(cfg, tp, method, prompt_tokens, hw, dtype_bytes, timer=timer)


def decode_s(cfg: LlamaConfig, tp: int, method: str, batch: int, context: int, hw,
             dtype_bytes: float = 4, timer: OpTimer | None = None) -> float:
    """Predicted seconds of one decode step of ``batch`` sequences of ``context`` tokens."""
    attn = StepOp("attention", "gemm", "local", (1, cfg.head_dim, context),
                  2 * batch * cfg.n_heads / tp)  # q @ k^T and p @ v per query row
    return _blocks_s(cfg, tp, method, batch, hw, dtype_bytes, attn, timer)
