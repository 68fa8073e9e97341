"""The `specd grammar` command: its flags parse (and importing its CLI loads neither torch, grpc nor
xgrammar), and a real process serves masks on loopback and stops cleanly on SIGTERM.
"""

from __future__ import annotations

import pytest

from specd.grammar.backend import GrammarSpec, GrammarStep
from specd.clients.grammar import RemoteGrammarBackend
from specd.transport.ports import free_port
from tests.services.service_process import heavy_imports_of, serving


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
    assert heavy_imports_of("services.grammar.cli", {'torch', 'grpc', 'xgrammar'}) == []


def test_grammar_process_serves_and_stops_on_sigterm(tiny_models):
    port = free_port()
    with serving(["grammar", str(tiny_models["target-llama"]), "--host", "127.0.0.1", "--port", str(port),
                  "--cache-entries", "8"]) as log:
        with RemoteGrammarBackend(f"127.0.0.1:{port}", deadline_s=60) as remote:
            remote.validate(GrammarSpec("json_object"))
            remote.open(0, GrammarSpec("regex", "ab"))
            out = remote.step(GrammarStep(drafts={0: [69]}))  # id 69 is "b", not the "a" the regex wants
            assert out[0].num_valid_drafts == 0 and out[0].bitmask.shape == (1, 16)
    text = "".join(log)
    assert "event=grammar_serving" in text and "event=stream_open" in text
    assert "event=stream_close" in text and "event=grammar_stopped" in text
