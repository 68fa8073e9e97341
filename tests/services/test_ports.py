"""Ports a launcher hands to its services lie outside the kernel's ephemeral range, so no port-0
bind or outgoing connection can take one between the pick and the service's bind."""

from __future__ import annotations

import socket

import pytest

from specd.transport import ports
from specd.transport.ports import candidate_ranges, ephemeral_range, free_port


def test_free_ports_are_bindable_distinct_and_outside_the_ephemeral_range():
    first, last = ephemeral_range()
    picked = [free_port() for _ in range(50)]
    assert len(set(picked)) == 50
    for port in picked:
        assert not first <= port <= last, (port, first, last)
        assert port >= ports.LOWEST_PORT
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free, as promised


def test_port_zero_binds_never_take_a_picked_port():
    port = free_port()
    held = []
    try:
        for _ in range(500):  # the drafter's step socket, clients' local ports: the kernel's picks
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            held.append(s)
            assert s.getsockname()[1] != port
    finally:
        for s in held:
            s.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_the_ephemeral_range_is_read_from_the_kernel_file(tmp_path):
    path = tmp_path / "ip_local_port_range"
    path.write_text("40000\t50000\n")
    assert ephemeral_range(str(path)) == (40000, 50000)
    path.write_text("garbage")
    assert ephemeral_range(str(path)) == ports.DEFAULT_EPHEMERAL_RANGE
    assert ephemeral_range(str(tmp_path / "missing")) == ports.DEFAULT_EPHEMERAL_RANGE


@pytest.mark.parametrize("ephemeral,expected", [
    ((32768, 60999), [range(10000, 32768), range(61000, 65536)]),
    ((1024, 65535), []),  # everything ephemeral: nothing outside it
    ((1024, 40000), [range(40001, 65536)]),
])
def test_candidate_ranges_avoid_the_ephemeral_range(ephemeral, expected):
    assert candidate_ranges(ephemeral) == expected


def test_a_machine_with_no_port_outside_the_range_still_gets_a_free_port(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 65535))
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
