"""Bigger TCP super-packets on the emulated links: an interface's GSO and GRO sizes over netlink.

On the emulated cluster the kernel's network stack runs on the ranks' own cores: every packet
that leaves tbf is a softirq, an inter-processor interrupt (RPS) and a trip through two veths,
the bridge and the receiver's TCP, CPU that the GEMM hiding the transfer needs and that a NIC
would not take. TCP hands the stack super-packets (GSO) of at most 64 KiB by default; Linux
6.3+ lets IPv4 go up to 512 KiB ("BIG TCP"), which makes that per-packet CPU several times
rarer. iproute2 before 6.3 cannot set it, so this module speaks rtnetlink itself: run in the
interface's namespace, ``python -m commfuse.testbed.gso SIZE IFNAME...`` sets each interface's
sizes and prints the IPv4 GSO size in force afterwards (the smallest over the interfaces;
65536 where the kernel ignores the request).
"""

from __future__ import annotations

import socket
import struct
import sys

RTM_NEWLINK, RTM_GETLINK, NLMSG_ERROR = 16, 18, 2
NLM_F_REQUEST, NLM_F_ACK = 1, 4
IFLA_GSO_MAX_SIZE, IFLA_GRO_MAX_SIZE = 41, 58
IFLA_GSO_IPV4_MAX_SIZE, IFLA_GRO_IPV4_MAX_SIZE = 63, 64
LEGACY_GSO = 65536
"""The IPv4 GSO size of a kernel without BIG TCP for IPv4 (and every interface's default)."""
MAX_GSO = 524280
"""The largest the kernel takes (GSO_MAX_SIZE, 512 KiB less 8)."""
BIG = 256 * 1024
"""The size for layer and op benchmarks of MiB-sized messages (``--gso-kib 256``): the
network stack's CPU a third of 64 KiB's, at the price of a tbf burst
(`commfuse.testbed.links.tbf_params`) of 288 KiB that a message sent after idle skips."""
DEFAULT = LEGACY_GSO
"""What the emulated cluster asks for unless told: the kernel's own 64 KiB. Messages of a few
hundred KiB (the README's training run) then take about their line-rate time; at 256 KiB one
sent after idle leaves at once, which made that run's communication half as long."""


def _request(sock: socket.socket, kind: int, flags: int, index: int, attrs: bytes) -> bytes:
    body = struct.pack("=BxHiII", socket.AF_UNSPEC, 0, index, 0, 0) + attrs
    sock.send(struct.pack("=IHHII", 16 + len(body), kind, NLM_F_REQUEST | flags, 1, 0) + body)
    reply = sock.recv(65536)
    if struct.unpack_from("=H", reply, 4)[0] == NLMSG_ERROR:
        err = struct.unpack_from("=i", reply, 16)[0]
        if err:
            raise OSError(-err, f"rtnetlink: {socket.if_indextoname(index)}: error {-err}")
    return reply


def _attrs(reply: bytes) -> dict[int, bytes]:
    """The link attributes of an RTM_NEWLINK reply (after its 16-byte header and ifinfomsg)."""
    out, at = {}, 32
    while at + 4 <= len(reply):
        length, kind = struct.unpack_from("=HH", reply, at)
        if length < 4:
            break
        out[kind & 0x3FFF] = reply[at + 4:at + length]
        at += (length + 3) & ~3
    return out


def set_sizes(ifname: str, size: int) -> int:
    """Set ``ifname``'s GSO and GRO sizes (IPv4 and generic) to ``size`` bytes; return the
    IPv4 GSO size in force afterwards."""
    if not LEGACY_GSO <= size <= MAX_GSO:
        raise ValueError(f"GSO size must be {LEGACY_GSO}..{MAX_GSO} bytes, got {size}")
    index = socket.if_nametoindex(ifname)
    attrs = b"".join(struct.pack("=HHI", 8, kind, size) for kind in (
        IFLA_GSO_MAX_SIZE, IFLA_GRO_MAX_SIZE, IFLA_GSO_IPV4_MAX_SIZE, IFLA_GRO_IPV4_MAX_SIZE))
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0) as sock:  # NETLINK_ROUTE
        sock.bind((0, 0))
        _request(sock, RTM_NEWLINK, NLM_F_ACK, index, attrs)
        got = _attrs(_request(sock, RTM_GETLINK, 0, index, b""))
    raw = got.get(IFLA_GSO_IPV4_MAX_SIZE)
    return struct.unpack("=I", raw[:4])[0] if raw else LEGACY_GSO


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.split("\n\n")[0] + "\nusage: python -m commfuse.testbed.gso SIZE IFNAME...",
              file=sys.stderr)
        return 2
    print(min(set_sizes(name, int(argv[0])) for name in argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
