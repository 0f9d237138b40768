from specmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Speculation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPECULATION_UNSPECIFIED: _ClassVar[Speculation]
    SPECULATION_ADAPTIVE: _ClassVar[Speculation]
    SPECULATION_FIXED: _ClassVar[Speculation]
    SPECULATION_OFF: _ClassVar[Speculation]
SPECULATION_UNSPECIFIED: Speculation
SPECULATION_ADAPTIVE: Speculation
SPECULATION_FIXED: Speculation
SPECULATION_OFF: Speculation

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "chat", "prompt_ids", "sampling", "request_id", "max_tree_nodes", "speculation", "resume_ids")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    RESUME_IDS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    chat: ChatMessages
    prompt_ids: _common_pb2.TokenIds
    sampling: _common_pb2.SamplingParams
    request_id: str
    max_tree_nodes: int
    speculation: Speculation
    resume_ids: _common_pb2.TokenIds
    def __init__(self, prompt: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., prompt_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., max_tree_nodes: _Optional[int] = ..., speculation: _Optional[_Union[Speculation, str]] = ..., resume_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class SpeculationStats(_message.Message):
    __slots__ = ("target_steps", "drafted_nodes", "accepted_tokens", "mean_accepted_length", "resyncs", "first_token_ms", "total_ms", "drafters", "drafted_ahead", "draft_ms", "verify_ms", "request_kind", "drafter_steps", "verifier_ms")
    class DrafterStepsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TARGET_STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_NODES_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    RESYNCS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_AHEAD_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_KIND_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_STEPS_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_MS_FIELD_NUMBER: _ClassVar[int]
    target_steps: int
    drafted_nodes: int
    accepted_tokens: int
    mean_accepted_length: float
    resyncs: int
    first_token_ms: float
    total_ms: float
    drafters: _containers.RepeatedScalarFieldContainer[str]
    drafted_ahead: int
    draft_ms: float
    verify_ms: float
    request_kind: str
    drafter_steps: _containers.ScalarMap[str, int]
    verifier_ms: float
    def __init__(self, target_steps: _Optional[int] = ..., drafted_nodes: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., mean_accepted_length: _Optional[float] = ..., resyncs: _Optional[int] = ..., first_token_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., drafters: _Optional[_Iterable[str]] = ..., drafted_ahead: _Optional[int] = ..., draft_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., request_kind: _Optional[str] = ..., drafter_steps: _Optional[_Mapping[str, int]] = ..., verifier_ms: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "finish_reason", "usage", "stats")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    usage: Usage
    stats: SpeculationStats
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., stats: _Optional[_Union[SpeculationStats, _Mapping]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "stats", "step")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    usage: Usage
    stats: SpeculationStats
    step: StepTrace
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., stats: _Optional[_Union[SpeculationStats, _Mapping]] = ..., step: _Optional[_Union[StepTrace, _Mapping]] = ...) -> None: ...

class StepTrace(_message.Message):
    __slots__ = ("budget", "tree_nodes", "draft_ms", "pass_ms", "step_ms", "batch_size")
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    PASS_MS_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    budget: int
    tree_nodes: int
    draft_ms: float
    pass_ms: float
    step_ms: float
    batch_size: int
    def __init__(self, budget: _Optional[int] = ..., tree_nodes: _Optional[int] = ..., draft_ms: _Optional[float] = ..., pass_ms: _Optional[float] = ..., step_ms: _Optional[float] = ..., batch_size: _Optional[int] = ...) -> None: ...

class CountTokensRequest(_message.Message):
    __slots__ = ("prompt", "chat")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    chat: ChatMessages
    def __init__(self, prompt: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ...) -> None: ...

class CountTokensResponse(_message.Message):
    __slots__ = ("count", "token_ids")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    count: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, count: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelCard(_message.Message):
    __slots__ = ("id", "tokenizer_hash", "max_length", "vocab_size")
    ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_HASH_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    id: str
    tokenizer_hash: str
    max_length: int
    vocab_size: int
    def __init__(self, id: _Optional[str] = ..., tokenizer_hash: _Optional[str] = ..., max_length: _Optional[int] = ..., vocab_size: _Optional[int] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelCard]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelCard, _Mapping]]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterStatus(_message.Message):
    __slots__ = ("address", "name", "domains", "healthy")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DOMAINS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    address: str
    name: str
    domains: _containers.RepeatedScalarFieldContainer[str]
    healthy: bool
    def __init__(self, address: _Optional[str] = ..., name: _Optional[str] = ..., domains: _Optional[_Iterable[str]] = ..., healthy: _Optional[bool] = ...) -> None: ...

class RouterInfo(_message.Message):
    __slots__ = ("model", "drafters", "active_requests", "max_concurrent_requests", "max_tree_nodes", "verifiers", "version", "routing", "speculation")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    VERIFIERS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    model: ModelCard
    drafters: _containers.RepeatedCompositeFieldContainer[DrafterStatus]
    active_requests: int
    max_concurrent_requests: int
    max_tree_nodes: int
    verifiers: int
    version: str
    routing: _containers.RepeatedCompositeFieldContainer[RoutingEstimate]
    speculation: str
    def __init__(self, model: _Optional[_Union[ModelCard, _Mapping]] = ..., drafters: _Optional[_Iterable[_Union[DrafterStatus, _Mapping]]] = ..., active_requests: _Optional[int] = ..., max_concurrent_requests: _Optional[int] = ..., max_tree_nodes: _Optional[int] = ..., verifiers: _Optional[int] = ..., version: _Optional[str] = ..., routing: _Optional[_Iterable[_Union[RoutingEstimate, _Mapping]]] = ..., speculation: _Optional[str] = ...) -> None: ...

class RoutingEstimate(_message.Message):
    __slots__ = ("kind", "drafter", "acceptance")
    KIND_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    drafter: str
    acceptance: float
    def __init__(self, kind: _Optional[str] = ..., drafter: _Optional[str] = ..., acceptance: _Optional[float] = ...) -> None: ...
