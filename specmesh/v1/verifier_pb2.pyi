from specmesh.v1 import common_pb2 as _common_pb2
from specmesh.v1 import router_pb2 as _router_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifierInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerifierInfo(_message.Message):
    __slots__ = ("verifier_id", "pool", "model", "tokenizer_hash", "vocab_size", "max_length", "max_sessions", "active_sessions", "max_batch_tokens", "batches", "jobs", "idle_fraction", "draining", "busy_seconds")
    VERIFIER_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_HASH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    IDLE_FRACTION_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    verifier_id: str
    pool: str
    model: str
    tokenizer_hash: str
    vocab_size: int
    max_length: int
    max_sessions: int
    active_sessions: int
    max_batch_tokens: int
    batches: int
    jobs: int
    idle_fraction: float
    draining: bool
    busy_seconds: float
    def __init__(self, verifier_id: _Optional[str] = ..., pool: _Optional[str] = ..., model: _Optional[str] = ..., tokenizer_hash: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_length: _Optional[int] = ..., max_sessions: _Optional[int] = ..., active_sessions: _Optional[int] = ..., max_batch_tokens: _Optional[int] = ..., batches: _Optional[int] = ..., jobs: _Optional[int] = ..., idle_fraction: _Optional[float] = ..., draining: _Optional[bool] = ..., busy_seconds: _Optional[float] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("released_sessions",)
    RELEASED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    released_sessions: int
    def __init__(self, released_sessions: _Optional[int] = ...) -> None: ...

class Admission(_message.Message):
    __slots__ = ("request_id", "prompt", "sampling", "max_tree_nodes", "fixed_budget", "kind", "reply_to", "final_only")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    FIXED_BUDGET_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REPLY_TO_FIELD_NUMBER: _ClassVar[int]
    FINAL_ONLY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: _common_pb2.TokenIds
    sampling: _common_pb2.SamplingParams
    max_tree_nodes: int
    fixed_budget: bool
    kind: str
    reply_to: str
    final_only: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_tree_nodes: _Optional[int] = ..., fixed_budget: _Optional[bool] = ..., kind: _Optional[str] = ..., reply_to: _Optional[str] = ..., final_only: _Optional[bool] = ...) -> None: ...

class RequestDelta(_message.Message):
    __slots__ = ("request_id", "position", "tokens", "finish_reason", "message", "step", "stats")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    position: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    message: str
    step: _router_pb2.StepTrace
    stats: _router_pb2.SpeculationStats
    def __init__(self, request_id: _Optional[str] = ..., position: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., message: _Optional[str] = ..., step: _Optional[_Union[_router_pb2.StepTrace, _Mapping]] = ..., stats: _Optional[_Union[_router_pb2.SpeculationStats, _Mapping]] = ...) -> None: ...

class StepOutputs(_message.Message):
    __slots__ = ("verifier_id", "deltas", "report")
    VERIFIER_ID_FIELD_NUMBER: _ClassVar[int]
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    verifier_id: str
    deltas: _containers.RepeatedCompositeFieldContainer[RequestDelta]
    report: RoutingReport
    def __init__(self, verifier_id: _Optional[str] = ..., deltas: _Optional[_Iterable[_Union[RequestDelta, _Mapping]]] = ..., report: _Optional[_Union[RoutingReport, _Mapping]] = ...) -> None: ...

class Abort(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class RoutingRecord(_message.Message):
    __slots__ = ("kind", "name", "team", "hits", "attempts")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TEAM_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    name: str
    team: bool
    hits: _containers.RepeatedScalarFieldContainer[float]
    attempts: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, kind: _Optional[str] = ..., name: _Optional[str] = ..., team: _Optional[bool] = ..., hits: _Optional[_Iterable[float]] = ..., attempts: _Optional[_Iterable[float]] = ...) -> None: ...

class RoutingReport(_message.Message):
    __slots__ = ("records",)
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[RoutingRecord]
    def __init__(self, records: _Optional[_Iterable[_Union[RoutingRecord, _Mapping]]] = ...) -> None: ...

class RoutingSnapshot(_message.Message):
    __slots__ = ("version", "router_id", "records", "max_drafters", "explore")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    EXPLORE_FIELD_NUMBER: _ClassVar[int]
    version: int
    router_id: str
    records: _containers.RepeatedCompositeFieldContainer[RoutingRecord]
    max_drafters: int
    explore: float
    def __init__(self, version: _Optional[int] = ..., router_id: _Optional[str] = ..., records: _Optional[_Iterable[_Union[RoutingRecord, _Mapping]]] = ..., max_drafters: _Optional[int] = ..., explore: _Optional[float] = ...) -> None: ...
