"""The experts' GEMMs over rows grouped by local expert: `grouped` (forward and input grads)
and `weight_grads` (one GEMM per expert over all its rows).

Legend: R rows in groups of ``sizes[e]`` consecutive rows per local expert e (E_l of them),
K the contraction, N the output columns; ``w_EKN`` holds one [K, N] matrix per local expert.

Both run ``torch._grouped_mm`` where it applies (`grouped_ok`: this torch has it, for the
dtype and device: float32 / bfloat16 / float16 on CPU, bfloat16 on CUDA devices of compute
capability 8.0 or more, the kernels' documented domain; the operands' strides 16-byte
multiples), else one GEMM per non-empty group; both give the same rows. The decision is
made before the call, so an error the kernel raises (a CUDA error included) propagates.
Group ends are int32 tensors on the rows' device (`device_ints`: one copy from pinned host
memory, no per-call ``torch.tensor(list, device=...)`` on the GPU's queue).
"""

from __future__ import annotations

import functools

import torch

from commfuse.runtime import modes

GROUPED_DTYPES = {"cpu": (torch.float32, torch.bfloat16, torch.float16),
                  "cuda": (torch.bfloat16,)}


@functools.cache
def _device_ok(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return device.type == "cpu"


def grouped_ok(x_RK: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `grouped` (``w`` [E, K, N]) or `weight_grads` (``w``: the [R, N] grads) can
    hand its GEMMs to ``torch._grouped_mm``."""
    if not hasattr(torch, "_grouped_mm") or x_RK.shape[0] == 0:
        return False
    if x_RK.dtype not in GROUPED_DTYPES.get(x_RK.device.type, ()) or w.dtype != x_RK.dtype:
        return False
    return _device_ok(x_RK.device) and _aligned(x_RK) and _aligned(w)


def device_ints(values, device: torch.device) -> torch.Tensor:
    """``values`` (ints) as an int32 tensor on ``device``: on CUDA one asynchronous copy
    from pinned host memory."""
    host = torch.tensor(values, dtype=torch.int32)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def ends(sizes) -> list[int]:
    """Cumulative ends of consecutive groups of ``sizes`` (``torch._grouped_mm``'s offs)."""
    out, end = [], 0
    for n in sizes:
        end += n
        out.append(end)
    return out


def grouped(x_RK: torch.Tensor, w_EKN: torch.Tensor, sizes, out: torch.Tensor,
            offs: torch.Tensor | None = None) -> None:
    """``out[rows of group e] = x_RK[rows of group e] @ w_EKN[e]`` for every local expert e;
    ``sizes``: the rows of each group, consecutive, summing to R (empty groups allowed);
    ``offs``: their ends on x's device if the caller holds them (`device_ints`)."""
    if modes.current() == "comm_only":
        return
    if sum(1 for n in sizes if n) > 1 and grouped_ok(x_RK, w_EKN):
        if offs is None:
            offs = device_ints(ends(sizes), x_RK.device)
        out.copy_(torch._grouped_mm(x_RK, w_EKN, offs=offs))
        return
    start = 0
    for e, n in enumerate(sizes):
        if n:
            modes.gemm(x_RK[start:start + n], w_EKN[e], out=out[start:start + n])
        start += n


def weight_grads(x_RK: torch.Tensor, gy_RN: torch.Tensor, runs, experts: int) -> torch.Tensor:
    """``dW[e] = X_e^T @ dY_e`` -> ``[experts, K, N]``: X_e, dY_e the rows of local expert e,
    which lie in ``runs[e]`` ((start, rows) pieces of the receive layout, one per source
    slot). The rows are gathered expert-major in one index (none if they already are), then
    one grouped GEMM over all experts (``torch._grouped_mm``'s K-grouped form) or, where it
    does not apply, one GEMM per expert on its contiguous rows; zeros for an expert that got
    no rows. A fixed summation order per expert either way."""
    gw = x_RK.new_zeros((experts, x_RK.shape[1], gy_RN.shape[1]))
    pieces = [(s, n) for e in range(experts) for s, n in runs[e] if n]
    sizes = [sum(n for _, n in runs[e]) for e in range(experts)]
    if not pieces or modes.current() == "comm_only":
        return gw
    at, contiguous = pieces[0][0], True
    for s, n in pieces:
        contiguous &= s == at
        at = s + n
    if contiguous:
        lo = pieces[0][0]
        x, gy = x_RK[lo:at], gy_RN[lo:at]
    else:
        index = torch.cat([torch.arange(s, s + n) for s, n in pieces]).to(x_RK.device)
        x, gy = x_RK.index_select(0, index), gy_RN.index_select(0, index)
    xt = x.t()
    if sum(1 for n in sizes if n) > 1 and grouped_ok(xt, gy):
        gw.copy_(torch._grouped_mm(xt, gy, offs=device_ints(ends(sizes), x.device)))
        return gw
    start = 0
    for e, n in enumerate(sizes):
        if n:
            torch.mm(xt[:, start:start + n], gy[start:start + n], out=gw[e])
        start += n
    return gw


def _aligned(t: torch.Tensor) -> bool:
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(
        (stride * size) % 16 == 0 for stride, n in zip(t.stride(), t.shape) if stride != 1 and n > 1)
