"""A hardware model's compute fitted, at start, to the device the ranks run on.

The presets' compute figures are a fit to one day's machine, and a VM does not keep one
speed. On the CPU testbed, the day ``cpu-testbed`` was fitted, one core ran GEMMs at 85-96
GFLOP/s and the causal attention kernel at 64 (S=2048) and 74 (S=4096) GFLOP/s; on a later
day at 140-158, 86-94 and 105, while elementwise adds of 32 MiB ran at 4.3 GB/s (the preset:
5). The three did not move together, so no single clock factor fits them. Every choice of
``auto`` (method, commfuse's m, query-split or row-parallel attention) depends on how long
the compute beside a transfer takes.

`measure` times, on this rank's device and in the run's dtype, one GEMM of ``GEMM_SHAPE``
and (where the model times attention as a fused kernel) one causal attention of
``ATTENTION_SHAPE``, each the fastest of ``REPEATS`` runs after two warm-ups. `probe` takes the
slowest rank's rate of each (one all-reduce of MIN over the group, 3 significant digits, so
that every rank holds the same model and makes the same choices) and `fit` sets the model's
GEMM peak and attention efficiency (forward and backward by the same factor: the backward is
not timed) so that the model predicts exactly those rates for those shapes. The rest stays
the model's: memory bandwidth (a fit that counts the page faults of new buffers; a probe
add of cache-sized tensors ran at 14-26 GB/s, four times what the prefill's adds get), host
time per launch, and the links (a link's rate is the network's, and its efficiencies are a
fit that one probe message would not improve).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from commfuse.sim.hardware import Hardware  # (torch is imported where a device is timed)

# per device type: ~30 ms of a CPU core for the GEMM and the attention, ~1 ms of an H100
GEMM_SHAPE = {"cpu": (1024, 1024, 2048), "cuda": (8192, 8192, 8192)}
ATTENTION_SHAPE = {"cpu": (1, 4, 2048, 64), "cuda": (4, 32, 4096, 128)}  # B, H, S, d
REPEATS = 10


@dataclass(frozen=True)
class Rates:
    """What one device measured (or the group's slowest, after `probe`)."""

    gemm_flops: float
    """flop/s of the ``GEMM_SHAPE`` GEMM."""
    attention_flops: float | None
    """flop/s (causal FLOPs) of the ``ATTENTION_SHAPE`` fused attention; None: not timed."""

    def line(self) -> str:
        attn = f", attention {self.attention_flops / 1e9:.1f} GFLOP/s" \
            if self.attention_flops else ""
        return f"GEMM {self.gemm_flops / 1e9:.1f} GFLOP/s{attn}"


def _best_s(fn, device, repeats: int) -> float:
    """Fewest seconds of ``fn()`` over ``repeats`` runs after two warm-ups: the rate the
    device sustains when nothing else holds it (on the CPU testbed a run of ~150 ms now and
    then goes at half speed, on either rank; a median of 5 caught one such window)."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for i in range(repeats + 2):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i >= 2:  # the first runs warm the allocator and the kernel
            times.append(time.perf_counter() - t0)
    return min(times)


def _key(device_type: str) -> str:
    """The probe's shapes' key for a device type (every accelerator times the CUDA ones)."""
    return "cpu" if device_type == "cpu" else "cuda"


def attention_flops(B: int, H: int, S: int, d: int) -> float:
    """Causal FLOPs of attention over S tokens (QK^T and PV, 2 a multiply-add; row p sees
    p + 1 keys), as `commfuse.sim.attention` counts them."""
    return 4.0 * B * H * d * S * (S + 1) / 2


def measure(device="cpu", dtype=None, attention: bool = True, repeats: int = REPEATS) -> Rates:
    """This device's `Rates` in ``dtype`` (default float32; ``attention``: time the fused
    attention kernel too)."""
    import torch
    import torch.nn.functional as F

    dtype = dtype or torch.float32
    device = torch.device(device)
    key = _key(device.type)
    gen = torch.Generator(device="cpu").manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)
    m, k, n = GEMM_SHAPE[key]
    a, b = rand(m, k), rand(k, n)
    gemm = 2.0 * m * k * n / _best_s(lambda: a @ b, device, repeats)
    attn = None
    if attention:
        B, H, S, d = ATTENTION_SHAPE[key]
        q, kk, v = rand(B, H, S, d), rand(B, H, S, d), rand(B, H, S, d)
        attn = attention_flops(B, H, S, d) / _best_s(
            lambda: F.scaled_dot_product_attention(q, kk, v, is_causal=True), device, repeats)
    return Rates(gemm, attn)


def fit(hw: Hardware, rates: Rates, device_type: str = "cpu") -> Hardware:
    """``hw`` with its GEMM peak and attention efficiency set so that it predicts ``rates``
    for the probe's shapes on ``device_type`` (the rest unchanged)."""
    if not rates.gemm_flops > 0:
        raise ValueError(f"gemm_flops must be > 0, got {rates.gemm_flops!r}")
    key = _key(device_type)
    m, k, n = GEMM_SHAPE[key]
    gemm = rates.gemm_flops * hw.gemm_time(m, k, n) / (2.0 * m * k * n)  # ratio to the model's
    out = replace(hw, gemm_flops=hw.gemm_flops * gemm)
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
    default group if initialised; else this process alone) runs `measure`, the group takes
    the minimum of each rate, which every rank then shares."""
    import torch
    import torch.distributed as dist

    device = torch.device(device)
    rates = measure(device, dtype, attention=bool(hw.attention_efficiency[0]))
    values = [rates.gemm_flops, rates.attention_flops or 0.0]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        t = torch.tensor(values, dtype=torch.float64,
                         device=device if dist.get_backend(group) == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        values = t.tolist()
    g, a = (float(f"{v:.3g}") for v in values)
    rates = Rates(g, a or None)
    return fit(hw, rates, device.type), rates
