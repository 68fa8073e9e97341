"""How many threads a service's torch (and so OpenMP) uses: its share of the cores it owns.

Every service is its own process, and several usually share a host: `specd serve api_server`
starts a drafter, a grammar service, a verifier and a gateway on one machine, and compose places
replicas side by side. torch's default, one intra-op thread per core in every process,
oversubscribes the cores several times over once they all compute, and OpenMP's spinning threads
then take the cores from each other (BENCHMARKS.md, "Co-located services (CPU)").

So each service sizes its threads at start (`--threads N` overrides, and so does an
OMP_NUM_THREADS the operator set):
- the gateway and the grammar service: 1 (tokenizing and grammar masks, no tensor products);
- a verifier or drafter on a GPU: 1 (the host launches graphs; more threads would only spin);
- a verifier or drafter on the CPU: the cores it owns, halved when it shares them. A process held
  to fewer cores than the host has (a container's CPU limit, a cpuset) owns them alone; one that
  sees every core of the host assumes it shares them with the other compute service of a stack
  (the verifier with its drafter).
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

log = logging.getLogger("specd.threads")

COMPUTE_SERVICES_PER_HOST = 2  # a verifier and its drafter


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup in cores (v2 cpu.max, or v1 cfs), None if unlimited."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def owned_cores() -> tuple[int, bool]:
    """(cores this process may run on, whether that is fewer than the host has)."""
    host = os.cpu_count() or 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else host
    limit = cgroup_cpu_limit()
    if limit is not None:
        cores = min(cores, max(1, math.ceil(limit)))
    return max(1, cores), cores < host


def auto_threads(service: str, device: str = "cpu") -> int:
    """The thread count the module doc gives `service` ("verifier", "drafter", "grammar", "gateway")."""
    if service not in ("verifier", "drafter") or not device.startswith("cpu"):
        return 1
    cores, limited = owned_cores()
    return cores if limited else max(1, cores // COMPUTE_SERVICES_PER_HOST)


def size_threads(service: str, device: str = "cpu", threads: int = 0) -> int:
    """Set torch's intra-op (and inter-op) threads for this service's process; returns the count.
    threads > 0: as given; else OMP_NUM_THREADS when the operator set it; else auto_threads."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if threads <= 0:
        from_env = os.environ.get("OMP_NUM_THREADS", "").strip()
        threads = int(from_env) if from_env.isdigit() and int(from_env) > 0 else auto_threads(service, device)
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)  # the services' Python threads are their concurrency
    except RuntimeError:  # inter-op work already started in this process: keep its pool
        pass
    log.info("%s: %d torch thread(s)", service, threads)
    return threads


def add_threads_argument(parser) -> None:
    parser.add_argument("--threads", type=int, default=0,
                        help="torch / OpenMP threads of this process (0: its share of the cores it owns, "
                             "or OMP_NUM_THREADS when set; see specd/host_threads.py)")
