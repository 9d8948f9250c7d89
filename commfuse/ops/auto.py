"""``method="auto"``: choose each op's method and options from the simulator's cost model.

For a new (op, shape, group size, dtype) the candidates (`commfuse.sim.choose.CANDIDATES`) are
timed by `commfuse.sim` on the hardware model of the tensors' device (`set_hardware`, else the
`cpu-testbed` preset on CPU and `h100-nvlink` on CUDA), and the fastest is used; ``none`` wins
where decomposing would lose. Choices are cached per shape and logged (logger
``commfuse.auto``, level INFO). The simulator is deterministic, so every rank of a group makes
the same choice given the same hardware model; `agree` checks that once per shape and
group (ranks configured differently raise `CommFuseError`). The backward of an op reuses its
forward's choice. Calibrate the model to a
machine with ``commfuse simulate --calibrate`` and pass the result to `set_hardware`.
"""

from __future__ import annotations

import logging
import weakref
import zlib

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
    _CHOICES.clear()  # (not _AGREED: whether a call exchanges must not differ between ranks)


def choose(op: str, shape: tuple[int, int, int], world: int, like: torch.Tensor) -> tuple[str, dict]:
    """The fastest (method, options) for ``op`` of logical GEMM ``shape`` = (M, K, N)."""
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


def resolve(spec: MethodSpec, op: str, shape, world: int, like, group=None) -> MethodSpec:
    """``spec`` itself, or for method "auto" the method `choose` picks for the shape (checked
    against the other ranks of ``group`` by `agree` on the first call per shape)."""
    if spec.method != "auto":
        return spec
    shape = tuple(int(x) for x in shape)
    method, opts = choose(op, shape, world, like)
    if group is not None:
        agree(group, op, shape, like, (method, opts))
    return method_spec(method, {**opts, "timeout": spec.timeout} if spec.timeout else opts)


_AGREED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # group -> keys agreed on


def agree(group, op: str, shape: tuple, like: torch.Tensor, choice: tuple[str, dict]) -> None:
    """Make sure every rank of ``group`` runs the same ``choice`` for this op and shape: on the
    first call per (op, shape, dtype, device, group), one small all-gather of a hash of this
    rank's hardware model and of its choice; `CommFuseError` on every rank if they differ
    (`set_hardware` is per process: ranks configured differently would choose differently
    and deadlock). Later calls cost nothing. Whether a call exchanges depends only on what is
    the same on every rank, so call `set_hardware` on every rank before the first auto op."""
    import torch.distributed as dist

    from commfuse.errors import CommFuseError

    key = (op, shape, like.element_size(), like.device.type)
    done = _AGREED.setdefault(group, set())
    if key in done or group.size() == 1:
        return
    hw = _HARDWARE.get(like.device.type) or preset("h100-nvlink" if like.is_cuda else "cpu-testbed")
    mine = torch.tensor([zlib.crc32(repr(hw).encode()), zlib.crc32(repr(choice).encode())],
                        dtype=torch.int64, device=like.device)
    every = [torch.empty_like(mine) for _ in range(group.size())]
    dist.all_gather(every, mine, group=group)
    hashes = [tuple(t.tolist()) for t in every]
    if len(set(hashes)) > 1:
        sides: dict[tuple, list[int]] = {}
        for p, h in enumerate(hashes):
            sides.setdefault(h, []).append(p)
        raise CommFuseError(
            f"commfuse {op} (method=auto, rank {group.rank()} of {group.size()}): the ranks "
            f"would choose differently for M,K,N={shape}: ranks "
            f"{' / '.join(map(str, sides.values()))} have different hardware models or "
            f"choices (this rank: {choice[0]} {choice[1]}); call "
            "commfuse.ops.auto.set_hardware with the same model on every rank")
    done.add(key)
