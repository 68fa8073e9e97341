"""The `specd grammar` command: its flags parse (and importing its CLI loads neither torch, grpc nor
xgrammar), and a real process serves masks on loopback and stops cleanly on SIGTERM.
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

from specd.grammar.backend import GrammarSpec, GrammarStep
from specd.grammar.remote import RemoteGrammarBackend

ROOT = Path(__file__).resolve().parents[2]


def test_cli_help_parses(capsys):
    from specd.cli import build_parser

    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["grammar", "--help"])
    assert done.value.code == 0 and "--cache-entries" in capsys.readouterr().out
    args = build_parser().parse_args(["grammar", "m"])
    assert (args.model, args.host, args.port, args.cache_entries, args.max_workers, args.log_level) == (
        "m", "0.0.0.0", 50081, 256, 32, "info")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["grammar", "m", "--cache-entries", "0"])
    light = subprocess.run([sys.executable, "-c", "import sys, services.grammar.cli; "
                            "print(sorted({'torch', 'grpc', 'xgrammar'} & set(sys.modules)))"],
                           cwd=ROOT, capture_output=True, text=True, check=True)
    assert light.stdout.strip() == "[]"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_grammar_process_serves_and_stops_on_sigterm(tiny_models):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specd.cli", "grammar", str(tiny_models["target-llama"]),
                             "--host", "127.0.0.1", "--port", str(port), "--cache-entries", "8"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        with RemoteGrammarBackend(f"127.0.0.1:{port}", deadline_s=60) as remote:
            remote.validate(GrammarSpec("json_object"))
            remote.open(0, GrammarSpec("regex", "ab"))
            out = remote.step(GrammarStep(drafts={0: [69]}))  # id 69 is "b", not the "a" the regex wants
            assert out[0].num_valid_drafts == 0 and out[0].bitmask.shape == (1, 16)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(5)
    text = "".join(log)
    assert "event=grammar_serving" in text and "event=stream_open" in text
    assert "event=stream_close" in text and "event=grammar_stopped" in text
