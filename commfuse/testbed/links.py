"""What one emulated link is: its rate, delay and jitter in tc's units, and the token-bucket
parameters that shape it (`commfuse.testbed.net` applies them)."""

from __future__ import annotations

import re
from dataclasses import dataclass

# tc's SI units (bit: bits/s, bps: bytes/s) in bits/s.
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
               "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9}
_TIME_UNITS = {"us": 1.0, "usec": 1.0, "ms": 1e3, "msec": 1e3, "s": 1e6, "sec": 1e6}


def _quantity(text: str, units: dict, what: str) -> float:
    """``"1.5ms"``, ``_TIME_UNITS`` -> 1500.0: a non-negative number times its unit."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in units:
        raise ValueError(f"bad {what} {text!r}: expected a number and a unit out of "
                         f"{', '.join(units)}")
    return float(m.group(1)) * units[m.group(2).lower()]


def parse_rate(text: str) -> int:
    """``"1gbit"`` -> 1_000_000_000 bits/s. Units as in tc: bit, kbit, mbit, gbit, bps, ..."""
    bits = round(_quantity(text, _RATE_UNITS, "rate"))
    if bits < 8000:
        raise ValueError(f"rate {text!r} is below 8kbit, too slow to shape usefully")
    return bits


def parse_duration_us(text: str) -> float:
    """``"50us"`` -> 50.0, ``"1ms"`` -> 1000.0, ``"0"`` -> 0.0 (microseconds)."""
    return 0.0 if str(text).strip() == "0" else _quantity(text, _TIME_UNITS, "duration")


@dataclass(frozen=True)
class LinkSpec:
    """One rank's link to the switch, as seen by the bytes it sends."""

    rate: str = "1gbit"
    """Bandwidth in tc units: '1gbit', '200mbit', '10gbit', '125mbps' (bytes/s)."""
    delay: str = "50us"
    """One-way added latency ('50us', '1ms', '0'); needs the kernel's sch_netem."""
    jitter: str = "0us"
    """Random +- variation of the delay (netem may then reorder packets); <= delay."""

    def __post_init__(self) -> None:
        parse_rate(self.rate)
        if parse_duration_us(self.jitter) > parse_duration_us(self.delay):
            raise ValueError(f"jitter {self.jitter!r} exceeds delay {self.delay!r}")

    @property
    def rate_bps(self) -> int:
        """`rate` in bits/s."""
        return parse_rate(self.rate)

    @property
    def delay_us(self) -> float:
        """`delay` in microseconds."""
        return parse_duration_us(self.delay)

    @property
    def jitter_us(self) -> float:
        """`jitter` in microseconds."""
        return parse_duration_us(self.jitter)

    def describe(self) -> str:
        """A short label such as '1gbit delay 50us'."""
        jitter = f" jitter {self.jitter}" if self.jitter_us else ""
        return f"{self.rate} delay {self.delay}{jitter}"


def tbf_params(rate_bps: int, packet: int = 64 * 1024) -> tuple[int, int]:
    """(burst, limit) in bytes for a tbf at ``rate_bps`` passing TCP super-packets (GSO) of up
    to ``packet`` bytes; measured with TCP over veth.

    burst: 250 us of the rate, at least 96 KiB, and at least a whole super-packet and 32 KiB.
    Smaller loses rate to timer granularity (16 KiB at 1gbit: 92 %); and below the packet size
    tbf cuts every super-packet into MTU-sized packets, whose trip through two veths and the
    bridge cost the sending core 30-40 ms of CPU per 8 MB at 1gbit, against 3 ms when 64 KiB
    packets pass whole (measured with `time.process_time` around a gloo send): CPU the GEMM
    that should hide the transfer needs, where a real NIC would take none. 96 KiB at 1gbit
    still gives 0.91-0.92 Gbit/s one way. The price of a burst: after the link was idle, its
    first ``burst`` bytes leave at once (docs/design.md, "The emulated network").
    limit: TCP small queues keeps ~1 ms of the *pacing* rate (not of the shaped rate) queued
    per socket: a 256 KiB queue dropped packets at 1gbit, 1 MiB never. So at least 1 MiB.
    """
    rate_bytes = rate_bps / 8
    burst = max(96 * 1024, packet + 32 * 1024, int(rate_bytes * 250e-6))
    return burst, max(1024 * 1024, int(rate_bytes * 4e-3), 4 * burst)
