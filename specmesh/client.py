"""The specmesh client SDK: ``Client`` (blocking) and ``AsyncClient`` (asyncio) for the router's API.

    with Client("127.0.0.1:50051") as client:
        result = client.generate("Write a haiku about trees.", max_tokens=64)
        print(result.text, result.stats.mean_accepted_length)
        for chunk in client.stream(chat=[("user", "Hi!")]):
            print(chunk.text, end="", flush=True)

Calls carry a deadline (``timeout_s``: the whole call's, its failovers' tries included); UNAVAILABLE is
retried with exponential back-off by the channel's own retry policy (before any token was received); a
cap on in-flight calls protects the channel; leaving a stream early (``break``, an exception, cancelling
the task) cancels the call, and the router frees the request's drafter sessions, KV cache and queue
entries. Errors are ``grpc.RpcError`` with the server's status code and message.

Several routers (``Client("10.0.0.1:50051,10.0.0.2:50051")`` or a list): calls start at each router in
turn, and one that fails UNAVAILABLE is tried on the next (``retries`` times in all, backing off after
each round of the routers). A stream cut after some chunks goes on at the next router from the tokens
received (``resume_ids``): the caller sees one stream, and a greedy answer is the one an uncut stream
would have given. A seeded sampled answer is a sample of the target's distribution after those tokens,
but not the tokens the uncut stream would have drawn (the seed is a per-request generator).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Iterator, Sequence

import grpc

from specmesh.v1 import common_pb2, router_pb2, router_pb2_grpc

SPECULATION = {"adaptive": router_pb2.SPECULATION_ADAPTIVE, "fixed": router_pb2.SPECULATION_FIXED,
               "off": router_pb2.SPECULATION_OFF}


def _auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    key = api_key if api_key is not None else os.environ.get("SPECMESH_API_KEY", "")
    return (("authorization", f"Bearer {key}"),) if key else ()


def _tls(ca: str) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=open(ca, "rb").read() if ca else None)


def _service_config(retries: int) -> str:
    return json.dumps({
        "methodConfig": [{
            "name": [{"service": "specmesh.v1.Router"}],
            "retryPolicy": {
                "maxAttempts": retries + 1,
                "initialBackoff": "0.2s",
                "maxBackoff": "5s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }]
    })


def _channel_options(retries: int) -> list[tuple[str, object]]:
    options: list[tuple[str, object]] = [("grpc.max_receive_message_length", 64 << 20)]
    if retries < 1:  # gRPC's retry policies try at least twice: none at all means retries off
        return [*options, ("grpc.enable_retries", 0)]
    return [*options, ("grpc.enable_retries", 1), ("grpc.service_config", _service_config(retries))]


def _addresses(address: str | Sequence[str]) -> list[str]:
    found = [a.strip() for a in (address.split(",") if isinstance(address, str) else address) if a.strip()]
    if not found:
        raise ValueError("give a router's address (host:port), or several")
    return found


def _backoff_s(attempt: int, routers: int) -> float:
    """Before try ``attempt`` (from 0): none while untried routers are left, then 0.2 s doubling."""
    if attempt == 0 or attempt % routers:
        return 0.0
    return min(0.2 * 2 ** (attempt // routers - 1), 5.0)


def _resumed(message: router_pb2.GenerateRequest, received: Sequence[int]) -> router_pb2.GenerateRequest:
    if not received:
        return message
    again = router_pb2.GenerateRequest()
    again.CopyFrom(message)
    again.resume_ids.CopyFrom(common_pb2.TokenIds(ids=[*message.resume_ids.ids, *received]))
    return again


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Stats:
    target_steps: int
    drafted_nodes: int
    accepted_tokens: int
    mean_accepted_length: float
    resyncs: int
    first_token_ms: float
    total_ms: float
    drafters: tuple[str, ...]
    drafted_ahead: int
    draft_ms: float  # waiting for drafters
    verify_ms: float  # waiting for verification (queue, transport, target pass)
    request_kind: str  # what the router took the request to be about
    drafter_steps: dict[str, int]  # drafter -> steps it drafted for
    verifier_ms: float  # of verify_ms, the verifier's own work (prefill, passes); the rest is queue and transport


@dataclass(frozen=True)
class Generation:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    stats: Stats


@dataclass(frozen=True)
class StepTrace:
    """The target step that committed a chunk's tokens, as the router saw it."""

    budget: int  # tree nodes the speculation controller allowed
    tree_nodes: int  # nodes verified
    draft_ms: float  # waiting for the drafters
    pass_ms: float  # the verifier's pass
    step_ms: float  # the whole step
    batch_size: int  # requests verified in that pass


@dataclass(frozen=True)
class Chunk:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None  # set on the last chunk
    usage: Usage | None  # last chunk only
    stats: Stats | None  # last chunk only
    step: StepTrace | None = None  # None from a router that does not report steps


def _usage(message) -> Usage:
    return Usage(message.prompt_tokens, message.completion_tokens)


def _stats(message) -> Stats:
    return Stats(message.target_steps, message.drafted_nodes, message.accepted_tokens, message.mean_accepted_length,
                 message.resyncs, message.first_token_ms, message.total_ms, tuple(message.drafters),
                 message.drafted_ahead, message.draft_ms, message.verify_ms, message.request_kind,
                 dict(message.drafter_steps), message.verifier_ms)


def _generation(message: router_pb2.GenerateResponse) -> Generation:
    return Generation(message.request_id, message.text, list(message.token_ids), message.finish_reason,
                      _usage(message.usage), _stats(message.stats))


def _chunk(message: router_pb2.GenerateChunk) -> Chunk:
    final = bool(message.finish_reason)
    step = message.step if message.HasField("step") else None
    trace = StepTrace(step.budget, step.tree_nodes, step.draft_ms, step.pass_ms, step.step_ms,
                      step.batch_size) if step is not None else None
    return Chunk(message.request_id, list(message.token_ids), message.text, message.finish_reason or None,
                 _usage(message.usage) if final else None, _stats(message.stats) if final else None, trace)


def generate_request(
    prompt: str | None = None, *, chat: Sequence[tuple[str, str]] | None = None, prompt_ids: Sequence[int] | None = None,
    max_tokens: int = 0, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
    max_tree_nodes: int | None = None, request_id: str = "", speculation: str | None = None,
) -> router_pb2.GenerateRequest:
    """The request message; exactly one of ``prompt`` (raw text), ``chat`` ((role, content) pairs, rendered
    with the model's chat template) or ``prompt_ids``. ``max_tokens`` 0 takes the router's default;
    ``speculation`` ("adaptive", "fixed", "off"; None: the router's setting) how the router speculates."""
    if speculation is not None and speculation not in SPECULATION:
        raise ValueError(f"speculation must be one of {', '.join(SPECULATION)}, got {speculation!r}")
    given = [x is not None for x in (prompt, chat, prompt_ids)]
    if sum(given) != 1:
        raise ValueError("give exactly one of prompt, chat or prompt_ids")
    sampling = common_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=max_tokens)
    if seed is not None:
        sampling.seed = seed
    message = router_pb2.GenerateRequest(sampling=sampling, request_id=request_id)
    if prompt is not None:
        message.prompt = prompt
    elif chat is not None:
        message.chat.CopyFrom(router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role=r, content=c) for r, c in chat]))
    else:
        message.prompt_ids.CopyFrom(common_pb2.TokenIds(ids=list(prompt_ids)))
    if max_tree_nodes is not None:
        message.max_tree_nodes = max_tree_nodes
    if speculation is not None:
        message.speculation = SPECULATION[speculation]
    return message


def _count_request(prompt: str | None, chat: Sequence[tuple[str, str]] | None) -> router_pb2.CountTokensRequest:
    if (prompt is None) == (chat is None):
        raise ValueError("give exactly one of prompt or chat")
    if prompt is not None:
        return router_pb2.CountTokensRequest(prompt=prompt)
    return router_pb2.CountTokensRequest(
        chat=router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role=r, content=c) for r, c in chat])
    )


class _Routers:
    """A client's routers: one channel each, and the order in which a call tries them. With one router its
    channel retries UNAVAILABLE itself; with several, the client moves on to the next router instead."""

    def __init__(self, address: str | Sequence[str], retries: int, channel) -> None:
        self.addresses = _addresses(address)
        self.retries = retries
        options = _channel_options(retries if len(self.addresses) == 1 else 0)
        self.channels = [channel(a, options) for a in self.addresses]
        self.stubs = [router_pb2_grpc.RouterStub(c) for c in self.channels]
        self._turn = itertools.count()

    def order(self) -> Iterator[router_pb2_grpc.RouterStub]:
        """The stubs a call tries, starting at the next router in turn: ``retries`` more after the first
        (only the first with one router, whose channel retries)."""
        first = next(self._turn)
        tries = 1 if len(self.stubs) == 1 else self.retries + 1
        return (self.stubs[(first + i) % len(self.stubs)] for i in range(tries))

    def fail_over(self, exc: grpc.RpcError, attempt: int, deadline: float) -> bool:
        """Whether a call that failed so on its ``attempt``-th try (from 0) goes on at the next router: only
        while its deadline (``time.monotonic()``'s) leaves time after the back-off before that try."""
        return (len(self.stubs) > 1 and attempt < self.retries and exc.code() == grpc.StatusCode.UNAVAILABLE
                and time.monotonic() + _backoff_s(attempt + 1, len(self.stubs)) < deadline)


def _left_s(deadline: float) -> float:
    """A try's timeout: what is left of its call's deadline (every try of a call shares one)."""
    return max(deadline - time.monotonic(), 1e-3)


class Client:
    """Blocking client; thread-safe; at most ``max_in_flight`` calls at once (others wait)."""

    def __init__(self, address: str | Sequence[str], timeout_s: float = 300.0, retries: int = 4,
                 max_in_flight: int = 64, api_key: str | None = None, tls_ca: str | None = None) -> None:
        """``address``: a router's host:port, or several (comma-separated, or a list) to fail over between;
        ``api_key``: sent as ``authorization: Bearer <key>`` (default: ``$SPECMESH_API_KEY``, if set);
        ``tls_ca``: connect over TLS, trusting this CA (a PEM file; "" for the system's roots)."""
        self.timeout_s = timeout_s
        self._metadata = _auth_metadata(api_key)
        self._routers = _Routers(address, retries, lambda a, options: (
            grpc.secure_channel(a, _tls(tls_ca), options=options) if tls_ca is not None
            else grpc.insecure_channel(a, options=options)))
        self._slots = threading.BoundedSemaphore(max_in_flight)

    def _call(self, method: str, message, timeout_s: float | None = None):
        """A unary call, on the next router in turn, then the others while they are unavailable."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        for attempt, stub in enumerate(self._routers.order()):
            time.sleep(_backoff_s(attempt, len(self._routers.stubs)))
            try:
                return getattr(stub, method)(message, timeout=_left_s(deadline), metadata=self._metadata)
            except grpc.RpcError as exc:
                if not self._routers.fail_over(exc, attempt, deadline):
                    raise

    def generate(self, prompt: str | None = None, *, timeout_s: float | None = None, **kwargs) -> Generation:
        message = generate_request(prompt, **kwargs)
        with self._slots:
            return _generation(self._call("Generate", message, timeout_s))

    def stream(self, prompt: str | None = None, *, timeout_s: float | None = None, **kwargs) -> Iterator[Chunk]:
        message, received = generate_request(prompt, **kwargs), []
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        with self._slots:
            for attempt, stub in enumerate(self._routers.order()):
                time.sleep(_backoff_s(attempt, len(self._routers.stubs)))
                call = stub.GenerateStream(_resumed(message, received), timeout=_left_s(deadline),
                                           metadata=self._metadata)
                try:
                    for answer in call:
                        received += answer.token_ids
                        yield _chunk(answer)
                    return
                except grpc.RpcError as exc:
                    if not self._routers.fail_over(exc, attempt, deadline):
                        raise
                finally:
                    call.cancel()  # a no-op when the stream ended; frees the server's state when it did not

    def count_tokens(self, prompt: str | None = None, *, chat: Sequence[tuple[str, str]] | None = None) -> int:
        return self._call("CountTokens", _count_request(prompt, chat)).count

    def info(self) -> router_pb2.RouterInfo:
        """The next router's, in turn."""
        return self._call("Info", router_pb2.InfoRequest())

    def list_models(self) -> list[router_pb2.ModelCard]:
        return list(self._call("ListModels", router_pb2.ListModelsRequest()).models)

    def close(self) -> None:
        for channel in self._routers.channels:
            channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """asyncio client; at most ``max_in_flight`` calls at once on its channel (firing thousands of calls
    at once on one channel makes gRPC cancel some)."""

    def __init__(self, address: str | Sequence[str], timeout_s: float = 300.0, retries: int = 4,
                 max_in_flight: int = 64, api_key: str | None = None, tls_ca: str | None = None) -> None:
        """As ``Client``'s."""
        self.timeout_s = timeout_s
        self._metadata = _auth_metadata(api_key)
        self._routers = _Routers(address, retries, lambda a, options: (
            grpc.aio.secure_channel(a, _tls(tls_ca), options=options) if tls_ca is not None
            else grpc.aio.insecure_channel(a, options=options)))
        self._slots = asyncio.Semaphore(max_in_flight)

    async def _call(self, method: str, message, timeout_s: float | None = None):
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        for attempt, stub in enumerate(self._routers.order()):
            await asyncio.sleep(_backoff_s(attempt, len(self._routers.stubs)))
            try:
                return await getattr(stub, method)(message, timeout=_left_s(deadline), metadata=self._metadata)
            except grpc.RpcError as exc:
                if not self._routers.fail_over(exc, attempt, deadline):
                    raise

    async def generate(self, prompt: str | None = None, *, timeout_s: float | None = None, **kwargs) -> Generation:
        message = generate_request(prompt, **kwargs)
        async with self._slots:
            return _generation(await self._call("Generate", message, timeout_s))

    async def stream(self, prompt: str | None = None, *, timeout_s: float | None = None, **kwargs) -> AsyncIterator[Chunk]:
        message, received = generate_request(prompt, **kwargs), []
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        async with self._slots:
            for attempt, stub in enumerate(self._routers.order()):
                await asyncio.sleep(_backoff_s(attempt, len(self._routers.stubs)))
                call = stub.GenerateStream(_resumed(message, received), timeout=_left_s(deadline),
                                           metadata=self._metadata)
                try:
                    async for answer in call:
                        received += answer.token_ids
                        yield _chunk(answer)
                    return
                except grpc.RpcError as exc:
                    if not self._routers.fail_over(exc, attempt, deadline):
                        raise
                finally:
                    call.cancel()

    async def count_tokens(self, prompt: str | None = None, *, chat: Sequence[tuple[str, str]] | None = None) -> int:
        return (await self._call("CountTokens", _count_request(prompt, chat))).count

    async def info(self) -> router_pb2.RouterInfo:
        return await self._call("Info", router_pb2.InfoRequest())

    async def list_models(self) -> list[router_pb2.ModelCard]:
        return list((await self._call("ListModels", router_pb2.ListModelsRequest())).models)

    async def close(self) -> None:
        for channel in self._routers.channels:
            await channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
