from specd.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifierStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerifierStatsResponse(_message.Message):
    __slots__ = ("consumer", "num_running", "num_waiting", "num_finished", "num_steps", "num_output_tokens", "spec_stats", "draft_seconds", "verify_seconds", "other_seconds", "draining", "num_errors", "uptime_seconds")
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_STATS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OTHER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    NUM_ERRORS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    consumer: str
    num_running: int
    num_waiting: int
    num_finished: int
    num_steps: int
    num_output_tokens: int
    spec_stats: _common_pb2.SpecStats
    draft_seconds: float
    verify_seconds: float
    other_seconds: float
    draining: bool
    num_errors: int
    uptime_seconds: float
    def __init__(self, consumer: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_finished: _Optional[int] = ..., num_steps: _Optional[int] = ..., num_output_tokens: _Optional[int] = ..., spec_stats: _Optional[_Union[_common_pb2.SpecStats, _Mapping]] = ..., draft_seconds: _Optional[float] = ..., verify_seconds: _Optional[float] = ..., other_seconds: _Optional[float] = ..., draining: _Optional[bool] = ..., num_errors: _Optional[int] = ..., uptime_seconds: _Optional[float] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("exit_when_drained",)
    EXIT_WHEN_DRAINED_FIELD_NUMBER: _ClassVar[int]
    exit_when_drained: bool
    def __init__(self, exit_when_drained: _Optional[bool] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("num_running", "num_waiting")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ...) -> None: ...
