"""Where ranks run: local processes for tests and training, and the emulated cluster.

    spawn.py    N local ranks (gloo) with a race-free rendezvous, failures reported, no hangs
    launch.py   ``commfuse launch``: ranks in network namespaces with shaped links
    procs.py    the ranks as processes: started, watched, stopped together, signals forwarded
    links.py    one link's rate, delay and jitter, and its tbf parameters
    net.py      the namespaces, veth pairs, bridge and tc shaping of the emulated network
    cpu.py      a straggler's CPU quota (cgroup v2)
    faults.py   fault injection: forked ranks whose peer is killed, stalls or loses its link
    stress.py   python -m commfuse.testbed.stress: the faults over and over under CPU load
"""
