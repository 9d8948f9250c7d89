"""Planning: every valid (tp, up, dp, method) of a model on N devices, ranked by the predicted
step time of `simulate_step` (equivalently by MFU: the global batch is the same for all).

    from commfuse.sim.plan import plan, table
    plans, rejected = plan("70b", 256, "h100-nvlink", seq=4096, inter_hw="multinode-400g")
    print(table(plans))

A layout is valid when `ParallelDims` accepts it for the model (tp divides the heads, kv heads
and FFN; up the heads and kv heads; tp*up the sequence; dp the global batch and the rows of
every DP-sharded weight) and the batch splits into whole micro-batches. TP and UP are not
combined (the plans do not support it). All plans share one `OpTimer`, so an op that several
plans run is simulated once.
"""

from __future__ import annotations

from dataclasses import dataclass

from commfuse.sim.model_ops import CURRENT, StepModel, model_config
from commfuse.sim.step import OpTimer, StepResult, simulate_step

METHODS = ("none", "sliced", "decompose", "commfuse")


@dataclass(frozen=True)
class Plan:
    """One layout and method, and its predicted step."""

    tp: int
    up: int
    dp: int
    method: str
    result: StepResult

    @property
    def name(self) -> str:
        return f"tp={self.tp} up={self.up} dp={self.dp} {self.method}"


def layouts(model, devices: int, seq: int, batch: int, micro_batch: int = 1):
    """([(tp, up, dp) valid for ``model`` on ``devices``], [(tp, up, dp, why) rejected])."""
    from commfuse.parallel.config import ParallelDims

    cfg = model_config(model)
    ok, rejected = [], []
    inners = [d for d in range(1, devices + 1) if devices % d == 0]
    for tp, up in [(1, 1)] + [(d, 1) for d in inners[1:]] + [(1, d) for d in inners[1:]]:
        dp = devices // (tp * up)
        try:
            dims = ParallelDims(tp=tp, up=up, dp=dp, world_size=devices)
            dims.check_model(cfg, seq, batch)
            if batch % (dp * micro_batch):
                raise ValueError(f"global batch {batch} is not a whole number of micro-batches "
                                 f"of {micro_batch} on each of {dp} DP replicas")
            ok.append((tp, up, dp))
        except ValueError as e:
            rejected.append((tp, up, dp, str(e)))
    return ok, rejected


def plan(model, devices: int, hw="h100-nvlink", *, seq: int, batch: int | None = None,
         micro_batch: int = 1, methods=METHODS, method_opts: dict | None = None,
         dtype_bytes: float = 2, inter_hw=None, node_size: int = 8,
         timer: OpTimer | None = None, step_model: StepModel = CURRENT):
    """(plans sorted by predicted step time, rejected layouts with the reason). ``batch``:
    global sequences per step (default: ``devices``, one per rank-equivalent).
    ``method_opts``: options passed to the methods that take them (`method_options`).
    ``step_model``: which training step (`commfuse.sim.model_ops.StepModel`)."""
    from commfuse.parallel.config import ParallelDims

    batch = devices if batch is None else batch
    ok, rejected = layouts(model, devices, seq, batch, micro_batch)
    timer = timer or OpTimer(dtype_bytes)
    plans = []
    for tp, up, dp in ok:
        for method in methods:
            dims = ParallelDims(tp=tp, up=up, dp=dp, method=method, world_size=devices,
                                method_opts=method_options(method, method_opts or {}))
            r = simulate_step(model, dims, hw, seq=seq, batch=batch, micro_batch=micro_batch,
                              dtype_bytes=dtype_bytes, inter_hw=inter_hw, node_size=node_size,
                              timer=timer, step_model=step_model)
            plans.append(Plan(tp, up, dp, method, r))
    plans.sort(key=lambda p: (p.result.step_s, p.tp, p.up, p.method))
    return plans, rejected


def method_options(method: str, opts: dict) -> dict:
    """The entries of ``opts`` that ``method`` takes (splits/topology, chunks)."""
    keep = {"decompose": ("topology", "splits"), "commfuse": ("topology", "splits"),
            "sliced": ("chunks",)}.get(method, ())
    return {k: v for k, v in opts.items() if k in keep and v is not None}


def table(plans, top: int | None = None) -> str:
    """A fixed-width table of ``plans`` (best first): step time, throughput, MFU, exposed
    communication, the step's limit (same compute and bytes, no dependency) and the seconds
    per step spent on each group's ops."""
    head = (f"{'#':>3} {'tp':>3} {'up':>3} {'dp':>5} {'method':<10}{'step s':>9}{'limit s':>9}"
            f"{'tokens/s':>11}"
            f"{'MFU':>7}{'exposed':>9}{'TP/UP s':>9}{'DP s':>8}{'GEMM s':>8}{'world s':>8}")
    lines = [head, "-" * len(head)]
    for i, p in enumerate(plans[:top] if top else plans, 1):
        r, b = p.result, p.result.breakdown
        lines.append(
            f"{i:>3} {p.tp:>3} {p.up:>3} {p.dp:>5} {p.method:<10}{r.step_s:>9.3f}"
            f"{r.limit_s:>9.3f}{r.tokens / r.step_s:>11,.0f}{100 * r.mfu:>6.1f}%"
            f"{100 * r.exposed_comm_s / r.step_s:>8.1f}%{b.get('tp', 0) + b.get('up', 0):>9.3f}"
            f"{b.get('dp', 0):>8.3f}{b.get('local', 0):>8.3f}{b.get('world', 0):>8.3f}")
    return "\n".join(lines)
