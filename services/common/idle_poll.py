"""Keeping a service's CPUs out of idle: one busy loop per CPU at SCHED_IDLE (opt-in, Linux).

Why: GPUs are rented as virtual machines, and there an idle vCPU halts (HLT: a VM exit); a thread
woken on it waits until the host runs that vCPU again. A drafter round trip is about six such
wake-ups across two processes (gRPC's sender, poller and reader threads, the drafter's handler),
each after the ~5 ms the threads sleep through the device's step. On the H200 VM
(bench/grpc_transport.py, echo server in its own process) a round trip took 332 us back to back
but 665 us after 4 ms of client work; with a busy loop at SCHED_IDLE on each of the 16 vCPUs, 208
and 396 us. No vCPU halts, and a waking thread preempts the loop at once: SCHED_IDLE yields to
every other task. It is what the kernel's idle=poll does, on a machine whose boot line you do not
control.

Cost: every CPU of the service's affinity set stays busy. Under a cgroup CPU *limit* (Kubernetes
`limits.cpu`, `docker --cpus`) the loops would spend the quota and throttle the service itself:
use it only on CPUs to spare (a GPU host's cores, a pod with a CPU request but no limit). Off by
default; `--idle-poll` (env SPECD_IDLE_POLL=1) on the verifier and the drafter.

The loops run in a helper process (`python -m services.common.idle_poll CPU...`), one forked child
per CPU, each pinned to its CPU; the helper dies with the service that started it, and the loops
with the helper (PR_SET_PDEATHSIG), however the service ends.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

IDLE_POLL_ENV = "SPECD_IDLE_POLL"  # "1": the verifier / drafter start their CPUs' busy loops
_PR_SET_PDEATHSIG = 1


def add_argument(parser) -> None:
    """--idle-poll / --no-idle-poll on a service's parser (default: SPECD_IDLE_POLL)."""
    import argparse

    parser.add_argument("--idle-poll", action=argparse.BooleanOptionalAction,
                        default=os.environ.get(IDLE_POLL_ENV, "0") not in ("", "0"),
                        help="keep this service's CPUs out of idle with a busy loop per CPU at SCHED_IDLE: "
                             "faster thread wake-ups on VMs, at the cost of always-busy CPUs; not under a "
                             "CPU limit (services/common/idle_poll.py; env SPECD_IDLE_POLL=1)")


def start(cpus: set[int] | None = None) -> subprocess.Popen:
    """Start the busy loops on `cpus` (default: this process's affinity set); returns the helper
    process (terminate it to stop them; it also ends when this process does)."""
    if not hasattr(os, "SCHED_IDLE"):
        raise OSError("idle polling needs Linux (SCHED_IDLE, sched_setaffinity)")
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if not cpus:
        raise ValueError("idle polling: no CPUs given")
    return subprocess.Popen([sys.executable, "-m", "services.common.idle_poll", str(os.getpid()),
                             *map(str, cpus)], stdin=subprocess.DEVNULL, close_fds=True)


def _die_with_parent(parent: int) -> None:
    """SIGKILL when the process that started this one ends (and at once if it already has)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:  # it ended before the signal was armed
        os._exit(0)


def _spin(cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    while True:
        pass


def main(argv: list[str]) -> int:
    """The helper: argv = [service pid, cpu, ...]."""
    parent, cpus = int(argv[0]), [int(c) for c in argv[1:]]
    _die_with_parent(parent)
    helper = os.getpid()
    for cpu in cpus:
        if os.fork() == 0:
            try:
                _die_with_parent(helper)
                _spin(cpu)
            finally:
                os._exit(1)
    while True:  # until a signal ends it (SIGTERM from stop(), SIGKILL with the service); the loops follow
        signal.pause()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
