"""The services' --idle-poll: busy loops at SCHED_IDLE, one per CPU, that end with the service."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.common import idle_poll
from specd.cli import build_parser

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux only (SCHED_IDLE)")
ROOT = Path(__file__).resolve().parents[2]


def _children(pid: int, count: int, timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        kids = [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        if len(kids) >= count:
            return kids
        time.sleep(0.05)
    raise AssertionError(f"process {pid} started {kids}, expected {count} children")


def _ended(pid: int) -> bool:
    """Gone, or a zombie nobody reaped yet (its loop has stopped either way)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _wait_ended(pids: list[int], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all(map(_ended, pids)):
        time.sleep(0.05)
    assert all(map(_ended, pids)), f"still running: {[p for p in pids if not _ended(p)]}"


def test_one_loop_per_cpu_pinned_at_sched_idle_and_stopped_with_the_helper():
    cpu = min(os.sched_getaffinity(0))
    helper = idle_poll.start({cpu})
    try:
        (loop,) = _children(helper.pid, 1)
        assert os.sched_getscheduler(loop) == os.SCHED_IDLE
        assert os.sched_getaffinity(loop) == {cpu}
        assert helper.poll() is None
    finally:
        helper.terminate()
        helper.wait(10)
    _wait_ended([loop])


def test_the_loops_end_when_the_service_is_killed():
    """SIGKILL leaves no chance to clean up: the helper and its loops must still go with it."""
    cpu = min(os.sched_getaffinity(0))
    service = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from services.common import idle_poll; "
                               f"print(idle_poll.start({{{cpu}}}).pid, flush=True); time.sleep(60)"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        helper = int(service.stdout.readline())
        (loop,) = _children(helper, 1)
        assert not _ended(helper) and not _ended(loop)
    finally:
        service.send_signal(signal.SIGKILL)
        service.wait(10)
    _wait_ended([helper, loop])


@pytest.mark.parametrize("service", ["verifier", "drafter"])
def test_the_flag_defaults_to_the_environment(service, monkeypatch):
    extra = ["--speculative-algorithm", "ngram"] if service == "drafter" else []
    monkeypatch.delenv(idle_poll.IDLE_POLL_ENV, raising=False)
    assert build_parser().parse_args([service, "m", *extra]).idle_poll is False
    monkeypatch.setenv(idle_poll.IDLE_POLL_ENV, "1")
    assert build_parser().parse_args([service, "m", *extra]).idle_poll is True
    assert build_parser().parse_args([service, "m", *extra, "--no-idle-poll"]).idle_poll is False


def test_no_cpus_is_an_error():
    with pytest.raises(ValueError, match="no CPUs"):
        idle_poll.start(set())
