"""Errors of the gateway, in the shape both front ends (HTTP and gRPC) map to their statuses."""

from __future__ import annotations

import redis.exceptions

REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)

_ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 422: "invalid_request_error",
                429: "rate_limit_error", 499: "cancelled", 503: "service_unavailable", 504: "timeout"}


class GatewayError(Exception):
    """A request failed with an HTTP-like status; the HTTP and gRPC front ends both map it."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    @property
    def type(self) -> str:
        return _ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def to_body(self) -> dict:
        """OpenAI's error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}


def redis_unavailable(error: Exception) -> GatewayError:
    return GatewayError(503, f"the request queue (Redis) is unreachable: {error}", code="redis_unavailable",
                        retry_after=1)
