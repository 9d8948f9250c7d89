"""``commfuse train --compare-none``: the run beside the same steps under method ``none``,
and the verdict, as one line a reader can act on and as fields of the ``--metrics-json`` file.

The built-in Llama's two runs are paired (`paired_rank`): two models built alike on the same
ranks, each step run by one then the other on the same batch (the order swapped every step),
so a machine that speeds up or slows down during the run does so for both. An --hf-config
run and its ``none`` run are sequential (`sequential_none`).

Three figures: the step-time ratio (paired: the median of each step's ratio; sequential: the
ratio of the median step times; the first step, a warm-up, left out), how much of the
communication ``none`` leaves exposed the method hid (1 - its exposed / none's, both measured
after training by `commfuse.train.report.exposed`), and the largest difference of a step's
loss (the same arithmetic in another summation order, so it stays small). A ratio within
`SAME` of 1 is called no gain. On loopback a transfer costs no time, so there is nothing to
hide and the ratio measures the schedules' overhead; the line says so instead of claiming an
overlap.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

SAME = 0.03
"""|ratio - 1| up to which the two methods are called equally fast."""
LOSS_TOL = {"float32": 0.01, "bfloat16": 0.05}
"""Largest |loss - loss(none)|, relative to none's final loss, that summation order explains."""


def link_label(world: int, device: str = "cpu") -> str:
    """The ranks' network: "none" for one process, the emulated cluster's label
    (``COMMFUSE_LINK``, set by `commfuse.testbed.launch`), "loopback" for ranks spawned here,
    else the cluster's own."""
    if world == 1:
        return "none"
    if "COMMFUSE_LINK" in os.environ:
        return os.environ["COMMFUSE_LINK"]
    if device == "cuda":
        return "NCCL between GPUs"
    return "the cluster's network" if "RANK" in os.environ else "loopback"


@dataclass
class Verdict:
    """One ``--compare-none``: the method's run against none's, with the line that says it."""

    method: str
    """The run's method (the one compared with none)."""
    link: str
    """The ranks' network (`link_label`)."""
    steps: int
    """Steps both runs trained, each compared."""
    step_s: float
    """The method's median step time (seconds, steps after the first)."""
    none_step_s: float
    """none's median step time."""
    exposed_s: float | None
    """The method's exposed communication per fwd+bwd (None: not measured)."""
    none_exposed_s: float | None
    """none's exposed communication per fwd+bwd."""
    none_fwd_bwd_s: float | None
    """none's fwd+bwd(+grad sync) time, of which none_exposed_s is a part."""
    max_loss_diff: float
    """Largest |loss - loss(none)| over the steps."""
    loss_tol: float
    """The largest difference summation order explains (`LOSS_TOL` x none's final loss)."""
    step_ratios: list[float] | None = None
    """Paired runs: each step's time over none's in the same step (steps after the first);
    None: the runs were sequential."""

    @property
    def ratio(self) -> float:
        """The method's step time over none's, below 1 is faster: the median of
        ``step_ratios`` where paired, else the ratio of the median step times."""
        if self.step_ratios:
            return statistics.median(self.step_ratios)
        return self.step_s / self.none_step_s

    @property
    def hidden(self) -> float | None:
        """The share of none's exposed communication the method hid (None: not measured or
        none exposes nothing)."""
        if self.exposed_s is None or not self.none_exposed_s:
            return None
        return 1.0 - self.exposed_s / self.none_exposed_s

    @property
    def losses_equal(self) -> bool:
        return self.max_loss_diff <= self.loss_tol

    @property
    def loopback(self) -> bool:
        return self.link.startswith("loopback")

    def line(self) -> str:
        """The verdict in one line: ratio, what it means, the loss check."""
        m, r = self.method, self.ratio
        speed = f"{m} step {r:.2f}x of none"
        if self.link == "none":
            what = f"{speed} in one process, which has nothing to communicate: the ratio is noise"
        elif self.loopback:
            what = (f"{speed} on loopback, which cannot show overlap: transfers cost no time "
                    f"there and the ranks share the cores, so the ratio is the schedules' "
                    f"overhead and noise (as root with iproute2 the ranks run on the emulated "
                    f"1 Gbit/s links, where overlap shows)")
        elif r < 1 - SAME:
            what = f"{speed} ({100 * (1 - r):.0f} % less time per step){self._hiding()}"
        elif r > 1 + SAME:
            what = (f"{speed} ({100 * (r - 1):.0f} % MORE time per step): slower "
                    f"here{self._hiding()}")
        else:
            what = (f"{speed}: no gain beyond the {100 * SAME:.0f} % step times "
                    f"vary{self._hiding()}")
        loss = ("losses identical" if self.max_loss_diff == 0 else
                f"losses equal within {self.max_loss_diff:.2g}" if self.losses_equal else
                f"losses DIFFER by up to {self.max_loss_diff:.3g}, more than the "
                f"{self.loss_tol:.2g} summation order explains")
        return f"verdict: {what}; {loss} over {self.steps} steps"

    def _hiding(self) -> str:
        """What the method did with none's exposed communication, for the line."""
        if self.exposed_s is None or self.none_exposed_s is None:
            return ""
        ms = lambda s: f"{s * 1e3:.0f} ms"
        change = f"({ms(self.none_exposed_s)} -> {ms(self.exposed_s)} per fwd+bwd)"
        if self.none_fwd_bwd_s and self.none_exposed_s < 0.15 * self.none_fwd_bwd_s:
            return (f"; little to hide: none exposes {ms(self.none_exposed_s)} of its "
                    f"{ms(self.none_fwd_bwd_s)} fwd+bwd")
        if self.hidden < 0:
            return f"; yet it exposed more communication than none {change}: a noisy machine?"
        return (f": {100 * self.hidden:.0f} % of the communication none leaves exposed hidden "
                f"{change}")

    def fields(self) -> dict:
        """The verdict as JSON fields: the measurements, the derived figures and the line."""
        return {**dataclasses.asdict(self), "ratio": self.ratio, "hidden": self.hidden,
                "losses_equal": self.losses_equal, "loopback": self.loopback,
                "line": self.line()}


def verdict(cfg, first: list[dict], base: list[dict], link: str,
            paired: bool = False) -> Verdict:
    """Compare the method's run ``first`` with none's ``base`` (per-step metrics, each with
    its summary as ``.summary`` where measured: `commfuse.train.report.Steps`); ``paired``:
    their steps ran in turn (`paired_rank`), so each step's times are compared."""
    med = lambda ms: statistics.median(m["step_s"] for m in ms[1:] or ms)
    summary = lambda ms: getattr(ms, "summary", {}) or {}
    s, n = summary(first), summary(base)
    pairs = list(zip(first, base))
    ratios = [a["step_s"] / b["step_s"] for a, b in pairs[1:] or pairs] if paired else None
    return Verdict(method=cfg.method, link=link, steps=min(len(first), len(base)),
                   step_s=med(first), none_step_s=med(base),
                   exposed_s=s.get("exposed_comm_s"), none_exposed_s=n.get("exposed_comm_s"),
                   none_fwd_bwd_s=n.get("fwd_bwd_s"),
                   max_loss_diff=max(abs(a["loss"] - b["loss"]) for a, b in zip(first, base)),
                   loss_tol=LOSS_TOL[cfg.dtype] * abs(base[-1]["loss"]), step_ratios=ratios)


def record(path: str, v: Verdict) -> None:
    """Add the verdict to the run's ``--metrics-json`` file as its "compare_none" object."""
    data = json.loads(Path(path).read_text())
    data["compare_none"] = v.fields()
    Path(path).write_text(json.dumps(data, indent=1))


def sequential_none(cfg):
    """The config of the ``none`` run that follows the method's (--hf-config): the same
    steps from scratch, nothing saved or written."""
    return dataclasses.replace(cfg, method="none", checkpoint_dir=None, resume=False,
                               metrics_json=None)


def paired_rank(rank: int, world: int, cfg) -> tuple[list[dict], list[dict]]:
    """One rank of --compare-none on the built-in Llama: the method's model and none's, built
    alike (the same seed, each on process groups of its own), both resumed with ``--resume``,
    step in turn on the same batch, the order swapped every step; then each one's exposed
    communication. Returns both runs' per-step metrics (`commfuse.train.report.Steps`); only
    the method's run prints its progress, saves checkpoints and writes ``--metrics-json``."""
    from commfuse.train import loop
    from commfuse.train.config import DTYPES
    from commfuse.train.report import exposed, finish, measure_matmul_flops, progress

    device = loop.device_of(cfg)
    loop.fit_cost_model(cfg, rank, device)
    none_cfg = dataclasses.replace(cfg, method="none", metrics_json=None, progress=False)
    runs = (loop.build_llama(cfg, world, device), loop.build_llama(none_cfg, world, device))
    data = loop.llama_batches(runs[0])
    peak = cfg.peak_flops or measure_matmul_flops(dtype=DTYPES[cfg.dtype], device=device)
    show = cfg.progress and rank == 0
    if show:
        print(f"{loop.header(runs[0], peak, world)}; each step also run by method none "
              f"(--compare-none), in turn", flush=True)
    metrics: tuple[list[dict], list[dict]] = ([], [])
    for step in range(runs[0].start, loop.last_step(cfg)):
        tokens, targets = loop.batch_at(cfg, data, step, device)
        for i in (0, 1) if step % 2 == 0 else (1, 0):  # neither always first
            metrics[i].append(loop.llama_step(runs[i], step, tokens, targets, peak, world))
        if show:
            progress(metrics[0], cfg.steps)
        loop.save_if_due(runs[0], step, world)
    out = []
    for run, ms in zip(runs, metrics):
        summary = {"exposed_comm_s": None, "peak_flops_per_rank": peak}
        if ms and cfg.exposed_iters and world > 1:
            summary.update(exposed(run.pmodel, tokens, targets, cfg.exposed_iters))
        out.append(finish(run.cfg, rank, world, ms, summary, show and run is runs[0]))
    return out[0], out[1]
