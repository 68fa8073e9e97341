"""OpenAI's logprobs shapes, from the (token id, logprob entry) pairs a RequestStream releases.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`;
completions (legacy): `{"tokens", "token_logprobs", "top_logprobs" (token -> logprob), "text_offset"}`.
A token's string is the token decoded alone (as vLLM), its bytes that string's UTF-8. Excluded
tokens' -inf (processed mode) is sent as -9999.0, as vLLM does: JSON has no infinity.
"""

from __future__ import annotations

from pydantic import BaseModel

MIN_LOGPROB = -9999.0


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobInfo(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobInfo] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class LogprobRenderer:
    """One request's logprobs rendered chunk by chunk (text_offset runs on across chunks)."""

    def __init__(self, tokenizer, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text_offset = 0  # chars of the token strings rendered so far (completions)

    @classmethod
    def of(cls, stream) -> "LogprobRenderer | None":
        """The renderer of a RequestStream whose request asked for logprobs, else None."""
        if stream.params.logprobs is None:
            return None
        return cls(stream.detokenizer.tokenizer, stream.params.skip_special_tokens)

    def token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=self.skip_special_tokens)

    def chat(self, items: list | None) -> ChatLogprobs:
        content = []
        for token_id, entry in items or []:
            if entry is None:  # not produced where this request resumed: nothing to report
                continue
            logprob, top = entry
            content.append(TokenLogprobInfo(**self._top(token_id, logprob).model_dump(),
                                            top_logprobs=[self._top(t, lp) for t, lp in top]))
        return ChatLogprobs(content=content)

    def completion(self, items: list | None) -> CompletionLogprobs:
        tokens, values, tops, offsets = [], [], [], []
        for token_id, entry in items or []:
            text = self.token(token_id)
            tokens.append(text)
            offsets.append(self.text_offset)
            self.text_offset += len(text)
            if entry is None:
                values.append(None)
                tops.append(None)
                continue
            logprob, top = entry
            values.append(max(logprob, MIN_LOGPROB))
            # the top alternatives and, as OpenAI's legacy API and vLLM, the chosen token
            tops.append({self.token(t): max(lp, MIN_LOGPROB) for t, lp in [*top, (token_id, logprob)]})
        return CompletionLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets)

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.token(token_id)
        return TopLogprob(token=text, logprob=max(logprob, MIN_LOGPROB), bytes=list(text.encode("utf-8")))
