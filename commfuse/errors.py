"""The errors commfuse raises."""


class CommFuseError(RuntimeError):
    """A fused op failed while communicating: a peer died, stalled or timed out.

    The message names the op, the method, the schedule step and the peer, so the failing link
    can be found from any surviving rank's log.
    """


class ShapeMismatchError(CommFuseError, ValueError):
    """Checked mode (``check=True`` or ``COMMFUSE_CHECK=1``): the ranks of a group called a
    fused op with shapes or ``sizes`` that do not fit together. Raised on every rank, before
    the op moves any data; the message names the op, the ranks and what each one has."""
