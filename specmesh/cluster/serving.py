"""What every specmesh gRPC service shares: the error-to-status interceptor, health checking,
reflection, and graceful shutdown on SIGTERM (stop taking work, drain, then exit)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from specmesh.cluster.auth import Access, Permit
from specmesh.cluster.lifetime import die_with
from specmesh.cluster.metrics import ServiceMetrics
from specmesh.cluster.settings import Settings
from specmesh.cluster.tls import TlsFiles
from specmesh.errors import (
    InvalidArgument, NotFound, RequestFailed, ResourceExhausted, SpecmeshError, Unauthenticated, Unavailable,
)

log = logging.getLogger("specmesh.cluster.serving")
OPEN_PREFIX = "/grpc.health.v1.Health/"  # probes (Kubernetes, load balancers) carry no key

# The one mapping of the domain's errors, for the gRPC API and the HTTP (OpenAI) API alike.
STATUS_OF = {
    InvalidArgument: (grpc.StatusCode.INVALID_ARGUMENT, 400),
    ResourceExhausted: (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    Unavailable: (grpc.StatusCode.UNAVAILABLE, 503),
    NotFound: (grpc.StatusCode.NOT_FOUND, 404),
    Unauthenticated: (grpc.StatusCode.UNAUTHENTICATED, 401),
    RequestFailed: (grpc.StatusCode.INTERNAL, 500),  # the request's own numbers: not retried, the others go on
}


def _statuses(exc: BaseException) -> tuple[grpc.StatusCode, int, str]:
    for kind, (code, http) in STATUS_OF.items():
        if isinstance(exc, kind):
            return code, http, str(exc)
    if isinstance(exc, SpecmeshError):
        return grpc.StatusCode.FAILED_PRECONDITION, 409, str(exc)
    return grpc.StatusCode.INTERNAL, 500, f"internal error ({type(exc).__name__}): {exc}"


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    code, _, message = _statuses(exc)
    return code, message


def http_status_for(exc: BaseException) -> tuple[int, str]:
    _, status, message = _statuses(exc)
    return status, message


class Malformed:
    """A request whose bytes are no valid message (truncated, wrong wire types, invalid UTF-8 in a string):
    the servicer never sees it, the caller gets INVALID_ARGUMENT."""

    def __init__(self, why: str) -> None:
        self.why = why


def tolerant(deserializer: Callable[[bytes], object] | None) -> Callable[[bytes], object] | None:
    """``deserializer`` that returns ``Malformed`` instead of raising (gRPC would answer UNKNOWN)."""
    if deserializer is None:
        return None

    def parse(data: bytes) -> object:
        try:
            return deserializer(data)
        except Exception as exc:
            return Malformed(str(exc) or type(exc).__name__)

    return parse


def check_wellformed(method: str, request: object) -> None:
    if isinstance(request, Malformed):
        raise InvalidArgument("request", f"is not a valid {method.rsplit('/', 1)[-1]} message ({request.why})")


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps the domain's exceptions to status codes in one place; any other exception becomes INTERNAL
    (logged with its traceback) instead of an opaque UNKNOWN. Servicers just raise. With ``metrics``,
    every call is counted by method and status code, and timed."""

    def __init__(self, metrics: ServiceMetrics | None = None, access: Access | None = None) -> None:
        """``access``: callers must present an API key (``authorization`` metadata) and stay within its
        limits, on every method but health checking."""
        self.metrics = metrics
        self.access = access

    def _admit(self, method: str, context) -> Permit | None:
        if self.access is None or method.startswith(OPEN_PREFIX):
            return None
        metadata = dict(context.invocation_metadata() or ())
        return self.access.admit(metadata.get("authorization"))

    def _done(self, method: str, code: grpc.StatusCode, started: float) -> None:
        if self.metrics is not None:
            self.metrics.rpc_done(method, code.name, time.perf_counter() - started)

    async def _relayed(self, method: str, context, replies: Callable[[], AsyncIterator],
                       arrived: deque[float] | None = None):
        """A streaming call's replies (``replies()``, the handler's) with the key checked, errors mapped to their
        status and the call counted when it ends; with ``arrived`` (when each request message came, on a held
        stream answering each in order) every reply is counted as a call instead, timed from its request."""
        started, code, permit = time.perf_counter(), grpc.StatusCode.OK, None
        try:
            permit = self._admit(method, context)
            async for item in replies():
                if arrived is not None:
                    self._done(method, grpc.StatusCode.OK, arrived.popleft() if arrived else started)
                yield item
        except (asyncio.CancelledError, GeneratorExit):
            code = grpc.StatusCode.CANCELLED
            raise
        except grpc.aio.AbortError:
            code = context.code() or grpc.StatusCode.UNKNOWN
            raise
        except Exception as exc:
            code = status_for(exc)[0]
            await _abort(context, method, exc)
        finally:
            if permit is not None:
                permit.release()
            if arrived is None or code != grpc.StatusCode.OK:
                self._done(method, code, started)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.unary_unary is not None:
            return self._unary(method, handler)
        if handler.unary_stream is not None:
            return self._server_stream(method, handler)
        if handler.stream_stream is not None:  # a held stream (proposals, reflection): one call, many messages
            return self._bidi(method, handler)
        if self.access is not None and not method.startswith(OPEN_PREFIX):
            return None  # a client-streaming method without a check of its own: not served
        return handler

    def _unary(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        inner = handler.unary_unary

        async def unary(request, context):
            started, code, permit = time.perf_counter(), grpc.StatusCode.OK, None
            try:
                permit = self._admit(method, context)
                check_wellformed(method, request)
                return await inner(request, context)
            except asyncio.CancelledError:
                code = grpc.StatusCode.CANCELLED
                raise
            except grpc.aio.AbortError:
                code = context.code() or grpc.StatusCode.UNKNOWN
                raise
            except Exception as exc:
                code = status_for(exc)[0]
                await _abort(context, method, exc)
            finally:
                if permit is not None:
                    permit.release()
                self._done(method, code, started)

        return grpc.unary_unary_rpc_method_handler(
            unary, request_deserializer=tolerant(handler.request_deserializer),
            response_serializer=handler.response_serializer)

    def _server_stream(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        inner = handler.unary_stream

        async def stream(request, context):
            def replies():
                check_wellformed(method, request)
                return inner(request, context)

            async with aclosing(self._relayed(method, context, replies)) as relayed:
                async for item in relayed:
                    yield item

        return grpc.unary_stream_rpc_method_handler(
            stream, request_deserializer=tolerant(handler.request_deserializer),
            response_serializer=handler.response_serializer)

    def _bidi(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        inner = handler.stream_stream

        async def bidi(requests, context):
            arrived: deque[float] = deque()

            def replies():
                return inner(_wellformed(method, requests, arrived), context)

            async with aclosing(self._relayed(method, context, replies, arrived)) as relayed:
                async for item in relayed:
                    yield item

        return grpc.stream_stream_rpc_method_handler(
            bidi, request_deserializer=tolerant(handler.request_deserializer),
            response_serializer=handler.response_serializer)


async def _wellformed(method: str, requests, arrived: deque[float]):
    """A stream's requests, each checked as a unary call's is (a malformed one ends the stream), each one's
    arrival noted."""
    async for request in requests:
        arrived.append(time.perf_counter())
        check_wellformed(method, request)
        yield request


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
    code, message = status_for(exc)
    if isinstance(exc, RequestFailed):  # the verifier logged the cause; one line here
        log.warning("%s: %s", method, exc)
    elif code == grpc.StatusCode.INTERNAL:
        log.exception("%s failed", method)
    await context.abort(code, message)


@dataclass
class Service:
    """A gRPC service to host: its full name, how to add it, and what to do on shutdown."""

    name: str
    add: Callable[[grpc.aio.Server], None]
    drain: Callable[[], Awaitable[None]] | None = None


@dataclass
class Server:
    server: grpc.aio.Server
    health: HealthServicer
    port: int
    services: Sequence[Service]
    stopping: asyncio.Event = field(default_factory=asyncio.Event)

    async def set_serving(self, serving: bool, names: Sequence[str] | None = None) -> None:
        """The health of ``names`` (default: the server's, "", and every service's)."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *(s.name for s in self.services)) if names is None else names:
            await self.health.set(name, status)

    async def shutdown(self, grace_s: float) -> None:
        """Health goes NOT_SERVING, every service drains, then the server stops (in-flight calls get
        ``grace_s`` to finish)."""
        await self.set_serving(False)
        for service in self.services:
            if service.drain is not None:
                try:
                    await service.drain()
                except Exception:  # shutting down anyway: say so, keep going
                    log.exception("draining %s failed", service.name)
        await self.server.stop(grace_s)

    async def wait(self, grace_s: float = 10.0) -> None:
        """Serve until SIGTERM or SIGINT, then shut down gracefully."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        await self.stopping.wait()
        log.info("shutting down: draining")
        await self.shutdown(grace_s)


async def start_server(
    services: Sequence[Service], address: str, max_message_mb: int = 64, metrics: ServiceMetrics | None = None,
    access: Access | None = None, tls: TlsFiles | None = None, require_client_cert: bool = False,
) -> Server:
    """Start a gRPC server with health checking, reflection and the error interceptor on ``address``
    (``host:port``; port 0 picks a free one); ``metrics`` counts its calls; ``access``: API keys required;
    ``tls``: serve TLS, and with ``require_client_cert`` only to callers with a certificate from its CA."""
    options = [
        ("grpc.max_receive_message_length", max_message_mb << 20),
        ("grpc.max_send_message_length", max_message_mb << 20),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.aio.server(interceptors=[ErrorInterceptor(metrics, access)], options=options)
    for service in services:
        service.add(server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        [s.name for s in services] + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )
    if tls is not None:
        port = server.add_secure_port(address, tls.server_credentials(require_client_cert))
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise Unavailable(f"cannot listen on {address}")
    await server.start()
    result = Server(server, health, port, services)
    await result.set_serving(True)
    return result


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")


class TorchThread:
    """One thread that does all of a service's torch work — loading, warming up, every pass.

    OpenMP keeps a thread team per calling thread: touching torch from the event loop's thread and
    from a worker makes two teams, and on a small machine their threads outnumber the cores and every
    parallel region slows (measured on 2 cores: a 16-request pass 8 → 16 ms once a second team existed,
    idle or not). So all of a service's torch work runs on one thread: this one, or with ``inline`` the
    event loop's own. Inline suits a CPU verifier: its pass computes on every core, so the loop's work
    meanwhile would only take cores and the GIL from it, and the hop to a thread and back costs ~0.5 ms
    a step; the loop then stands still for a pass (its heartbeat with it: a pass must stay well inside
    the heartbeat's TTL).
    """

    def __init__(self, name: str = "torch", inline: bool = False) -> None:
        self.inline = inline
        self._executor = None if inline else ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn, *args):
        return await self.submit(fn, *args)

    def submit(self, fn, *args) -> asyncio.Future:
        """``fn(*args)`` handed to the thread now (inline: run now); its result when awaited."""
        loop = asyncio.get_running_loop()
        if self._executor is not None:
            return loop.run_in_executor(self._executor, fn, *args)
        done = loop.create_future()
        try:
            done.set_result(fn(*args))
        except Exception as exc:  # raised where the future is awaited, as from the thread
            done.set_exception(exc)
        return done

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)


PARENT_PID = "SPECMESH_PARENT_PID"  # set by a launcher: the service ends (SIGTERM) when that process is gone


def die_with_parent() -> None:
    """Linux: SIGTERM this process when the launcher that started it dies, even by SIGKILL."""
    parent = os.environ.get(PARENT_PID)
    if parent:
        die_with(int(parent))


def run_service(prog: str, description: str, settings: type[Settings], serve: Callable[..., Awaitable[None]],
                argv: Sequence[str] | None) -> int:
    """A service's command line: its settings, logging, then serve until SIGTERM; a bad flag or variable exits
    2 with its reason."""
    args = settings.parse(argv, prog, description)
    configure_logging(args.log_level)
    die_with_parent()
    try:
        asyncio.run(serve(args))
    except InvalidArgument as exc:
        print(f"{prog}: error: {exc}", flush=True)
        return 2
    return 0
