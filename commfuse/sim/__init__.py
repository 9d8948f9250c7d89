"""Timeline simulator: the same schedules the ops run (`commfuse.schedule.build`), timed on a
hardware model (`Hardware`, presets in `PRESETS`) by a discrete-event engine.

    from commfuse import sim
    r = sim.simulate_op("matmul_rs", "commfuse", 4, (8192, 4096, 4096), 2, "h100-nvlink")
    r.total_s, r.compute_s, r.exposed_comm_s; sim.write_trace(r.timeline, "t.json")

``compute_s`` is the same schedules with free transfers and collectives, so
``exposed_comm_s = total_s - compute_s`` is what docs/design.md calls exposed communication.

A whole training step of a Llama-style model under TP / Ulysses / ZeRO-3 DP:
`simulate_step` (`commfuse.sim.step`); every layout of a model on N devices, ranked:
`commfuse.sim.plan` (``commfuse plan``). The whole training step as a framework runs it
(memory-bound work, recompute, optimizer, FSDP prefetch) and its peak memory per rank:
`simulate_train_step` (`commfuse.sim.train_step`, `commfuse.sim.memory`).
"""

from __future__ import annotations

from commfuse.sim.costs import OpSpec, op_costs
from commfuse.sim.hardware import PRESETS, Hardware, preset
from commfuse.sim.ops import SimResult, paper_table1, simulate_layer, simulate_op, simulate_ops
from commfuse.trace import Span, write_trace

__all__ = ["Hardware", "PRESETS", "preset", "OpSpec", "Span", "SimResult", "op_costs",
           "simulate_op", "simulate_ops", "simulate_layer", "paper_table1", "write_trace",
           "simulate_step", "StepResult", "OpTimer", "MODELS", "simulate_train_step",
           "TrainStepResult", "TrainSetup"]


def __getattr__(name):  # the whole-model step (commfuse.sim.step), imported on first use
    if name in ("simulate_step", "StepResult", "OpTimer"):
        from commfuse.sim import step

        return getattr(step, name)
    if name in ("simulate_train_step", "TrainStepResult"):
        from commfuse.sim import train_step

        return getattr(train_step, name)
    if name == "TrainSetup":
        from commfuse.sim.work import TrainSetup

        return TrainSetup
    if name == "MODELS":
        from commfuse.sim.model_ops import MODELS

        return MODELS
    raise AttributeError(f"module 'commfuse.sim' has no attribute {name!r}")
