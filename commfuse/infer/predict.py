"""The simulator's prediction of a prefill and of a decode step (`commfuse.sim`'s op timer on
the blocks' ops of a forward, as `commfuse.sim.step.timing.simulate_step` builds them), and decode's choice between the fused ops and
replicated rows with all-reduces (`decode_choice`).

Prefill of S tokens is the blocks' forward over S rows (the fused ops, the attention GEMMs),
the head once (one token per sequence). A decode step is the same ops over B rows (the new
tokens), its attention B x H query rows against ``context`` keys, and the head. Each block's
memory-bound kernels (norms, RoPE, SwiGLU, residual adds) are timed as the training step's
model times them (`commfuse.sim.step.work.block_elementwise_bytes` over the preset's memory
bandwidth), on the rank's share of the tokens. What is not modelled: the cache writes,
sampling and Python overhead (the measured times include them), and the one small
all-reduce of the last hidden states.

The interleaved prefill (`interleaved_prefill_s`, ``prefill_chunks`` n > 1) is timed as it
runs: each chunk's stages in order (per block all-gather, q|k|v + attention + out-proj,
reduce-scatter, all-gather, gate|up + down, reduce-scatter; on 2 ranks q|k|v + attention +
out-proj, all-reduce, gate|up + down, all-reduce), the chunks resumed in turn as
`commfuse.infer.interleave.prefill` does, on one compute lane and one link that carries
one collective at a time (gloo sends to a peer in order); compute runs at 1 / (1 +
`Hardware.interference`) of its speed while the link is busy, and each collective's launch
costs `Hardware.host_collective_s` of host time, as in the op simulator.
"""

from __future__ import annotations

from commfuse.models.config import LlamaConfig
from commfuse.sim.attention import attention_s
from commfuse.sim.step.ops import StepOp, block_ops
from commfuse.sim.step.timing import OpTimer
from commfuse.sim.step.work import block_elementwise_bytes, block_width_bytes, mem_time


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


CHUNK_CANDIDATES = (2, 3, 4)  # the interleaved prefill's chunk counts `prefill_choice` times


def interleaved_prefill_s(cfg: LlamaConfig, tp: int, prompt_tokens: int, chunks: int, hw,
                          dtype_bytes: float = 4, batch: int = 1) -> float:
    """Predicted seconds of the prefill of ``batch`` prompts of ``prompt_tokens`` tokens
    interleaved in ``chunks`` chunks (module doc)."""
    from commfuse.infer.interleave import chunk_bounds, replicated

    D, K, F, H = cfg.dim, cfg.head_dim, cfg.ffn_hidden, cfg.n_heads
    qkv = (H + 2 * cfg.n_kv_heads) * K // tp
    bounds, rep = chunk_bounds(prompt_tokens, chunks), replicated(tp)
    stages = []  # per chunk: compute, then (transfer, compute) per collective
    for a, b in zip(bounds, bounds[1:]):
        rows = batch * (b - a)
        half = _elementwise_s(cfg, rows / tp, hw, dtype_bytes) / cfg.n_layers / 2
        if rep:  # the norms and residual adds over all rows, not rows / T
            half += mem_time(hw, block_width_bytes(cfg, dtype_bytes) * rows * (1 - 1 / tp)) / 2
        attn = hw.gemm_time(rows, D, qkv) + hw.gemm_time(rows, H * K // tp, D) + half + \
            attention_s(hw, range(a, b), batch * H / tp, K)
        mlp = hw.gemm_time(rows, D, 2 * F // tp) + hw.gemm_time(rows, F // tp, D) + half
        if rep:  # an all-reduce after out-proj and down: my partial to the peer
            move = hw.collective_time("all_gather", tp * rows * D * dtype_bytes, tp)
            block = (attn, move, mlp, move)
        else:  # all-gather, reduce-scatter of the chunk's rows, twice
            move = hw.collective_time("all_gather", rows * D * dtype_bytes, tp)
            block = (move, attn, move, 0.0, move, mlp, move, 0.0)
        # compute first and last, a transfer between each two
        stages.append(list(block) * cfg.n_layers + [0.0] if rep else
                      [0.0] + list(block) * cfg.n_layers)
    now = link = 0.0
    ready = [0.0] * chunks
    at = [0] * chunks  # the index of each chunk's next stage
    busy: list[list[float]] = []  # the link's busy intervals, in order (merged)
    first = 0  # the first of them that ends after ``now`` (compute never starts before it)
    slow = 1.0 / (1.0 + hw.interference)  # compute's speed while a transfer runs

    def compute(t: float, work: float) -> float:  # when ``work`` started at t is done
        for s, e in busy[first:]:
            if e <= t:
                continue
            if s > t:
                if work <= s - t:
                    return t + work
                work, t = work - (s - t), s
            if work <= (e - t) * slow:
                return t + work / slow
            work, t = work - (e - t) * slow, e
        return t + work

    def run(c: int) -> None:  # compute the next stage, then post the transfer after it
        nonlocal now, link, first
        now = compute(max(now, ready[c]), stages[c][at[c]])
        while first < len(busy) and busy[first][1] <= now:
            first += 1
        if at[c] + 1 < len(stages[c]):
            now += hw.host_collective_s  # the launch's host time, as the op simulator's
            start = max(now, link)
            link = start + stages[c][at[c] + 1]
            if busy and busy[-1][1] >= start:
                busy[-1][1] = link
            else:
                busy.append([start, link])
            ready[c] = link
        at[c] += 2

    for c in range(chunks):
        run(c)
    while any(i < len(st) for i, st in zip(at, stages)):
        for c in range(chunks):
            if at[c] < len(stages[c]):
                run(c)
    head = hw.gemm_time(batch, D, cfg.vocab_size)
    return now + head


def best_chunks(cfg: LlamaConfig, tp: int, prompt_tokens: int, batch: int, hw,
                dtype_bytes: float) -> tuple[int, float]:
    """(chunks, predicted s) of the fastest interleaved prefill among `CHUNK_CANDIDATES`
    whose chunks give every rank rows ((1, inf) if none does)."""
    key = (repr(cfg), tp, prompt_tokens, batch, repr(hw), dtype_bytes)
    if key not in _BEST:
        times = {n: interleaved_prefill_s(cfg, tp, prompt_tokens, n, hw, dtype_bytes, batch)
                 for n in CHUNK_CANDIDATES if tp > 1 and prompt_tokens // n >= tp}
        n = min(times, key=times.get) if times else 1
        _BEST[key] = (n, times[n]) if times else (1, float("inf"))
    return _BEST[key]


_BEST: dict[tuple, tuple[int, float]] = {}


_PREFILL: dict[tuple, int] = {}


def prefill_choice(cfg: LlamaConfig, tp: int, prompt_tokens: int, batch: int, hw,
                   dtype_bytes: float, query_split: bool = False) -> int:
    """The chunk count the model predicts fastest for a prefill: 1 (the fused ops under
    "auto", with ``query_split`` as given) or `best_chunks`'s (a function of what every
    rank shares)."""
    key = (repr(cfg), tp, prompt_tokens, batch, repr(hw), dtype_bytes, query_split)
    if key not in _PREFILL:
        fused = prefill_s(cfg, tp, "auto", prompt_tokens, hw, dtype_bytes, batch=batch,
                          query_split=query_split)
        n, t = best_chunks(cfg, tp, prompt_tokens, batch, hw, dtype_bytes)
        _PREFILL[key] = n if t < fused else 1
    return _PREFILL[key]


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
