"""The training benchmark's configurations and its table (`commfuse bench train`); pure.

A configuration is (preset, layout, method); a run is one ``commfuse train`` of it, whose rank
0 writes its metrics JSON ({config, world, steps: [per-step metrics], summary}, see
`commfuse.train.loop`). `aggregate` turns the runs of every configuration (several repeats,
interleaved) into rows: per method the median over repeats of the run's median step, the
ratio to ``none`` of the same preset and layout, tokens/s, MFU, exposed communication, the
simulator's predicted step and the step's limit, and whether its losses equal ``none``'s.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass

from commfuse.schedule import VARIANTS

LAYOUT_RE = re.compile(r"^(?:(tp|up|dp)(\d+))(?:x(tp|up|dp)(\d+))*$")


@dataclass(frozen=True)
class Config:
    """One training configuration of the benchmark."""

    preset: str
    """A `commfuse.models.config.PRESETS` name (tiny, small)."""
    tp: int
    up: int
    dp: int
    method: str
    """A label of `commfuse.schedule.VARIANTS` (none, sliced, commfuse, commfuse-m4, auto...)."""
    prefetch: str | None = None
    """ZeRO-3 prefetch: ``commfuse train --prefetch`` N (blocks ahead; 0 off), ``Nr`` adds
    ``--reduce-in-op``; None: the default, not passed."""
    regather: bool = True
    """The backward posts AG->GEMM re-gathers ahead (`commfuse.ops.prefetch`; TP only)."""
    query_split: bool | None = None
    """TP attention and its out-projection per query slice: True ``commfuse train
    --query-split`` (label suffix "-qs"), False ``--no-query-split`` ("-noqs"), None the
    default (auto's cost model chooses; row-parallel for the other methods)."""
    hardware: str | None = None
    """``commfuse train --hardware`` (label suffix "@NAME", e.g. "auto@cpu-testbed": the
    preset instead of the model fitted at start); None: the default, not passed."""

    @property
    def world(self) -> int:
        return self.tp * self.up * self.dp

    @property
    def layout(self) -> str:
        axes = "x".join(f"{a}{n}" for a, n in (("tp", self.tp), ("up", self.up), ("dp", self.dp))
                        if n > 1) or "single"
        return axes if self.prefetch is None else f"{axes}-pf{self.prefetch}"

    @property
    def key(self) -> str:
        """A file-name-safe id of the configuration."""
        return f"{self.preset}-{self.layout}-{self.label}"

    @property
    def label(self) -> str:
        """The method, "-qs" / "-noqs" with query-split attention forced on / off,
        "-noprefetch" without the backward prefetch."""
        return (self.method + {None: "", True: "-qs", False: "-noqs"}[self.query_split]
                + ("" if self.regather else "-noprefetch")
                + ("" if self.hardware is None else f"@{self.hardware}"))

    def train_flags(self) -> list[str]:
        """``commfuse train`` flags of this configuration (the method's options included)."""
        method, opts = VARIANTS[self.method]
        flags = ["--preset", self.preset, "--tp", str(self.tp), "--up", str(self.up),
                 "--dp", str(self.dp), "--method", method]
        if self.prefetch is not None:
            flags += ["--prefetch", self.prefetch.rstrip("r")]
            flags += ["--reduce-in-op"] if self.prefetch.endswith("r") else []
        for k, v in opts.items():
            if k != "collective":
                flags += ["--" + k, str(v)]
        return (flags + {None: [], True: ["--query-split"], False: ["--no-query-split"]}[
            self.query_split] + ([] if self.regather else ["--no-regather-prefetch"])
            + ([] if self.hardware is None else ["--hardware", self.hardware]))


def rotated(cfgs: list[Config], turn: int) -> list[Config]:
    """``cfgs`` with each run of consecutive configurations of one preset, layout and
    ``--prefetch`` value (its methods) rotated left by ``turn``: over repeats every method
    takes every place in the order."""
    out: list[Config] = []
    i = 0
    while i < len(cfgs):
        group = (cfgs[i].preset, cfgs[i].layout)
        j = i
        while j < len(cfgs) and (cfgs[j].preset, cfgs[j].layout) == group:
            j += 1
        k = turn % (j - i)
        out += cfgs[i + k:j] + cfgs[i:i + k]
        i = j
    return out


def parse_layout(text: str) -> tuple[int, int, int]:
    """``tp2`` -> (2, 1, 1); ``tp2xdp2`` -> (2, 1, 2). ValueError on anything else."""
    m = LAYOUT_RE.match(text.strip())
    if not m:
        raise ValueError(f"layout must look like tp2, up2, dp2 or tp2xdp2, got {text!r}")
    sizes = {"tp": 1, "up": 1, "dp": 1}
    for axis, n in re.findall(r"(tp|up|dp)(\d+)", text):
        if int(n) < 1:
            raise ValueError(f"layout {text!r}: {axis} must be >= 1")
        sizes[axis] = int(n)
    return sizes["tp"], sizes["up"], sizes["dp"]


def configs(presets, layouts, methods, prefetch=(None,), regather=(True,)) -> list[Config]:
    """Every preset x layout x prefetch x method x regather setting, methods (then regather)
    innermost (each layout's methods together); ``prefetch``: the ``--prefetch`` values
    (None: not passed); ``regather``: with and/or without the backward's re-gather prefetch.
    A method label may end in "-qs" / "-noqs" (query-split attention on / off; TP layouts
    only, skipped in the others), and then in "@NAME" (``--hardware NAME``)."""
    from commfuse.ops.auto import hardware_choices

    hw = [m.partition("@")[2] or None for m in methods]
    parsed = [split_query_split(m.partition("@")[0]) for m in methods]
    bad = [m for m, (v, _), h in zip(methods, parsed, hw)
           if v not in VARIANTS or VARIANTS[v][1].get("collective")
           or (h is not None and h not in hardware_choices())]
    if bad:
        raise ValueError(f"unknown method(s) {bad}; choose from "
                         f"{[v for v in VARIANTS if not VARIANTS[v][1].get('collective')]}, "
                         f"each optionally with -qs or -noqs, then @ and one of "
                         f"{list(hardware_choices())}")
    out = []
    for preset in presets:
        for layout in layouts:
            tp, up, dp = parse_layout(layout)
            out += [Config(preset, tp, up, dp, m, pf, r, q, h) for pf in prefetch
                    for (m, q), h in zip(parsed, hw) if q is None or tp > 1 for r in regather]
    return out


def split_query_split(label: str) -> tuple[str, bool | None]:
    """``"commfuse-qs"`` -> ("commfuse", True); ``"auto-noqs"`` -> ("auto", False);
    ``"auto"`` -> ("auto", None)."""
    for suffix, value in (("-noqs", False), ("-qs", True)):
        if label.endswith(suffix):
            return label[:-len(suffix)], value
    return label, None


def run_row(metrics: dict) -> dict:
    """The numbers of one run from its metrics JSON: median step, tokens/s, MFU, exposed
    communication (None if not measured), and the per-step losses."""
    s = metrics["summary"]
    return {"step_s": s["median_step_s"], "tokens_per_s": s["median_tokens_per_s"],
            "mfu": s["median_mfu"], "exposed_s": s.get("exposed_comm_s"),
            "losses": [m["loss"] for m in metrics["steps"]]}


def aggregate(runs: dict, predictions: dict | None = None, loss_tol: float = 1e-4) -> list[dict]:
    """Rows of the table. ``runs``: Config -> [metrics JSON of each repeat]; ``predictions``:
    Config -> (predicted step s, limit s). Per configuration the medians over its repeats;
    ``vs_none`` divides by ``none``'s median step of the same preset and layout, without the
    backward prefetch where it ran both ways (the plain reference; None without a ``none``
    run); ``losses`` compares the first repeat's per-step losses with ``none``'s:
    "equal" within ``loss_tol`` (relative), else the largest difference."""
    predictions = predictions or {}
    rows = []
    for cfg, metrics in runs.items():
        if not metrics:
            continue
        per = [run_row(m) for m in metrics]
        med = lambda key: (statistics.median(r[key] for r in per)
                           if all(r[key] is not None for r in per) else None)
        rows.append({"config": cfg, "repeats": len(per), "step_s": med("step_s"),
                     "tokens_per_s": med("tokens_per_s"), "mfu": med("mfu"),
                     "exposed_s": med("exposed_s"), "losses": per[0]["losses"],
                     "predicted_s": predictions.get(cfg, (None, None))[0],
                     "limit_s": predictions.get(cfg, (None, None))[1]})
    nones = sorted((r for r in rows if r["config"].method == "none"),  # the plain one wins
                   key=lambda r: (r["config"].query_split is not None, not r["config"].regather))
    base = {(r["config"].preset, r["config"].layout): r for r in nones}
    for r in rows:
        b = base.get((r["config"].preset, r["config"].layout))
        r["vs_none"] = r["step_s"] / b["step_s"] if b else None
        r["loss_check"] = _loss_check(r["losses"], b["losses"], loss_tol) if b else "no none run"
    return rows


def _loss_check(losses: list[float], ref: list[float], tol: float) -> str:
    if len(losses) != len(ref):
        return f"{len(losses)} steps vs {len(ref)}"
    diff = max((abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref)), default=0.0)
    return "equal" if diff <= tol else f"differ (max rel {diff:.1e})"


HEADER = ("| preset | layout | method | median step ms | vs none | tokens/s | MFU | exposed comm "
          "ms | predicted ms | limit ms | losses vs none |")


def _ms(x) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


def row_line(r: dict) -> str:
    """One markdown row."""
    c = r["config"]
    ratio = "-" if r["vs_none"] is None else f"{r['vs_none']:.3f}"
    return (f"| {c.preset} | {c.layout} | {c.label} | {_ms(r['step_s'])} | {ratio} | "
            f"{r['tokens_per_s']:,.0f} | {100 * r['mfu']:.2f}% | {_ms(r['exposed_s'])} | "
            f"{_ms(r['predicted_s'])} | {_ms(r['limit_s'])} | {r['loss_check']} |")


def markdown(rows: list[dict], meta: dict) -> str:
    """The benchmark document: what ran, where, the exact command, the table, the legend."""
    lines = [f"# {meta['title']}", "",
             f"- date: {meta['date']}", f"- machine: {meta['machine']}",
             f"- torch {meta['torch']}; link: {meta['link']}; ranks per layout: tp*up*dp",
             f"- run: {meta['run']}", f"- command: `{meta['command']}`", "",
             HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    lines += [row_line(r) for r in rows]
    lines += ["", LEGEND.format(**meta)]
    return "\n".join(lines) + "\n"


LEGEND = """\
Columns: median step = the median over repeats of each run's median step time (rank 0's,
first step excluded: warm-up); vs none = that divided by method none's of the same preset and
layout (its run without the backward prefetch where there are both; "-noprefetch": the
backward posts no re-gather ahead, `commfuse train --no-regather-prefetch`); tokens/s and MFU as `commfuse train` reports them (MFU against each rank's measured
dense-matmul peak); exposed comm = fwd+bwd(+grad sync) minus the same in compute-only mode,
medians of {exposed_iters} interleaved pairs after training; predicted =
`commfuse.sim.step.simulate_train_step` of the same model, layout, method, batch and sequence on
the `{hw}` hardware model, for the training step {step_model}: the GEMMs and communication,
fused attention, the elementwise kernels, the loss and the AdamW step, as `commfuse train`
runs them (no activation checkpointing, no FSDP2 prefetch); limit = the same compute and
bytes with no dependency between them (max(compute alone, wire time) per rank, same
model); losses vs none = every step's loss
within a relative {loss_tol:g} of method none's (the same seed and data)."""
