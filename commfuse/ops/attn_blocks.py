"""Causal attention of a run of query rows, as blocks with their log-sum-exp, forward and
backward: what query-split attention computes per slot, with no boolean mask built.

A run of n query rows at sequence positions a..a+n-1 sees keys 0..a+n-1: the *prefix* block
(keys 0..a-1, no mask) and the *diagonal* block (keys a..a+n-1, causal, its top-left corner
on the run's first row). Each block is one fused SDPA kernel that also returns its
log-sum-exp ``lse``; the two are merged as ``o = sum_b exp(lse_b - lse) o_b`` with
``lse = logaddexp(lse_b)`` (`merge`, one lerp). The causal kernel skips the blocks above the
diagonal, so the runs of a sequence together cost what one causal attention of it costs.

The backward of a block needs only the merged ``o`` and ``lse`` (the flash-attention
backward: ``P = exp(s - lse)``, ``dS = P (dP - rowsum(dO o))``), so each block's
gradients are its own kernel call and the prefix's dk, dv add into the keys they saw.

Kernels: on CPU ATen's flash-attention kernels for CPU (``_scaled_dot_product_flash_
attention_for_cpu`` and its backward, which take a top-left ``is_causal`` and return the
lse); elsewhere the same formulas in plain torch (exact, but they build the scores).

Legend: B batch, H heads, n query rows, k keys, d head dim; lse is [B, H, n] in float32
(float64 for float64 inputs).
"""

from __future__ import annotations

import torch

_CPU_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def block(q_BHnd, k_BHkd, v_BHkd, causal: bool):
    """``(o_BHnd, lse_BHn)`` of attention of q over one key block (``causal``: top-left)."""
    if fused_kernels(q_BHnd):
        return _CPU_FWD(q_BHnd, k_BHkd, v_BHkd, 0.0, causal)
    s = _scores(q_BHnd, k_BHkd, causal)
    lse = torch.logsumexp(s, -1)
    return (torch.exp(s - lse[..., None]).to(v_BHkd.dtype) @ v_BHkd), lse


def block_backward(go_BHnd, q_BHnd, k_BHkd, v_BHkd, o_BHnd, lse_BHn, causal: bool):
    """``(dq, dk, dv)`` of one key block, from the merged output ``o`` and its ``lse``."""
    if fused_kernels(q_BHnd):
        return _CPU_BWD(go_BHnd, q_BHnd, k_BHkd, v_BHkd, o_BHnd, lse_BHn, 0.0, causal)
    scale = q_BHnd.shape[-1] ** -0.5
    p = torch.exp(_scores(q_BHnd, k_BHkd, causal) - lse_BHn[..., None]).to(q_BHnd.dtype)
    dv = p.transpose(-1, -2) @ go_BHnd
    dp = go_BHnd @ v_BHkd.transpose(-1, -2)
    ds = p * (dp - (go_BHnd * o_BHnd).sum(-1, keepdim=True))
    return ds @ k_BHkd * scale, ds.transpose(-1, -2) @ q_BHnd * scale, dv


def fused_kernels(t: torch.Tensor) -> bool:
    """Whether the fused kernels serve ``t``'s device (CPU), else the plain-torch formulas."""
    return t.device.type == "cpu"


def _scores(q, k, causal: bool) -> torch.Tensor:
    s = (q @ k.transpose(-1, -2)).to(lse_dtype(q.dtype)) * q.shape[-1] ** -0.5
    if causal:
        n, m = s.shape[-2:]
        s = s.masked_fill(torch.ones(n, m, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the log-sum-exp (and of the merge) for inputs of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def run_forward(q_BHnd, k_BHSd, v_BHSd, a: int, causal: bool):
    """``(o, lse)`` of the n query rows at positions a.. (``causal``) or of any rows over all
    keys (not causal): the diagonal block, merged with the prefix block when a > 0."""
    n = q_BHnd.shape[2]
    if not causal:
        return block(q_BHnd, k_BHSd, v_BHSd, False)
    o, lse = block(q_BHnd, k_BHSd[:, :, a:a + n], v_BHSd[:, :, a:a + n], True)
    if a == 0:
        return o, lse
    o_p, lse_p = block(q_BHnd, k_BHSd[:, :, :a], v_BHSd[:, :, :a], False)
    return merge(o, lse, o_p, lse_p)


def merge(o_BHnd, lse_BHn, o2_BHnd, lse2_BHn):
    """``(o, lse)`` of attention over two key blocks from each block's: the weights are
    ``exp(lse_b - lse)``, so ``o = lerp(o_1, o_2, sigmoid(lse_2 - lse_1))``, one pass over the
    outputs (in the lse dtype, back to the outputs' dtype)."""
    w = torch.sigmoid(lse2_BHn - lse_BHn)[..., None]
    total = torch.logaddexp(lse_BHn, lse2_BHn)
    if o_BHnd.dtype == w.dtype:
        return torch.lerp(o_BHnd, o2_BHnd, w), total
    return torch.lerp(o_BHnd.to(w.dtype), o2_BHnd.to(w.dtype), w).to(o_BHnd.dtype), total


def run_backward(go, q, k_BHSd, v_BHSd, o, lse, a: int, causal: bool, dk_BHSd, dv_BHSd):
    """dq of the run (returned); its dk, dv are added into ``dk_BHSd`` / ``dv_BHSd``."""
    n = q.shape[2]
    if not causal:
        dq, dk, dv = block_backward(go, q, k_BHSd, v_BHSd, o, lse, False)
        dk_BHSd.add_(dk)
        dv_BHSd.add_(dv)
        return dq
    dq, dk, dv = block_backward(go, q, k_BHSd[:, :, a:a + n], v_BHSd[:, :, a:a + n], o, lse, True)
    dk_BHSd[:, :, a:a + n].add_(dk)
    dv_BHSd[:, :, a:a + n].add_(dv)
    if a:
        dq_p, dk, dv = block_backward(go, q, k_BHSd[:, :, :a], v_BHSd[:, :, :a], o, lse, False)
        dq = dq.add_(dq_p)
        dk_BHSd[:, :, :a].add_(dk)
        dv_BHSd[:, :, :a].add_(dv)
    return dq
