"""The gRPC channel every client here opens: message limits and a short reconnect backoff."""

from __future__ import annotations

import grpc

MAX_MESSAGE_BYTES = 256 << 20  # hidden-state rows of a long prefill
# Short reconnect backoff: gRPC's default (1 s growing to 120 s) would leave a restarted peer
# unused for minutes.
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000)]


def open_channel(address: str, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    """A channel to address ("host:port"): TLS with credentials, else plaintext."""
    if credentials is not None:
        return grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS)
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
