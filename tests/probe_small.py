"""A smaller hardware probe for tests that run ``--hardware measured`` (`commfuse.runtime.probe`).

The probe's kernels are sized to time a machine well (a 1024 x 1024 x 2048 GEMM, a 2048-token
attention, 20 runs each, up to 3 attempts): seconds per rank on a 2-core machine, more under
load. A test of what a run does with a fitted model (the same choices on every rank, a fit
per workload, exact results) needs the probe's code path, not its accuracy: `shrink` scales
every shape down 8x in work and measures once. Call it in the process that probes (a rank);
a forked rank's change dies with it.
"""


def shrink() -> None:
    from commfuse.runtime import probe

    probe.GEMM_SHAPE["cpu"] = (512, 512, 1024)
    probe.SMALL_GEMM_SHAPE["cpu"] = (128, 512, 1024)
    probe.NARROW_SHAPES["cpu"] = ((64, 512, 1024), (64, 1024, 2048))
    probe.ATTENTION_SHAPE["cpu"] = (1, 2, 1024, 64)
    probe.ATTEMPTS = 1
