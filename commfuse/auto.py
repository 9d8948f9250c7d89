"""``method="auto"``: choose each op's method and options from the simulator's cost model.

For a new (op, shape, group size, dtype) the candidates below are timed by `commfuse.sim` on
the hardware model of the tensors' device (`set_hardware`, else the `cpu-testbed` preset on
CPU and `h100-nvlink` on CUDA), and the fastest is used; ``none`` wins where decomposing would
lose. Choices are cached per shape and logged (logger ``commfuse.auto``, level INFO). The
simulator is deterministic, so every rank of a group makes the same choice. The backward of
an op reuses its forward's choice. Calibrate the model to a machine with
``commfuse simulate --calibrate`` and pass the result to `set_hardware`.

Host time: the hardware model's host costs per launch (``Hardware.host_collective_s`` /
``host_p2p_s``, fitted by the calibration; the `cpu-testbed` preset has them, the GPU presets
have 0) are charged inside the simulation; ``STEP_OVERHEAD_S`` per schedule step (dispatch)
is added to the simulated time on top.
"""

from __future__ import annotations

import logging

import torch

# in order of preference where the model predicts a tie (commfuse's schedules first: at equal
# predicted time they post earlier and wait later than decompose)
CANDIDATES = (("none", {}), ("commfuse", {}), ("commfuse", {"splits": 2}),
              ("commfuse", {"splits": 4}), ("commfuse", {"topology": "direct"}),
              ("decompose", {}), ("sliced", {"chunks": 4}))
# host time per schedule step (Python dispatch, posting a transfer), which the simulator does
# not model: it is what keeps small GEMMs on "none", where a few microseconds of GEMM cannot
# pay for a pipeline of steps
STEP_OVERHEAD_S = {"cpu": 50e-6, "cuda": 10e-6}
_HARDWARE: dict[str, object] = {}  # device type -> sim.Hardware
_CHOICES: dict[tuple, tuple[str, dict]] = {}
log = logging.getLogger("commfuse.auto")


def set_hardware(hw, device_type: str = "cpu") -> None:
    """Use ``hw`` (a `commfuse.sim.Hardware` or a preset name) for ``device_type``'s choices."""
    from commfuse.sim.hardware import Hardware, preset

    _HARDWARE[device_type] = preset(hw) if isinstance(hw, str) else hw
    if not isinstance(_HARDWARE[device_type], Hardware):
        raise TypeError(f"hw must be a commfuse.sim.Hardware or a preset name, got {hw!r}")
    _CHOICES.clear()


def choose(op: str, shape: tuple[int, int, int], world: int, like: torch.Tensor) -> tuple[str, dict]:
    """The fastest (method, options) for ``op`` of logical GEMM ``shape`` = (M, K, N)."""
    from commfuse.sim import simulate_op
    from commfuse.sim.hardware import preset

    hw = _HARDWARE.get(like.device.type) or preset("h100-nvlink" if like.is_cuda else "cpu-testbed")
    key = (op, tuple(shape), world, like.element_size(), like.device.type, id(hw))
    if key not in _CHOICES:
        if world == 1 or min(shape) == 0:
            _CHOICES[key] = ("none", {})
        else:
            step_s = STEP_OVERHEAD_S.get(like.device.type, 50e-6)
            _CHOICES[key] = fastest(op, shape, world, like.element_size(), hw, step_s)[:2]
        log.info("auto: %s M,K,N=%s on %d ranks -> %s %s", op, shape, world, *_CHOICES[key])
    return _CHOICES[key]


def fastest(op: str, shape, world: int, dtype_bytes: float, hw, step_s: float = 50e-6,
            candidates=CANDIDATES) -> tuple[str, dict, float]:
    """(method, options, predicted seconds) of the fastest of ``candidates`` on ``hw`` (a
    `commfuse.sim.Hardware`), ``step_s`` added per schedule step. Ties go to the earlier
    candidate. A candidate whose compute alone already loses is not simulated further."""
    from commfuse.sim import OpSpec
    from commfuse.sim.engine import Engine

    sym = not (hw.compute_straggler or hw.link_straggler)
    best = (float("inf"), -1)
    for i, (m, o) in enumerate(candidates):
        engine = Engine(hw, world, [OpSpec(op, m, tuple(shape), **o)], dtype_bytes, True,
                        False, sym)
        extra = step_s * _steps(op, m, world, o)
        if engine.work_s() + extra >= best[0]:  # a lower bound of its time: it cannot win
            continue
        best = min(best, (max(engine.run()[0]) + extra, i))
    t, i = best
    return candidates[i][0], candidates[i][1], t


def _steps(op: str, method: str, world: int, opts: dict) -> int:
    from commfuse.sim.program import schedule

    return len(schedule(op, method, world, 0, **opts).steps)
