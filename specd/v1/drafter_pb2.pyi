from specd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HiddenKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HIDDEN_KIND_NONE: _ClassVar[HiddenKind]
    HIDDEN_KIND_FINAL: _ClassVar[HiddenKind]
    HIDDEN_KIND_AUX: _ClassVar[HiddenKind]
HIDDEN_KIND_NONE: HiddenKind
HIDDEN_KIND_FINAL: HiddenKind
HIDDEN_KIND_AUX: HiddenKind

class DrafterInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterInfoResponse(_message.Message):
    __slots__ = ("method", "hidden_kind", "aux_layer_ids", "vocab_size", "hidden_size", "max_num_draft_tokens", "fast_step_port", "takes_step_hidden_states", "takes_attached_rows")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_KIND_FIELD_NUMBER: _ClassVar[int]
    AUX_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FAST_STEP_PORT_FIELD_NUMBER: _ClassVar[int]
    TAKES_STEP_HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    TAKES_ATTACHED_ROWS_FIELD_NUMBER: _ClassVar[int]
    method: str
    hidden_kind: HiddenKind
    aux_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    vocab_size: int
    hidden_size: int
    max_num_draft_tokens: int
    fast_step_port: int
    takes_step_hidden_states: bool
    takes_attached_rows: bool
    def __init__(self, method: _Optional[str] = ..., hidden_kind: _Optional[_Union[HiddenKind, str]] = ..., aux_layer_ids: _Optional[_Iterable[int]] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., max_num_draft_tokens: _Optional[int] = ..., fast_step_port: _Optional[int] = ..., takes_step_hidden_states: _Optional[bool] = ..., takes_attached_rows: _Optional[bool] = ...) -> None: ...

class DraftStepRequest(_message.Message):
    __slots__ = ("step_id", "open", "sequences", "close", "hidden_states")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    open: _containers.RepeatedCompositeFieldContainer[OpenSequence]
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceDraftInput]
    close: _containers.RepeatedScalarFieldContainer[int]
    hidden_states: _common_pb2.Tensor
    def __init__(self, step_id: _Optional[int] = ..., open: _Optional[_Iterable[_Union[OpenSequence, _Mapping]]] = ..., sequences: _Optional[_Iterable[_Union[SequenceDraftInput, _Mapping]]] = ..., close: _Optional[_Iterable[int]] = ..., hidden_states: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class OpenSequence(_message.Message):
    __slots__ = ("seq_id", "params", "grammar_kind", "grammar_source")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_KIND_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_SOURCE_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    params: _common_pb2.SamplingParameters
    grammar_kind: str
    grammar_source: str
    def __init__(self, seq_id: _Optional[int] = ..., params: _Optional[_Union[_common_pb2.SamplingParameters, _Mapping]] = ..., grammar_kind: _Optional[str] = ..., grammar_source: _Optional[str] = ...) -> None: ...

class SequenceDraftInput(_message.Message):
    __slots__ = ("seq_id", "new_token_ids", "new_hidden_states", "num_draft_tokens", "num_output_tokens", "num_hidden_rows")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_HIDDEN_ROWS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    new_hidden_states: _common_pb2.Tensor
    num_draft_tokens: int
    num_output_tokens: int
    num_hidden_rows: int
    def __init__(self, seq_id: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., new_hidden_states: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., num_draft_tokens: _Optional[int] = ..., num_output_tokens: _Optional[int] = ..., num_hidden_rows: _Optional[int] = ...) -> None: ...

class DraftStepResponse(_message.Message):
    __slots__ = ("step_id", "sequences", "draft_time_us", "handle_time_us")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TIME_US_FIELD_NUMBER: _ClassVar[int]
    HANDLE_TIME_US_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceDrafts]
    draft_time_us: int
    handle_time_us: int
    def __init__(self, step_id: _Optional[int] = ..., sequences: _Optional[_Iterable[_Union[SequenceDrafts, _Mapping]]] = ..., draft_time_us: _Optional[int] = ..., handle_time_us: _Optional[int] = ...) -> None: ...

class SequenceDrafts(_message.Message):
    __slots__ = ("seq_id", "token_ids", "probs")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _common_pb2.Tensor
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...
