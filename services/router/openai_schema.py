"""The OpenAI HTTP API's messages, as pydantic models: what ``/v1/chat/completions``, ``/v1/completions``
and ``/v1/models`` accept and return (the served OpenAPI schema is generated from them).

Types are strict (a string is not a number) and numbers finite. Fields a client SDK may send that
specmesh ignores (``user``, ``metadata``, ...) are accepted; fields that would change the output in a
way specmesh does not implement (``n`` > 1, penalties, ``logit_bias``, ``logprobs``, tools) are refused
with a 400 naming them, never silently dropped.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

REQUEST = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")
INT32 = 2**31 - 1  # counts travel as int32 on the wire


class TextPart(BaseModel):
    model_config = REQUEST
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = REQUEST
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class StreamOptions(BaseModel):
    model_config = REQUEST
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What chat and text completions share: sampling, limits, streaming and specmesh's own knobs."""

    model_config = REQUEST
    model: str = Field(max_length=256)
    max_tokens: int | None = Field(None, ge=1, le=INT32, description="most tokens to generate (default: the router's)")
    temperature: float | None = Field(None, ge=0, le=2, description="default 1; 0 is greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, description="only 1")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, description="up to 4 strings; the output ends before the first")
    seed: int | None = Field(None, ge=-(2**63), lt=2**63, description="makes a sampled request reproducible")
    presence_penalty: float | None = Field(None, description="only 0")
    frequency_penalty: float | None = Field(None, description="only 0")
    logit_bias: dict[str, float] | None = Field(None, description="only empty")
    user: str | None = None
    # specmesh's extensions
    top_k: int | None = Field(None, ge=0, le=INT32, description="specmesh: sample among the k likeliest tokens (0: all)")
    speculation: Literal["adaptive", "fixed", "off"] | None = Field(
        None, description="specmesh: how to speculate (default: the router's, normally adaptive)")
    max_tree_nodes: int | None = Field(None, ge=0, le=INT32, description="specmesh: at most this many drafted tokens a step")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32, description="the same as max_tokens")
    logprobs: bool | None = Field(None, description="only false")
    top_logprobs: int | None = Field(None, description="unsupported")
    tools: list[dict] | None = Field(None, description="unsupported")
    tool_choice: str | dict | None = Field(None, description="only \"none\"")
    functions: list[dict] | None = Field(None, description="unsupported")
    function_call: str | dict | None = Field(None, description="only \"none\"")
    response_format: dict | None = Field(None, description="only {\"type\": \"text\"}")


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] = Field(description="one text, a list of one text, or token ids")
    echo: bool | None = Field(None, description="only false")
    suffix: str | None = Field(None, description="unsupported")
    best_of: int | None = Field(None, description="only 1")
    logprobs: int | None = Field(None, description="unsupported")


# ---- responses ----

class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpeculationUsage(BaseModel):
    """specmesh's extension on a response (and a stream's last chunk): how the answer was speculated."""

    target_steps: int
    drafted_tokens: int
    accepted_tokens: int
    mean_accepted_length: float
    drafters: list[str]
    request_kind: str
    first_token_ms: float
    total_ms: float


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage
    system_fingerprint: str
    specmesh: SpeculationUsage


class ChoiceDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChoiceDelta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: CompletionUsage | None = None
    system_fingerprint: str
    specmesh: SpeculationUsage | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class Completion(BaseModel):
    """A text completion, and (``object`` "text_completion" too) each chunk of a streamed one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = None
    system_fingerprint: str
    specmesh: SpeculationUsage | None = None


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specmesh"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    verifiers: int


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
