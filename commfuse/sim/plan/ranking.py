"""Planning: every valid (tp, up, dp, method) of a model on N devices, ranked by the predicted
step time of `simulate_step` (equivalently by MFU: the global batch is the same for all).

    from commfuse.sim.plan import plan, table
    plans, rejected = plan("70b", 256, "h100-nvlink", seq=4096, inter_hw="multinode-400g")
    print(table(plans))

A layout is valid when `ParallelDims` accepts it for the model (tp divides the heads, kv heads
and FFN; up the heads and kv heads; tp*up the sequence; dp the global batch and the rows of
every DP-sharded weight) and the batch splits into whole micro-batches. TP and UP are not
combined (the plans do not support it). A model with MoE layers (`commfuse.sim.step.arch`) also
takes every expert-parallel size ep that divides dp and its experts (the ep group is made of
DP ranks, `commfuse.sim.step.layers`) and, with tp > 1, the experts split over the TP group (ep =
tp, as ``commfuse train --ep`` runs them; "Ntp" in the tables); Mamba layers need their heads and groups split over tp
and no Ulysses. All plans share one `OpTimer`, so an op that several plans run is simulated
once.

With a `commfuse.sim.step.work.TrainSetup` (``setup``), each plan is the whole training step of
`commfuse.sim.step.train.simulate_train_step` (memory-bound work, recompute, optimizer, FSDP
prefetch, peak memory): plans that fit the device come first, each group ranked by tokens
per second per device (with ``local_batch`` the global batch is dp x local_batch, so it
differs between layouts). `plan_records` turns plans into JSON-ready dicts.
"""

from __future__ import annotations

from dataclasses import dataclass

from commfuse.sim.step.arch import check_layout, sublayers
from commfuse.sim.step.ops import CURRENT, StepModel, model_config
from commfuse.sim.step.timing import OpTimer, StepResult, simulate_step
from commfuse.sim.step.work import TrainSetup

METHODS = ("none", "sliced", "decompose", "commfuse")


@dataclass(frozen=True)
class Plan:
    """One layout and method, and its predicted step."""

    tp: int
    up: int
    dp: int
    method: str
    result: StepResult  # the GEMMs and collectives (`simulate_step`)
    train: object = None  # the whole step (`TrainStepResult`), when planned with a setup
    ep: int = 1  # expert-parallel ranks (of the dp), MoE models
    ep_axis: str = "dp"  # "tp": the experts split over the TP group (ep = tp)

    @property
    def ep_label(self) -> str:
        return f"{self.ep}tp" if self.ep_axis == "tp" else str(self.ep)

    @property
    def name(self) -> str:
        ep = f" ep={self.ep_label}" if self.ep > 1 else ""
        return f"tp={self.tp} up={self.up} dp={self.dp}{ep} {self.method}"

    @property
    def step_s(self) -> float:
        return (self.train or self.result).step_s

    @property
    def tokens_per_s_per_device(self) -> float:
        r = self.train or self.result
        return r.tokens / r.step_s / (self.tp * self.up * self.dp)

    @property
    def mfu(self) -> float:
        return (self.train or self.result).mfu

    @property
    def peak_memory_gib(self):
        return self.train.peak_memory_gib if self.train else None

    @property
    def fits(self):
        return self.train.fits if self.train else None


def layouts(model, devices: int, seq: int, batch: int | None, micro_batch: int = 1,
            local_batch: int | None = None, ep: int | None = None):
    """([(tp, up, dp) valid for ``model`` on ``devices``], [(tp, up, dp, why) rejected]);
    for a model with MoE layers (tp, up, dp, ep, ep_axis) for every valid ep over the DP
    ranks (or ``ep`` alone) and, with tp > 1, (tp, up, dp, tp, "tp").
    ``local_batch``: sequences per DP replica (the global batch is then dp x local_batch)."""
    from commfuse.parallel.config import ParallelDims

    cfg = model_config(model)
    moe = "E" in sublayers(cfg)
    ok, rejected = [], []
    inners = [d for d in range(1, devices + 1) if devices % d == 0]
    for tp, up in [(1, 1)] + [(d, 1) for d in inners[1:]] + [(1, d) for d in inners[1:]]:
        dp = devices // (tp * up)
        if local_batch is not None:
            batch = dp * local_batch
        try:
            dims = ParallelDims(tp=tp, up=up, dp=dp, world_size=devices)
            dims.check_model(cfg, seq, batch)
            if batch % (dp * micro_batch):
                raise ValueError(f"global batch {batch} is not a whole number of micro-batches "
                                 f"of {micro_batch} on each of {dp} DP replicas")
            check_layout(cfg, tp, up, dp, 1)  # the rest of the model; ep just below
        except ValueError as e:
            rejected.append((tp, up, dp, *([ep or 1] if moe else []), str(e)))
            continue
        if not moe:
            ok.append((tp, up, dp))
            continue
        options = [(e, "dp") for e in ([ep] if ep else range(1, dp + 1)) if dp % e == 0 or ep]
        if tp > 1 and ep in (None, tp):
            options.append((tp, "tp"))
        for e, axis in options:
            try:
                check_layout(cfg, tp, up, dp, e, axis)
                ok.append((tp, up, dp, e, axis))
            except ValueError as why:
                if ep and (axis == "tp" or ep != tp):
                    rejected.append((tp, up, dp, e, str(why)))
    return ok, rejected


def plan(model, devices: int, hw="h100-nvlink", *, seq: int, batch: int | None = None,
         micro_batch: int | None = None, methods=METHODS, method_opts: dict | None = None,
         dtype_bytes: float = 2, inter_hw=None, node_size: int = 8,
         timer: OpTimer | None = None, step_model: StepModel = CURRENT,
         local_batch: int | None = None, setup: TrainSetup | None = None, only=None,
         ep: int | None = None):
    """(plans, best first; rejected layouts with the reason). ``batch``: global sequences per
    step (default: ``devices``), or ``local_batch`` sequences per DP replica;
    ``micro_batch``: sequences per forward/backward (default 1, or the local batch).
    ``method_opts``: options passed to the methods that take them (`method_options`).
    ``step_model``: which training step (`commfuse.sim.step.ops.StepModel`). ``setup``: plan
    whole training steps (module doc); None: the GEMMs and collectives only, ranked by step
    time (tokens/s per device, with ``local_batch``). ``only``: a (tp, up, dp) to time
    alone, or (tp, up, dp, ep) for an MoE model (ep "tp": the experts over the TP group).
    ``ep``: plan this expert-parallel size only (MoE models; default: every valid one)."""
    from commfuse.parallel.config import ParallelDims
    from commfuse.sim.step.train import simulate_train_step

    if local_batch is not None and batch is not None:
        raise ValueError("give batch or local_batch, not both")
    if batch is None and local_batch is None:
        batch = devices
    axis_only = None
    if only is not None and len(only) == 4:
        ep, only = only[3], tuple(only[:3])
        if ep == "tp":
            ep, axis_only = only[0], "tp"
    ok, rejected = layouts(model, devices, seq, batch, micro_batch or local_batch or 1,
                           local_batch, ep)
    if only is not None:
        ok = [lay for lay in ok if lay[:3] == tuple(only)
              and (axis_only is None or lay[4] == axis_only)]
        rejected = [r for r in rejected if r[:3] == tuple(only)]
        if not ok and not rejected:
            rejected = [(*only, f"tp*up*dp is not {devices}, or TP and UP combined")]
    timer = timer or OpTimer(dtype_bytes)
    plans = []
    for tp, up, dp, *e in ok:
        e, axis = e if e else (1, "dp")
        b = dp * local_batch if local_batch is not None else batch
        mb = micro_batch or local_batch or 1
        for method in methods:
            dims = ParallelDims(tp=tp, up=up, dp=dp, method=method, world_size=devices,
                                method_opts=method_options(method, method_opts or {}))
            kw = dict(seq=seq, batch=b, micro_batch=mb, dtype_bytes=dtype_bytes,
                      inter_hw=inter_hw, node_size=node_size, timer=timer,
                      step_model=step_model, ep=e, ep_axis=axis)
            if setup is None:
                plans.append(Plan(tp, up, dp, method, simulate_step(model, dims, hw, **kw),
                                  ep=e, ep_axis=axis))
            else:
                t = simulate_train_step(model, dims, hw, setup=setup, **kw)
                plans.append(Plan(tp, up, dp, method, t.base, t, ep=e, ep_axis=axis))
    if setup is None:  # by step time; the same order unless the batch differs (local_batch)
        plans.sort(key=lambda p: (-p.tokens_per_s_per_device, p.tp, p.up, p.ep, p.ep_axis,
                                  p.method))
    else:
        plans.sort(key=lambda p: (not p.fits, -p.tokens_per_s_per_device, p.tp, p.up, p.ep,
                                  p.ep_axis, p.method))
    return plans, rejected


def plan_records(plans) -> list[dict]:
    """Every plan as a dict (for ``commfuse plan --json``): tp, up, dp, ep, ep_axis, method, step_s,
    tokens_per_s_per_device, mfu, peak_memory_gib, fits (None without a setup), the global
    tokens per step, and the seconds per step of each part (``breakdown``)."""
    out = []
    for p in plans:
        r = p.train or p.result
        out.append(dict(tp=p.tp, up=p.up, dp=p.dp, ep=p.ep, ep_axis=p.ep_axis, method=p.method,
                        step_s=p.step_s,
                        tokens_per_s_per_device=p.tokens_per_s_per_device, mfu=p.mfu,
                        peak_memory_gib=p.peak_memory_gib, fits=p.fits,
                        tokens_per_step=p.result.tokens,
                        breakdown=dict(r.breakdown)))
    return out


def method_options(method: str, opts: dict) -> dict:
    """The entries of ``opts`` that ``method`` takes (splits/topology, chunks)."""
    keep = {"decompose": ("topology", "splits"), "commfuse": ("topology", "splits"),
            "sliced": ("chunks",)}.get(method, ())
    return {k: v for k, v in opts.items() if k in keep and v is not None}


def table(plans, top: int | None = None) -> str:
    """A fixed-width table of ``plans`` (best first): step time, throughput, MFU, exposed
    communication, the step's limit (same compute and bytes, no dependency) and the seconds
    per step spent on each group's ops (the MoE ep group's and the experts' edp shards' in
    the DP column: both are DP ranks)."""
    eps = _ep_column(plans)
    head = (f"{'#':>3} {'tp':>3} {'up':>3} {'dp':>5}{eps('ep')} {'method':<10}{'step s':>9}"
            f"{'limit s':>9}"
            f"{'tokens/s':>11}"
            f"{'MFU':>7}{'exposed':>9}{'TP/UP s':>9}{'DP s':>8}{'GEMM s':>8}{'world s':>8}")
    lines = [head, "-" * len(head)]
    for i, p in enumerate(plans[:top] if top else plans, 1):
        r, b = p.result, p.result.breakdown
        lines.append(
            f"{i:>3} {p.tp:>3} {p.up:>3} {p.dp:>5}{eps(p.ep_label)} {p.method:<10}"
            f"{r.step_s:>9.3f}"
            f"{r.limit_s:>9.3f}{r.tokens / r.step_s:>11,.0f}{100 * r.mfu:>6.1f}%"
            f"{100 * r.exposed_comm_s / r.step_s:>8.1f}%{b.get('tp', 0) + b.get('up', 0):>9.3f}"
            f"{b.get('dp', 0) + b.get('ep', 0) + b.get('edp', 0):>8.3f}"
            f"{b.get('local', 0):>8.3f}{b.get('world', 0):>8.3f}")
    return "\n".join(lines)


def train_table(plans, top: int | None = None) -> str:
    """A fixed-width table of whole-step ``plans`` (planned with a setup; best first): step
    time, tokens/s per device, MFU, peak memory and whether it fits, then the seconds per
    step of each part (`commfuse.sim.step.train`): GEMMs and collectives as the ops run them
    ("ops", FSDP's transfers taken out), fused attention, memory-bound work, recompute, what
    FSDP's prefetch leaves exposed (transfers and the compute they slow)."""
    eps = _ep_column(plans)
    head = (f"{'#':>3} {'tp':>3} {'up':>3} {'dp':>5}{eps('ep')} {'method':<10}{'step s':>8}"
            f"{'tok/s/dev':>10}{'MFU':>7}{'mem GiB':>9}{'fits':>5}"
            f"{'ops s':>8}{'attn s':>8}{'membw s':>8}{'recomp s':>9}{'DP exp s':>9}")
    lines = [head, "-" * len(head)]
    for i, p in enumerate(plans[:top] if top else plans, 1):
        b = p.train.breakdown
        lines.append(
            f"{i:>3} {p.tp:>3} {p.up:>3} {p.dp:>5}{eps(p.ep_label)} {p.method:<10}"
            f"{p.step_s:>8.3f}"
            f"{p.tokens_per_s_per_device:>10,.0f}{100 * p.mfu:>6.1f}%"
            f"{p.peak_memory_gib:>9.1f}{'yes' if p.fits else 'NO':>5}"
            f"{b.get('ops', 0):>8.3f}{b.get('attention', 0):>8.3f}"
            f"{b.get('memory-bound', 0):>8.3f}{b.get('recompute', 0):>9.3f}"
            f"{b.get('dp exposed', 0) + b.get('dp interference', 0):>9.3f}")
    return "\n".join(lines)


def _ep_column(plans):
    """A formatter of the ep column: 5 wide where any plan has ep > 1, else nothing."""
    if any(p.ep > 1 for p in plans):
        return lambda v: f"{v:>5}"
    return lambda v: ""
