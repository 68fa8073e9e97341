"""Free TCP ports to tell a service to listen on, outside the kernel's ephemeral range.

A launcher that picks a port and hands it to a child process races everything that binds
between the pick and the child's bind. Ports from the ephemeral range (Linux's
ip_local_port_range) lose that race to any socket bound to port 0 or connecting out, which
services do all the time (the drafter's step socket, every Redis and gRPC client connection):
a stack's drafter once failed to start so in CI. Below the range only explicit binds compete,
and those pick their numbers on purpose.
"""

from __future__ import annotations

import random
import socket

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
DEFAULT_EPHEMERAL_RANGE = (32768, 60999)  # Linux's default, where the file cannot be read
LOWEST_PORT = 10000  # below: well-known and registered services' usual ports

_handed_out: set[int] = set()


def ephemeral_range(path: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """(first, last) of the ports the kernel gives to port-0 binds and outgoing connections."""
    try:
        with open(path) as f:
            first, last = (int(v) for v in f.read().split())
        return first, last
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL_RANGE


def candidate_ranges(ephemeral: tuple[int, int]) -> list[range]:
    """The non-ephemeral ports from LOWEST_PORT up, as ranges (the ephemeral range may sit
    anywhere, so below and above it)."""
    first, last = ephemeral
    ranges = [range(LOWEST_PORT, min(first, 65536)), range(max(last + 1, LOWEST_PORT), 65536)]
    return [r for r in ranges if len(r) > 0]


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(attempts: int = 200) -> int:
    """A port free now, outside the ephemeral range, and not handed out before by this process
    (callers often take several before binding any). Falls back to a kernel-chosen port when
    no such port is found (a machine whose ephemeral range covers everything)."""
    ranges = candidate_ranges(ephemeral_range())
    sizes = [len(r) for r in ranges]
    for _ in range(attempts if ranges else 0):
        r = random.choices(ranges, weights=sizes)[0]
        port = random.choice(r)
        if port not in _handed_out and _bindable(port):
            _handed_out.add(port)
            return port
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
