"""The verifier's admin gRPC port: VerifierAdmin (Stats, Drain), grpc.health.v1, reflection.

The servicer is thin: it converts the worker's domain snapshot to protobuf and forwards Drain.
Errors are mapped to status codes in one place (ErrorInterceptor). Health reports NOT_SERVING
until the model is loaded and again once a drain began, so load balancers and the launcher stop
routing to a verifier that will not admit.
"""

from __future__ import annotations

import logging
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.grpc_server import NO_PORT_SHARING
from specd.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

log = logging.getLogger("specd.verifier.admin")

SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["VerifierAdmin"].full_name


class NotReadyError(Exception):
    """The verifier is still loading its model."""


class ErrorInterceptor(grpc.ServerInterceptor):
    """Maps exceptions raised by unary handlers to gRPC status codes with a readable message."""

    _CODES = ((NotReadyError, grpc.StatusCode.UNAVAILABLE), (ValueError, grpc.StatusCode.INVALID_ARGUMENT))

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        inner, method = handler.unary_unary, handler_call_details.method

        def guarded(request, context):
            try:
                return inner(request, context)
            except Exception as e:  # one place for every RPC's errors
                code = next((c for t, c in self._CODES if isinstance(e, t)), grpc.StatusCode.INTERNAL)
                if code is grpc.StatusCode.INTERNAL:
                    log.exception("admin RPC failed", extra={"method": method})
                error = e
            context.abort(code, f"{type(error).__name__}: {error}" if code is grpc.StatusCode.INTERNAL
                          else str(error))

        return grpc.unary_unary_rpc_method_handler(guarded, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


def snapshot_to_pb(snap) -> verifier_pb2.VerifierStatsResponse:
    s = snap.spec_stats
    return verifier_pb2.VerifierStatsResponse(
        consumer=snap.consumer, num_running=snap.num_running, num_waiting=snap.num_waiting,
        num_finished=snap.num_finished, num_steps=snap.num_steps, num_output_tokens=snap.num_output_tokens,
        spec_stats=common_pb2.SpecStats(num_drafts=s.num_drafts, num_draft_tokens=s.num_draft_tokens,
                                        num_accepted_tokens=s.num_accepted_tokens,
                                        accepted_per_position=s.accepted_per_position),
        draft_seconds=snap.draft_seconds, verify_seconds=snap.verify_seconds,
        other_seconds=snap.other_seconds, draining=snap.draining, num_errors=snap.num_errors,
        uptime_seconds=snap.uptime_seconds)


class VerifierAdminServicer(verifier_pb2_grpc.VerifierAdminServicer):
    """Stats and Drain over the worker (attached once the model is loaded)."""

    def __init__(self) -> None:
        self.worker = None

    def _worker(self):
        if self.worker is None:
            raise NotReadyError("the verifier is loading its model")
        return self.worker

    def Stats(self, request, context):
        return snapshot_to_pb(self._worker().snapshot())

    def Drain(self, request, context):
        num_running, num_waiting = self._worker().drain(exit_when_drained=request.exit_when_drained)
        return verifier_pb2.DrainResponse(num_running=num_running, num_waiting=num_waiting)


class AdminServer:
    """The gRPC server of the admin port (a small thread pool; the loop stays in its own thread)."""

    def __init__(self, host: str = "0.0.0.0", port: int = 0, max_workers: int = 4, credentials=None) -> None:
        """credentials: grpc.ServerCredentials for TLS (services/common/tls.py), None for plaintext."""
        self.servicer = VerifierAdminServicer()
        self.health = health.HealthServicer()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers,
                                                             thread_name_prefix="verifier-admin"),
                                  interceptors=[ErrorInterceptor()], options=[NO_PORT_SHARING])
        verifier_pb2_grpc.add_VerifierAdminServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server)
        try:
            address = f"{host}:{port}"
            self.port = (self.server.add_secure_port(address, credentials) if credentials is not None
                         else self.server.add_insecure_port(address))
        except RuntimeError:  # grpcio raises where older versions returned 0
            self.port = 0
        if self.port == 0:
            raise OSError(f"admin port: could not bind {host}:{port}")
        self.set_serving(False)

    def start(self) -> "AdminServer":
        self.server.start()
        return self

    def attach(self, worker) -> None:
        """The model is loaded: answer Stats / Drain, report SERVING, NOT_SERVING once draining."""
        self.servicer.worker = worker
        worker.on_drain = lambda: self.set_serving(False)
        self.set_serving(not worker.draining)

    def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in ("", SERVICE_NAME):
            self.health.set(service, status)

    def stop(self, grace: float = 1.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()
