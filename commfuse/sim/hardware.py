"""The hardware model the simulator times schedules on, and named presets.

Units: flop/s, bytes/s, seconds. Every figure is per rank (one GPU/NPU/core) and per
direction for links. The GEMM model is a simple roofline-like one: a GEMM of m x k x n takes
``2*m*k*n / (gemm_flops * efficiency(m, n, k))`` with

    efficiency = gemm_max_efficiency / (1 + m0/m + n0/n + k0/k)

so that small or thin GEMMs (the price of cutting a GEMM into slices or chunks) run at a
lower fraction of peak; large ones approach ``gemm_max_efficiency``. This is a fit, not a
kernel model: m0/n0/k0 play the role of the tile sizes below which a kernel wastes its tiles.
Below ``narrow_rows`` rows a second regime takes over: a library that switches to another
kernel for narrow shapes (the CPU testbed's, between 160 and 192 rows) runs them at
``narrow_efficiency`` of that, less for a larger B (``narrow_decay``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

NARROW_KN = 1024 * 2048
"""Elements of B at which ``Hardware.narrow_efficiency`` holds (the probe's narrow GEMM's)."""


@dataclass(frozen=True)
class Hardware:
    """One rank's compute, memory and links, and how they interfere."""

    gemm_flops: float
    """Peak dense GEMM throughput of one rank in the simulated dtype (flop/s)."""
    link_bandwidth: float
    """Bandwidth of one rank's link, each direction (bytes/s); a rank's egress (and its
    ingress) is shared fairly by the transfers using it at the same time."""
    link_latency: float
    """Fixed cost of every point-to-point transfer and of every step of a collective (s)."""
    mem_bandwidth: float = 1e12
    """Memory bandwidth for elementwise adds (Reduce steps): an add of b bytes moves 3b (s)."""
    add_bandwidth: float = 0.0
    """Memory bandwidth of a split op's reduce adds (its pieces, into a buffer the op writes
    once), same accounting as ``mem_bandwidth``; 0: ``mem_bandwidth``. On the CPU testbed
    ``mem_bandwidth`` is a fit that counts fresh buffers' page faults, which the op model
    charges on its own (``first_touch_bandwidth``)."""
    gemm_max_efficiency: float = 1.0
    """Fraction of ``gemm_flops`` that a large GEMM reaches (0..1]."""
    m0: float = 0.0
    """Rows at which the GEMM efficiency model loses half of its headroom (see module doc)."""
    n0: float = 0.0
    """Columns, likewise."""
    k0: float = 0.0
    """Contraction length, likewise."""
    narrow_rows: float = 0.0
    """GEMMs of fewer rows than this run another kernel, at ``narrow_efficiency`` of the rate
    above (0: one kernel for every shape). The CPU testbed's fp32 GEMM (MKL, one thread) runs
    at one flat rate below about 176 rows and a markedly higher one above: a step, not a curve."""
    narrow_efficiency: float = 1.0
    """Rate of a narrow GEMM (``narrow_rows``) whose B has ``NARROW_KN`` elements, as a
    fraction of what the efficiency formula gives it."""
    narrow_decay: float = 0.0
    """How a narrow GEMM slows as its B grows: its rate goes as (k n / NARROW_KN)^-decay
    (every call reads all of B, so a larger B leaves less of each call's time to the
    arithmetic). A smaller B than NARROW_KN runs at ``narrow_efficiency``: the probe times no
    narrow GEMM, and narrow pieces of a small B still run below the rate the power law gives
    them (docs/benchmarks/simulator.md)."""
    interference: float = 0.0
    """Compute slowdown while a transfer or collective is in flight on the same rank: compute
    runs at 1 / (1 + interference) of its speed (0 = none; 1 = half speed)."""
    duplex_efficiency: float = 1.0
    """Fraction of ``link_bandwidth`` each direction gets while a rank sends and receives at
    the same time (1 = full duplex; the CPU testbed reaches about 0.5-1)."""
    collective_efficiency: float = 1.0
    """Fraction of the ring model's speed that the backend's collectives reach (0..1]; a
    collective of b bytes over W ranks takes (W-1) * (latency + b / (W * bw)) / efficiency."""
    host_collective_s: float = 0.0
    """Host time to launch one collective (s): work on the rank's own timeline before the
    collective starts, nothing else running on it meanwhile. On the CPU testbed the host is
    the core that computes (Python, gloo's batch of transfers); 0 where launches are
    asynchronous and cheap next to the kernels (the GPU presets)."""
    host_p2p_s: float = 0.0
    """Host time to post one batch of P2P transfers (a schedule's ``Post``), likewise."""
    host_async: bool = False
    """The host launches ahead of the device (CUDA: kernels and NCCL batches are queued, the
    host returns): the host costs above are not charged on the rank's timeline, where the
    device would wait for them only once the host falls behind. They cap the pieces instead:
    a P2P schedule whose posts take the host longer than the op's compute is launch-bound
    and not chosen (`commfuse.sim.choose.launch_bound`)."""
    first_touch_bandwidth: float = 0.0
    """Bytes/s at which an op's fresh buffers of ``first_touch_bytes`` or more are first
    written (page faults: glibc hands buffers of 32 MiB and more back to the kernel, so each
    one faults again); charged to the op's compute. 0: free (a caching allocator, GPUs)."""
    first_touch_bytes: float = 32 * 2 ** 20
    """Smallest buffer that `first_touch_bandwidth` charges."""
    choice_margin: float = 0.0
    """The model's error on the ratio of two methods' times on this machine kind, measured
    (`commfuse.sim.calibrate.choice_error`): ``auto`` departs from the default method
    (``commfuse`` at its chosen m) only where it predicts a gain larger than this fraction
    (`commfuse.sim.choose.choice`), so a mis-fit cannot make it slower than the default by
    more than the runs' own spread. 0: no measurement, the fastest prediction is taken."""

    serial_p2p: bool = False
    """A rank's P2P batches (a schedule's ``Post`` steps) run one after another, in post
    order, each once the previous one is done: NCCL runs every P2P batch of a process group
    on that group's one internal stream (the GPU presets); gloo runs them concurrently."""
    fifo_per_peer: bool = False
    """A rank's transfers to one peer run one at a time, each at the link's whole rate, in
    the order they become ready (both sides posted): gloo on the CPU testbed sends through
    one thread and one connection per peer and direction (`commfuse.runtime.gloo`), so back
    to back messages follow each other on the wire. False: a rank's transfers in flight
    share its link fairly, and pieces posted together all arrive at the end."""
    compute_straggler: dict = field(default_factory=dict)
    """rank -> factor >= 1: that rank's compute (GEMMs, adds) takes factor times longer."""
    link_straggler: dict = field(default_factory=dict)
    """rank -> factor >= 1: that rank's link (both directions) is factor times slower."""
    mem_efficiency: float = 1.0
    """Fraction of ``mem_bandwidth`` that streaming (elementwise, memory-bound) kernels reach;
    the whole-step model (`commfuse.sim.step.work`) times such work at this rate."""
    attention_efficiency: tuple = (0.0, 0.0)
    """Fraction of ``gemm_flops`` a fused attention kernel reaches (forward, backward), causal
    FLOPs counted; (0, 0): time attention as GEMMs (``gemm_time``)."""
    attention_k0: float = 0.0
    """Mean keys per query row at which a fused attention kernel reaches half of
    ``attention_efficiency`` (short sequences run below it, as small GEMMs do); 0: the same
    efficiency at every length."""
    attention_q0: float = 0.0
    """Query rows per kernel call at which a fused attention call runs at half its rate (a
    call of n rows: n / (n + q0)); what cutting attention into many calls costs (query-split's
    runs: prefix + diagonal blocks per run of rows). 0: free."""
    memory_gib: float = 0.0
    """Device memory a process can allocate (GiB); 0: unknown (every plan fits)."""
    tdp_w: float = 0.0
    """Power at which ``gemm_flops`` and the GEMM efficiency were measured (W); 0: no model."""
    power_limit_w: float = 0.0
    """The device's power limit (W), below ``tdp_w``: compute slows to ``clock_factor()``;
    0: the TDP."""

    def __post_init__(self):
        for name in ("gemm_flops", "link_bandwidth", "mem_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("link_latency", "add_bandwidth", "m0", "n0", "k0", "narrow_rows",
                     "narrow_decay", "interference", "host_collective_s", "host_p2p_s",
                     "first_touch_bandwidth", "first_touch_bytes", "choice_margin"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("memory_gib", "tdp_w", "power_limit_w"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not self.choice_margin < 1:
            raise ValueError(f"choice_margin must be < 1, got {self.choice_margin!r}")
        if self.power_limit_w and not self.tdp_w:
            raise ValueError("power_limit_w needs tdp_w (the power the peak was measured at)")
        if len(self.attention_efficiency) != 2 or not all(
                0 <= e <= 1 for e in self.attention_efficiency):
            raise ValueError(f"attention_efficiency must be (forward, backward) in [0, 1], got "
                             f"{self.attention_efficiency!r}")
        for name in ("gemm_max_efficiency", "narrow_efficiency", "duplex_efficiency",
                     "collective_efficiency", "mem_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)!r}")
        for name in ("compute_straggler", "link_straggler"):
            for rank, f in getattr(self, name).items():
                if not (isinstance(rank, int) and rank >= 0 and f >= 1):
                    raise ValueError(f"{name}: want rank -> factor >= 1, got {rank!r}: {f!r}")

    def gemm_efficiency(self, m: float, k: float, n: float) -> float:
        """Fraction of ``gemm_flops`` an m x k x n GEMM reaches (module doc)."""
        e = self.gemm_max_efficiency / (1 + self.m0 / m + self.n0 / n + self.k0 / k)
        if m < self.narrow_rows:
            # a B below NARROW_KN runs at the rate there (the decay is only fitted above it)
            kn = max(1.0, k * n / NARROW_KN)
            e *= min(1.0, self.narrow_efficiency * kn ** -self.narrow_decay)
        return e

    def clock_factor(self) -> float:
        """Compute speed under ``power_limit_w`` relative to ``tdp_w``: dynamic power goes as
        C V^2 f and the voltage as the clock, so power ~ f^3 and the clock the power limit
        sustains is (limit / tdp)^(1/3) of the one at the TDP (1 without a limit)."""
        if not self.power_limit_w or self.power_limit_w >= self.tdp_w:
            return 1.0
        return (self.power_limit_w / self.tdp_w) ** (1 / 3)

    def gemm_time(self, m: float, k: float, n: float, rank: int = 0) -> float:
        """Seconds for an [m, k] @ [k, n] GEMM on ``rank`` (0 if any dim is empty)."""
        if m <= 0 or k <= 0 or n <= 0:
            return 0.0
        t = 2.0 * m * k * n / (self.gemm_flops * self.clock_factor()
                               * self.gemm_efficiency(m, k, n))
        return t * self.compute_straggler.get(rank, 1.0)

    def attention_time(self, flops: float, keys_per_row: float, backward: bool = False,
                       rank: int = 0, rows_per_call: float = float("inf")) -> float:
        """Seconds of a fused attention kernel of ``flops`` (causal FLOPs) whose query rows see
        ``keys_per_row`` keys on average, run in calls of ``rows_per_call`` query rows, at
        ``attention_efficiency`` (needs it set)."""
        e = self.attention_efficiency[1 if backward else 0]
        if self.attention_k0:
            e *= keys_per_row / (keys_per_row + self.attention_k0)
        if self.attention_q0 and rows_per_call != float("inf"):
            e *= rows_per_call / (rows_per_call + self.attention_q0)
        return flops / (self.gemm_flops * self.clock_factor() * e) \
            * self.compute_straggler.get(rank, 1.0)

    def add_time(self, nbytes: float, rank: int = 0) -> float:
        """Seconds to add two tensors of ``nbytes`` each into a third on ``rank``."""
        return 3.0 * nbytes / (self.add_bandwidth or self.mem_bandwidth) \
            * self.compute_straggler.get(rank, 1.0)

    def copy_time(self, nbytes: float, rank: int = 0) -> float:
        """Seconds to copy ``nbytes`` into a freshly allocated buffer on ``rank`` (2 x bytes
        moved; on the CPU testbed the page faults of the new buffer are part of the rate)."""
        return 2.0 * nbytes / self.mem_bandwidth * self.compute_straggler.get(rank, 1.0)

    def first_touch_time(self, buffers, rank: int = 0) -> float:
        """Seconds of first writes into fresh buffers of these byte sizes on ``rank``."""
        if not self.first_touch_bandwidth:
            return 0.0
        big = sum(b for b in buffers if b >= self.first_touch_bytes)
        return big / self.first_touch_bandwidth * self.compute_straggler.get(rank, 1.0)

    def bandwidth(self, rank: int) -> float:
        """``rank``'s link bandwidth each direction, straggler included (bytes/s)."""
        return self.link_bandwidth / self.link_straggler.get(rank, 1.0)

    def collective_time(self, kind: str, nbytes: float, world: int, ranks=None) -> float:
        """A ring all-gather / reduce-scatter / all-to-all of ``nbytes`` in total (the whole
        gathered or scattered buffer): (W-1) steps of latency + nbytes / (W * bw), paced by
        the slowest link among ``ranks`` (all ranks by default)."""
        if world <= 1:
            return 0.0
        slow = max(self.link_straggler.get(r, 1.0) for r in (ranks or range(world))) \
            if self.link_straggler else 1.0
        step = self.link_latency + nbytes / (world * self.link_bandwidth / slow)
        return (world - 1) * step / self.collective_efficiency

    def with_(self, **changes) -> "Hardware":
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def with_links_of(self, other: "Hardware") -> "Hardware":
        """This rank's compute and host with ``other``'s links (a group that spans nodes)."""
        return replace(self, **{k: getattr(other, k) for k in LINK_FIELDS})


LINK_FIELDS = ("link_bandwidth", "link_latency", "duplex_efficiency", "collective_efficiency",
               "link_straggler")


# Efficiency shape shared by the accelerator presets: large bf16 GEMMs reach about 70 % of the
# datasheet's dense peak (typical of cuBLAS/CANN on big shapes), slices under ~128 rows lose it.
# Host time per P2P post on CUDA, host_p2p_s = 60 us: an estimate, not a measurement (no
# session has had a GPU): a schedule step's Python dispatch (STEP_OVERHEAD_S["cuda"], 10 us),
# building the batch's P2POps and batch_isend_irecv through ProcessGroupNCCL (ncclGroupStart /
# End, a CUDA event recorded and waited, a work object: some tens of us in PyTorch profiles
# of P2P pipelines), commfuse's event record and wait per dependency (a few us each).
# `commfuse check-gpu`'s host_vs_gpu check measures it (host_per_post_us in its report).
_GPU = dict(gemm_max_efficiency=0.7, m0=128.0, n0=128.0, k0=128.0, link_latency=5e-6,
            interference=0.05, serial_p2p=True, host_p2p_s=60e-6, host_async=True)
# Hopper (H100/H200 SXM) from published measurements rather than a guess:
# - GEMM: the Maximum Achievable Matmul FLOPS table of stas00/ml-engineering
#   (compute/accelerator/README.md, mamf-finder.py): H100 SXM bf16 792.1 TFLOP/s = 80.1 % of 989
#   (CUDA 12.1, 700 W TDP), the best of a sweep of shapes up to 20480 in each dim. That best
#   is the ceiling (gemm_max_efficiency = 0.801); the 128-element tile terms of _GPU take
#   smaller or thinner shapes below it. (H200 SXM: the same SMs and clocks; the table's later
#   edition lists "H100/H200 SXM" together at 794.5.)
# - Attention: FlashAttention-2 (what torch's SDPA runs) on H100 SXM, head dim 128, sequence
#   8k: 333 TFLOP/s forward (causal) and 318 backward, Shah et al., "FlashAttention-3", 2024
#   (arXiv 2407.08608), figures of forward / backward speed; causal FLOPs counted.
# - Memory-bound kernels: 90 % of the HBM datasheet bandwidth (the order STREAM-style copies
#   reach on HBM; an assumption, not a measurement of ours).
_HOPPER = dict(_GPU, gemm_max_efficiency=0.801, attention_efficiency=(333 / 989, 318 / 989),
               mem_efficiency=0.9, tdp_w=700.0)

PRESETS: dict[str, Hardware] = {
    # NVIDIA H100 SXM5 datasheet (nvidia.com/en-us/data-center/h100): bf16 dense 989 TFLOP/s
    # (1979 with sparsity), HBM3 3.35 TB/s, 80 GB, NVLink 4 900 GB/s total = 450 GB/s each
    # way; 700 W.
    "h100-nvlink": Hardware(gemm_flops=989e12, link_bandwidth=450e9, mem_bandwidth=3.35e12,
                            memory_gib=79.1, **_HOPPER),
    # The H100 of torchtitan's published benchmarks (benchmarks/llama3_h100_202412_torchtitan.md
    # in pytorch/torchtitan: Meta's Grand Teton hosts): 96 GB HBM2e at 2.4 TB/s, NVLink within
    # the host, run at the default 500 W power limit (of a 700 W TDP): compute at
    # (500/700)^(1/3) = 0.89 of the clock (`Hardware.clock_factor`). Usable memory: 94 GiB
    # (the capacity such 96 GB HBM2e H100s report).
    "h100-hbm2e-500w": Hardware(gemm_flops=989e12, link_bandwidth=450e9, mem_bandwidth=2.4e12,
                                memory_gib=94.0, power_limit_w=500.0, **_HOPPER),
    # NVIDIA H200 SXM datasheet (nvidia.com/en-us/data-center/h200): bf16 dense 989 TFLOP/s,
    # HBM3e 4.8 TB/s, 141 GB, NVLink 900 GB/s total = 450 GB/s each way; up to 700 W.
    "h200-nvlink": Hardware(gemm_flops=989e12, link_bandwidth=450e9, mem_bandwidth=4.8e12,
                            memory_gib=139.8, **_HOPPER),
    # NVIDIA A100 SXM 80GB datasheet (nvidia.com/en-us/data-center/a100): bf16 dense 312
    # TFLOP/s, HBM2e 2.039 TB/s, NVLink 3 600 GB/s total = 300 GB/s each way.
    "a100-nvlink": Hardware(gemm_flops=312e12, link_bandwidth=300e9, mem_bandwidth=2.039e12,
                            memory_gib=79.1, **_GPU),
    # Huawei Ascend 910B (hiascend.com product pages / Atlas 800T A2 datasheet, as publicly
    # reported): about 313 TFLOP/s fp16/bf16, HBM2e about 1.6 TB/s, HCCS 7 links x 56 GB/s
    # (392 GB/s) per NPU in an 8-NPU full mesh: one peer link is 56 GB/s (bidirectional
    # figure; we take it per direction as the vendor quotes it, an optimistic reading).
    "ascend910b-hccs": Hardware(gemm_flops=313e12, link_bandwidth=56e9, mem_bandwidth=1.6e12,
                                **_GPU),
    # PCIe-only node: NVIDIA H100 PCIe datasheet: bf16 dense 756 TFLOP/s, HBM2e 2.0 TB/s;
    # no NVLink bridge, GPUs talk over PCIe Gen5 x16: 64 GB/s each way (PCI-SIG spec; about
    # 50 GB/s achieved), through the host: higher latency; 80 GB.
    "pcie-node": Hardware(gemm_flops=756e12, link_bandwidth=50e9, mem_bandwidth=2.0e12,
                          memory_gib=79.1, **{**_GPU, "link_latency": 10e-6}),
    # Multi-node: H100 SXM compute, one NIC per GPU (InfiniBand/RoCE line rates, e.g. NVIDIA
    # ConnectX-7 datasheet: up to 400 Gbit/s), 1 bit = 1/8 byte; ~10 us latency across nodes.
    **{f"multinode-{g}g": Hardware(gemm_flops=989e12, link_bandwidth=g * 1e9 / 8,
                                   mem_bandwidth=3.35e12, memory_gib=79.1,
                                   **{**_HOPPER, "link_latency": 10e-6})
       for g in (100, 200, 400)},
    # The project's CPU testbed (docs/benchmarks/testbed.md): one x86_64 core of the dev VM
    # per rank, float32, 1 intra-op thread, 1 Gbit/s tbf links between network namespaces.
    # gemm_flops, link_bandwidth and host_collective_s are `commfuse simulate --calibrate`
    # fitted to a bench run of the four ops (S=2048, D=1024, splits 1-8): 1.204 Gbit/s is
    # 0.90 each way with duplex 0.75; a P2P post costs no host time the fit can see (AG's copy
    # of its own rows is `copy_time`). gloo sends a rank's messages to one peer one after
    # another (fifo_per_peer). Transfers cost CPU on the rank's own core, where the kernel's
    # network stack runs (interference). Attention: ATen's CPU flash kernel (causal, head dim
    # 64) at 0.90 forward and 0.87 backward (counting 2.5x the forward's FLOPs) x K/(K + 300)
    # of gemm_flops, for K mean keys per query row. A fresh output of 32 MiB or more pays its
    # page faults at 2.4 GB/s (glibc returns such buffers to the kernel). GEMMs of under 176
    # rows run at 0.67 of the formula's rate at a B of 8 MiB, slowly less as B grows
    # (narrow_*). Adds walking distinct buffers into a reused output move 17 GB/s (3x the
    # bytes). `--hardware measured`, the default of bench and train, starts from this preset
    # and fits the compute rates to the running machine at start (`commfuse.runtime.probe`);
    # predictions against measured runs: docs/benchmarks/simulator.md. choice_margin 0.06:
    # the 90th percentile of the model's error on the ratio of a method's time to the
    # default's over the K x N sweep (`commfuse.sim.calibrate.choice_error` on
    # docs/benchmarks/simulator/, 180 pairs: median 0.02, worst 0.08).
    "cpu-testbed": Hardware(gemm_flops=92.6e9, link_bandwidth=1.204e9 / 8, link_latency=50e-6,
                            mem_bandwidth=5e9, add_bandwidth=17e9, gemm_max_efficiency=1.0,
                            m0=8.0, n0=8.0, k0=32.0, narrow_rows=176.0, narrow_efficiency=0.67,
                            narrow_decay=0.06, interference=0.3, duplex_efficiency=0.75,
                            collective_efficiency=0.75, host_collective_s=0.65e-3,
                            host_p2p_s=0.0, fifo_per_peer=True,
                            attention_efficiency=(0.90, 0.87), attention_k0=300.0,
                            attention_q0=32.0, first_touch_bandwidth=2.4e9,
                            choice_margin=0.06),
}


def preset(name: str) -> Hardware:
    """The named preset (see ``PRESETS``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown hardware preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name]


def resolve(hw) -> Hardware:
    """``hw`` itself if it is a `Hardware`, else the preset it names."""
    return preset(hw) if isinstance(hw, str) else hw
