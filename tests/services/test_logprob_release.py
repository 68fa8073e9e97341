"""A streamed chunk carries the logprobs of the tokens whose text it carries
(services/gateway/logprob_release.py), through held-back UTF-8 and stop strings; result entries
carry logprobs only when asked (specd/transport/redis_streams.py)."""

from __future__ import annotations

from services.gateway.detokenize import IncrementalDetokenizer, StopStringFilter
from services.gateway.logprob_release import LogprobRelease
from services.verifier.results.flush import ResultQueue
from specd.transport.redis_streams import ResultEntry


class ByteTokenizer:
    """Token i is byte i; text is the bytes decoded as UTF-8 (incomplete characters as U+FFFD)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def stream(entries: list[list[int]], stop_words=()):
    """Run the gateway's per-entry steps; returns [(text, token ids released)] per entry."""
    detok, stop, release = IncrementalDetokenizer(ByteTokenizer()), StopStringFilter(list(stop_words)), LogprobRelease()
    out = []
    for n, tokens in enumerate(entries):
        final = n == len(entries) - 1
        release.add(tokens, [[-float(t), []] for t in tokens])
        text = detok.push(tokens)
        if final:
            text += detok.finish()
        text = stop.push(text, is_final=final)
        taken = release.take(len(detok.text), stop, final=final)
        assert all(entry == [-float(t), []] for t, entry in taken)  # each token keeps its own entry
        out.append((text, [t for t, _ in taken]))
    return out


def test_tokens_go_with_their_text():
    euro = list("€".encode())  # three tokens, one character
    out = stream([[ord("a")], euro[:1], euro[1:], [ord("b")]])
    assert out == [("a", [ord("a")]), ("", []), ("€", euro), ("b", [ord("b")])]


def test_text_held_for_a_stop_string_holds_its_tokens_and_the_cut_drops_the_rest():
    out = stream([[ord("x")], [ord("S")], [ord("T"), ord("y")], [ord("z")]], stop_words=["STOP"])
    assert out == [("x", [ord("x")]), ("", []), ("STy", [ord("S"), ord("T"), ord("y")]), ("z", [ord("z")])]
    out = stream([[ord("x")], [ord("S")], [ord("T"), ord("O"), ord("P"), ord("y")], [ord("z")]], stop_words=["STOP"])
    assert out == [("x", [ord("x")]), ("", []), ("", []), ("", [])]  # the cut: STOP's tokens are not in the text


def test_entries_carry_logprobs_only_when_asked():
    entry = ResultEntry("delta", pos=3, tokens=[5, 6], logprobs=[[-0.5, [[5, -0.5]]], None])
    assert ResultEntry.from_fields(entry.to_fields()).logprobs == [[-0.5, [[5, -0.5]]], None]
    assert "logprobs" not in ResultEntry("delta", tokens=[5]).to_fields()
    queue = ResultQueue(client=None, request_stream="s")
    queue.delta("a", 0, [5], logprobs=[(-float("inf"), [(5, -float("inf"))])])
    queue.delta("b", 0, [5])
    queue.final("c", 0, [5], "stop", None, 1)
    (_, asked), (_, plain), (_, final) = queue._entries
    assert ResultEntry.from_fields(asked).logprobs == [[-float("inf"), [[5, -float("inf")]]]]
    assert b"logprobs" not in plain and b"logprobs" not in final
