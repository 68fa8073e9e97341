"""bench/grpc_transport.py: a real echo stream to a server in its own process, timed per gap."""

from __future__ import annotations

from bench import grpc_transport


def test_round_trips_are_timed_per_gap_against_a_server_process(capsys):
    assert grpc_transport.main(["--pings", "40", "--gaps-ms", "0,2", "--payload", "64"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "x |" in line]
    assert [r.split("|")[1].strip() for r in rows] == ["0", "2"]
    medians = [float(r.split("|")[2]) for r in rows]
    assert all(0 < m < 1e6 for m in medians)  # microseconds: answered, and well under a second
    assert rows[0].rstrip().endswith("1.00x |")
