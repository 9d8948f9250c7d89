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


def _hardware(device_type: str) -> Hardware:
    return _HARDWARE.get(device_type) or preset("h100-nvlink" if device_type == "cuda"
                                                else "cpu-testbed")


def choose(op: str, shape: tuple[int, int, int], world: int,
           like: torch.Tensor) -> tuple[str, dict]:
    """The fastest (method, options) for ``op`` of logical GEMM ``shape`` = (M, K, N)."""
    return _choose(op, tuple(shape), world, like.element_size(), like.device.type)


def _choose(op: str, shape: tuple[int, ...], world: int, itemsize: int,
            device_type: str) -> tuple[str, dict]:
    hw = _hardware(device_type)
    key = (op, shape, world, itemsize, device_type, id(hw))
    if key not in _CHOICES:
        if world == 1 or min(shape) == 0:
            _CHOICES[key] = ("none", {})
        else:
            step_s = STEP_OVERHEAD_S.get(device_type, 50e-6)
            _CHOICES[key] = fastest(op, shape, world, itemsize, hw, step_s)[:2]
        log.info("auto: %s M,K,N=%s on %d ranks -> %s %s", op, shape, world, *_CHOICES[key])
    return _CHOICES[key]


def choose_splits(op: str, shape: tuple[int, int, int], world: int, like: torch.Tensor,
                  topology: str = "ring") -> int:
    """The m that ``method="commfuse"`` runs ``op`` of ``shape`` with when none is given."""
    return _splits(op, tuple(shape), world, like.element_size(), like.device.type, topology)


def _splits(op: str, shape: tuple[int, ...], world: int, itemsize: int, device_type: str,
            topology: str) -> int:
    hw = _hardware(device_type)
    key = (op, shape, world, itemsize, device_type, id(hw), topology)
    if key not in _SPLITS:
        step_s = STEP_OVERHEAD_S.get(device_type, 50e-6)
        _SPLITS[key] = best_splits(op, shape, world, itemsize, hw, step_s, topology)
        log.info("commfuse splits: %s M,K,N=%s on %d ranks -> m=%d", op, shape, world,
                 _SPLITS[key])
    return _SPLITS[key]


@torch.compiler.assume_constant_result  # under torch.compile: run once while tracing
def _choose_items(*args) -> tuple[str, tuple]:
    """`_choose` with the options as sorted items: a constant Dynamo can hold."""
    method, opts = _choose(*args)
    return method, tuple(sorted(opts.items()))


def resolve(spec: MethodSpec, op: str, shape, world: int, like) -> MethodSpec:
    """``spec`` with every choice made: for method "auto" the method `choose` picks for the
    shape, for "commfuse" without ``splits`` the m `choose_splits` picks. Under
    torch.compile the method is chosen while tracing, as in eager, but "commfuse" without
    ``splits`` runs the paper's m=1 (the shapes may be symbolic there): give ``splits``."""
    compiling = torch.compiler.is_compiling()
    if compiling and spec.method == "commfuse" and spec.splits is None:
        return replace(spec, splits=1)  # shapes may be symbolic: no per-shape m, the paper's
    args = (op, tuple(int(x) for x in shape), world, like.element_size(), like.device.type)
    if spec.method == "auto":
        if compiling:
            method, items = _choose_items(*args)
            opts = dict(items)
        else:
            method, opts = _choose(*args)
        if "splits" in OPTIONS[method]:
            opts = {"splits": 1, **opts}  # what the model timed: no splits is m=1
        return method_spec(method, {**opts, "timeout": spec.timeout} if spec.timeout else opts)
    if spec.method == "commfuse" and spec.splits is None:
        return replace(spec, splits=_splits(*args, spec.topology))
    return spec
