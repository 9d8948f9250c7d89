"""The simulator: the same schedules the ops run (`commfuse.schedule.build`), timed on a
hardware model (`Hardware`, presets in `PRESETS`) by a discrete-event engine. Pure: no torch.

    from commfuse import sim
    r = sim.simulate_op("matmul_rs", "commfuse", 4, (8192, 4096, 4096), 2, "h100-nvlink")
    r.total_s, r.compute_s, r.exposed_comm_s; sim.write_trace(r.timeline, "t.json")

``compute_s`` is the same schedules with free transfers and collectives, so
``exposed_comm_s = total_s - compute_s`` is what docs/design.md calls exposed communication.

This package is the op timeline (what ``method="auto"`` asks, and ``commfuse simulate``):

    hardware.py   `Hardware`: compute, links, host costs; the presets
    costs.py      `OpSpec` and the FLOPs and bytes of one op's slots
    program.py    a schedule compiled into one rank's timed instructions
    engine.py     the discrete-event engine that runs every rank's program
    simulate.py   simulate_op / simulate_ops / simulate_layer: one op or a stack of them
    attention.py  the attention a query-split slot computes
    moe.py        the MoE dispatch/combine schedules on variable counts; routing.py the
                  routing tables they are timed on
    choose.py     the pure choice behind ``auto``: the fastest method, kept to the default
                  within the model's error, the best splits
    calibrate.py  the hardware model fitted to ``commfuse bench op`` results
    cli.py        ``commfuse simulate``

Two packages build on it and are never imported by it: `commfuse.sim.step` (one training step
of a whole model, timed and sized) and `commfuse.sim.plan` (every layout of a model ranked:
``commfuse plan``). The hardware model's start-up fit to this device is
`commfuse.runtime.probe` (it times kernels with torch).
"""

from __future__ import annotations

from commfuse.sim.costs import OpSpec, op_costs
from commfuse.sim.hardware import PRESETS, Hardware, preset
from commfuse.sim.simulate import (SimResult, paper_table1, simulate_layer, simulate_op,
                                   simulate_ops)
from commfuse.trace import Span, write_trace

__all__ = ["Hardware", "PRESETS", "preset", "OpSpec", "Span", "SimResult", "op_costs",
           "simulate_op", "simulate_ops", "simulate_layer", "paper_table1", "write_trace"]
