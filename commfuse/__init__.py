"""commfuse: collectives fused with GEMMs as overlapped P2P schedules (arXiv 2604.24013).

The four ops (`commfuse.ops.fused`) run on any torch.distributed backend and are exact: the
same arithmetic as the plain collective + GEMM, in a schedule that hides the transfers.

The package, in dependency order (docs/design.md has the whole picture):

    schedule   the schedules, as data (pure)        trace     spans, Chrome trace, Gantt (pure)
    runtime    executor, transports, collectives    sim       the simulator and planner (pure)
    ops        the fused ops and their methods      testbed   local ranks, emulated cluster
    parallel   TP / Ulysses / ZeRO-3 plans          bench     measurements on the testbed
    models     the Llama-style model                train     ``commfuse train``
    tp         TPSP styles for any model (torch's parallelize_module, transformers models)
    moe        Mixture-of-Experts layer and its expert parallelism (fused dispatch/combine)

Exports resolve lazily (PEP 562), so ``import commfuse.sim`` does not import torch.
"""

from __future__ import annotations

import importlib
import sys


def lazy_exports(package: str, exports: dict[str, tuple[str, ...]]):
    """PEP 562 for a commfuse package: ``(__getattr__, __dir__, __all__)`` that import module
    ``m`` on the first use of a name in ``exports[m]``. Every package's ``__init__`` uses it,
    so importing a package imports none of its modules, nor torch, until a name is used."""
    where = {name: module for module, names in exports.items() for name in names}
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = namespace[name] = getattr(importlib.import_module(where[name]), name)
        return value

    def __dir__():
        return sorted({*namespace, *where})

    return __getattr__, __dir__, list(where)


_getattr, __dir__, __all__ = lazy_exports(__name__, {
    "commfuse.ops.fused": ("fused_all_gather_matmul", "fused_matmul_reduce_scatter",
                           "fused_matmul_all_to_all", "fused_all_to_all_matmul"),
    "commfuse.runtime.gloo": ("duplex",),
    "commfuse.ops.binding": ("even_sizes",),
    "commfuse.errors": ("CommFuseError",),
    "commfuse.schedule": ("METHODS", "TOPOLOGIES"),
})


def _version() -> str:
    """The installed distribution's version (pyproject.toml's), from its metadata; a
    placeholder in a source tree that was never installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("commfuse")
    except PackageNotFoundError:
        return "0+unknown"


def __getattr__(name: str):
    if name == "__version__":  # on first use: the lookup scans the installed distributions
        value = globals()["__version__"] = _version()
        return value
    if name == "auto":  # commfuse.auto.set_hardware(...), as documented before the ops package
        return importlib.import_module("commfuse.ops.auto")
    return _getattr(name)
