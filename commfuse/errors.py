"""The errors commfuse raises."""


class CommFuseError(RuntimeError):
    """A fused op failed while communicating: a peer died, stalled or timed out.

    The message names the op, the method, the schedule step and the peer, so the failing link
    can be found from any surviving rank's log.
    """
