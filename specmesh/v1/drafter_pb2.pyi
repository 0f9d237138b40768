from specmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenSessionRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("request_id", "committed", "budget", "assumed", "features", "opens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    OPENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    committed: _containers.RepeatedScalarFieldContainer[int]
    budget: int
    assumed: _containers.RepeatedScalarFieldContainer[int]
    features: _common_pb2.Features
    opens: bool
    def __init__(self, request_id: _Optional[str] = ..., committed: _Optional[_Iterable[int]] = ..., budget: _Optional[int] = ..., assumed: _Optional[_Iterable[int]] = ..., features: _Optional[_Union[_common_pb2.Features, _Mapping]] = ..., opens: _Optional[bool] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("tree", "draft_ms")
    TREE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    tree: _common_pb2.TokenTree
    draft_ms: float
    def __init__(self, tree: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ..., draft_ms: _Optional[float] = ...) -> None: ...

class ProposeManyRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ProposeRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[ProposeRequest, _Mapping]]] = ...) -> None: ...

class ProposeManyResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ProposeResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ProposeResult, _Mapping]]] = ...) -> None: ...

class ProposeResult(_message.Message):
    __slots__ = ("code", "message", "answer")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    answer: ProposeResponse
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., answer: _Optional[_Union[ProposeResponse, _Mapping]] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("request_id", "committed")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    committed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., committed: _Optional[_Iterable[int]] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterInfo(_message.Message):
    __slots__ = ("name", "kind", "domains", "target", "tokenizer_hash", "active_sessions", "max_sessions", "feature_layers", "hidden_size", "opens_in_propose", "proposes_in_stream")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DOMAINS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_HASH_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    OPENS_IN_PROPOSE_FIELD_NUMBER: _ClassVar[int]
    PROPOSES_IN_STREAM_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    domains: _containers.RepeatedScalarFieldContainer[str]
    target: str
    tokenizer_hash: str
    active_sessions: int
    max_sessions: int
    feature_layers: _containers.RepeatedScalarFieldContainer[int]
    hidden_size: int
    opens_in_propose: bool
    proposes_in_stream: bool
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., domains: _Optional[_Iterable[str]] = ..., target: _Optional[str] = ..., tokenizer_hash: _Optional[str] = ..., active_sessions: _Optional[int] = ..., max_sessions: _Optional[int] = ..., feature_layers: _Optional[_Iterable[int]] = ..., hidden_size: _Optional[int] = ..., opens_in_propose: _Optional[bool] = ..., proposes_in_stream: _Optional[bool] = ...) -> None: ...
