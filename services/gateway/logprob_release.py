"""Which tokens' logprobs go with which streamed text: a chunk carries the logprobs of the tokens
whose text it carries.

Text leaves later than its tokens in two places: the detokenizer holds back an incomplete UTF-8
character (its tokens' text arrives with a later token), and the stop-string filter holds back a
tail that may begin a stop string. So each token is tagged with the span of text it produced (the
tokens of one detokenizer delta share that delta's span; a token that produced none, a skipped
special token, joins the next delta's) and released once the text up to its span's end was sent.
When a stop string cuts the text, tokens whose span starts past the cut are dropped: their text
is not in the response either.
"""

from __future__ import annotations

from services.gateway.detokenize import StopStringFilter


class LogprobRelease:
    """Tokens with their logprobs, held until their text is sent."""

    def __init__(self) -> None:
        self._pending: list[tuple[int, list | None]] = []  # (token id, logprob entry), text not sent
        self._spans: list[tuple[int, int]] = []  # (start, end) in chars, for the first len() pending
        self._text_end = 0  # chars of text the detokenizer produced, as tagged so far

    def add(self, token_ids: list[int], logprobs: list | None) -> None:
        """A result entry's tokens, logprobs aligned (None: the entry carried none)."""
        self._pending.extend(zip(token_ids, logprobs if logprobs is not None else [None] * len(token_ids)))

    def take(self, text_end: int, stop_filter: StopStringFilter, *, final: bool = False) -> list:
        """The tokens to send now. text_end: chars the detokenizer has produced (after this entry's
        push, and finish when final); stop_filter: what of them was sent."""
        if text_end > self._text_end or final:  # the untagged tokens produced text up to text_end
            start = self._text_end
            self._spans.extend([(start, text_end)] * (len(self._pending) - len(self._spans)))
            self._text_end = text_end
        sent = stop_filter.num_sent
        if stop_filter.is_stopped:  # the response ends at the cut: tokens whose text starts before it
            out = [p for p, (start, _) in zip(self._pending, self._spans) if start < sent]
            self._pending, self._spans = [], []
            return out
        n = 0
        while n < len(self._spans) and self._spans[n][1] <= sent:
            n += 1
        out, self._pending, self._spans = self._pending[:n], self._pending[n:], self._spans[n:]
        return out
