"""One error hierarchy for the verifier's service clients.

    RemoteServiceError                 a service failed a call; `lost_seq_ids` lost their state there
    ├─ ServiceUnavailableError         unreachable, past the deadline, or the stream broke: worth a
    │                                  fallback and a reconnect
    ├─ ServiceRejectedError            the service refused the call as malformed: a bug (or a bad
    │                                  grammar) on this side, not transient
    ├─ DrafterError                    ├─ DrafterUnavailableError, DrafterRejectedError
    └─ GrammarServiceError             └─ GrammarUnavailableError, GrammarRejectedError

A service's own errors (DrafterError, GrammarServiceError) name the service in their message;
`from_status` picks the unavailable or rejected kind of that service from a gRPC status.
"""

from __future__ import annotations

import grpc

# Status codes that mean "refused" (a malformed call); any other failure means "unavailable".
REJECTED_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                  grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.INTERNAL)


class RemoteServiceError(RuntimeError):
    """A service at `address` failed a call (`code`: its gRPC status, when it had one)."""

    service = "service"  # the message's prefix
    unavailable: type[RemoteServiceError]  # the service's two kinds (set below for each service)
    rejected: type[RemoteServiceError]

    def __init__(self, address: str, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(f"{self.service} {address}: {message}")
        self.address = address
        self.code = code
        self.lost_seq_ids: list[int] = []

    @classmethod
    def from_status(cls, address: str, code: grpc.StatusCode, details: str) -> RemoteServiceError:
        kind = cls.rejected if code in REJECTED_CODES else cls.unavailable
        return kind(address, f"{code.name}: {details}", code)

    @classmethod
    def from_rpc(cls, address: str, err: grpc.RpcError) -> RemoteServiceError:
        return cls.from_status(address, err.code(), err.details())


class ServiceUnavailableError(RemoteServiceError):
    """The service is unreachable, missed the deadline, or its stream broke."""


class ServiceRejectedError(RemoteServiceError):
    """The service refused the call as malformed."""


class DrafterError(RemoteServiceError):
    """A drafter failed a step; its draft state for `lost_seq_ids` is gone."""

    service = "drafter"


class DrafterUnavailableError(DrafterError, ServiceUnavailableError):
    """The drafter is unreachable, missed the step deadline, or its stream broke."""


class DrafterRejectedError(DrafterError, ServiceRejectedError):
    """The drafter refused a step as malformed (a bug on this side, not a transient failure)."""


class GrammarServiceError(RemoteServiceError):
    """The grammar service failed a call; the matchers of `lost_seq_ids` are gone."""

    service = "grammar service"


class GrammarUnavailableError(GrammarServiceError, ServiceUnavailableError):
    """The grammar service is unreachable, missed the deadline, or its stream broke."""


class GrammarRejectedError(GrammarServiceError, ServiceRejectedError):
    """The grammar service refused a step (unknown sequence, a commit the grammar rejects, a
    grammar that does not compile at open): a bug or a bad grammar on this side."""


for _family, _unavailable, _rejected in ((RemoteServiceError, ServiceUnavailableError, ServiceRejectedError),
                                         (DrafterError, DrafterUnavailableError, DrafterRejectedError),
                                         (GrammarServiceError, GrammarUnavailableError, GrammarRejectedError)):
    _family.unavailable, _family.rejected = _unavailable, _rejected
