"""Measurement modes of the executor, for ``commfuse bench`` and the training report.

``mode(name)`` sets, process-wide, how every op inside runs:

- ``"normal"``: as it would anyway;
- ``"compute_only"``: the same partitioned GEMMs and copies with no transfers (every transfer
  and collective is done at once, moving nothing): the *compute alone* of a schedule;
- ``"comm_only"``: the same transfers with empty GEMMs (`gemm` returns uninitialised results);
- ``"record"``: runs normally and lists the collectives launched, to replay their bytes.

A `commfuse.trace.Tracer` given to `mode` receives compute and transfer spans.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from commfuse.runtime.transport import Done, Transport
from commfuse.trace import Tracer

MODES = ("normal", "compute_only", "comm_only", "record")
_state: dict[str, Any] = {"mode": "normal", "tracer": None, "recorded": []}


@contextlib.contextmanager
def mode(name: str, tracer: Tracer | None = None):
    """Run the ops inside in measurement mode ``name``; yields the list ``record`` fills."""
    if name not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {name!r}")
    saved = dict(_state)
    _state.update(mode=name, tracer=tracer, recorded=[])
    try:
        yield _state["recorded"]
    finally:
        _state.update(saved)


def current() -> str:
    """The mode in force (``"normal"`` outside any `mode` block)."""
    return _state["mode"]


def tracer() -> Tracer | None:
    """The tracer given to the `mode` block in force, if any."""
    return _state["tracer"]


def gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` (``torch.matmul``), or in ``comm_only`` mode an uninitialised result of the
    same shape.

    ``a`` [..., K] against a matrix ``b`` [K, N] is always one GEMM over the leading dims folded
    into rows: ``torch.matmul`` folds them only when they fold into a view or ``b`` requires
    grad, else it runs a batched GEMM, one GEMM per leading index. The ops' operands are often
    views that do not fold (the scattered dim moved to the front of [B, S, K], even for B = 1,
    whose size-1 dim keeps a stride matmul does not skip), and batched, a prefill's slot GEMMs
    (weights without grad) run several times slower than the same GEMM folded. Here such an
    ``a`` is copied into rows (what matmul itself does when ``b`` requires grad)."""
    if _state["mode"] == "comm_only":
        return out if out is not None else a.new_empty((*a.shape[:-1], b.shape[-1]))
    if a.dim() < 3 or b.dim() != 2 or (out is not None and not out.is_contiguous()):
        return torch.matmul(a, b, out=out)
    rows = math.prod(a.shape[:-1])  # explicit: -1 is ambiguous when K or N is 0
    a_XK = a.reshape(rows, a.shape[-1])  # a view where the strides allow, else a copy
    if out is None:
        return torch.mm(a_XK, b).view(*a.shape[:-1], b.shape[-1])
    torch.mm(a_XK, b, out=out.view(rows, out.shape[-1]))
    return out


class NullTransport(Transport):
    """``compute_only`` mode: every transfer and collective is done at once, moving nothing.
    What a collective would have received is this rank's own input repeated over its output
    (a gather: this rank's part in every rank's place); a point-to-point receive is zeros.
    Uninitialised memory could hold NaNs and denormals (slow paths), and zero rows tie a MoE
    router's scores (every such token to the same experts): both change the work measured."""

    def post(self, transfers):
        for t, buf in transfers:
            if t.kind == "recv":
                buf.zero_()
        return [Done() for _ in transfers]

    def launch(self, kind, out, inp, tag, **parts):
        flat, n = inp.reshape(-1), out.numel()
        if flat.numel() == 0 or n == 0:
            out.zero_()
        else:
            out.copy_(flat.repeat(-(-n // flat.numel()))[:n].view(out.shape))
        return Done()


class Records:
    """``record`` mode: runs as the transport it is mixed into and notes each collective (to
    replay its bytes)."""

    def launch(self, kind, out, inp, tag, **parts):
        _state["recorded"].append((kind, out.shape, inp.shape, out.dtype, tag, parts))
        return super().launch(kind, out, inp, tag, **parts)


class RecordingTransport(Records, Transport):
    """``record`` mode on CPU (gloo)."""


_RECORDING_CUDA: list[type] = []  # the CUDA one, made on first use (CUDA code is lazy)


def transport_class(device: torch.device, group=None) -> type[Transport]:
    """The transport this mode and ``device`` call for (CUDA's is imported only on a GPU, or
    for a ``group`` that carries its own CUDA backend: `commfuse.runtime.nccl_model`'s
    virtual ranks, on any device)."""
    if _state["mode"] == "compute_only":
        return NullTransport
    record = _state["mode"] == "record"
    if device.type == "cuda" or getattr(group, "commfuse_backend", None) is not None:
        from commfuse.runtime.cuda import CudaTransport  # CUDA-only code, imported lazily

        if not record:
            return CudaTransport
        if not _RECORDING_CUDA:  # batched as CUDA's (a pair's send and receive in one batch)
            _RECORDING_CUDA.append(type("RecordingCudaTransport", (Records, CudaTransport),
                                        {"__doc__": "``record`` mode on CUDA."}))
        return _RECORDING_CUDA[0]
    return RecordingTransport if record else Transport
