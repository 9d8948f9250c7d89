"""The runtime: what runs a schedule on a process group.

    executor.py     walks a schedule's steps with an op's binding and a transport
    transport.py    posts transfers and collectives, waits with a deadline (CPU / gloo)
    gloo.py         gloo's point-to-point posting: sender threads, one connection per direction
    cuda.py         the CUDA transport: a communication stream ordered with events (lazy)
    deadlines.py    waits' deadlines: the host's on CPU, a watchdog thread's on CUDA
    nccl_model.py   NCCL's matching and ordering of one communicator, modelled on CPU
    virtual_ranks.py  threads of one process as ranks over that model (tests, check-gpu)
    collectives.py  the collectives behind none / sliced: the backend's, or the same bytes as P2P
    modes.py        measurement modes (compute alone, communication alone, record, trace)
    probe.py        times this device's kernels at start and fits the simulator's hardware
                    model to them (what ``auto`` decides on; `commfuse.ops.auto.calibrate`)
    tax.py          what moving bytes costs the rank at start: the compute's slowdown beside
                    transfers, the host time per post (the probe's CPU gloo part)
"""
