"""What the verifier's gRPC clients (drafters, grammar service) share: channel options and how a
failed call is read.

A refused call (a malformed step: a bug on this side) is told apart from an unavailable peer (down,
slow, stream broken), because only the second is worth a fallback and a reconnect.
"""

from __future__ import annotations

import grpc

REJECTED_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                  grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.INTERNAL)
MAX_MESSAGE_BYTES = 256 << 20  # hidden-state rows of a long prefill
# Short reconnect backoff: gRPC's default (1 s growing to 120 s) would leave a restarted peer
# unused for minutes.
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000)]

