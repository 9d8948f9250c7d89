"""A hardware model's compute (`commfuse.sim.Hardware`) fitted, at start, to this device.

A preset's compute figures are one machine's fit, and a VM does not keep one speed (the CPU
testbed's GEMM rate has moved by 2x between VMs of one kind, its attention and elementwise
rates independently of it); every choice of ``auto`` depends on how long the compute beside a
transfer takes.

`measure` times, on this rank's device and in the run's dtype, two GEMMs (``GEMM_SHAPE``, and
``SMALL_GEMM_SHAPE`` with fewer rows, as a finely split op's pieces have), where the model has a
narrow regime (``Hardware.narrow_rows``) two ``NARROW_SHAPES`` GEMMs walked through a buffer as
a split op's pieces are, and, where the model times attention as a fused kernel, one causal
``ATTENTION_SHAPE`` attention: ``REPEATS`` runs of each in ``ROUNDS`` rounds (`_rounds`). The
large GEMM's rate is its median, every other kernel's is set by the median of its ratio to
the large GEMM within a round. `probe` gives every rank the rates of the rank whose large GEMM
was slowest (one all-gather, 3 significant digits, so all hold one model and make the same
choices) and, on a CPU gloo group, the largest slowdown of a GEMM beside an exchange
(`transfer_slowdown`: what a piece in flight takes from the compute beside it) and the
largest host time per post (`post_cost`: what a piece costs), both in
`commfuse.runtime.tax`. `fit` sets the GEMM peak and row overhead ``m0``
(`Hardware.gemm_efficiency`), the narrow regime's rate and its fall with B's size, the
attention efficiency (forward and backward alike), ``interference`` and ``host_p2p_s`` to
predict them.

Why each part (docs/design.md, "The model's compute is fitted"; docs/benchmarks/simulator.md):
the slowdown, because the rank's own core runs the network stack of the emulated links
(docs/benchmarks/testbed.md); two GEMMs and the narrow regime, because a GEMM of a few hundred
rows runs well below a 1024-row one (a step near 176 rows, not a curve) and a peak-only fit
split too finely; medians in rounds, because a VM has spells of seconds at half speed;
measuring again, because a fresh process's first probe can spread its rounds far more than
later ones. Memory bandwidth, host time per collective launch and the links stay
the model's (a link's rate is the network's; one probe message would not improve that fit).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

from commfuse.runtime.tax import GEMM_SHAPE, _NOT_TIMED, _rounds, post_cost, transfer_slowdown
from commfuse.sim.hardware import Hardware  # (torch is imported where a device is timed)

# per device type: ~30 ms of a CPU core for the GEMM and the attention, ~1 ms of an H100
SMALL_GEMM_SHAPE = {"cpu": (256, 1024, 2048), "cuda": (1024, 8192, 8192)}  # fewer rows only
# two narrow GEMMs (B of 2^21 elements and 4x that) for `Hardware.narrow_rows`'s regime
NARROW_SHAPES = {"cpu": ((128, 1024, 2048), (128, 2048, 4096)), "cuda": ()}
ATTENTION_SHAPE = {"cpu": (1, 4, 2048, 64), "cuda": (4, 32, 4096, 128)}  # B, H, S, d
REPEATS = 20
ROUNDS = 4  # `measure`'s REPEATS runs in that many rounds (`_rounds`)
SPREAD_LIMIT, ATTEMPTS = 1.25, 3  # `probe` measures again (<= 3 in all) over that spread


@dataclass(frozen=True)
class Rates:
    """What one device measured (or the group's slowest, after `probe`)."""

    gemm_flops: float
    """flop/s of the ``GEMM_SHAPE`` GEMM."""
    attention_flops: float | None
    """flop/s (causal FLOPs) of the ``ATTENTION_SHAPE`` fused attention; None: not timed."""
    small_gemm_flops: float | None = None
    """flop/s of the ``SMALL_GEMM_SHAPE`` GEMM; None: not timed (the model's m0 is kept)."""
    interference: float | None = None
    """How much longer the ``GEMM_SHAPE`` GEMM takes while the rank exchanges messages with
    its neighbours (`transfer_slowdown`); None: not timed (the model's is kept)."""
    narrow_flops: tuple | None = None
    """flop/s of each ``NARROW_SHAPES`` GEMM; None: not timed (the model's regime is kept)."""
    spread: float | None = None
    """The large GEMM's second-slowest round over its fastest (`measure`); after `probe`, the
    largest rank's, or the fastest rank's rate over the slowest's if larger, in the attempt
    it kept (of ``attempts``)."""
    attempts: int = 1
    post_s: float | None = None
    """Host seconds to post one batch of P2P transfers (`post_cost`); None: not timed (the
    model's ``host_p2p_s`` is kept)."""

    def line(self) -> str:
        small = f" ({self.small_gemm_flops / 1e9:.1f} at fewer rows)" \
            if self.small_gemm_flops else ""
        if self.narrow_flops:
            small += " (narrow: " + ", ".join(f"{r / 1e9:.1f}" for r in self.narrow_flops) + ")"
        attn = f", attention {self.attention_flops / 1e9:.1f} GFLOP/s" \
            if self.attention_flops else ""
        slow = "" if self.interference is None else \
            f", GEMM {self.interference:.2f} slower beside transfers"
        if self.post_s is not None:
            slow += f", {self.post_s * 1e6:.0f} us per post"
        again = f" (best of {self.attempts} probes)" if self.attempts > 1 else ""
        spread = "" if self.spread is None else f", spread {self.spread:.2f}x{again}"
        return f"GEMM {self.gemm_flops / 1e9:.1f} GFLOP/s{small}{attn}{slow}{spread}"


def _key(device_type: str) -> str:
    """The probe's shapes' key for a device type (every accelerator times the CUDA ones)."""
    return "cpu" if device_type == "cpu" else "cuda"


def attention_flops(B: int, H: int, S: int, d: int) -> float:
    """Causal FLOPs of attention over S tokens (QK^T and PV, 2 a multiply-add; row p sees
    p + 1 keys), as `commfuse.sim.attention` counts them."""
    return 4.0 * B * H * d * S * (S + 1) / 2


def measure(device="cpu", dtype=None, attention: bool = True, repeats: int = REPEATS,
            narrow: bool = False) -> Rates:
    """This device's `Rates` in ``dtype`` (default float32; ``attention``: time the fused
    attention kernel too; ``narrow``: the ``NARROW_SHAPES`` GEMMs too): ``repeats`` runs of
    each in `ROUNDS` rounds (`_rounds`; a narrow walk once a round). The large GEMM's rate is
    the median of its rounds'; each other kernel's is the large one's times the median over
    rounds of their ratio within a round, so a slow spell over a round moves neither m0 nor
    the narrow regime's fit."""
    import torch
    import torch.nn.functional as F

    dtype = dtype or torch.float32
    device = torch.device(device)
    key = _key(device.type)
    gen = torch.Generator(device="cpu").manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)
    m, k, n = GEMM_SHAPE[key]
    a, b = rand(m, k), rand(k, n)
    ms = SMALL_GEMM_SHAPE[key][0]
    fns = {"gemm": lambda: a @ b, "small": lambda: a[:ms] @ b}
    flops = {"gemm": 2.0 * m * k * n, "small": 2.0 * ms * k * n}
    if attention:
        B, H, S, d = ATTENTION_SHAPE[key]
        q, kk, v = rand(B, H, S, d), rand(B, H, S, d), rand(B, H, S, d)
        fns["attention"] = lambda: F.scaled_dot_product_attention(q, kk, v, is_causal=True)
        flops["attention"] = attention_flops(B, H, S, d)
    for i, (mn, kn, nn) in enumerate(NARROW_SHAPES[key] if narrow else ()):
        fns[f"narrow{i}"], flops[f"narrow{i}"] = _walk(rand(8 * mn, kn), rand(kn, nn), mn)
    rounds = min(ROUNDS, repeats)
    runs = {name: 1 if name.startswith("narrow") else max(1, repeats // rounds) for name in fns}
    times = _rounds(fns, device, rounds, runs)
    rate = _paired_rates(times, flops, "gemm")
    narrow_rates = tuple(rate[name] for name in fns if name.startswith("narrow"))
    gemm = sorted(times["gemm"])
    return Rates(rate["gemm"], rate.get("attention"), rate["small"],
                 narrow_flops=narrow_rates or None, spread=gemm[-2 if len(gemm) > 1 else 0]
                 / gemm[0])


def _paired_rates(times: dict, flops: dict, ref: str) -> dict[str, float]:
    """flop/s per kernel from its seconds per round (`_rounds`): ``ref``'s from the median of
    its rounds, every other's from ``ref``'s and the median of their ratio within a round."""
    r = flops[ref] / statistics.median(times[ref])
    return {name: r * statistics.median(g / t for g, t in zip(times[ref], times[name]))
            * flops[name] / flops[ref] for name in times}


def _walk(x, w, rows: int):
    """(a function multiplying ``rows``-row slices of ``x`` by ``w``, the slices walked through
    ``x`` one after another as a split op's pieces are; its flops)."""
    slices = [x[i:i + rows] for i in range(0, x.shape[0] - rows + 1, rows)]
    return (lambda: [s @ w for s in slices]), 2.0 * rows * x.shape[1] * w.shape[1] * len(slices)


def fit(hw: Hardware, rates: Rates, device_type: str = "cpu") -> Hardware:
    """``hw`` with its GEMM peak, row overhead m0 (where ``rates`` has the small GEMM) and
    attention efficiency set so that it predicts ``rates`` for the probe's shapes on
    ``device_type`` (the rest unchanged). m0 is kept >= 0: a small GEMM measured as fast as
    the large one (or faster) gives m0 = 0 and a peak fitted to the large one. Where ``hw``
    has a narrow regime and ``rates`` the narrow GEMMs, its efficiency and decay are set to
    predict both (the efficiency capped at 1, the decay kept >= 0: a narrow GEMM is never
    modelled faster than the wide formula). Where timed, ``interference`` is the slowdown
    beside transfers and ``host_p2p_s`` the host time per post (each kept >= 0)."""
    small = rates.small_gemm_flops
    for name, v in (("gemm_flops", rates.gemm_flops), ("small_gemm_flops", small)):
        if v is not None and not v > 0:
            raise ValueError(f"{name} must be > 0, got {v!r}")
    key = _key(device_type)
    m, k, n = GEMM_SHAPE[key]
    out = hw if rates.interference is None else replace(hw, interference=max(
        0.0, rates.interference))
    if rates.post_s is not None:
        out = replace(out, host_p2p_s=max(0.0, rates.post_s))
    if small is not None:
        # rate = peak * eff / (1 + m0/m + c) at both row counts, c = n0/n + k0/k: solve m0
        r, r_s, m_s, c = rates.gemm_flops, small, SMALL_GEMM_SHAPE[key][0], hw.n0 / n + hw.k0 / k
        if r_s / m_s <= r / m:  # slower per row than the large one's whole: not a row cost
            raise ValueError(f"small_gemm_flops {r_s!r} is below {m_s}/{m} of gemm_flops {r!r}")
        out = replace(out, m0=max(0.0, (r - r_s) * (1 + c) / (r_s / m_s - r / m)))
    gemm = rates.gemm_flops * out.gemm_time(m, k, n) / (2.0 * m * k * n)  # ratio to the model's
    out = replace(out, gemm_flops=out.gemm_flops * gemm)
    if rates.narrow_flops and out.narrow_rows:
        # each narrow rate over the wide formula's at its shape: the regime's factor at
        # the first B size, and its power law in k n from the two
        wide = replace(out, narrow_rows=0.0)
        (f1, kn1), (f2, kn2) = ((r * wide.gemm_time(ms, ks, ns) / (2.0 * ms * ks * ns), ks * ns)
                                for r, (ms, ks, ns) in zip(rates.narrow_flops,
                                                           NARROW_SHAPES[key]))
        out = replace(out, narrow_efficiency=min(1.0, f1),
                      narrow_decay=max(0.0, math.log(f1 / f2) / math.log(kn2 / kn1)))
    if rates.attention_flops and out.attention_efficiency[0]:
        B, H, S, d = ATTENTION_SHAPE[key]
        flops = attention_flops(B, H, S, d)
        factor = rates.attention_flops * out.attention_time(flops, (S + 1) / 2,
                                                             rows_per_call=S) / flops
        out = replace(out, attention_efficiency=tuple(
            min(1.0, e * factor) for e in out.attention_efficiency))
    return out


def probe(hw: Hardware, group=None, device="cpu", dtype=None) -> tuple[Hardware, Rates]:
    """``(hw fitted to the slowest rank's rates, those rates)``: every rank of ``group`` (the
    default group if initialised; else this process alone) runs `measure`; the ranks gather
    them and every rank takes the rates of the one whose large GEMM was slowest (ties: the
    lowest rank) and the largest slowdown beside transfers and host time per post, so all
    share one model. Where a
    rank's rounds spread over `SPREAD_LIMIT` (`Rates.spread`) or the ranks' large-GEMM rates
    differ by more, all measure again (decided on the gathered rates, so all agree), up to
    `ATTEMPTS` times, and keep the attempt of the smallest spread."""
    import torch
    import torch.distributed as dist

    device = torch.device(device)
    many = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    kept = None
    for attempt in range(1, ATTEMPTS + 1):
        rates = measure(device, dtype, bool(hw.attention_efficiency[0]),
                        narrow=bool(hw.narrow_rows))
        if attempt == 1:  # the slowdown once: it is a median of turns, each with its own idle
            slowdown = transfer_slowdown(hw, group, dtype) if device.type == "cpu" else None
            post = post_cost(group) if device.type == "cpu" else None
        narrow = rates.narrow_flops or (0.0,) * len(NARROW_SHAPES[_key(device.type)])
        rows = [[rates.gemm_flops, rates.attention_flops or 0.0, rates.small_gemm_flops or 0.0,
                 _NOT_TIMED if slowdown is None else slowdown, rates.spread or 1.0,
                 _NOT_TIMED if post is None else post, *narrow]]
        if many:
            t = torch.tensor(rows[0], dtype=torch.float64,
                             device=device if dist.get_backend(group) == "nccl" else "cpu")
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, t, group=group)
            rows = [p.tolist() for p in parts]
        gemm = [row[0] for row in rows]
        spread = max(max(row[4] for row in rows), max(gemm) / min(gemm))
        if kept is None or spread < kept[0]:
            kept = (spread, rows)
        if spread <= SPREAD_LIMIT:
            break
    spread, rows = kept
    slowest = min(rows, key=lambda row: row[0])
    g, a, s = (float(f"{v:.3g}") for v in slowest[:3])
    timed = [row[3] for row in rows if row[3] != _NOT_TIMED]
    slowdown = round(max(timed), 2) if timed else None  # the largest rank's
    posts = [row[5] for row in rows if row[5] != _NOT_TIMED]
    post = float(f"{max(posts):.2g}") if posts else None  # the largest rank's
    narrow = tuple(float(f"{v:.3g}") for v in slowest[6:])
    rates = Rates(g, a or None, s or None, slowdown, narrow if all(narrow) else None,
                  round(spread, 2), attempt, post)
    return fit(hw, rates, device.type), rates


FITTED = ("gemm_flops", "m0", "attention_efficiency", "interference", "narrow_efficiency",
          "narrow_decay", "host_p2p_s")  # what `fit` changes


def fitted_fields(hw: Hardware) -> dict:
    """The fields `fit` sets, as a run's JSON records them (``commfuse bench``'s meta)."""
    return {name: getattr(hw, name) for name in FITTED}


def from_fields(fields: dict, hw: Hardware) -> Hardware:
    """``hw`` with the fitted fields a run recorded (`fitted_fields`; those absent, as in files
    from before the probe fitted them, stay ``hw``'s)."""
    return replace(hw, **{name: tuple(v) if name == "attention_efficiency" else v
                          for name, v in fields.items() if name in FITTED})

