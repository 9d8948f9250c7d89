"""Expert parallelism's fused ops: the dispatch all-to-all feeding the experts' first GEMM and
the experts' last GEMM feeding the combine all-to-all, with variable per-peer counts.

    autograd.py   moe_dispatch_matmul, moe_matmul_combine: the autograd Functions (contracts)
    bindings.py   the MoE schedules (`commfuse.schedule.moe`) bound to tensors, no autograd
    counts.py     exchange_counts: the per-step table of per-peer, per-expert rows, validated
    routing.py    plan / to_experts / home_sum: a step's dedup routing (one row per token and rank)
    gemm.py       the experts' grouped GEMMs (torch._grouped_mm where it applies)
    library.py    commfuse::moe_expert_ffn: the whole expert call as a custom op (torch.compile)
"""

from __future__ import annotations

from commfuse.ops.moe.autograd import moe_dispatch_matmul, moe_matmul_combine
from commfuse.ops.moe.counts import CountsError, exchange_counts

__all__ = ["moe_dispatch_matmul", "moe_matmul_combine", "exchange_counts", "CountsError"]
