"""Sampling and the generation loop: prefill once, then one decode step per new token.

Every rank of the TP group holds bitwise the same logits (`InferenceLlama`), so sampling with
a generator seeded alike on every rank picks the same token everywhere, with no broadcast.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from the logits."""

    temperature: float = 0.0
    """0: greedy (argmax); otherwise logits / temperature, softmax, then sample."""
    top_k: int = 0
    """Sample only among the k most likely tokens (0: all)."""
    top_p: float = 1.0
    """Sample only among the most likely tokens whose probabilities sum to top_p (nucleus)."""
    seed: int = 0
    """Seed of the sampling generator (the same on every rank, so every rank samples alike)."""

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")


def sample(logits_BV: torch.Tensor, how: Sampling, gen: torch.Generator | None) -> torch.Tensor:
    """The next token [B] of each row of ``logits_BV`` (float32 math)."""
    logits = logits_BV.float()
    if how.temperature == 0:
        return logits.argmax(-1)
    logits = logits / how.temperature
    if how.top_k:
        kth = logits.topk(min(how.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if how.top_p < 1:
        sorted_, order = logits.sort(dim=-1, descending=True)
        probs = sorted_.softmax(-1)
        drop = probs.cumsum(-1) - probs >= how.top_p  # the mass before a token already suffices
        logits = logits.scatter(-1, order, sorted_.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=gen).squeeze(-1)


def pad_prompts(prompts: Sequence[Sequence[int]], pad: int = 0):
    """Right-padded tokens [B, S] and lengths [B] of prompts of any lengths (each >= 1)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    S = max(len(p) for p in prompts)
    tokens_BS = torch.full((len(prompts), S), pad, dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens_BS[b, :len(p)] = torch.as_tensor(list(p), dtype=torch.long)
    return tokens_BS, torch.tensor([len(p) for p in prompts])


@dataclass
class Timings:
    """Wall-clock seconds of one `generate` call."""

    prefill_s: float = 0.0
    """The prefill forward (prompts into the cache, logits of the first new token)."""
    first_token_s: float = 0.0
    """From the call to the first new token chosen (prefill + sampling): time to first token."""
    decode_s: float = 0.0
    """Every decode step after the first token."""
    decode_tokens: int = 0
    """Tokens the decode steps produced, per sequence."""

    @property
    def decode_tokens_per_s(self) -> float:
        """New tokens per second and sequence while decoding."""
        return self.decode_tokens / self.decode_s if self.decode_s else float("nan")


def generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             how: Sampling = Sampling(), on_token: Callable[[torch.Tensor], None] | None = None,
             timings: Timings | None = None) -> list[list[int]]:
    """The ``max_new_tokens`` tokens that follow each prompt (an `InferenceLlama` on every rank
    of its group, the same prompts and ``how`` everywhere). ``on_token(tokens_B)`` is called as
    each step's tokens are chosen (to stream them)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens!r}")
    device = model.tok_emb.weight.device
    tokens_BS, lengths_B = pad_prompts(prompts)
    gen = torch.Generator(device=device).manual_seed(how.seed)
    t = timings if timings is not None else Timings()
    t0 = time.perf_counter()
    cache = model.new_cache(len(prompts), int(lengths_B.max()) + max_new_tokens - 1)
    logits_BV = model.prefill(tokens_BS.to(device), lengths_B.to(device), cache)
    t.prefill_s = time.perf_counter() - t0
    out = [sample(logits_BV, how, gen)]
    t.first_token_s = time.perf_counter() - t0
    if on_token is not None:
        on_token(out[-1])
    t1 = time.perf_counter()
    for _ in range(max_new_tokens - 1):
        out.append(sample(model.decode(out[-1], cache), how, gen))
        if on_token is not None:
            on_token(out[-1])
    t.decode_s, t.decode_tokens = time.perf_counter() - t1, max_new_tokens - 1
    return torch.stack(out, 1).tolist()
