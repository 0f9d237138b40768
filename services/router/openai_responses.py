"""The OpenAI API's answers: a request's steps as pieces of text (stop strings applied), sent whole or as
server-sent events of OpenAI's chunk objects; a client that leaves (a closed stream or connection) frees its
request exactly as a cancelled gRPC call does."""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import aclosing
from typing import AsyncIterator, Callable

from fastapi import Request
from sse_starlette import EventSourceResponse

from specmesh.cluster.auth import Permit
from specmesh.cluster.gateway import Gateway, RequestState, TextStream, Ticket
from specmesh.cluster.stops import StopScanner, tokens_through
from specmesh.services.router.openai_errors import ClientGone, error_event
from specmesh.services.router.openai_requests import OpenAIFrontend
from specmesh.services.router.openai_schema import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChoiceDelta,
    Completion,
    CompletionChoice,
    CompletionUsage,
    SamplingFields,
    SpeculationUsage,
)


def usage_due(body: SamplingFields, piece: Piece) -> bool:
    """A stream's usage chunk follows its last piece when the client asked for one."""
    return piece.finish_reason is not None and bool(body.stream_options and body.stream_options.include_usage)


def speculation_usage(generation: RequestState) -> SpeculationUsage:
    s = generation.stats
    return SpeculationUsage(target_steps=s.target_steps, drafted_tokens=s.drafted_nodes,
                            accepted_tokens=s.accepted_tokens, mean_accepted_length=round(s.mean_accepted_length, 4),
                            drafters=generation.drafters, request_kind=s.request_kind,
                            first_token_ms=round(s.first_token_s * 1e3, 3), total_ms=round(s.total_s * 1e3, 3))


class Piece:
    """What one step adds to an answer: its text (stop strings applied), and at the end why it ended and
    how many tokens it counts."""

    def __init__(self, text: str, generation: RequestState, finish_reason: str | None = None, tokens: int = 0) -> None:
        self.text, self.generation, self.finish_reason, self.tokens = text, generation, finish_reason, tokens

    def usage(self) -> CompletionUsage:
        prompt = self.generation.prompt_tokens
        return CompletionUsage(prompt_tokens=prompt, completion_tokens=self.tokens, total_tokens=prompt + self.tokens)


async def pieces(gateway: Gateway, ticket: Ticket, stops: tuple[str, ...], whole: bool = False) -> AsyncIterator[Piece]:
    """The answer step by step (``whole``: in one piece, posted once by its verifier: an answer that is not
    streamed and has no stop string to watch for); the last piece has ``finish_reason``. Closing this ends
    the request."""
    text, scanner = TextStream(gateway.decode), StopScanner(stops)
    async with aclosing(gateway.generate(ticket, final_only=whole)) as steps:
        async for generation, step in steps:
            final = step.finish_reason is not None
            out = scanner.push(text.push(step.token_ids, final))
            if scanner.stopped:  # ends the request here: closing the steps frees its sessions and cache
                generation.finish_reason = "stop"
                yield Piece(out, generation, "stop", tokens_through(gateway.decode, generation.token_ids, scanner.stop_end))
                return
            if final:
                yield Piece(out + scanner.flush(), generation, step.finish_reason, len(generation.token_ids))
                return
            if out:
                yield Piece(out, generation)


class ChatFormat:
    """One chat completion's answer as OpenAI's objects: ``chat.completion`` whole, ``chat.completion.chunk``
    a piece."""

    def __init__(self, frontend: OpenAIFrontend, body: SamplingFields) -> None:
        self.frontend, self.body = frontend, body
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def _chunk(self, choices: list[ChatChunkChoice], piece: Piece | None = None,
               usage: CompletionUsage | None = None) -> str:
        final = piece is not None and piece.finish_reason is not None
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.frontend.name, choices=choices,
                                   usage=usage, system_fingerprint=self.frontend.fingerprint,
                                   specmesh=speculation_usage(piece.generation) if final else None).model_dump_json()

    def events(self, piece: Piece, first: bool) -> list[str]:
        delta = ChoiceDelta(role="assistant", content=piece.text) if first else ChoiceDelta(content=piece.text)
        out = [self._chunk([ChatChunkChoice(index=0, delta=delta, finish_reason=piece.finish_reason)], piece)]
        if usage_due(self.body, piece):
            out.append(self._chunk([], usage=piece.usage()))
        return out

    def whole(self, text: str, last: Piece) -> ChatCompletion:
        return ChatCompletion(id=self.id, created=self.created, model=self.frontend.name, usage=last.usage(),
                              choices=[ChatChoice(index=0, message=AssistantMessage(content=text),
                                                  finish_reason=last.finish_reason)],
                              system_fingerprint=self.frontend.fingerprint, specmesh=speculation_usage(last.generation))


class TextFormat:
    """One text completion's answer as OpenAI's ``text_completion`` objects, whole or a piece each."""

    def __init__(self, frontend: OpenAIFrontend, body: SamplingFields) -> None:
        self.frontend, self.body = frontend, body
        self.id, self.created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def _completion(self, choices: list[CompletionChoice], piece: Piece | None = None,
                    usage: CompletionUsage | None = None) -> Completion:
        final = piece is not None and piece.finish_reason is not None
        return Completion(id=self.id, created=self.created, model=self.frontend.name, choices=choices, usage=usage,
                          system_fingerprint=self.frontend.fingerprint,
                          specmesh=speculation_usage(piece.generation) if final else None)

    def events(self, piece: Piece, first: bool) -> list[str]:
        out = [self._completion([CompletionChoice(index=0, text=piece.text, finish_reason=piece.finish_reason)],
                                piece).model_dump_json()]
        if usage_due(self.body, piece):
            out.append(self._completion([], usage=piece.usage()).model_dump_json())
        return out

    def whole(self, text: str, last: Piece) -> Completion:
        return self._completion([CompletionChoice(index=0, text=text, finish_reason=last.finish_reason)], last,
                                last.usage())


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
        first = await unless_gone(request, asyncio.ensure_future(queue.get()))
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
                        yield error_event(item)
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
    return await unless_gone(request, work)


async def unless_gone(request: Request, work: asyncio.Future):
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
