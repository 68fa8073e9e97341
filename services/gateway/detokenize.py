"""Tokens to text for a streamed response: incremental detokenizing and stop strings."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Text deltas from a growing token list.

    Each delta is the decoded text minus what was already sent, decoding a short window of recent
    tokens (the window's first tokens only give context, as in vLLM, so cost per delta does not grow
    with the output). A trailing U+FFFD is held back: it may be a UTF-8 sequence whose remaining
    bytes come with the next token. `finish` reconciles with one decode of all tokens.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""  # sent so far
        self._prefix_offset = 0  # window start
        self._read_offset = 0  # tokens whose text was sent

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: list[int]) -> str:
        self.token_ids.extend(token_ids)
        prefix_text = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self.token_ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        full = self._decode(self.token_ids)
        if full.startswith(self.text):
            delta = full[len(self.text):]
        else:  # a tokenizer whose window decode drifted: keep what was sent, flush the window
            prefix_text = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
            delta = self._decode(self.token_ids[self._prefix_offset:])[len(prefix_text):]
        self.text += delta
        return delta


class StopStringFilter:
    """Cuts text before the first stop string; holds back a tail that may begin one."""

    def __init__(self, stop_words: list[str], include_stop_str: bool = False) -> None:
        self.stop_words = [w for w in stop_words if w]
        self.include_stop_str = include_stop_str
        self.text = ""  # everything seen
        self.num_sent = 0
        self.is_stopped = False

    def push(self, delta: str, *, is_final: bool = False) -> str:
        if self.is_stopped:
            return ""
        self.text += delta
        if not self.stop_words:
            return self._send(len(self.text))
        longest = max(len(w) for w in self.stop_words)
        search_from = max(0, self.num_sent - longest + 1)
        hits = [(i, w) for w in self.stop_words if (i := self.text.find(w, search_from)) >= 0]
        if hits:
            index, word = min(hits)
            self.is_stopped = True
            return self._send(index + (len(word) if self.include_stop_str else 0))
        if is_final:
            return self._send(len(self.text))
        return self._send(len(self.text) - self._partial_stop_len())

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of the unsent text that is a proper prefix of a stop word."""
        tail = self.text[self.num_sent:]
        for n in range(min(len(tail), max(len(w) for w in self.stop_words) - 1), 0, -1):
            if any(w.startswith(tail[-n:]) for w in self.stop_words):
                return n
        return 0

    def _send(self, end: int) -> str:
        out = self.text[self.num_sent:end] if end > self.num_sent else ""
        self.num_sent = max(self.num_sent, end)
        return out
