"""The fused ops: one module per op family, each an autograd.Function over a schedule.

    fused.py            the public ops (validated arguments, method resolution)
    methods.py          the methods and their options (pure)
    checks.py           input checks, run before any communication
    binding.py          the slot/chunk geometry the op bindings share; `execute`
    ag_matmul.py        all-gather -> GEMM schedule binding      } autograd pair:
    matmul_rs.py        GEMM -> reduce-scatter schedule binding  } gather_scatter.py
    all_to_all.py       GEMM <-> all-to-all (Ulysses), bindings and autograd
    attention.py        query-split attention (TP attention inside the RS ring)
    moe/                expert parallelism: dispatch a2a -> expert GEMM, expert GEMM ->
                        combine a2a, variable per-peer counts (its autograd Functions,
                        bindings, count exchange and grouped expert GEMMs)
    auto.py             method="auto": the cost model's choice, cached per shape
    library.py          the ops as torch.library custom ops (what torch.compile sees)
    registry.py         the ops by name: function, one way to call them, shapes (demo, bench,
                        tests)

Exports resolve lazily (PEP 562): `commfuse.ops.methods` imports without torch.
"""

from __future__ import annotations

from commfuse import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "commfuse.ops.fused": ("fused_all_gather_matmul", "fused_matmul_reduce_scatter",
                           "fused_matmul_all_to_all", "fused_all_to_all_matmul"),
    "commfuse.ops.attention": ("query_split_attention",),
    "commfuse.ops.moe.autograd": ("moe_dispatch_matmul", "moe_matmul_combine"),
    "commfuse.ops.moe.counts": ("exchange_counts", "CountsError"),
    "commfuse.ops.binding": ("even_sizes",),
    "commfuse.ops.methods": ("OPTIONS", "MethodSpec", "method_spec"),
})
