"""commfuse: collectives fused with GEMMs as overlapped P2P schedules (arXiv 2604.24013).

The four ops (`commfuse.ops.fused`) run on any torch.distributed backend and are exact: the
same arithmetic as the plain collective + GEMM, in a schedule that hides the transfers.

The package, in dependency order (docs/design.md has the whole picture):

    schedule   the schedules, as data (pure)        trace     spans, Chrome trace, Gantt (pure)
    runtime    executor, transports, collectives    sim       the simulator and planner (pure)
    ops        the fused ops and their methods      testbed   local ranks, emulated cluster
    parallel   TP / Ulysses / ZeRO-3 plans          bench     measurements on the testbed
    models     the Llama-style model                train     ``commfuse train``

Exports resolve lazily (PEP 562), so ``import commfuse.sim`` does not import torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"
_EXPORTS = {
    "fused_all_gather_matmul": "commfuse.ops.fused",
    "fused_matmul_reduce_scatter": "commfuse.ops.fused",
    "fused_matmul_all_to_all": "commfuse.ops.fused",
    "fused_all_to_all_matmul": "commfuse.ops.fused",
    "duplex": "commfuse.runtime.gloo",
    "even_sizes": "commfuse.ops.binding",
    "CommFuseError": "commfuse.errors",
    "METHODS": "commfuse.schedule",
    "TOPOLOGIES": "commfuse.schedule",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name == "auto":  # commfuse.auto.set_hardware(...), as documented before the ops package
        return importlib.import_module("commfuse.ops.auto")
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # resolved once
        return value
    raise AttributeError(f"module 'commfuse' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_EXPORTS])
