"""The simulator's prediction of a prefill and of a decode step (`commfuse.sim`'s op timer on
the blocks' ops of a forward, as `commfuse.sim.step.simulate_step` builds them), and decode's choice between the fused ops and
replicated rows with all-reduces (`decode_choice`).

Prefill of S tokens is the blocks' forward over S rows (the fused ops, the attention GEMMs),
the head once (one token per sequence). A decode step is the same ops over B rows (the new
tokens), its attention B x H query rows against ``context`` keys, and the head. Each block's
memory-bound kernels (norms, RoPE, SwiGLU, residual adds) are timed as the training step's
model times them (`commfuse.sim.work.block_elementwise_bytes` over the preset's memory
bandwidth), on the rank's share of the tokens. What is not modelled: the cache writes,
sampling and Python overhead (the measured times include them), and the one small
all-reduce of the last hidden states.
"""

from __future__ import annotations

from commfuse.models.config import LlamaConfig
from commfuse.sim.model_ops import StepOp, block_ops
from commfuse.sim.step import OpTimer
from commfuse.sim.work import block_elementwise_bytes, mem_time


def _elementwise_s(cfg: LlamaConfig, tokens: float, hw, dtype_bytes: float) -> float:
    """Seconds of every block's memory-bound kernels over ``tokens`` tokens on one rank."""
    return cfg.n_layers * mem_time(hw, block_elementwise_bytes(cfg, dtype_bytes) * tokens)


def _blocks_s(cfg: LlamaConfig, tp: int, method: str, seq: int, hw, dtype_bytes: float,
              attention: StepOp | None = None, timer: OpTimer | None = None, batch: int = 1,
              query_split: bool = False) -> float:
    timer = timer or OpTimer(dtype_bytes)
    fwd, _ = block_ops(cfg, tp, 1, 1, seq, batch, backward=False, dtype_bytes=dtype_bytes,
                       query_split=query_split and tp > 1)
    total = 0.0
    for op in fwd:
        if attention is not None and op.name == "attention":
            op = attention
        total += timer.time(op, method, {}, tp if op.axis == "tp" else 1, hw)[0] * op.count
    head = StepOp("head", "gemm", "local", (batch, cfg.dim, cfg.vocab_size))
    return (cfg.n_layers * total + timer.time(head, method, {}, 1, hw)[0]
            + _elementwise_s(cfg, batch * seq / tp, hw, dtype_bytes))


def prefill_s(cfg: LlamaConfig, tp: int, method: str, prompt_tokens: int, hw,
              dtype_bytes: float = 4, timer: OpTimer | None = None, batch: int = 1,
              query_split: bool = False) -> float:
    """Predicted seconds of the prefill of ``batch`` prompts of ``prompt_tokens`` tokens;
    ``query_split``: attention inside the out-projection's reduce-scatter ring."""
    return _blocks_s(cfg, tp, method, prompt_tokens, hw, dtype_bytes, timer=timer, batch=batch,
                     query_split=query_split)


def decode_s(cfg: LlamaConfig, tp: int, method: str, batch: int, context: int, hw,
             dtype_bytes: float = 4, timer: OpTimer | None = None) -> float:
    """Predicted seconds of one decode step of ``batch`` sequences of ``context`` tokens;
    ``method`` "allreduce": replicated rows, local GEMMs, two all-reduces per block (each an all-gather
    of the partial sums, as `InferenceLlama._all_reduce` runs it)."""
    attn = StepOp("attention", "gemm", "local", (1, cfg.head_dim, context),
                  2 * batch * cfg.n_heads / tp)  # q @ k^T and p @ v per query row
    if method != "allreduce" or tp == 1:
        return _blocks_s(cfg, tp, method, batch, hw, dtype_bytes, attn, timer)
    timer = timer or OpTimer(dtype_bytes)
    D, K, F = cfg.dim, cfg.head_dim, cfg.ffn_hidden
    ops = [StepOp("q|k|v", "gemm", "local", (batch, D, (cfg.n_heads + 2 * cfg.n_kv_heads) * K
                                             // tp)), attn,
           StepOp("out-proj", "gemm", "local", (batch, cfg.n_heads * K // tp, D)),
           StepOp("gate|up", "gemm", "local", (batch, D, 2 * F // tp)),
           StepOp("down", "gemm", "local", (batch, F // tp, D)),
           StepOp("all-reduce", "all_gather", "tp", (tp * batch * D * dtype_bytes,), 2)]
    block = sum(timer.time(op, "none", {}, tp if op.axis == "tp" else 1, hw)[0] * op.count
                for op in ops)
    head = StepOp("head", "gemm", "local", (batch, D, cfg.vocab_size))
    return (cfg.n_layers * block + timer.time(head, "none", {}, 1, hw)[0]
            + _elementwise_s(cfg, batch, hw, dtype_bytes))  # every rank all B rows


_CHOICES: dict[tuple, str] = {}


def decode_choice(cfg: LlamaConfig, tp: int, batch: int, hw, dtype_bytes: float) -> str:
    """"allreduce" or "auto" (the fused ops, each on auto's pick): whichever decode step of
    ``batch`` rows the model predicts faster (a function of what every rank shares)."""
    key = (repr(cfg), tp, batch, repr(hw), dtype_bytes)
    if key not in _CHOICES:
        fused, rep = (decode_s(cfg, tp, m, batch, 1, hw, dtype_bytes)
                      for m in ("auto", "allreduce"))
        _CHOICES[key] = "allreduce" if rep <= fused else "auto"
    return _CHOICES[key]
