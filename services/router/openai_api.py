"""The router's OpenAI-compatible HTTP API: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
``/health`` and the OpenAPI schema at ``/openapi.json``, served by uvicorn in the router's own event loop.

It is a second face of the same ``Gateway`` as the gRPC servicer. The app is put together here from the parts
by what they convert: requests (``openai_requests``), answers and streams (``openai_responses``), errors
(``openai_errors``); the wire shapes are ``openai_schema``.
"""

from __future__ import annotations

import asyncio
import socket
from contextlib import contextmanager, nullcontext
from typing import AsyncIterator, Callable

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from fastapi.security import HTTPBearer

from specmesh import __version__
from specmesh.cluster.auth import Access, Permit
from specmesh.cluster.gateway import Gateway
from specmesh.cluster.service_settings import DEFAULT_MAX_BODY_BYTES
from specmesh.cluster.tls import TlsFiles
from specmesh.errors import InvalidArgument
from specmesh.services.router.openai_errors import CALLER, BodyLimit, KeyCheck, add_error_handlers
from specmesh.services.router.openai_requests import OpenAIFrontend, stop_strings
from specmesh.services.router.openai_responses import (
    ChatFormat,
    Piece,
    TextFormat,
    collected,
    pieces,
    streamed,
    unless_gone,
)
from specmesh.services.router.openai_schema import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    Health,
    Model,
    ModelList,
    SamplingFields,
)

ERROR_RESPONSES = {status: {"model": ErrorResponse, "description": description} for status, description in (
    (400, "invalid request: the message names the field"), (404, "unknown model or route"),
    (413, "request body too large"), (429, "too many requests in flight; retry later"),
    (503, "no verifier can take the request now; retry later"))}
UNAUTHORIZED = {"model": ErrorResponse, "description": "no valid API key"}
STREAM = {200: {"content": {"application/json": {}, "text/event-stream": {}},
                "description": "the completion, or with stream=true its chunks as server-sent events"}}


def openai_app(gateway: Gateway, live_verifiers: Callable[[], int], max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               access: Access | None = None) -> FastAPI:
    """The HTTP app over ``gateway``; ``live_verifiers()``: how many verifiers can take work now (health);
    ``access``: every route but /health needs an API key (``Authorization: Bearer <key>``)
    within its limits."""
    app = FastAPI(title="specmesh", version=__version__, docs_url=None, redoc_url=None,
                  description="OpenAI-compatible API of a specmesh router: lossless speculative decoding. "
                              "Extensions: top_k, speculation, max_tree_nodes; responses carry `specmesh` statistics.")
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if access is not None:  # outermost: a caller without a key is refused before its body is read
        app.add_middleware(KeyCheck, keys=access.keys)
    add_error_handlers(app)
    routes = _Routes(OpenAIFrontend(gateway), access)
    routes.add_model_routes(app, live_verifiers)
    routes.add_completion_routes(app)
    app.openapi = lambda: _openapi_schema(app, gateway.card.name)
    return app


class _Routes:
    """The app's endpoints over one front end, each within its caller's key limits where keys are required."""

    def __init__(self, frontend: OpenAIFrontend, access: Access | None) -> None:
        self.frontend, self.access = frontend, access
        self.guarded = [Depends(HTTPBearer(auto_error=False))] if access is not None else []  # in the schema
        self.errors = {**ERROR_RESPONSES, **({401: UNAUTHORIZED} if access is not None else {})}

    def admit(self, request: Request) -> Permit | None:
        return self.access.limits.admit(request.scope["state"][CALLER]) if self.access is not None else None

    def add_model_routes(self, app: FastAPI, live_verifiers: Callable[[], int]) -> None:
        frontend, errors = self.frontend, self.errors

        @app.get("/health", response_model=Health, responses={503: {"model": Health, "description": "no live verifier"}})
        async def health():
            verifiers = live_verifiers()
            status = "ok" if verifiers else "unavailable"
            return JSONResponse(Health(status=status, verifiers=verifiers).model_dump(),
                                status_code=200 if verifiers else 503)

        @app.get("/v1/models", response_model=ModelList, dependencies=self.guarded,
                 responses={k: v for k, v in errors.items() if k in (401, 429)})
        async def models(request: Request):
            with self.admit(request) or nullcontext():
                return ModelList(data=[frontend.model()])

        @app.get("/v1/models/{model_id}", response_model=Model, dependencies=self.guarded,
                 responses={k: v for k, v in errors.items() if k in (401, 404, 429)})
        async def model(model_id: str, request: Request):
            with self.admit(request) or nullcontext():
                frontend.check_model(model_id)
                return frontend.model()

    def add_completion_routes(self, app: FastAPI) -> None:
        frontend = self.frontend

        @app.post("/v1/chat/completions", response_model=ChatCompletion, dependencies=self.guarded,
                  responses={**self.errors, **STREAM})
        async def chat_completions(body: ChatCompletionRequest, request: Request):
            return await self.answer(request, body, frontend.chat_ticket, ChatFormat(frontend, body))

        @app.post("/v1/completions", response_model=Completion, dependencies=self.guarded,
                  responses={**self.errors, **STREAM})
        async def completions(body: CompletionRequest, request: Request):
            return await self.answer(request, body, frontend.completion_ticket, TextFormat(frontend, body))

    async def answer(self, request: Request, body: SamplingFields, make_ticket, form: ChatFormat | TextFormat):
        """The request's answer in ``form``: whole, or streamed where the body asks."""
        answer, permit = await self.begin(request, body, make_ticket)
        if body.stream:
            return await streamed(answer, form.events, request, permit)
        text, last = await collected(answer, request, permit)
        return form.whole(text, last)

    async def begin(self, request: Request, body: SamplingFields, make_ticket) -> tuple[AsyncIterator[Piece], Permit | None]:
        """Admit the caller and validate the request: its answer, and the permit the answer holds. A client
        that leaves while its prompt waits to be read (one input thread: a burst queues) is dropped there."""
        permit = self.admit(request)
        gateway = self.frontend.gateway
        try:  # a prompt not read yet when its client leaves gives up its turn on the input thread
            ticket = await unless_gone(request, asyncio.ensure_future(gateway.prepare(make_ticket, body)))
            stops = stop_strings(body)
        except BaseException:  # refused before it began: the key's slot is free again
            permit and permit.release()
            raise
        return pieces(gateway, ticket, stops, whole=not body.stream and not stops), permit


def _openapi_schema(app: FastAPI, model_name: str) -> dict:
    """The schema, once: errors are 400s in OpenAI's shape (FastAPI's 422 is never sent), and the one model
    served is the only ``model`` a request may name."""
    if app.openapi_schema is None:
        document = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for path in document.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        schemas = document.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        for name in ("ChatCompletionRequest", "CompletionRequest"):
            schemas.get(name, {}).get("properties", {}).get("model", {})["enum"] = [model_name]
        app.openapi_schema = document
    return app.openapi_schema


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
