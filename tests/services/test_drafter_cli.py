"""The `specd drafter` command: its flags parse (and importing its CLI loads neither torch nor grpc),
and a real process serves drafts on loopback and stops cleanly on SIGTERM.
"""

from __future__ import annotations

import pytest

from specd.proposers.base import DraftRequest
from specd.clients.drafter import RemoteProposer
from specd.sampling_params import SamplingParams
from specd.transport.ports import free_port
from tests.services.service_process import heavy_imports_of, serving


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
    assert heavy_imports_of("services.drafter.cli", {'torch', 'grpc'}) == []


def test_drafter_process_serves_and_stops_on_sigterm(tiny_models):
    port = free_port()
    target = str(tiny_models["target-llama"])
    with serving(["drafter", target, "--speculative-algorithm", "ngram", "--host", "127.0.0.1",
                  "--port", str(port)]) as log:
        with RemoteProposer([f"127.0.0.1:{port}"], connect_timeout_s=60) as remote:
            remote.open(0, SamplingParams())
            out = remote.propose([DraftRequest(0, [5, 6, 7, 5, 6], None, 3)])
            assert out[0].token_ids.tolist() == [7, 5, 6]
    text = "".join(log)
    assert "event=drafter_serving" in text and "event=stream_open" in text
    assert "event=stream_close" in text and "event=drafter_stopped" in text
