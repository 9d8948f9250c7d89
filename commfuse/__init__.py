"""commfuse: collectives fused with GEMMs as overlapped P2P schedules (arXiv 2604.24013).

The four ops (see `commfuse.api`) run on any torch.distributed backend and are exact:
the same arithmetic as the plain collective + GEMM, in a schedule that hides the transfers.
"""

from commfuse.api import (fused_all_gather_matmul, fused_all_to_all_matmul,
                          fused_matmul_all_to_all, fused_matmul_reduce_scatter)
from commfuse._p2p import duplex
from commfuse.errors import CommFuseError
from commfuse.ops._common import even_sizes
from commfuse.schedule import METHODS, TOPOLOGIES

__version__ = "0.1.0"
__all__ = ["fused_all_gather_matmul", "fused_matmul_reduce_scatter", "fused_matmul_all_to_all",
           "fused_all_to_all_matmul", "duplex", "even_sizes", "CommFuseError", "METHODS", "TOPOLOGIES"]
