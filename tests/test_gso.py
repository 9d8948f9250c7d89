"""TCP super-packets on the emulated links (commfuse.testbed.gso): the size asked, the size in
force, tbf's burst sized for it, and the packets a transfer actually takes."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap

import pytest

from commfuse.testbed import gso, links
from commfuse.testbed.launch import ClusterSpec, add_launch_arguments, launch, spec_from_args
from commfuse.testbed.net import EmulatedNetwork
from marks import needs_netns


def test_tbf_burst_holds_a_whole_super_packet():
    assert links.tbf_params(10**9) == links.tbf_params(10**9, gso.LEGACY_GSO)
    assert links.tbf_params(10**9)[0] == 96 * 1024  # what the testbed always had at 64 KiB
    for packet in (gso.BIG, gso.MAX_GSO):
        burst, limit = links.tbf_params(10**9, packet)
        assert burst == packet + 32 * 1024 and limit >= 4 * burst


def test_gso_option():
    parse = add_launch_arguments(argparse.ArgumentParser()).parse_args
    assert spec_from_args(parse(["--", "true"])).gso_bytes == gso.DEFAULT == gso.LEGACY_GSO
    assert ClusterSpec().gso_bytes == gso.DEFAULT
    assert spec_from_args(parse(["--gso-kib", "256", "--", "true"])).gso_bytes == gso.BIG
    assert spec_from_args(parse(["--gso-kib", "512", "--", "true"])).gso_bytes == gso.MAX_GSO
    for bad in ("63", "513"):
        with pytest.raises(ValueError, match="--gso-kib must be 64..512"):
            spec_from_args(parse(["--gso-kib", bad, "--", "true"]))
    with pytest.raises(ValueError, match="gso_bytes"):
        ClusterSpec(gso_bytes=1000)
    with pytest.raises(ValueError, match="GSO size"):
        gso.set_sizes("lo", gso.MAX_GSO + 8)


def test_gso_module_usage():
    out = subprocess.run([sys.executable, "-m", "commfuse.testbed.gso"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "usage" in out.stderr


def _tbf_burst(netns: str, ifname: str) -> float:
    """tbf's burst in bytes, as tc shows it (98250b, 288Kb: tc rounds through time units)."""
    shown = subprocess.run(["tc", "-n", netns, "qdisc", "show", "dev", ifname],
                           capture_output=True, text=True, check=True).stdout
    value = shown.split("burst ")[1].split()[0]
    for unit, scale in (("Mb", 1 << 20), ("Kb", 1 << 10), ("b", 1)):
        if value.endswith(unit):
            return float(value[:-len(unit)]) * scale
    raise AssertionError(f"no burst in {shown!r}")


@needs_netns
@pytest.mark.parametrize("asked", [gso.LEGACY_GSO, gso.BIG])
def test_links_take_the_size_and_tbf_lets_it_through(asked):
    net = EmulatedNetwork([links.LinkSpec()] * 2, gso_bytes=asked)
    net.up()
    try:
        # 256 KiB where the kernel has BIG TCP for IPv4 (Linux 6.3+), else its 64 KiB
        assert net.gso_in_force in {asked, gso.LEGACY_GSO}
        burst = links.tbf_params(10**9, net.gso_in_force)[0]
        for port in net.ports:
            assert _tbf_burst(port.netns, port.ifname) == pytest.approx(burst, rel=0.01)
    finally:
        net.down()


# Rank 0 sends NBYTES to rank 1; each writes how many packets its interface sent meanwhile.
_COUNT = """\
import json, os, sys, torch, torch.distributed as dist
stats = f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics/tx_packets"
dist.init_process_group("gloo")
rank, x = dist.get_rank(), torch.ones(NBYTES // 4)
dist.barrier()
before = int(open(stats).read())
dist.send(x, 1) if rank == 0 else dist.recv(x, 0)
dist.barrier()
json.dump({"tx": int(open(stats).read()) - before, "link": os.environ["COMMFUSE_LINK"]},
          open(f"{OUT}/rank{rank}.json", "w"))
dist.destroy_process_group()
"""


@needs_netns
def test_a_transfer_goes_as_super_packets_of_the_size_in_force(tmp_path):
    nbytes = 16 << 20
    script = tmp_path / "count.py"
    script.write_text(f"NBYTES = {nbytes}\nOUT = {str(tmp_path)!r}\n" + textwrap.dedent(_COUNT))
    assert launch(ClusterSpec(nproc=2, gso_bytes=gso.BIG), [sys.executable, str(script)],
                  timeout=120) == 0
    sent = json.loads((tmp_path / "rank0.json").read_text())
    size = int(sent["link"].rsplit("GSO ", 1)[1].split()[0]) * 1024
    assert size in {gso.BIG, gso.LEGACY_GSO}, sent
    # TCP fills most super-packets to the size in force: fewer than twice the minimum count,
    # where 1500-byte packets would be 11 000
    assert nbytes / size <= sent["tx"] < 2 * nbytes / size + 16, sent
