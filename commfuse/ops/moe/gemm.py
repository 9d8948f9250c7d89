"""The experts' GEMMs over rows grouped by local expert: `grouped` (forward and input grads)
and `weight_grads` (one GEMM per expert over all its rows).

Legend: R rows in groups of ``sizes[e]`` consecutive rows per local expert e (E_l of them),
K the contraction, N the output columns; ``w_EKN`` holds one [K, N] matrix per local expert.

`grouped` runs ``torch._grouped_mm`` where this torch build has it for the dtype and device
and the operands' strides are 16-byte multiples (its kernels' requirement: float32 / bfloat16 /
float16, on CPU as on CUDA), else one GEMM per non-empty group; both give the same rows.
"""

from __future__ import annotations

import torch

from commfuse.runtime import modes

GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_REFUSED: set[tuple[str, torch.dtype]] = set()  # (device type, dtype) the build turned down


def grouped_ok(x_RK: torch.Tensor, w_EKN: torch.Tensor) -> bool:
    """Whether `grouped` can hand ``x_RK @ w_EKN[e]`` to ``torch._grouped_mm``."""
    if not hasattr(torch, "_grouped_mm") or x_RK.dtype not in GROUPED_DTYPES:
        return False
    if (x_RK.device.type, x_RK.dtype) in _REFUSED or x_RK.shape[0] == 0:
        return False
    return _aligned(x_RK) and _aligned(w_EKN)


def grouped(x_RK: torch.Tensor, w_EKN: torch.Tensor, sizes, out: torch.Tensor) -> None:
    """``out[rows of group e] = x_RK[rows of group e] @ w_EKN[e]`` for every local expert e;
    ``sizes``: the rows of each group, consecutive, summing to R (empty groups allowed)."""
    if modes.current() == "comm_only":
        return
    if len(sizes) > 1 and grouped_ok(x_RK, w_EKN):
        offs = torch.tensor(_ends(sizes), dtype=torch.int32, device=x_RK.device)
        try:
            out.copy_(torch._grouped_mm(x_RK, w_EKN, offs=offs))
            return
        except (RuntimeError, NotImplementedError):  # this build lacks the kernel: loop
            _REFUSED.add((x_RK.device.type, x_RK.dtype))
    start = 0
    for e, n in enumerate(sizes):
        if n:
            modes.gemm(x_RK[start:start + n], w_EKN[e], out=out[start:start + n])
        start += n


def weight_grads(x_RK: torch.Tensor, gy_RN: torch.Tensor, runs, experts: int) -> torch.Tensor:
    """``dW[e] = X_e^T @ dY_e`` -> ``[experts, K, N]``: X_e, dY_e the rows of local expert e,
    which lie in ``runs[e]`` ((start, rows) pieces of the receive layout, one per source
    slot). One GEMM per expert over all its rows (a fixed summation order); zeros for an
    expert that got no rows."""
    gw = x_RK.new_zeros((experts, x_RK.shape[1], gy_RN.shape[1]))
    for e in range(experts):
        pieces = [(s, n) for s, n in runs[e] if n]
        if not pieces:
            continue
        if len(pieces) == 1:
            (s, n), = pieces
            x, gy = x_RK[s:s + n], gy_RN[s:s + n]
        else:
            x = torch.cat([x_RK[s:s + n] for s, n in pieces])
            gy = torch.cat([gy_RN[s:s + n] for s, n in pieces])
        torch.mm(x.t(), gy, out=gw[e])
    return gw


def _aligned(t: torch.Tensor) -> bool:
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(
        (stride * size) % 16 == 0 for stride, n in zip(t.stride(), t.shape) if stride != 1 and n > 1)


def _ends(sizes) -> list[int]:
    out, end = [], 0
    for n in sizes:
        end += n
        out.append(end)
    return out
