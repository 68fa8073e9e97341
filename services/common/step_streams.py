"""Step streams, as the drafter and grammar services serve them: one long-lived bidirectional RPC
per verifier, one response per request, and every failure ends that stream with a status and a
readable message while the server keeps serving the others."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import grpc

logger = logging.getLogger(__name__)


class StepError(Exception):
    """A step the service refuses; `code` is the gRPC status the stream ends with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def invalid(message: str) -> StepError:
    return StepError(grpc.StatusCode.INVALID_ARGUMENT, message)


def serve_steps(stream, request_iterator, context, step: Callable, close: Callable[[object, str], None],
                status_of: Callable[[BaseException], tuple[grpc.StatusCode, str]]) -> Iterator:
    """The body of a streaming servicer method: yields step(stream, request) for each request.

    close(stream, reason) runs however the RPC ends (it must be idempotent): at the end of the
    requests, on an error, and from gRPC's callback when the client vanishes while we wait on it.
    An error becomes status_of(error)'s status; INTERNAL ones are logged with their traceback.
    """
    # gRPC runs the callback on its server thread; close takes the servicer's lock, which a long
    # step (another stream's) may hold for seconds: off that thread, or the server stalls meanwhile.
    context.add_callback(lambda: threading.Thread(target=close, args=(stream, "rpc_done"), daemon=True).start())
    try:
        for request in request_iterator:
            yield step(stream, request)
    except Exception as exc:  # noqa: BLE001 - every failure ends this stream, not the server
        if isinstance(exc, grpc.RpcError) and not context.is_active():
            # The client ended the RPC (its process stopped, or it cancelled): a normal end.
            logger.info("stream %s: the client ended the stream", getattr(stream, "stream_id", "?"))
            close(stream, "client_ended")
            return
        code, message = status_of(exc)
        if code == grpc.StatusCode.INTERNAL:
            logger.exception("stream %s: step failed", getattr(stream, "stream_id", "?"))
        close(stream, f"error:{code.name}")
        context.abort(code, message)
    finally:
        close(stream, "end")
