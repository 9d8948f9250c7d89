"""``method="auto"``: choose each op's method and options from the simulator's cost model.

For a new (op, shape, group size, dtype) the candidates (`commfuse.sim.choose.CANDIDATES`) are
timed by `commfuse.sim` on the hardware model of the tensors' device (`set_hardware`, else the
`cpu-testbed` preset on CPU and `h100-nvlink` on CUDA), and the fastest is used; ``none`` wins
where decomposing would lose. Choices are cached per shape and logged (logger
``commfuse.auto``, level INFO). The simulator is deterministic, so every rank of a group makes
the same choice. The backward of an op reuses its forward's choice. Calibrate the model to a
machine with ``commfuse simulate --calibrate`` and pass the result to `set_hardware`.

``method="commfuse"`` without ``splits`` gets its m here too (`resolve`): the fastest of
`commfuse.sim.choose.SPLITS` on the same hardware model (`commfuse.sim.choose.best_splits`),
a function of the op, shape, group size, dtype and hardware only, so the same on every rank.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from commfuse.ops.methods import OPTIONS, MethodSpec, method_spec
from commfuse.sim.choose import STEP_OVERHEAD_S, best_splits, fastest
from commfuse.sim.hardware import Hardware, preset
from commfuse.sim.hardware import resolve as resolve_hw

_HARDWARE: dict[str, Hardware] = {}  # device type -> hardware model
_CHOICES: dict[tuple, tuple[str, dict]] = {}  # auto's choices
_SPLITS: dict[tuple, int] = {}  # commfuse's m per shape
log = logging.getLogger("commfuse.auto")


def set_hardware(hw, device_type: str = "cpu") -> None:
    """Use ``hw`` (a `commfuse.sim.Hardware` or a preset name) for ``device_type``'s choices."""
    _HARDWARE[device_type] = resolve_hw(hw)
    if not isinstance(_HARDWARE[device_type], Hardware):
        raise TypeError(f"hw must be a commfuse.sim.Hardware or a preset name, got {hw!r}")
    _CHOICES.clear()
    _SPLITS.clear()


def _hardware(like: torch.Tensor) -> Hardware:
    return _HARDWARE.get(like.device.type) or preset("h100-nvlink" if like.is_cuda
                                                     else "cpu-testbed")


def choose(op: str, shape: tuple[int, int, int], world: int, like: torch.Tensor) -> tuple[str, dict]:
    """The fastest (method, options) for ``op`` of logical GEMM ``shape`` = (M, K, N)."""
    hw = _hardware(like)
    key = (op, tuple(shape), world, like.element_size(), like.device.type, id(hw))
    if key not in _CHOICES:
        if world == 1 or min(shape) == 0:
            _CHOICES[key] = ("none", {})
        else:
            step_s = STEP_OVERHEAD_S.get(like.device.type, 50e-6)
            _CHOICES[key] = fastest(op, shape, world, like.element_size(), hw, step_s)[:2]
        log.info("auto: %s M,K,N=%s on %d ranks -> %s %s", op, shape, world, *_CHOICES[key])
    return _CHOICES[key]


def choose_splits(op: str, shape: tuple[int, int, int], world: int, like: torch.Tensor,
                  topology: str = "ring") -> int:
    """The m that ``method="commfuse"`` runs ``op`` of ``shape`` with when none is given."""
    hw = _hardware(like)
    key = (op, tuple(shape), world, like.element_size(), like.device.type, id(hw), topology)
    if key not in _SPLITS:
        step_s = STEP_OVERHEAD_S.get(like.device.type, 50e-6)
        _SPLITS[key] = best_splits(op, shape, world, like.element_size(), hw, step_s, topology)
        log.info("commfuse splits: %s M,K,N=%s on %d ranks -> m=%d", op, shape, world,
                 _SPLITS[key])
    return _SPLITS[key]


def resolve(spec: MethodSpec, op: str, shape, world: int, like) -> MethodSpec:
    """``spec`` with every choice made: for method "auto" the method `choose` picks for the
    shape, for "commfuse" without ``splits`` the m `choose_splits` picks."""
    shape = tuple(int(x) for x in shape)
    if spec.method == "auto":
        method, opts = choose(op, shape, world, like)
        if "splits" in OPTIONS[method]:
            opts = {"splits": 1, **opts}  # what the model timed: no splits is m=1
        return method_spec(method, {**opts, "timeout": spec.timeout} if spec.timeout else opts)
    if spec.method == "commfuse" and spec.splits is None:
        return replace(spec, splits=choose_splits(op, shape, world, like, spec.topology))
    return spec
