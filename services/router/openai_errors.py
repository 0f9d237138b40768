"""The OpenAI API's errors: OpenAI's JSON shape (``{"error": {"message", "type", "param", "code"}}``) for every
refusal, the exception handlers that map specmesh's errors to it (``serving.http_status_for``, as the gRPC
interceptor maps them to status codes), and the two guards that refuse a request before its body is read:
too large (413) and, where keys are required, no valid key (401)."""

from __future__ import annotations

import json
import logging
from typing import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from specmesh.cluster.serving import http_status_for
from specmesh.errors import NotFound, RequestFailed, SpecmeshError, Unauthenticated

log = logging.getLogger("specmesh.router.http")

DRAIN_BYTES = 64 << 20
ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               409: "conflict_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error",
               503: "service_unavailable"}  # OpenAI's own types: 401 and 404 are invalid requests too
CALLER = "specmesh_caller"  # where KeyCheck leaves the authenticated caller in the request's state
RETRY_AFTER_S = "1"  # a refusal for load: worth retrying soon


class ModelNotFound(NotFound):
    field, code = "model", "model_not_found"


class ClientGone(Exception):
    """The client disconnected before its answer was whole (the request was cancelled)."""


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "error"), "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def public_status(exc: BaseException, where: str) -> tuple[int, str]:
    """``exc``'s HTTP status and the message a client may read: a bug's details go to the log instead."""
    status, message = http_status_for(exc)
    if status == 500 and not isinstance(exc, RequestFailed):
        log.error("internal error %s", where, exc_info=exc)
        message = "internal error; the router's log has the details"
    return status, message


def mapped_error(exc: BaseException) -> JSONResponse:
    status, message = public_status(exc, "on the HTTP API")
    if status == 401:
        response = error_response(401, message, code="invalid_api_key")
        response.headers["WWW-Authenticate"] = "Bearer"
        return response
    response = error_response(status, message, getattr(exc, "field", None), getattr(exc, "code", None))
    if status in (429, 503):
        response.headers["Retry-After"] = RETRY_AFTER_S
    return response


def error_event(exc: BaseException) -> str:
    """An error after a stream's status was sent: said as the stream's last event."""
    status, message = public_status(exc, "in a stream")
    return json.dumps(error_body(status, message, getattr(exc, "field", None)))


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


def add_error_handlers(app: FastAPI) -> None:
    """Every error ``app`` meets answered in OpenAI's shape (FastAPI's 422 for a malformed body as a 400)."""

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
