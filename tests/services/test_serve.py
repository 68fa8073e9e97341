"""`specd serve api_server` runs the seed's command line (lmdeploy -> specd) and Ctrl-C stops it all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import openai

from specd.transport.ports import free_port


def processes_mentioning(marker: str) -> list[str]:
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if marker in line and "ps -eo" not in line]


def test_seed_command_line_serves_and_ctrl_c_stops_everything(tiny_models, tmp_path):
    port, verifier_metrics = free_port(), free_port()
    # The seed's command with `lmdeploy` replaced by `specd` and the model paths made local.
    cmd = [sys.executable, "-m", "specd.cli", "serve", "api_server", str(tiny_models["target-llama"]),
           "--backend", "pytorch", "--server-port", str(port),
           "--speculative-draft-model", str(tiny_models["draft-eagle3"]), "--speculative-algorithm", "eagle3",
           "--speculative-num-draft-tokens", "3", "--max-batch-size", "128", "--enable-metrics",
           "--verifier-metrics-port", str(verifier_metrics)]
    # Started with SIGINT ignored, as `specd serve ... &` in a script starts it (bash ignores SIGINT
    # in background jobs; scripts/demo.sh stops its stack with one): Ctrl-C must still stop it.
    # (stderr to a file: the children inherit it, and a pipe would block the failure message's read)
    log = tmp_path / "stderr.log"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("wb"),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the stack did not come up"
            time.sleep(0.3)
        assert processes_mentioning(str(tiny_models["draft-eagle3"]))  # the drafter runs in its own process
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=8,
                                               messages=[{"role": "user", "content": "Shanghai is"}],
                                               temperature=0)
        assert reply.usage.completion_tokens >= 1 and reply.model_extra["spec_stats"]["num_drafts"] >= 1
        # A constrained request opens the verifier's stream to the grammar service, which Ctrl-C ends.
        constrained = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=8,
                                                     messages=[{"role": "user", "content": "Shanghai is"}],
                                                     response_format={"type": "json_object"})
        assert constrained.usage.completion_tokens >= 1
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
        assert "specd:spec_decode_num_drafts_total" in metrics
        # The verifier's step metrics, on the port given
        steps = urllib.request.urlopen(f"http://127.0.0.1:{verifier_metrics}/metrics").read().decode()
        assert "specd:spec_decode_draft_length" in steps
    finally:
        proc.send_signal(signal.SIGINT)
        try:  # the launcher gives each of its children up to 20 s to stop, in turn
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            for line in processes_mentioning(str(tiny_models["target-llama"])):  # every child names it
                os.kill(int(line.split()[0]), signal.SIGKILL)  # (in sessions of their own)
            raise AssertionError("Ctrl-C did not stop the stack in 120 s; its stderr ends:\n"
                                 + log.read_text(errors="replace")[-3000:]) from None
    assert code == 0
    # A normal shutdown reads as one: no traceback, no ERROR line from any service.
    text = log.read_text(errors="replace")
    bad = [line for line in text.splitlines() if "Traceback" in line or " ERROR " in line]
    assert not bad, "\n".join(bad[:20]) + "\n---\n" + text[-4000:]
    time.sleep(0.5)
    assert not processes_mentioning(f"--port {port}"), "a child outlived the launcher"
    assert not processes_mentioning(str(tiny_models["draft-eagle3"]))


def test_tp_above_one_is_refused_clearly(tiny_models):
    out = subprocess.run([sys.executable, "-m", "specd.cli", "serve", "api_server", str(tiny_models["target-llama"]),
                          "--tp", "2"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "tensor parallelism" in out.stderr and "Traceback" not in out.stderr
