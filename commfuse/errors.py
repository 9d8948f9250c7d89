"""The errors commfuse raises."""

from __future__ import annotations


class CommFuseError(RuntimeError):
    """A fused op failed while communicating: a peer died, stalled or timed out.

    The message names the op, the method, the schedule step and the peer, so the failing link
    can be found from any surviving rank's log; the same facts are attributes (None where one
    does not apply: ``step`` before the schedule runs, ``peer`` for a collective over the
    whole group): ``op``, ``method``, ``rank``, ``step``, ``peer``.
    """

    def __init__(self, message: str, *, op: str | None = None, method: str | None = None,
                 rank: int | None = None, step: int | None = None, peer: int | None = None):
        super().__init__(message)
        self.op, self.method, self.rank, self.step, self.peer = op, method, rank, step, peer


class ShapeMismatchError(CommFuseError, ValueError):
    """Checked mode (``check=True`` or ``COMMFUSE_CHECK=1``): the ranks of a group called a
    fused op with shapes or ``sizes`` that do not fit together. Raised on every rank, before
    the op moves any data; the message names the op, the ranks and what each one has."""
