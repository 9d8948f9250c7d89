"""One training step of a whole model on the simulator: its ops, its other work, its time and
its memory. Pure: no torch.

    from commfuse.sim.step import simulate_train_step
    from commfuse.parallel.config import ParallelDims
    r = simulate_train_step("8b", ParallelDims(dp=8, method="none", world_size=8),
                            "h100-hbm2e-500w", seq=8192, local_batch=2)
    r.tokens_per_s_per_device, r.peak_memory_gib, r.fits, r.breakdown

One step model in two layers:

    timing.py   simulate_step: the step's GEMMs and collectives (ops.py, layers.py), each
                op timed on its group by the op timeline (`commfuse.sim`) and summed along
                the step (`commfuse plan --ops-only`)
    train.py    simulate_train_step: timing.py's step plus the rest of what a framework's
                step runs (work.py) and its peak memory (memory.py): ``commfuse plan``

and what they read:

    arch.py     model configs beyond the Llama block: MoE and Mamba-2 hybrids (`HybridConfig`)
    ops.py      a Llama step's ops as data (`StepOp`), which step (`StepModel`), `MODELS`
    layers.py   the ops of a hybrid model's layers, grouped by kind
    work.py     memory-bound kernels, fused attention, recompute, optimizer; `TrainSetup`
    memory.py   the peak memory of one rank
"""

from __future__ import annotations

from commfuse.sim.step.ops import MODELS, StepModel
from commfuse.sim.step.timing import OpTimer, StepResult, simulate_step
from commfuse.sim.step.train import TrainStepResult, simulate_train_step
from commfuse.sim.step.work import TrainSetup

__all__ = ["simulate_step", "StepResult", "OpTimer", "simulate_train_step", "TrainStepResult",
           "TrainSetup", "StepModel", "MODELS"]
