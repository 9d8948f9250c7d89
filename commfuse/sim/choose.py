"""The fastest method for one op on a hardware model: what ``method="auto"`` runs, and the
``splits`` that ``method="commfuse"`` runs when none is given (`best_splits`).

Pure (no torch): `commfuse.ops.auto` calls `fastest` for the tensors of a live call (and
caches its choice); the whole-step simulation (`commfuse.sim.step.timing`) calls it for ``auto``
plans.

`choice` is ``auto``'s pick: the fastest, where its predicted gain over the default method
(`default`: ``commfuse`` at `best_splits`'s m) exceeds the model's measured error
(``Hardware.choice_margin``), else the default.

Host time: the hardware model's host costs per launch (``Hardware.host_collective_s`` /
``host_p2p_s``, fitted by the calibration on the `cpu-testbed`) are charged inside the
simulation, where the host is the core that computes; ``STEP_OVERHEAD_S`` per schedule step
(dispatch) is added to the simulated time on top. On the GPU presets (``host_async``) the host
launches ahead of the device: its cost per post caps the pieces instead (`launch_bound`: a
P2P schedule whose posts take the host longer than the op's compute is not chosen).
"""

from __future__ import annotations

from commfuse.schedule import VARIANTS, Post
from commfuse.sim.costs import OpSpec
from commfuse.sim.engine import Engine
from commfuse.sim.program import schedule

# in order of preference where the model predicts a tie (commfuse's schedules first: at equal
# predicted time they post earlier and wait later than decompose)
CANDIDATES = tuple(VARIANTS[label] for label in (
    "none", "commfuse", "commfuse-m2", "commfuse-m4", "commfuse-m8", "commfuse-direct",
    "decompose", "sliced"))
# host time per schedule step (Python dispatch, posting a transfer), which the simulator does
# not model: it is what keeps small GEMMs on "none", where a few microseconds of GEMM cannot
# pay for a pipeline of steps
STEP_OVERHEAD_S = {"cpu": 50e-6, "cuda": 10e-6}
# the sub-slice counts `best_splits` tries, in order of preference at equal predicted time
# (m=1, the paper's schedule, first)
SPLITS = (1, 2, 4, 8)
MAX_PIECES = 256  # best_splits: at most this many pieces (group size x m) along the dim


def fastest(op: str, shape, world: int, dtype_bytes: float, hw, step_s: float = 50e-6,
            candidates=CANDIDATES, attention: tuple = (),
            moved: float = 1.0) -> tuple[str, dict, float]:
    """(method, options, predicted seconds) of the fastest of ``candidates`` on ``hw`` (a
    `commfuse.sim.Hardware`), ``step_s`` added per schedule step. Ties go to the earlier
    candidate. A candidate whose compute alone already loses is not simulated further.
    ``attention``: the op's slots also run attention (`OpSpec.attention`: query-split);
    ``moved``: the share of its rows the transfers carry (`OpSpec.moved`)."""
    sym = not (hw.compute_straggler or hw.link_straggler)
    best = (float("inf"), -1)
    for i, (m, o) in enumerate(candidates):
        engine = Engine(hw, world, [OpSpec(op, m, tuple(shape), attention=attention,
                                           moved=moved, **o)],
                        dtype_bytes, True, False, sym)
        if o.get("splits", 1) > 1 and launch_bound(op, m, world, o, engine.work_s(), hw):
            continue  # more pieces than the host can post while the device computes
        extra = step_s * steps(op, m, world, o)
        if engine.work_s() + extra >= best[0]:  # a lower bound of its time: it cannot win
            continue
        best = min(best, (max(engine.run()[0]) + extra, i))
    t, i = best
    return candidates[i][0], candidates[i][1], t


def default(op: str, shape, world: int, dtype_bytes: float, hw, step_s: float = 50e-6,
            attention: tuple = (), moved: float = 1.0) -> tuple[str, dict]:
    """The method an op runs when none is given: ``commfuse`` on the ring at the m
    `best_splits` picks."""
    return _default_timed(op, shape, world, dtype_bytes, hw, step_s, attention, moved)[:2]


def _default_timed(op, shape, world, dtype_bytes, hw, step_s, attention, moved):
    """`default`'s method and options, and its predicted seconds (`_splits_timed`'s)."""
    m, t = _splits_timed(op, shape, world, dtype_bytes, hw, step_s, "ring", "commfuse",
                         attention, moved)
    return "commfuse", {"topology": "ring", "splits": m}, t


def choice(op: str, shape, world: int, dtype_bytes: float, hw, step_s: float = 50e-6,
           attention: tuple = (), moved: float = 1.0) -> tuple[str, dict, float]:
    """What ``method="auto"`` runs: (method, options, predicted seconds) of `fastest`, unless
    it predicts a gain over the `default` of no more than ``hw.choice_margin`` of the
    default's time; then the default. The margin is the model's measured error on such a
    ratio: a smaller predicted gain is within what the model can tell apart, and departing
    on it could as well lose (`Hardware.choice_margin`). A pure function of its arguments,
    so every rank that has the same model chooses alike."""
    method, opts, t = fastest(op, shape, world, dtype_bytes, hw, step_s, attention=attention,
                              moved=moved)
    if not hw.choice_margin or world <= 1 or min(shape) <= 0:
        return method, opts, t
    d_method, d_opts, t_default = _default_timed(op, shape, world, dtype_bytes, hw, step_s,
                                                 attention, moved)
    if (method, {"splits": 1, **opts}) == (d_method, d_opts):
        return method, opts, t
    if t <= (1 - hw.choice_margin) * t_default:
        return method, opts, t
    return d_method, d_opts, t_default


def launch_bound(op: str, method: str, world: int, opts: dict, compute_s: float, hw) -> bool:
    """Whether, on a ``host_async`` device, posting rank 0's batches of ``method`` takes the
    host longer (``host_p2p_s`` per ``Post``) than the op's ``compute_s``: the device would
    wait for the launches, whatever the simulated overlap. Always False where the host costs
    are charged in the simulation (``host_async`` off)."""
    if not hw.host_async or not hw.host_p2p_s:
        return False
    posts = sum(isinstance(s, Post) for s in schedule(op, method, world, 0, **opts).steps)
    return posts * hw.host_p2p_s > compute_s


def steps(op: str, method: str, world: int, opts: dict) -> int:
    """Steps of rank 0's schedule (what `STEP_OVERHEAD_S` is charged per)."""
    return len(schedule(op, method, world, 0, **opts).steps)


def best_splits(op: str, shape, world: int, dtype_bytes: float, hw, step_s: float = 50e-6,
                topology: str = "ring", method: str = "commfuse", attention: tuple = (),
                moved: float = 1.0) -> int:
    """The m of `SPLITS` with which ``method`` runs ``op`` of ``shape`` fastest on ``hw``
    (``step_s`` per schedule step added, as for `fastest`), searched upwards from m=1 and
    stopped at the first m that is not faster than the one before (ties keep the smaller m);
    an m that would cut the dim into more than `MAX_PIECES` pieces (W*m) is not tried: on
    wide groups each slice is already a small piece, and simulating them would dominate
    the planner's time; on a ``host_async`` device (the GPU presets) an m whose posts would
    keep the host longer than the op computes is not tried either (`launch_bound`), so the m
    shrinks as the host's cost per post grows. ``attention``, ``moved``: as for `fastest`.

    A pure function of its arguments (the simulator is deterministic), so every rank that
    passes the same shape, group size, dtype and hardware gets the same m: it sets the
    message sizes, which must match between the ranks."""
    return _splits_timed(op, shape, world, dtype_bytes, hw, step_s, topology, method, attention,
                         moved)[0]


def _splits_timed(op, shape, world, dtype_bytes, hw, step_s, topology, method, attention,
                  moved) -> tuple[int, float]:
    """`best_splits`'s m and ``method``'s predicted seconds at it (inf: not simulated, a
    single rank or an empty shape)."""
    if world <= 1 or min(shape) <= 0:
        return 1, float("inf")
    best_m, best_t = 1, float("inf")
    for m in SPLITS:
        if m > 1 and world * m > MAX_PIECES:
            break
        t = fastest(op, shape, world, dtype_bytes, hw, step_s,
                    [(method, {"topology": topology, "splits": m})], attention, moved)[2]
        if t >= best_t:  # slower, or launch-bound (not simulated: inf)
            break
        best_m, best_t = m, t
    return best_m, best_t
