"""The `specd drafter` command: its flags parse (and importing its CLI loads neither torch nor grpc),
and a real process serves drafts on loopback and stops cleanly on SIGTERM.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from specd.proposers.base import DraftRequest
from specd.proposers.remote import RemoteProposer
from specd.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def test_cli_help_parses(capsys):
    from specd.cli import build_parser

    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["drafter", "--help"])
    assert done.value.code == 0 and "--speculative-algorithm" in capsys.readouterr().out
    args = build_parser().parse_args(["drafter", "m", "--speculative-algorithm", "eagle3",
                                      "--speculative-draft-model", "d", "--device", "cuda:1"])
    assert (args.model, args.port, args.host, args.device, args.dtype) == ("m", 50061, "0.0.0.0", "cuda:1", "auto")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["drafter", "m", "--speculative-algorithm", "ngram", "--device", "gpu"])
    light = subprocess.run([sys.executable, "-c", "import sys, services.drafter.cli; "
                            "print(sorted({'torch', 'grpc'} & set(sys.modules)))"],
                           cwd=ROOT, capture_output=True, text=True, check=True)
    assert light.stdout.strip() == "[]"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_drafter_process_serves_and_stops_on_sigterm(tiny_models):
    port = _free_port()
    target = str(tiny_models["target-llama"])
    proc = subprocess.Popen([sys.executable, "-m", "specd.cli", "drafter", target, "--speculative-algorithm",
                             "ngram", "--host", "127.0.0.1", "--port", str(port)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        with RemoteProposer([f"127.0.0.1:{port}"], connect_timeout_s=60) as remote:
            remote.open(0, SamplingParams())
            out = remote.propose([DraftRequest(0, [5, 6, 7, 5, 6], None, 3)])
            assert out[0].token_ids.tolist() == [7, 5, 6]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(5)
    text = "".join(log)
    assert "event=drafter_serving" in text and "event=stream_open" in text
    assert "event=stream_close" in text and "event=drafter_stopped" in text
