"""The router's OpenAI-compatible HTTP API: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
``/health`` and the OpenAPI schema at ``/openapi.json``, served by uvicorn in the router's own event loop.

It is a second face of the same ``Router`` as the gRPC servicer: the same validation
(``Router.make_request``), the same admission limits, the same error mapping (``serving.http_status_for``),
and a client that leaves (a closed stream or connection) frees its request exactly as a cancelled gRPC
call does. Errors are OpenAI's JSON (``{"error": {"message", "type", "param", "code"}}``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
import uuid
from contextlib import aclosing, contextmanager, nullcontext
from typing import AsyncIterator, Callable, Sequence

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPBearer
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specmesh import __version__
from specmesh.cluster.auth import Access, Permit
from specmesh.cluster.gateway import Generation, Router, TextStream
from specmesh.cluster.serving import http_status_for
from specmesh.cluster.service_settings import DEFAULT_MAX_BODY_BYTES
from specmesh.cluster.stops import StopScanner, check_stops, tokens_through
from specmesh.cluster.tls import TlsFiles
from specmesh.errors import InvalidArgument, NotFound, RequestFailed, SpecmeshError, Unauthenticated
from specmesh.prompts import check_text
from specmesh.sampling import SamplingParams
from specmesh.services.router.openai_schema import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Delta,
    ErrorResponse,
    Health,
    Model,
    ModelList,
    SamplingFields,
    SpeculationStats,
    Usage,
)

log = logging.getLogger("specmesh.router.http")

DRAIN_BYTES = 64 << 20
ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               409: "conflict_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error",
               503: "service_unavailable"}  # OpenAI's own types: 401 and 404 are invalid requests too
CALLER = "specmesh_caller"  # where KeyCheck leaves the authenticated caller in the request's state
RETRY_AFTER_S = "1"  # a refusal for load: worth retrying soon
ERROR_RESPONSES = {status: {"model": ErrorResponse, "description": description} for status, description in (
    (400, "invalid request: the message names the field"), (404, "unknown model or route"),
    (413, "request body too large"), (429, "too many requests in flight; retry later"),
    (503, "no verifier can take the request now; retry later"))}
UNAUTHORIZED = {"model": ErrorResponse, "description": "no valid API key"}
STREAM = {200: {"content": {"application/json": {}, "text/event-stream": {}},
                "description": "the completion, or with stream=true its chunks as server-sent events"}}
ROLE_OF = {"developer": "system"}  # OpenAI's newer name for the system role


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "error"), "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def mapped_error(exc: BaseException) -> JSONResponse:
    status, message = http_status_for(exc)
    if status == 500 and not isinstance(exc, RequestFailed):  # a bug's details go to the log, not to the client
        log.error("internal error on the HTTP API", exc_info=exc)
        message = "internal error; the router's log has the details"
    if status == 401:
        response = error_response(401, message, code="invalid_api_key")
        response.headers["WWW-Authenticate"] = "Bearer"
        return response
    response = error_response(status, message, getattr(exc, "field", None), getattr(exc, "code", None))
    if status in (429, 503):
        response.headers["Retry-After"] = RETRY_AFTER_S
    return response


class ModelNotFound(NotFound):
    field, code = "model", "model_not_found"


class BodyLimit:
    """ASGI middleware: a request body larger than ``max_bytes`` is answered 413 before it is read whole
    (by its Content-Length, or while it streams in)."""

    class TooLarge(StarletteHTTPException):  # FastAPI re-raises HTTP exceptions met while reading a body
        def __init__(self, limit: int) -> None:
            super().__init__(413, f"the request body exceeds {limit} bytes")

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            return await self._refuse(receive, send)
        received, started = 0, False

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyLimit.TooLarge(self.max_bytes)
            return message

        async def watched_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, watched_send)
        except BodyLimit.TooLarge:
            if not started:
                await self._refuse(receive, send)

    async def _refuse(self, receive, send) -> None:
        # the rest of the body is read and dropped (up to DRAIN_BYTES), so that the client, still sending,
        # reads the 413 instead of a reset connection
        drained, more = 0, True
        while more and drained < DRAIN_BYTES:
            message = await receive()
            drained += len(message.get("body", b""))
            more = message["type"] == "http.request" and message.get("more_body", False)
        body = json.dumps(error_body(413, f"the request body exceeds {self.max_bytes} bytes", code="request_too_large"))
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body.encode()})


class KeyCheck:
    """ASGI middleware: /v1 requests and the schema (it names the served model and version) without a valid
    API key are answered 401 before anything else (the body is not read); per-key limits are applied where
    the request is served."""

    def __init__(self, app, keys) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and (scope["path"].startswith("/v1") or scope["path"] == "/openapi.json"):
            authorization = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1") or None
            try:  # the caller, for the endpoint's per-key limits: authenticated once
                scope.setdefault("state", {})[CALLER] = self.keys.authenticate(authorization)
            except Unauthenticated as exc:
                return await mapped_error(exc)(scope, receive, send)
        return await self.app(scope, receive, send)


def field_name(location: Sequence[str | int]) -> str:
    """A validation error's place as the router names fields everywhere: ``messages[0].role``; the body
    itself (missing, or not an object) is ``body``."""
    name = ""
    for part in location[1:] if location[:1] == ("body",) else location:
        name += f"[{part}]" if isinstance(part, int) else f".{part}" if name else str(part)
    return name or "body"


def _refuse_unsupported(body: SamplingFields) -> None:
    """Fields whose meaning specmesh does not implement are refused rather than ignored."""
    if body.n not in (None, 1):
        raise InvalidArgument("n", f"only 1 choice per request is served, got {body.n}")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0):
            raise InvalidArgument(name, "is not supported (only 0): speculation keeps the target's own distribution")
    if body.logit_bias:
        raise InvalidArgument("logit_bias", "is not supported")
    if isinstance(body, ChatCompletionRequest):
        if body.logprobs or body.top_logprobs:
            raise InvalidArgument("logprobs", "log-probabilities are not returned by specmesh")
        for name in ("tools", "functions"):
            if getattr(body, name):
                raise InvalidArgument(name, "tool and function calls are not supported")
        for name in ("tool_choice", "function_call"):
            if getattr(body, name) not in (None, "none"):
                raise InvalidArgument(name, "tool and function calls are not supported")
        if body.response_format is not None and body.response_format.get("type") != "text":
            raise InvalidArgument("response_format", "only {\"type\": \"text\"} is supported")
    if isinstance(body, CompletionRequest):
        if body.echo:
            raise InvalidArgument("echo", "is not supported")
        if body.suffix is not None:
            raise InvalidArgument("suffix", "is not supported")
        if body.best_of not in (None, 1):
            raise InvalidArgument("best_of", f"only 1 is served, got {body.best_of}")
        if body.logprobs is not None:
            raise InvalidArgument("logprobs", "log-probabilities are not returned by specmesh")


def _usage_due(body: SamplingFields, piece: Piece) -> bool:
    """A stream's usage chunk follows its last piece when the client asked for one."""
    return piece.finish_reason is not None and bool(body.stream_options and body.stream_options.include_usage)


def _stops(body: SamplingFields) -> tuple[str, ...]:
    if body.stop is None:
        return ()
    return check_stops([body.stop] if isinstance(body.stop, str) else body.stop)


def _stats(generation: Generation) -> SpeculationStats:
    s = generation.stats
    return SpeculationStats(target_steps=s.target_steps, drafted_tokens=s.drafted_nodes,
                            accepted_tokens=s.accepted_tokens, mean_accepted_length=round(s.mean_accepted_length, 4),
                            drafters=generation.drafters, request_kind=s.request_kind,
                            first_token_ms=round(s.first_token_s * 1e3, 3), total_ms=round(s.total_s * 1e3, 3))


class Piece:
    """What one step adds to an answer: its text (stop strings applied), and at the end why it ended and
    how many tokens it counts."""

    def __init__(self, text: str, generation: Generation, finish_reason: str | None = None, tokens: int = 0) -> None:
        self.text, self.generation, self.finish_reason, self.tokens = text, generation, finish_reason, tokens

    def usage(self) -> Usage:
        prompt = self.generation.prompt_tokens
        return Usage(prompt_tokens=prompt, completion_tokens=self.tokens, total_tokens=prompt + self.tokens)


async def pieces(router: Router, ticket, stops: tuple[str, ...], whole: bool = False) -> AsyncIterator[Piece]:
    """The answer step by step (``whole``: in one piece, posted once by its verifier: an answer that is not
    streamed and has no stop string to watch for); the last piece has ``finish_reason``. Closing this ends
    the request."""
    text, scanner = TextStream(router.decode), StopScanner(stops)
    async with aclosing(router.generate(ticket, final_only=whole)) as steps:
        async for generation, step in steps:
            final = step.finish_reason is not None
            out = scanner.push(text.push(step.token_ids, final))
            if scanner.stopped:  # ends the request here: closing the steps frees its sessions and cache
                generation.finish_reason = "stop"
                yield Piece(out, generation, "stop", tokens_through(router.decode, generation.token_ids, scanner.stop_end))
                return
            if final:
                yield Piece(out + scanner.flush(), generation, step.finish_reason, len(generation.token_ids))
                return
            if out:
                yield Piece(out, generation)


class OpenAIFrontend:
    """Turns OpenAI requests into the router's tickets and its steps into OpenAI responses."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.created = int(time.time())
        self.fingerprint = f"specmesh-{__version__}-{router.card.tokenizer_hash[:8]}"

    def model(self) -> Model:
        card = self.router.card
        return Model(id=card.name, created=self.created, max_model_len=card.max_length)

    def check_model(self, name: str) -> None:
        if name != self.router.card.name:
            raise ModelNotFound(f"model {name!r} is not served here; this router serves {self.router.card.name!r}")

    def sampling(self, body: SamplingFields, max_tokens: int | None) -> SamplingParams:
        _refuse_unsupported(body)
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,  # OpenAI's default
            top_k=body.top_k or 0, top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed,
            max_tokens=max_tokens or self.router.limits.default_max_tokens,
        )

    def chat_ticket(self, body: ChatCompletionRequest):
        self.check_model(body.model)
        if body.max_tokens is not None and body.max_completion_tokens is not None \
                and body.max_tokens != body.max_completion_tokens:
            raise InvalidArgument("max_completion_tokens", "differs from max_tokens; give one")
        params = self.sampling(body, body.max_completion_tokens or body.max_tokens)
        for i, message in enumerate(body.messages):
            if message.role == "assistant" and message.content is None:
                raise InvalidArgument(f"messages[{i}].content", "is missing")
        messages = [(ROLE_OF.get(m.role, m.role), m.text()) for m in body.messages]
        for i, (_, text) in enumerate(messages):
            check_text(f"messages[{i}].content", text)
        user = next((text for role, text in reversed(messages) if role == "user"), "")
        return self.router.make_request(self.router.encode_chat(messages), params, max_tree_nodes=body.max_tree_nodes,
                                        text=user, speculation=body.speculation)

    def completion_ticket(self, body: CompletionRequest):
        self.check_model(body.model)
        params = self.sampling(body, body.max_tokens)
        prompt, text = body.prompt, ""
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise InvalidArgument("prompt", f"give one prompt per request, got {len(prompt)}")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids, text = self.router.encode_text(prompt), prompt
        else:
            ids = [int(t) for t in prompt]
        return self.router.make_request(ids, params, max_tree_nodes=body.max_tree_nodes, text=text,
                                        speculation=body.speculation)


def openai_app(router: Router, live_verifiers: Callable[[], int], max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               access: Access | None = None) -> FastAPI:
    """The HTTP app over ``router``; ``live_verifiers()``: how many verifiers can take work now (health);
    ``access``: every route but /health needs an API key (``Authorization: Bearer <key>``)
    within its limits."""
    frontend = OpenAIFrontend(router)
    guarded = [Depends(HTTPBearer(auto_error=False))] if access is not None else []  # documents it in the schema
    errors = {**ERROR_RESPONSES, **({401: UNAUTHORIZED} if access is not None else {})}

    def admit(request: Request) -> Permit | None:
        return access.limits.admit(request.scope["state"][CALLER]) if access is not None else None

    async def begin(request: Request, body: SamplingFields, make_ticket) -> tuple[AsyncIterator[Piece], Permit | None]:
        """Admit the caller and validate the request: its answer, and the permit the answer holds. A client
        that leaves while its prompt waits to be read (one input thread: a burst queues) is dropped there."""
        permit = admit(request)
        try:  # a prompt not read yet when its client leaves gives up its turn on the input thread
            ticket = await _unless_gone(request, asyncio.ensure_future(router.prepare(make_ticket, body)))
            stops = _stops(body)
        except BaseException:  # refused before it began: the key's slot is free again
            permit and permit.release()
            raise
        return pieces(router, ticket, stops, whole=not body.stream and not stops), permit
    app = FastAPI(title="specmesh", version=__version__, docs_url=None, redoc_url=None,
                  description="OpenAI-compatible API of a specmesh router: lossless speculative decoding. "
                              "Extensions: top_k, speculation, max_tree_nodes; responses carry `specmesh` statistics.")

    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if access is not None:  # outermost: a caller without a key is refused before its body is read
        app.add_middleware(KeyCheck, keys=access.keys)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            return error_response(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', 'malformed')}")
        param = field_name(first.get("loc", ()))
        return error_response(400, f"{param}: {first.get('msg')}", param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone):
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @app.exception_handler(SpecmeshError)
    async def domain_error(request: Request, exc: SpecmeshError):
        return mapped_error(exc)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        return mapped_error(exc)

    @app.get("/health", response_model=Health, responses={503: {"model": Health, "description": "no live verifier"}})
    async def health():
        verifiers = live_verifiers()
        status = "ok" if verifiers else "unavailable"
        return JSONResponse(Health(status=status, verifiers=verifiers).model_dump(), status_code=200 if verifiers else 503)

    @app.get("/v1/models", response_model=ModelList, dependencies=guarded,
             responses={k: v for k, v in errors.items() if k in (401, 429)})
    async def models(request: Request):
        with admit(request) or nullcontext():
            return ModelList(data=[frontend.model()])

    @app.get("/v1/models/{model_id}", response_model=Model, dependencies=guarded,
             responses={k: v for k, v in errors.items() if k in (401, 404, 429)})
    async def model(model_id: str, request: Request):
        with admit(request) or nullcontext():
            frontend.check_model(model_id)
            return frontend.model()

    @app.post("/v1/chat/completions", response_model=ChatCompletion, dependencies=guarded,
              responses={**errors, **STREAM})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        answer, permit = await begin(request, body, frontend.chat_ticket)
        ids = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(choices: list[ChatChunkChoice], piece: Piece | None = None, usage: Usage | None = None) -> str:
            final = piece is not None and piece.finish_reason is not None
            return ChatCompletionChunk(id=ids[0], created=ids[1], model=router.card.name, choices=choices, usage=usage,
                                       system_fingerprint=frontend.fingerprint,
                                       specmesh=_stats(piece.generation) if final else None).model_dump_json()

        if body.stream:
            def events(piece: Piece, first: bool) -> list[str]:
                delta = Delta(role="assistant", content=piece.text) if first else Delta(content=piece.text)
                out = [chunk([ChatChunkChoice(index=0, delta=delta, finish_reason=piece.finish_reason)], piece)]
                if _usage_due(body, piece):
                    out.append(chunk([], usage=piece.usage()))
                return out
            return await streamed(answer, events, request, permit)
        text, last = await collected(answer, request, permit)
        return ChatCompletion(id=ids[0], created=ids[1], model=router.card.name, usage=last.usage(),
                              choices=[ChatChoice(index=0, message=AssistantMessage(content=text),
                                                  finish_reason=last.finish_reason)],
                              system_fingerprint=frontend.fingerprint, specmesh=_stats(last.generation))

    @app.post("/v1/completions", response_model=Completion, dependencies=guarded, responses={**errors, **STREAM})
    async def completions(body: CompletionRequest, request: Request):
        answer, permit = await begin(request, body, frontend.completion_ticket)
        ids = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def completion(choices: list[CompletionChoice], piece: Piece | None = None, usage: Usage | None = None) -> Completion:
            final = piece is not None and piece.finish_reason is not None
            return Completion(id=ids[0], created=ids[1], model=router.card.name, choices=choices, usage=usage,
                              system_fingerprint=frontend.fingerprint, specmesh=_stats(piece.generation) if final else None)

        if body.stream:
            def events(piece: Piece, first: bool) -> list[str]:
                out = [completion([CompletionChoice(index=0, text=piece.text, finish_reason=piece.finish_reason)],
                                  piece).model_dump_json()]
                if _usage_due(body, piece):
                    out.append(completion([], usage=piece.usage()).model_dump_json())
                return out
            return await streamed(answer, events, request, permit)
        text, last = await collected(answer, request, permit)
        return completion([CompletionChoice(index=0, text=text, finish_reason=last.finish_reason)], last, last.usage())

    def schema() -> dict:  # errors are 400s in OpenAI's shape: FastAPI's 422 is never sent
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            for path in document.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = document.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            for name in ("ChatCompletionRequest", "CompletionRequest"):  # the one model this router serves
                schemas.get(name, {}).get("properties", {}).get("model", {})["enum"] = [router.card.name]
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = schema
    return app


async def streamed(answer: AsyncIterator[Piece], events: Callable[[Piece, bool], list[str]], request: Request,
                   permit: Permit | None):
    """Server-sent events of ``answer``, then ``[DONE]``. The first step is awaited before the response
    starts, so that a refusal (429, 503, a bad request) is an HTTP status, not an event; an error after
    that is an ``error`` event. The answer runs in a task of its own: a client that leaves cancels it
    once, as gRPC cancels a call, and its clean-up (drafter sessions, queue entries) runs to the end —
    also while the first step is awaited (a long prompt's prefill under load can take minutes)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def produce() -> None:
        try:
            async with aclosing(answer):
                async for piece in answer:
                    queue.put_nowait(piece)
            queue.put_nowait(None)
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which reports it
            queue.put_nowait(exc)

    producer = asyncio.ensure_future(produce())
    if permit is not None:  # held while the answer runs, however it ends (even cancelled before it began)
        producer.add_done_callback(lambda _: permit.release())
    try:
        first = await _unless_gone(request, asyncio.ensure_future(queue.get()))
    except BaseException:  # the client left before the first step (or the call ended): nobody reads the answer
        producer.cancel()
        raise
    if isinstance(first, Exception):
        raise first

    async def send() -> AsyncIterator[str]:
        try:
            for data in events(first, True):
                yield data
            if first.finish_reason is None:
                while (item := await queue.get()) is not None:
                    if isinstance(item, Exception):  # after the status was sent: say it in the stream
                        status, message = http_status_for(item)
                        if status == 500 and not isinstance(item, RequestFailed):
                            log.error("internal error in a stream", exc_info=item)
                            message = "internal error; the router's log has the details"
                        yield json.dumps(error_body(status, message, getattr(item, "field", None)))
                        return
                    for data in events(item, False):
                        yield data
            yield "[DONE]"
        finally:
            producer.cancel()  # a no-op once the answer is whole

    return EventSourceResponse(send(), ping=15, sep="\n")


async def collected(answer: AsyncIterator[Piece], request: Request, permit: Permit | None) -> tuple[str, Piece]:
    """The whole answer's text and its last piece; a client that disconnects first ends the request."""
    async def whole() -> tuple[str, Piece]:
        parts, last = [], None
        async with aclosing(answer):
            async for last in answer:
                parts.append(last.text)
        return "".join(parts), last

    work = asyncio.ensure_future(whole())
    if permit is not None:
        work.add_done_callback(lambda _: permit.release())
    return await _unless_gone(request, work)


async def _unless_gone(request: Request, work: asyncio.Future):
    """``work``'s result, unless the client disconnects first (its body was read whole before): then
    ``work`` is cancelled, since nobody will read it, and ClientGone raised; so it is when this is."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        left = not work.done()
        if left:
            work.cancel()
    if left:
        raise ClientGone
    return work.result()


class ClientGone(Exception):
    """The client disconnected before its answer was whole (the request was cancelled)."""


class HttpServer:
    """uvicorn serving ``app`` on the running event loop; the host process keeps its own signal handling."""

    class _Server(uvicorn.Server):
        @contextmanager
        def capture_signals(self):  # the router's run_service handles SIGINT/SIGTERM
            yield

    def __init__(self, app: FastAPI, address: str, tls: TlsFiles | None = None) -> None:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise InvalidArgument("http_listen", f"must be host:port, got {address!r}")
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((host, int(port)))
        except OSError as exc:
            self.socket.close()
            raise InvalidArgument("http_listen", f"cannot listen on {address}: {exc.strerror}") from None
        self.host, self.port = host, self.socket.getsockname()[1]
        self.scheme = "https" if tls is not None else "http"
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=5,
                                ssl_certfile=str(tls.cert) if tls else None, ssl_keyfile=str(tls.key) if tls else None)
        self.server = self._Server(config)
        self.task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}/v1"

    async def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.socket]))
        while not self.server.started:
            if self.task.done():
                await self.task  # raises what stopped it
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await self.task
        self.socket.close()
