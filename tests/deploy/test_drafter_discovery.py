"""Drafters found by name: a `--drafter` name that resolves to several addresses (compose's DNS
under --scale, a headless Service) puts every replica on the verifier's hash ring."""

from __future__ import annotations

import socket

import pytest

from services.verifier import server


def fake_dns(table):
    def getaddrinfo(host, port, *args, **kwargs):
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "unknown")
        return [(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (ip, port, 0, 0) if ":" in ip else (ip, port)) for ip in table[host]]
    return getaddrinfo


@pytest.fixture
def dns(monkeypatch, caplog):
    caplog.set_level("INFO", logger="specd.verifier")  # the log line is part of what runs
    table = {}
    monkeypatch.setattr(server.socket, "getaddrinfo", fake_dns(table))
    return table


def test_a_name_with_several_addresses_becomes_one_address_each(dns, caplog):
    dns["drafter"] = ["10.0.0.7", "10.0.0.3", "10.0.0.7"]
    assert server.resolve_drafters(["drafter:50061"]) == ["10.0.0.3:50061", "10.0.0.7:50061"]
    (record,) = [r for r in caplog.records if r.getMessage() == "drafters resolved"]
    assert record.addresses == "10.0.0.3:50061,10.0.0.7:50061"


def test_one_address_or_none_keeps_the_name(dns):
    dns["drafter"] = ["10.0.0.3"]
    dns["localhost"] = ["127.0.0.1", "::1"]  # one per family: the same server, not two
    assert server.resolve_drafters(["drafter:50061", "localhost:1", "missing:2"]) == \
        ["drafter:50061", "localhost:1", "missing:2"]


def test_ipv6_only_names_get_brackets_and_duplicates_go(dns):
    dns["d6"] = ["fd00::2", "fd00::1"]
    dns["a"] = ["10.0.0.1", "10.0.0.2"]
    assert server.resolve_drafters(["d6:7", "a:1", "10.0.0.1:1"]) == \
        ["[fd00::1]:7", "[fd00::2]:7", "10.0.0.1:1", "10.0.0.2:1"]
