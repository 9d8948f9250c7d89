"""Simulating ops: one, several back to back, the TPSP MLP layer, the paper's Table 1 regime."""

from __future__ import annotations

from dataclasses import dataclass

from commfuse.sim.costs import OpSpec
from commfuse.sim.engine import Engine
from commfuse.sim.hardware import Hardware
from commfuse.sim.hardware import resolve as resolve_hw
from commfuse.trace import write_trace


@dataclass(frozen=True)
class SimResult:
    """Predicted times (seconds) of one simulated run, and its per-rank timeline."""

    total_s: float  # the slowest rank's finish
    compute_s: float  # the same schedules with zero-cost communication
    exposed_comm_s: float  # total_s - compute_s
    rank_s: tuple  # each rank's finish
    timeline: tuple  # Spans (empty when timeline=False)

    def write_trace(self, path: str) -> None:
        write_trace(self.timeline, path)


def simulate_ops(specs, world_size: int, dtype_bytes: float, hw, *,
                 timeline: bool = True, symmetric: bool = False) -> SimResult:
    """Run the `OpSpec`s one after the other on every rank (each rank starts op i+1 as soon as
    its own part of op i is done) and time them on ``hw`` (a `Hardware` or a preset name).

    ``symmetric=True`` simulates rank 0 only and gives every rank its times (exact without
    stragglers, see `commfuse.sim.engine`; the timeline then holds rank 0's spans only)."""
    hw, specs = resolve_hw(hw), list(specs)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not dtype_bytes > 0:
        raise ValueError(f"dtype_bytes must be > 0, got {dtype_bytes!r}")
    for s in specs:
        if len(s.shape) != 3 or min(s.shape) <= 0:
            raise ValueError(f"shape must be (M, K, N) > 0, got {s.shape!r}")
    engine = Engine(hw, world_size, specs, dtype_bytes, True, timeline, symmetric)
    finish, spans = engine.run()
    if symmetric:  # every rank computes at once: compute alone is rank 0's work, end to end
        compute, finish = engine.work_s(), finish * world_size
    else:
        compute = max(Engine(hw, world_size, specs, dtype_bytes, False, False).run()[0])
    total = max(finish)
    return SimResult(total, compute, total - compute, tuple(finish), tuple(spans))


def simulate_op(op: str, method: str, world_size: int, shape, dtype_bytes: float = 2,
                hw="h100-nvlink", *, topology: str = "ring", chunks: int = 4, splits: int = 1,
                timeline: bool = True, symmetric: bool = False) -> SimResult:
    """Time one op (``shape`` = (M, K, N), conventions in `op_costs`) under ``method``."""
    spec = OpSpec(op, method, tuple(shape), topology, chunks, splits)
    return simulate_ops([spec], world_size, dtype_bytes, hw, timeline=timeline,
                        symmetric=symmetric)


def mlp_specs(method: str, world_size: int, tokens: int, d_model: int, hidden: int | None = None,
              **opts) -> list[OpSpec]:
    """The TPSP MLP forward as ops: AG -> FC1 [tokens, d] @ [d, h/W], then
    FC2 [tokens, h/W] @ [h/W, d] -> RS (h = 4d by default; GELU not modelled)."""
    h = hidden or 4 * d_model
    return [OpSpec("ag_matmul", method, (tokens, d_model, h // world_size), **opts),
            OpSpec("matmul_rs", method, (tokens, h // world_size, d_model), **opts)]


def simulate_layer(method: str, world_size: int, tokens: int, d_model: int, dtype_bytes=2,
                   hw="h100-nvlink", *, layers: int = 1, hidden: int | None = None,
                   timeline: bool = True, **opts) -> SimResult:
    """Time ``layers`` TPSP MLP forwards (see `mlp_specs`) back to back."""
    specs = mlp_specs(method, world_size, tokens, d_model, hidden, **opts) * layers
    return simulate_ops(specs, world_size, dtype_bytes, hw, timeline=timeline)


PAPER_TABLE1 = {"vanilla": 122.3e-3, "vanilla_comm": 43.8e-3, "sliced": 83.9e-3,
                "sliced_exposed": 7.1e-3, "commfuse": 77.1e-3, "commfuse_exposed": 0.1e-3}


def table1_hardware(latency: float = 5e-6) -> Hardware:
    """Hardware calibrated so that vanilla (none, both ops) of the paper's Table 1 MLP takes
    122.3 ms of which 43.8 ms is communication: achieved GEMM flop/s from the 78.5 ms of compute,
    link bandwidth from one ring all-gather (= one reduce-scatter) taking 21.9 ms."""
    w, tokens, d = 4, 32 * 4096, 4096
    shape = (tokens, d, 4 * d // w)
    base = Hardware(gemm_flops=1.0, link_bandwidth=1.0, link_latency=latency,
                    mem_bandwidth=1.6e12, m0=128.0, n0=128.0, k0=128.0)
    flop_s = 2 * base.gemm_time(*shape) / (PAPER_TABLE1["vanilla"] - PAPER_TABLE1["vanilla_comm"])
    per_step = PAPER_TABLE1["vanilla_comm"] / 2 / (w - 1) - latency  # s per ring step
    return base.with_(gemm_flops=flop_s, link_bandwidth=tokens * d * 2 / w / per_step)


def paper_table1(chunks: int = 4, hw: Hardware | None = None) -> dict:
    """The paper's Table 1 regime (TP=4, TPSP MLP forward, (32, 4096, 4096), bf16): predicted
    vanilla / sliced / commfuse times and exposed communication (s), with the paper's figures."""
    hw = hw or table1_hardware()
    out = {"hardware": hw, "paper": PAPER_TABLE1}
    for name, method, opts in (("vanilla", "none", {}), ("sliced", "sliced", {"chunks": chunks}),
                               ("commfuse", "commfuse", {})):
        r = simulate_layer(method, 4, 32 * 4096, 4096, 2, hw, timeline=False, **opts)
        out[name], out[name + "_exposed"] = r.total_s, r.exposed_comm_s
    return out
