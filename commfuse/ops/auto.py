"""``method="auto"``: choose each op's method and options from the simulator's cost model.

For a new (op, shape, group size, dtype) the candidates (`commfuse.sim.choose.CANDIDATES`) are
timed by `commfuse.sim` on the hardware model of the tensors' device (`set_hardware`, else the
`cpu-testbed` preset on CPU and `h100-nvlink` on CUDA), and the fastest is used; ``none`` wins
where decomposing would lose. Choices are cached per shape and logged (logger
``commfuse.auto``, level INFO). The simulator is deterministic, so every rank of a group makes
the same choice. The backward of an op reuses its forward's choice. Calibrate the model to a
machine with ``commfuse simulate --calibrate`` and pass the result to `set_hardware`.
"""

from __future__ import annotations

import logging

import torch

from commfuse.ops.methods import MethodSpec, method_spec
from commfuse.sim.choose import STEP_OVERHEAD_S, fastest
from commfuse.sim.hardware import Hardware, preset
from commfuse.sim.hardware import resolve as resolve_hw

_HARDWARE: dict[str, Hardware] = {}  # device type -> hardware model
_CHOICES: dict[tuple, tuple[str, dict]] = {}
log = logging.getLogger("commfuse.auto")


def set_hardware(hw, device_type: str = "cpu") -> None:
    """Use ``hw`` (a `commfuse.sim.Hardware` or a preset name) for ``device_type``'s choices."""
    _HARDWARE[device_type] = resolve_hw(hw)
    if not isinstance(_HARDWARE[device_type], Hardware):
        raise TypeError(f"hw must be a commfuse.sim.Hardware or a preset name, got {hw!r}")
    _CHOICES.clear()


def choose(op: str, shape: tuple[int, int, int], world: int,
           like: torch.Tensor) -> tuple[str, dict]:
    """The fastest (method, options) for ``op`` of logical GEMM ``shape`` = (M, K, N)."""
    return _choose(op, tuple(shape), world, like.element_size(), like.device.type)


def _choose(op: str, shape: tuple[int, ...], world: int, itemsize: int,
            device_type: str) -> tuple[str, dict]:
    hw = _HARDWARE.get(device_type) or preset("h100-nvlink" if device_type == "cuda" else
                                              "cpu-testbed")
    key = (op, shape, world, itemsize, device_type, id(hw))
    if key not in _CHOICES:
        if world == 1 or min(shape) == 0:
            _CHOICES[key] = ("none", {})
        else:
            step_s = STEP_OVERHEAD_S.get(device_type, 50e-6)
            _CHOICES[key] = fastest(op, shape, world, itemsize, hw, step_s)[:2]
        log.info("auto: %s M,K,N=%s on %d ranks -> %s %s", op, shape, world, *_CHOICES[key])
    return _CHOICES[key]


@torch.compiler.assume_constant_result  # under torch.compile: run once while tracing
def _choose_items(*args) -> tuple[str, tuple]:
    """`_choose` with the options as sorted items: a constant Dynamo can hold."""
    method, opts = _choose(*args)
    return method, tuple(sorted(opts.items()))


def resolve(spec: MethodSpec, op: str, shape, world: int, like) -> MethodSpec:
    """``spec`` itself, or for method "auto" the method `choose` picks for the shape."""
    if spec.method != "auto":
        return spec
    args = (op, tuple(int(x) for x in shape), world, like.element_size(), like.device.type)
    if torch.compiler.is_compiling():  # the choice is made while tracing, as in eager
        method, items = _choose_items(*args)
        opts = dict(items)
    else:
        method, opts = _choose(*args)
    return method_spec(method, {**opts, "timeout": spec.timeout} if spec.timeout else opts)
