"""A bound on HTTP request bodies: 413 with OpenAI's error JSON, before the body is buffered.

A declared Content-Length over the limit is answered at once, without reading the body; a chunked
body is counted as it arrives and refused the moment it passes the limit. (Starlette's own limiter
answers a declared oversize with plain text, which OpenAI clients cannot show as an error.)
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodySizeLimit:
    """ASGI middleware; `reject(scope, receive, send)` sends the 413 for a declared oversize."""

    def __init__(self, app: ASGIApp, max_bytes: int, reject) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.reject = reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:  # h11 already refused malformed ones
            return await self.reject(scope, receive, send)
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI re-raises HTTPExceptions from body reading: the app's handler answers.
                    raise HTTPException(413)
            return message

        await self.app(scope, counting_receive, send)
