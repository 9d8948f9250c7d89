"""The four fused ops by name: their public functions, one way to call them, their shapes.

The demo, the benchmarks, the GPU check and the tests run every op of `commfuse.schedule.OPS`
by name; this is the one place that knows how the ops' signatures differ. Shapes, with s the
rows of this rank's slice of the sequence, S the whole sequence (the sum of the slices), W ranks:

==========  =============================================  ======  ========  ======  ===========
op          public call                                    A       B         output  layer
==========  =============================================  ======  ========  ======  ===========
ag_matmul   fused_all_gather_matmul(A, [B], dim)           [s, k]  [k, n]    [S, n]  TPSP FC1
matmul_rs   fused_matmul_reduce_scatter(A, B, "sum", dim)  [S, k]  [k, n]    [s, n]  TPSP FC2
matmul_a2a  fused_matmul_all_to_all(A, B, seq_dim=dim)     [s, k]  [k, W*n]  [S, n]  Ulysses QKV
a2a_matmul  fused_all_to_all_matmul(A, B, seq_dim=dim)     [S, k]  [W*k, n]  [s, n]  Ulysses out
==========  =============================================  ======  ========  ======  ===========

``dim``, the gathered, scattered or sequence dim, may be any dim of A but the last; the table
shows A as 2-D. ag_matmul takes any number of Bs and returns (A, [A @ B for each B]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from commfuse.ops import fused
from commfuse.schedule import OPS

# The basic variant of each method (labels of `commfuse.schedule.VARIANTS`): what the demo and
# the GPU check show.
BASIC_VARIANTS = ("none", "sliced", "decompose", "commfuse", "commfuse-direct")


@dataclass(frozen=True)
class Op:
    """One fused op: its public function and how its arguments differ from the others'."""

    name: str
    function: Callable
    whole_input: bool  # A holds the whole sequence, the output this rank's slice (sizes
    # default to even_sizes of the whole); else A is this rank's slice, the output the whole
    replicated_b: bool  # B is the whole weight on every rank (Ulysses); else this rank's shard


REGISTRY: dict[str, Op] = {op.name: op for op in (
    Op("ag_matmul", fused.fused_all_gather_matmul, whole_input=False, replicated_b=False),
    Op("matmul_rs", fused.fused_matmul_reduce_scatter, whole_input=True, replicated_b=False),
    Op("matmul_a2a", fused.fused_matmul_all_to_all, whole_input=False, replicated_b=True),
    Op("a2a_matmul", fused.fused_all_to_all_matmul, whole_input=True, replicated_b=True),
)}
assert tuple(REGISTRY) == OPS


def get(name: str) -> Op:
    if name not in REGISTRY:
        raise ValueError(f"op must be one of {OPS}, got {name!r}")
    return REGISTRY[name]


def outputs(name: str, a: torch.Tensor, bs: Sequence[torch.Tensor], method: str = "commfuse",
            opts: dict | None = None, *, dim: int = 0, group=None, reduce_op: str = "sum",
            return_A: bool = True, **kw) -> list[torch.Tensor]:
    """Every output of op ``name`` on ``a`` and ``bs``: ``[A, *Ys]`` for ag_matmul (``[*Ys]``
    without ``return_A``), which takes any number of Bs; ``[output]`` for the others, which
    take one. ``dim`` is the gathered/scattered/sequence dim; ``reduce_op`` is matmul_rs's;
    ``opts`` and ``kw`` (``timeout``, ``sizes``, ...) go to the op as keywords."""
    fn, kw = get(name).function, dict(method=method, **(opts or {}), **kw)
    if name == "ag_matmul":
        a_full, ys = fn(a, list(bs), dim, group, return_A=return_A, **kw)
        return [a_full, *ys] if return_A else ys
    (b,) = bs
    if name == "matmul_rs":
        return [fn(a, b, reduce_op, dim, group, **kw)]
    return [fn(a, b, group, seq_dim=dim, **kw)]


def call(name: str, a: torch.Tensor, b: torch.Tensor, method: str = "commfuse",
         opts: dict | None = None, **kw) -> torch.Tensor:
    """Op ``name``'s one output, ``(collective and) A @ B``, whatever its signature; keywords
    as in `outputs`."""
    return outputs(name, a, [b], method, opts, return_A=False, **kw)[0]


def a_rows(name: str, sizes: Sequence[int], rank: int) -> int:
    """Rows of ``rank``'s A along the sequence dim, given every rank's slice ``sizes``."""
    return sum(sizes) if get(name).whole_input else sizes[rank]


def b_shape(name: str, world: int, k: int, n: int) -> tuple[int, int]:
    """B's shape for A's last dim ``k`` and ``n`` columns of output (see the table)."""
    if not get(name).replicated_b:
        return k, n
    return (k, world * n) if name == "matmul_a2a" else (world * k, n)


def layer_shapes(name: str, world: int, seq: int, d: int,
                 ffn: int | None = None) -> tuple[tuple[int, ...], ...]:
    """(A, B) of op ``name`` in its layer (the table's last column) of a model of width ``d``
    over ``seq`` tokens (batch folded in) on ``world`` ranks: MLP hidden width ``ffn``
    (default 4d; the AG->GEMM and GEMM->RS ops), QKV 3d."""
    s, h = seq // world, (ffn or 4 * d) // world
    shapes = {"ag_matmul": ((s, d), (d, h)), "matmul_rs": ((seq, h), (h, d)),
              "matmul_a2a": ((s, d), (d, 3 * d)), "a2a_matmul": ((seq, d // world), (d, d))}
    return shapes[get(name).name]
