"""Attention under TPSP: each rank runs the whole sequence of its heads.

On T ranks with H query heads and G kv heads, rank r holds query heads
``[r H/T, (r+1) H/T)`` and kv heads ``[r G/T, (r+1) G/T)``, or, when G < T, the one kv head
its query heads read, replicated on the T/G ranks that share it (`FusedColwiseParallel`
``replicas``). `local_heads` tells the attention module these counts (its head attributes,
and a `LocalHeads` view of its config for code that reads the config's head counts, such as
Phi-3's split of its packed q|k|v). Packed projections hold whole heads per rank:
`packed_qkv_rows` (q|k|v) and `halves_rows` (gate|up) give the rows each rank owns;
`unpack_rows` puts a full parameter back in the model's layout (checkpoints, tests), for these
and for the mixers' assembled weights (`AssembledRows`: Mamba-2's and Gated DeltaNet's
in_proj / conv1d).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


KV = ("k_proj", "v_proj")


class LocalHeads:
    """A model config as one rank's attention sees it: ``num_attention_heads`` and
    ``num_key_value_heads`` this rank's; every other attribute read from (and written to)
    the model's config."""

    def __init__(self, config, heads: int, kv_heads: int):
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "num_attention_heads", heads)
        object.__setattr__(self, "num_key_value_heads", kv_heads)

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "_config":  # copy / pickle probe the bare object
            raise AttributeError(name)
        return getattr(self._config, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._config, name, value)


def head_counts(cfg) -> tuple[int, int]:
    """(H, G): query and kv heads of the model config ``cfg``."""
    H = cfg.num_attention_heads
    return H, getattr(cfg, "num_key_value_heads", None) or H


def head_problems(cfg, T: int) -> list[str]:
    """Why the config's heads cannot be split over ``T`` ranks (empty when they can)."""
    H, G = head_counts(cfg)
    problems = []
    if H % T:
        problems.append(f"num_attention_heads ({H}) must be divisible by the TP size ({T})")
    if G % T and T % G:
        problems.append(f"num_key_value_heads ({G}) and the TP size ({T}) must divide one "
                        f"another (kv heads are split, or replicated when fewer than ranks)")
    return problems


def module_heads(attn: nn.Module | None, cfg) -> tuple[int, int]:
    """(H, G) of the attention module ``attn``: the config's, its kv heads read from its own
    ``num_key_value_groups`` where it keeps one (MiMo-V2-Flash's sliding layers hold twice
    the config's kv heads)."""
    H, G = head_counts(cfg)
    groups = getattr(attn, "num_key_value_groups", None)
    if isinstance(groups, int) and groups > 0 and H % groups == 0:
        G = H // groups
    return H, G


def kv_replicas(cfg, T: int, attn: nn.Module | None = None) -> int:
    """Ranks that hold each kv head (1 when G >= T) of ``attn`` (`module_heads`)."""
    _, G = module_heads(attn, cfg)
    return T // G if G < T else 1


# an attention's children that read heads beyond this rank's, parameters or not (Kolibri
# 1.1's sparse-attention indexer scores the first query heads against kv head 0)
CROSS_HEAD = ("indexer",)


def attention_problems(attn: nn.Module, where: str, cfg, T: int) -> list[str]:
    """Why the attention ``attn`` (named ``where``) cannot be split over ``T`` ranks."""
    _, G = module_heads(attn, cfg)
    problems = [f"{where}.{n}: a sparse-attention indexer that reads heads across the ranks' "
                f"split (not built)" for n, _ in attn.named_children() if n in CROSS_HEAD]
    if G % T and T % G:
        problems.append(f"{where}: {G} kv heads and the TP size ({T}) must divide one another")
    return problems


def local_heads(attn: nn.Module, cfg, T: int) -> None:
    """Set ``attn``'s head counts to this rank's (H/T query heads over max(G/T, 1) kv heads,
    `module_heads`): the integer attributes it has, and its config as a `LocalHeads` view."""
    H, G = module_heads(attn, cfg)
    h, g = H // T, max(G // T, 1)
    for name, n in (("num_heads", h), ("num_attention_heads", h), ("num_key_value_heads", g),
                    ("num_key_value_groups", h // g)):
        if isinstance(getattr(attn, name, None), int):
            setattr(attn, name, n)
    if getattr(attn, "config", None) is not None and not isinstance(attn.config, LocalHeads):
        attn.config = LocalHeads(attn.config, h, g)


def packed_qkv_rows(cfg, head_dim: int, T: int) -> torch.Tensor:
    """The rows of a packed ``[q | k | v]`` projection each rank owns, in rank order: its
    query heads' rows, then its kv heads' (G divisible by T)."""
    H, G = head_counts(cfg)
    q, kv = H // T * head_dim, G // T * head_dim
    return torch.cat([torch.cat([torch.arange(r * q, (r + 1) * q),
                                 H * head_dim + torch.arange(r * kv, (r + 1) * kv),
                                 (H + G) * head_dim + torch.arange(r * kv, (r + 1) * kv)])
                      for r in range(T)])


def halves_rows(n: int, T: int) -> torch.Tensor:
    """The rows of a packed ``[gate | up]`` projection (``n`` rows, two equal halves) each
    rank owns, in rank order: its gate rows, then the matching up rows."""
    f = n // 2 // T
    return torch.cat([torch.cat([torch.arange(r * f, (r + 1) * f),
                                 n // 2 + torch.arange(r * f, (r + 1) * f)]) for r in range(T)])


@dataclass(frozen=True)
class AssembledRows:
    """A parameter held as ``Shard(0)`` of ``W[rows]``: ``rows`` the model rows of every rank in
    rank order, a row repeated where ranks share it (a mixer's replicated groups / key heads);
    what `unpack_rows` reads from a module's ``_commfuse_rows``."""

    rows: torch.Tensor
    replicas: int = 1


def unpack_rows(style, t: torch.Tensor, world: int) -> torch.Tensor:
    """A full parameter of a module sharded by ``style`` (a `FusedColwiseParallel`,
    `SplitDimNorm` or `AssembledRows`; ``t``: its ``full_tensor()``) in the model's row order:
    one copy of each replicated block or row, packed / assembled rows put back."""
    if style.replicas > 1:  # blocks b0 b0 b1 b1 .. (k copies each): one of each
        t = t.reshape(world, -1, *t.shape[1:])[::style.replicas].flatten(0, 1)
    if style.rows is not None:  # copies of a repeated row are equal: any one is kept
        out = t.new_empty((int(style.rows.max()) + 1, *t.shape[1:]))
        out[style.rows] = t
        t = out
    return t
