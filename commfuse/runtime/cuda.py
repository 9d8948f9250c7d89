"""CUDA transport: transfers on a dedicated communication stream, ordered with events.

Imported lazily by `commfuse.runtime.modes` only when the tensors live on a GPU.

Why a side stream: NCCL orders each P2P after the work already queued on the stream that is
current when it is posted. Posted from the compute stream, a send would wait for every GEMM
queued before it; posted from ``comm`` (which first waits for the compute stream, so the data
it sends exists), it starts as soon as its data does, and later GEMMs run beside it.
"""

from __future__ import annotations

from typing import Any

import torch

from commfuse.runtime.transport import Transport

_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def comm_stream(device: torch.device) -> torch.cuda.Stream:
    """One communication stream per device, created on first use."""
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device=device)
    return _STREAMS[device]


class CudaTransport(Transport):
    def __init__(self, group, device: torch.device, timeout_s: float, collective: str = "auto"):
        super().__init__(group, device, timeout_s, collective)
        self.comm = comm_stream(device)

    def post(self, transfers):
        self.comm.wait_stream(torch.cuda.current_stream(self.device))  # data to send is ready
        with torch.cuda.stream(self.comm):
            works = super().post(transfers)
        for _, buf in transfers:
            buf.record_stream(self.comm)  # keep buffers alive until the transfer is done
        return works

    def launch(self, kind, out, inp, tag, **parts) -> Any:
        self.comm.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.comm):
            work = super().launch(kind, out, inp, tag, **parts)
        out.record_stream(self.comm)
        inp.record_stream(self.comm)
        return work

    def wait(self, work: Any) -> None:
        # Makes the compute stream wait, not the host: the GPU keeps the overlap. NCCL's own
        # watchdog enforces the group timeout (a host-side timed wait would block the CPU).
        work.wait()
