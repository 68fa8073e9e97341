"""Each service sizes its torch threads to its share of the cores it owns (specd/host_threads.py)."""

import subprocess
import sys

import pytest
import torch

from specd import host_threads


def test_cgroup_limits_are_read_in_cores(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert host_threads.cgroup_cpu_limit(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert host_threads.cgroup_cpu_limit(tmp_path) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert host_threads.cgroup_cpu_limit(v1) is None
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("400000\n")
    assert host_threads.cgroup_cpu_limit(v1) == 4.0
    assert host_threads.cgroup_cpu_limit(tmp_path / "absent") is None


@pytest.mark.parametrize("service, device, cores, limited, want", [
    ("verifier", "cpu", 16, False, 8),   # a whole host: shared with the drafter
    ("drafter", "cpu", 16, False, 8),
    ("verifier", "cpu", 2, False, 1),
    ("verifier", "cpu", 4, True, 4),     # a container's CPU limit: its own cores
    ("verifier", "cpu", 1, False, 1),
    ("verifier", "cuda", 16, False, 1),  # the host only launches
    ("drafter", "cuda:1", 16, True, 1),
    ("grammar", "cpu", 16, False, 1),
    ("gateway", "cpu", 16, False, 1),
])
def test_each_service_takes_its_share(monkeypatch, service, device, cores, limited, want):
    monkeypatch.setattr(host_threads, "owned_cores", lambda: (cores, limited))
    assert host_threads.auto_threads(service, device) == want


def test_the_flag_then_the_operators_env_then_auto(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr(host_threads, "owned_cores", lambda: (6, True))
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        assert host_threads.size_threads("verifier", "cpu") == 6 and torch.get_num_threads() == 6
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert host_threads.size_threads("verifier", "cpu") == 2 and torch.get_num_threads() == 2
        assert host_threads.size_threads("verifier", "cpu", threads=3) == 3 and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_a_service_process_starts_with_its_share():
    """The real entry point: `specd grammar --help` parses --threads, and a fresh process sized as a
    grammar service runs one torch thread whatever the host's cores."""
    code = ("import torch; from specd.host_threads import size_threads; size_threads('grammar'); "
            "print(torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "1"
    helptext = subprocess.run([sys.executable, "-m", "specd.cli", "grammar", "--help"], capture_output=True,
                              text=True, check=True).stdout
    assert "--threads" in helptext
