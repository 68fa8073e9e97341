from specd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GrammarSpec(_message.Message):
    __slots__ = ("kind", "source", "model")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    kind: str
    source: str
    model: str
    def __init__(self, kind: _Optional[str] = ..., source: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class ValidateResponse(_message.Message):
    __slots__ = ("ok", "error")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class GrammarStepRequest(_message.Message):
    __slots__ = ("step_id", "open", "commit", "masks", "close")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    MASKS_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    open: _containers.RepeatedCompositeFieldContainer[OpenMatcher]
    commit: _containers.RepeatedCompositeFieldContainer[CommitTokens]
    masks: _containers.RepeatedCompositeFieldContainer[MaskRequest]
    close: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step_id: _Optional[int] = ..., open: _Optional[_Iterable[_Union[OpenMatcher, _Mapping]]] = ..., commit: _Optional[_Iterable[_Union[CommitTokens, _Mapping]]] = ..., masks: _Optional[_Iterable[_Union[MaskRequest, _Mapping]]] = ..., close: _Optional[_Iterable[int]] = ...) -> None: ...

class OpenMatcher(_message.Message):
    __slots__ = ("seq_id", "spec", "replay_token_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    REPLAY_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    spec: GrammarSpec
    replay_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., spec: _Optional[_Union[GrammarSpec, _Mapping]] = ..., replay_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitTokens(_message.Message):
    __slots__ = ("seq_id", "token_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class MaskRequest(_message.Message):
    __slots__ = ("seq_id", "draft_token_ids", "remaining_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REMAINING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    remaining_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., remaining_tokens: _Optional[int] = ...) -> None: ...

class GrammarStepResponse(_message.Message):
    __slots__ = ("step_id", "masks", "terminated", "mask_time_us", "handle_time_us")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    MASKS_FIELD_NUMBER: _ClassVar[int]
    TERMINATED_FIELD_NUMBER: _ClassVar[int]
    MASK_TIME_US_FIELD_NUMBER: _ClassVar[int]
    HANDLE_TIME_US_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    masks: _containers.RepeatedCompositeFieldContainer[TokenMasks]
    terminated: _containers.RepeatedScalarFieldContainer[int]
    mask_time_us: int
    handle_time_us: int
    def __init__(self, step_id: _Optional[int] = ..., masks: _Optional[_Iterable[_Union[TokenMasks, _Mapping]]] = ..., terminated: _Optional[_Iterable[int]] = ..., mask_time_us: _Optional[int] = ..., handle_time_us: _Optional[int] = ...) -> None: ...

class TokenMasks(_message.Message):
    __slots__ = ("seq_id", "bitmask", "num_valid_drafts", "num_closing_rows")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    BITMASK_FIELD_NUMBER: _ClassVar[int]
    NUM_VALID_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    NUM_CLOSING_ROWS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    bitmask: _common_pb2.Tensor
    num_valid_drafts: int
    num_closing_rows: int
    def __init__(self, seq_id: _Optional[int] = ..., bitmask: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., num_valid_drafts: _Optional[int] = ..., num_closing_rows: _Optional[int] = ...) -> None: ...
