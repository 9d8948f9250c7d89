"""``method="auto"``: choose each op's method and options from the simulator's cost model.

For a new (op, shape, group size, dtype) the candidates (`commfuse.sim.choose.CANDIDATES`) are
timed by `commfuse.sim` on the hardware model of the tensors' device (`set_hardware`, else the
`cpu-testbed` preset on CPU and `h100-nvlink` on CUDA), and the fastest is used where its
predicted gain over the default (``commfuse`` at its chosen m) exceeds the model's measured
error (`commfuse.sim.choose.choice`); ``none`` wins where decomposing would lose. Choices are cached per shape and logged (logger
``commfuse.auto``, level INFO). The simulator is deterministic, so every rank of a group makes
the same choice given the same hardware model; `agree` checks that once per shape and
group (ranks configured differently raise `CommFuseError`). The backward of an op reuses its
forward's choice. `calibrate` fits the model's compute to the machine at start (one GEMM
timed per rank; `commfuse train`, `commfuse generate` and `commfuse bench` do it unless
given ``--hardware PRESET``); ``commfuse simulate --calibrate`` fits a whole model to bench
results, to pass to `set_hardware`.

``method="commfuse"`` without ``splits`` gets its m here too (`resolve`): the fastest of
`commfuse.sim.choose.SPLITS` on the same hardware model (`commfuse.sim.choose.best_splits`),
a function of the op, the shape, the group size, dtype and hardware only, so the same on
every rank. Both choices set message sizes, which must match between the ranks, so they are
made from the real shape only where every rank has it (the default: B's shards are even);
where a caller says they are not (``uniform_b=False`` on the ops: AG->GEMM's local N or
GEMM->RS's local K differs between ranks), from a shape every rank shares (`_common`).
"""

from __future__ import annotations

import logging
from dataclasses import replace
import weakref
import zlib

import torch

from commfuse.ops.methods import OPTIONS, MethodSpec, method_spec
from commfuse.sim.choose import STEP_OVERHEAD_S, best_splits, choice
from commfuse.sim.hardware import Hardware, preset
from commfuse.sim.hardware import resolve as resolve_hw

_HARDWARE: dict[str, Hardware] = {}  # device type -> hardware model
_CHOICES: dict[tuple, tuple[str, dict]] = {}  # auto's choices
_SPLITS: dict[tuple, int] = {}  # commfuse's m per shape
_QUERY_SPLIT: dict[tuple, bool] = {}  # TP attention: query-split or row-parallel, per shape
log = logging.getLogger("commfuse.auto")


def set_hardware(hw, device_type: str = "cpu") -> None:
    """Use ``hw`` (a `commfuse.sim.Hardware` or a preset name) for ``device_type``'s choices."""
    _HARDWARE[device_type] = resolve_hw(hw)
    if not isinstance(_HARDWARE[device_type], Hardware):
        raise TypeError(f"hw must be a commfuse.sim.Hardware or a preset name, got {hw!r}")
    _CHOICES.clear()  # (not _AGREED: whether a call exchanges must not differ between ranks)
    _SPLITS.clear()
    _QUERY_SPLIT.clear()


def calibrate(like: torch.Tensor, group=None):
    """Fit the hardware model in use for ``like``'s device to this machine and use it
    (`set_hardware`): its GEMM peak and attention efficiency set to the slowest rank's rates
    measured in ``like``'s dtype (`commfuse.runtime.probe`). Collective over ``group``: call it
    on every rank, at the same point, before the first auto op. Returns the model and the
    rates."""
    from commfuse.runtime.probe import probe

    device_type = like.device.type
    fitted, rates = probe(_hardware(device_type), group, like.device, like.dtype)
    set_hardware(fitted, device_type)
    log.info("auto: %s hardware model fitted to %s measured", device_type, rates.line())
    return fitted, rates


def use_hardware(name: str, like: torch.Tensor, group=None) -> tuple[Hardware, str]:
    """What the CLIs' ``--hardware NAME`` does: "measured" `calibrate`s the device's model (a
    collective over ``group``), a preset name (`commfuse.sim.hardware.PRESETS`) is used as
    it is. Returns the model and a line for the run's log that says which it is."""
    device_type = like.device.type
    if name != "measured":
        set_hardware(name, device_type)
        return _hardware(device_type), f"hardware model: the {name} preset"
    hw, rates = calibrate(like, group)
    return hw, (f"hardware model: the {device_type} preset's compute fitted to {rates.line()} "
                f"measured here (--hardware PRESET keeps a preset)")


HARDWARE_HELP = ("The cost model's hardware, on which auto and commfuse's m choose: measured "
                 "(the device's preset with its GEMM and attention rates fitted at start to "
                 "kernels timed on every rank) or a preset name (commfuse.sim.hardware.PRESETS, "
                 "e.g. cpu-testbed; default: measured)")


def add_hardware_flag(parser, extra: str = "") -> None:
    """The CLIs' ``--hardware MODEL`` flag (`use_hardware` does what it says)."""
    parser.add_argument("--hardware", default="measured", choices=hardware_choices(),
                        metavar="MODEL", help=HARDWARE_HELP + extra)


def hardware_choices() -> tuple[str, ...]:
    """``--hardware``'s choices: "measured" and every preset."""
    from commfuse.sim.hardware import PRESETS

    return ("measured", *sorted(PRESETS))


def _hardware(device_type: str) -> Hardware:
    return _HARDWARE.get(device_type) or preset("h100-nvlink" if device_type == "cuda"
                                                else "cpu-testbed")


def choose(op: str, shape: tuple[int, int, int], world: int,
           like: torch.Tensor) -> tuple[str, dict]:
    """auto's (method, options) for ``op`` of logical GEMM ``shape`` = (M, K, N): the fastest
    on the model, or the default where it is not faster by more than the model's error."""
    return _choose(op, tuple(shape), world, like.element_size(), like.device.type)


def _choose(op: str, shape: tuple[int, ...], world: int, itemsize: int,
            device_type: str, attention: tuple = ()) -> tuple[str, dict]:
    hw = _hardware(device_type)
    key = (op, shape, world, itemsize, device_type, id(hw), attention)
    if key not in _CHOICES:
        if world == 1 or min(shape) == 0:
            _CHOICES[key] = ("none", {})
        else:
            step_s = STEP_OVERHEAD_S.get(device_type, 50e-6)
            _CHOICES[key] = choice(op, shape, world, itemsize, hw, step_s,
                                   attention=attention)[:2]
        log.info("auto: %s M,K,N=%s on %d ranks -> %s %s", op, shape, world, *_CHOICES[key])
    return _CHOICES[key]


def choose_splits(op: str, shape: tuple[int, int, int], world: int, like: torch.Tensor,
                  topology: str = "ring", uniform: bool = True) -> int:
    """The m that ``method="commfuse"`` runs ``op`` of ``shape`` with when none is given
    (``uniform``: as for `resolve`)."""
    return _splits(op, _shared(op, shape, uniform), world, like.element_size(),
                   like.device.type, (), topology)


def _splits(op: str, shape: tuple[int, ...], world: int, itemsize: int, device_type: str,
            attention: tuple, topology: str) -> int:
    hw = _hardware(device_type)
    key = (op, shape, world, itemsize, device_type, id(hw), attention, topology)
    if key not in _SPLITS:
        step_s = STEP_OVERHEAD_S.get(device_type, 50e-6)
        _SPLITS[key] = best_splits(op, shape, world, itemsize, hw, step_s, topology,
                                   attention=attention)
        log.info("commfuse splits: %s M,K,N=%s on %d ranks -> m=%d", op, shape, world,
                 _SPLITS[key])
    return _SPLITS[key]


@torch.compiler.assume_constant_result  # under torch.compile: run once while tracing
def _choose_items(*args) -> tuple[str, tuple]:
    """`_choose` with the options as sorted items: a constant Dynamo can hold."""
    method, opts = _choose(*args)
    return method, tuple(sorted(opts.items()))


def resolve(spec: MethodSpec, op: str, shape, world: int, like, group=None,
            uniform: bool = True, attention: tuple = ()) -> MethodSpec:
    """``spec`` with every choice made: for method "auto" the method `choose` picks for the
    shape, for "commfuse" without ``splits`` the m `choose_splits` picks. Under
    torch.compile the method is chosen while tracing, as in eager, but "commfuse" without
    ``splits`` runs the paper's m=1 (the shapes may be symbolic there): give ``splits``.
    In eager, auto's choice is checked against the other ranks of ``group`` by `agree` on
    the first call per shape (commfuse's m is not: no collective is added to the default
    method, so `set_hardware` must be the same on every rank). ``uniform``: every rank has
    this ``shape`` (else the choice is made for `_common`'s, which every rank shares).
    ``attention``: the op's slots also run causal attention (query-split,
    `commfuse.sim.costs.OpSpec.attention`), which the choice times with them."""
    compiling = torch.compiler.is_compiling()
    if compiling and spec.method == "commfuse" and spec.splits is None:
        return replace(spec, splits=1)  # shapes may be symbolic: no per-shape m, the paper's
    # only a shape every rank has decides: the choice sets message sizes
    args = (op, _shared(op, shape, uniform), world, like.element_size(), like.device.type,
            tuple(attention))
    if spec.method == "auto":
        if compiling:
            method, items = _choose_items(*args)
            opts = dict(items)
        else:
            method, opts = _choose(*args)
            if group is not None:
                agree(group, op + "+attention" * bool(attention), args[1], like,
                      (method, opts), spec.timeout)
        if "splits" in OPTIONS[method]:
            opts = {"splits": 1, **opts}  # what the model timed: no splits is m=1
        return method_spec(method, {**opts, "timeout": spec.timeout} if spec.timeout else opts)
    if spec.method == "commfuse" and spec.splits is None:
        return replace(spec, splits=_splits(*args, spec.topology))
    return spec


def _shared(op: str, shape, uniform: bool) -> tuple[int, ...]:
    shape = tuple(int(x) for x in shape)
    return shape if uniform else _common(op, shape)


def _common(op: str, shape: tuple[int, int, int]) -> tuple[int, int, int]:
    """``shape`` with the rank-local dim replaced by one every rank shares, for a choice that
    sets message sizes (auto's method, commfuse's m) and for `agree`'s key (which must hit or
    miss on every rank alike) where B's shards are uneven: AG->GEMM's N (this rank's columns
    of B) and GEMM->RS's K (its rows of B) may differ between ranks, the rows and the moved
    dim do not. The local dim is taken equal to the moved one (a square GEMM per slice)."""
    M, K, N = shape
    return {"ag_matmul": (M, K, K), "matmul_rs": (M, N, N)}.get(op, shape)


_AGREED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # group -> keys agreed on


def agree(group, op: str, shape: tuple, like: torch.Tensor, choice: tuple[str, dict],
          timeout: float | None = None) -> None:
    """Make sure every rank of ``group`` runs the same ``choice`` for this op and shape: on the
    first call per (op, shape, dtype, device, group), one small all-gather of a hash of this
    rank's hardware model and of its choice; `CommFuseError` on every rank if they differ
    (`set_hardware` is per process: ranks configured differently would choose differently
    and deadlock). Later calls cost nothing. Whether a call exchanges depends only on what is
    the same on every rank, so call `set_hardware` on every rank before the first auto op.
    The exchange waits at most ``timeout`` (the op's; None: the group's)."""
    from commfuse.errors import CommFuseError
    from commfuse.runtime.collectives import exchange

    key = (op, shape, like.element_size(), like.device.type)
    done = _AGREED.setdefault(group, set())
    if key in done or group.size() == 1:
        return
    hw = _hardware(like.device.type)
    mine = torch.tensor([zlib.crc32(repr(hw).encode()), zlib.crc32(repr(choice).encode())],
                        dtype=torch.int64, device=like.device)
    try:  # with the op's deadline: a peer that died before the op must not block this one
        every = exchange(mine, group, timeout)
    except Exception as e:
        raise CommFuseError(f"commfuse {op} (auto, rank {group.rank()} of {group.size()}) "
                            f"failed agreeing on the method: {type(e).__name__}: {e}", op=op,
                            method="auto", rank=group.rank()) from e
    hashes = [tuple(t.tolist()) for t in every]
    if len(set(hashes)) > 1:
        sides: dict[tuple, list[int]] = {}
        for p, h in enumerate(hashes):
            sides.setdefault(h, []).append(p)
        raise CommFuseError(
            f"commfuse {op} ({choice[0]} chosen by the cost model, rank {group.rank()} of "
            f"{group.size()}): the ranks "
            f"would choose differently for M,K,N={shape}: ranks "
            f"{' / '.join(map(str, sides.values()))} have different hardware models or "
            f"choices (this rank: {choice[0]} {choice[1]}); call "
            "commfuse.ops.auto.set_hardware with the same model on every rank")
    done.add(key)


def choose_query_split(seq: int, batch: int, heads: int, kv_heads: int, head_dim: int,
                       dim: int, world: int, like: torch.Tensor, backward: bool = True) -> bool:
    """Whether TP attention under method "auto" runs query-split (`commfuse.ops.attention`)
    rather than row-parallel attention + out-projection: ``batch`` sequences of ``seq``
    tokens, ``heads`` / ``kv_heads`` heads in all of ``head_dim``, model dim ``dim``, on
    ``world`` ranks. The simulator times both, forward and backward, each op with auto's own
    method, with q|k|v's re-gather after them, posted ahead as by default
    (`commfuse.sim.step.timing.query_split_wins`; turning the prefetch off never changes the
    choice, so it never changes the arithmetic); ``backward=False``: the forward alone (a
    prefill, `commfuse.infer.InferenceLlama`). Every rank has these global shapes, so every rank
    decides the same (given the same hardware model, as for every choice here). Only where
    query-split's attention blocks run fused kernels (CPU, `attn_blocks.fused_kernels`): on
    other devices they are plain torch formulas, which the model does not time."""
    from types import SimpleNamespace

    from commfuse.ops.attn_blocks import fused_kernels
    from commfuse.sim.step.timing import OpTimer, query_split_wins

    if not fused_kernels(like):
        return False

    device_type = like.device.type
    hw = _hardware(device_type)
    key = (seq, batch, heads, kv_heads, head_dim, dim, world, like.element_size(), device_type,
           id(hw), backward)
    if key not in _QUERY_SPLIT:
        cfg = SimpleNamespace(n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim, dim=dim)
        timer = OpTimer(like.element_size(), STEP_OVERHEAD_S.get(device_type, 50e-6))
        _QUERY_SPLIT[key] = world > 1 and query_split_wins(cfg, world, seq, batch, "auto", {},
                                                           hw, timer, backward)
        log.info("auto: TP attention of %d x %d tokens, %d heads on %d ranks -> %s", batch, seq,
                 heads, world, "query-split" if _QUERY_SPLIT[key] else "row-parallel")
    return _QUERY_SPLIT[key]
