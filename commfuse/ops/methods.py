"""The methods every fused op offers, and their options: validated before any communication.

Pure (no torch): the simulator, the planner and the configs validate methods with it too.
"""

from __future__ import annotations

from dataclasses import dataclass

from commfuse import schedule

DEFAULT_CHUNKS = 4
OPTIONS = {  # the options each method accepts
    "auto": {"timeout"},  # commfuse.ops.auto picks a method and its options per shape
    "none": {"timeout", "collective"},
    "sliced": {"timeout", "chunks", "collective"},
    "decompose": {"timeout", "topology", "splits"},
    "commfuse": {"timeout", "topology", "splits"},
}


@dataclass(frozen=True)
class MethodSpec:
    """A validated method and its options."""

    method: str
    topology: str = "ring"  # commfuse/decompose: "ring" (the paper) or "direct"
    chunks: int = DEFAULT_CHUNKS  # sliced: number of chunks along the gathered/scattered dim
    timeout: float | None = None  # seconds to wait for a transfer; None: the group's timeout
    collective: str = "auto"  # none/sliced: "backend", "p2p" or "auto" (runtime.collectives)
    splits: int | None = 1  # decompose/commfuse: sub-slices per rank's slice (m in
    # docs/design.md); None (commfuse without an explicit ``splits``): the public ops pick m
    # per shape on the cost model (`commfuse.ops.auto.resolve`); run as 1 if used unresolved


def method_spec(method: str, opts: dict) -> MethodSpec:
    if not isinstance(method, str) or method not in OPTIONS:
        raise ValueError(f"method must be one of {sorted(OPTIONS)}, got {method!r}")
    unknown = set(opts) - OPTIONS[method]
    if unknown:
        raise ValueError(f"unknown option(s) {sorted(unknown)} for method={method!r}; "
                         f"it accepts {sorted(OPTIONS[method])}")
    topology = opts.get("topology", "ring")
    if topology not in schedule.TOPOLOGIES:
        raise ValueError(f"topology must be one of {schedule.TOPOLOGIES}, got {topology!r}")
    chunks = opts.get("chunks", DEFAULT_CHUNKS)
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"chunks must be a positive int, got {chunks!r}")
    timeout = opts.get("timeout")
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    splits = opts.get("splits", None if method == "commfuse" else 1)
    if splits is None and method == "commfuse":
        pass  # chosen per shape by commfuse.ops.auto.resolve
    elif not isinstance(splits, int) or isinstance(splits, bool) or splits < 1:
        raise ValueError(f"splits must be a positive int, got {splits!r}")
    collective = opts.get("collective", "auto")
    if collective not in schedule.COLLECTIVE_POLICIES:
        raise ValueError(f"collective must be one of {schedule.COLLECTIVE_POLICIES}, "
                         f"got {collective!r}")
    return MethodSpec(method, topology, chunks, timeout, collective, splits)
