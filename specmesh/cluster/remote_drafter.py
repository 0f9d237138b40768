"""A drafter on another node, behind the loop's ``AsyncDrafter`` interface.

The adapter holds each request's committed tokens, so a drafter that restarted (NOT_FOUND) gets its
session re-opened with the whole context, and one that is down (UNAVAILABLE, deadline exceeded) just
proposes nothing — the request goes on with the other drafters, or as plain decoding — until a
back-off has passed. A drafter's failure costs speculation, never a request.

The proposals asked for in one event-loop turn (a step's, one a request) go in one ``ProposeMany`` message,
each item answered alone: on the held proposal stream where the drafter's card offers it (v1.5,
``proposal_stream.py``), else as a call; a drafter that predates ProposeMany (UNIMPLEMENTED) is called
once a proposal instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Sequence

import grpc
import torch

from specmesh.cluster.backoff import unreachable_node
from specmesh.cluster.drafter_sessions import MAX_PROPOSE_ITEMS
from specmesh.cluster.proposal_stream import ProposalStream, rpc_failure
from specmesh.cluster.service_settings import DrafterClientSettings
from specmesh.cluster.settings import default_of
from specmesh.cluster.wire import features_to_pb, tree_from_pb
from specmesh.errors import InvalidArgument
from specmesh.runtime.features import MAX_PROMPT_FEATURES, Features
from specmesh.tree import TokenTree
from specmesh.v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger("specmesh.cluster.remote_drafter")

# drafter kinds that learn from every delivered answer (a suffix index over the deployment's responses):
# they see each request from its start, drafted for or not
LEARNS_FROM_EVERY_ANSWER = frozenset({"history"})
# a call that failed with these may still have run on the drafter (its session opened): it is closed too
MAY_HAVE_RUN = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})
# a ProposeMany call's items stop at this many bytes (a feature drafter's first blocks are big) or at
# MAX_PROPOSE_ITEMS; the rest go in further calls. Well under the services' 64 MB messages
MAX_CALL_BYTES = 16 << 20
STATUS_OF_CODE = {code.value[0]: code for code in grpc.StatusCode}

Answer = drafter_pb2.ProposeResponse | grpc.aio.AioRpcError  # an item's: its tree, or its failure


class RemoteDrafter:
    def __init__(self, address: str, timeout_s: float = default_of(DrafterClientSettings, "drafter_timeout"), max_backoff_s: float = 10.0,
                 credentials: grpc.ChannelCredentials | None = None, options: Sequence[tuple[str, str]] = ()) -> None:
        """``credentials``: call over TLS (the cluster's CA and the router's own certificate); ``options``:
        the channel's (``tls.channel_options``)."""
        self.address = address
        self.timeout_s = timeout_s
        self.max_backoff_s = max_backoff_s
        self.name = address
        self.kind = "unknown"
        self.domains: tuple[str, ...] = ()
        self.tokenizer_hash = ""
        self.feature_layers: tuple[int, ...] = ()  # a feature drafter's: the target's hidden states it reads
        self._channel = (grpc.aio.secure_channel(address, credentials, options=list(options))
                         if credentials is not None else grpc.aio.insecure_channel(address, options=list(options)))
        self._stub = drafter_pb2_grpc.DrafterStub(self._channel)
        self._context: dict[str, list[int]] = {}  # request -> every committed token
        self._unsent: dict[str, list[int]] = {}  # request -> committed since the drafter last heard
        self._open: set[str] = set()  # sessions the drafter may hold: each is closed when its request ends
        self._stale: set[str] = set()  # ... of which these are out of step with us: opened afresh before drafting
        self._closing: set[asyncio.Task] = set()  # sessions being closed (their requests ended)
        self._features: dict[str, list[Features]] = {}  # request -> blocks not yet sent (feature drafters)
        self._feature_end: dict[str, int] = {}  # request -> where the next block must start
        self._refused: set[str] = set()  # requests whose features the drafter refused: it sits them out
        self._batching = True  # False once the drafter answered UNIMPLEMENTED to ProposeMany (an older one)
        self._stream: ProposalStream | None = None  # where the card offers it (v1.5): ProposeMany on a held stream
        self._queued: list[tuple[drafter_pb2.ProposeRequest, asyncio.Future]] = []  # this turn's proposals
        self._calls: set[asyncio.Task] = set()  # ProposeMany calls in flight
        self._down_until = 0.0
        self._backoff = unreachable_node(max_backoff_s)
        self._expected_hash: str | None = None
        self._expected_hidden: int | None = None
        self._expected_layers: int | None = None
        self.opens_in_propose = False  # the drafter's card says whether a proposal may open its session (v1.4)
        self.failures = 0

    @property
    def active_requests(self) -> int:
        """Requests started on this drafter and not yet ended."""
        return len(self._context)

    @property
    def healthy(self) -> bool:
        return time.monotonic() >= self._down_until

    async def connect(self, tokenizer_hash: str | None = None, hidden_size: int | None = None,
                      num_layers: int | None = None) -> bool:
        """Read the drafter's card; refuse one built for another vocabulary, or a feature drafter that reads
        hidden states of another size or layers than the target has. False when unreachable."""
        self._expected_hash, self._expected_hidden, self._expected_layers = tokenizer_hash, hidden_size, num_layers
        try:
            info = await self._stub.Info(drafter_pb2.DrafterInfoRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            self._mark_down(exc)
            return False
        if tokenizer_hash and info.tokenizer_hash != tokenizer_hash:
            raise InvalidArgument("drafter", f"{self.address} ({info.name}) drafts with another vocabulary than the target's")
        if info.feature_layers and hidden_size and info.hidden_size != hidden_size:
            raise InvalidArgument("drafter", f"{self.address} ({info.name}) reads hidden states of size {info.hidden_size}; "
                                  f"the target's are {hidden_size}")
        if info.feature_layers and num_layers and not all(1 <= n <= num_layers for n in info.feature_layers):
            raise InvalidArgument("drafter", f"{self.address} ({info.name}) reads layers {list(info.feature_layers)}; "
                                  f"the target has {num_layers}")
        self.name, self.kind, self.domains, self.tokenizer_hash = info.name, info.kind, tuple(info.domains), info.tokenizer_hash
        self.feature_layers = tuple(info.feature_layers)
        self.opens_in_propose = info.opens_in_propose
        if info.proposes_in_stream and self._stream is None:
            self._stream = ProposalStream(self._stub, self.timeout_s)
        elif not info.proposes_in_stream and self._stream is not None:  # replaced by an older drafter
            await self._stream.close()
            self._stream = None
        self._up()
        return True

    async def close(self) -> None:
        await asyncio.gather(*self._closing, *self._calls, return_exceptions=True)
        if self._stream is not None:
            await self._stream.close()
        await self._channel.close()

    async def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        self._context[request_id] = list(prompt_ids)
        self._unsent[request_id] = []
        if self.healthy and not self.tokenizer_hash:  # unreachable at start-up: its card (name, domains) first
            try:
                if not await self.connect(self._expected_hash, self._expected_hidden, self._expected_layers):
                    return
            except InvalidArgument as exc:
                log.warning("%s", exc)
                self._down_until = time.monotonic() + self.max_backoff_s
                return
        # other drafters open the session with the first proposal: a request the policy never drafts
        # for (budget 0 all along, or routed elsewhere) costs them nothing, not even a call
        if self.healthy and self.kind in LEARNS_FROM_EVERY_ANSWER:
            await self._open_session(request_id)

    async def propose(self, request_id: str, budget: int, assumed: Sequence[int] = ()) -> TokenTree:
        if not self.healthy or request_id not in self._context or request_id in self._refused:
            return TokenTree()
        for _ in range(2):  # a second try after re-opening a session the drafter lost
            opens = request_id not in self._open or request_id in self._stale
            if opens and not self.opens_in_propose:  # an older drafter: a call to open it first
                if not await self._open_session(request_id):
                    return TokenTree()
                opens = False
            request = drafter_pb2.ProposeRequest(
                request_id=request_id, committed=self._context[request_id] if opens else self._unsent[request_id],
                budget=budget, assumed=assumed, opens=opens,
            )
            sent_tokens = len(self._unsent[request_id])
            if opens:
                self._open.add(request_id)  # counted open before the answer, as _open_session counts it
            blocks = list(self._features.get(request_id, ()))
            if blocks:
                request.features.CopyFrom(features_to_pb(_joined(blocks)))
            try:
                answer = await self._answer(request)
            except grpc.aio.AioRpcError as exc:  # counted against the drafter where the call ended
                if exc.code() == grpc.StatusCode.NOT_FOUND:  # the drafter lost it: open it again
                    self._open.discard(request_id)
                    continue
                # the call may have run there (a deadline passed while the drafter was busy): the session
                # is open, with what we sent or without it; the next proposal opens it afresh
                self._stale.add(request_id)
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT and blocks:
                    self._refused.add(request_id)  # features it cannot read: the request goes on without it
                return TokenTree()
            except asyncio.CancelledError:  # its item may have been drafted there all the same
                self._stale.add(request_id)
                raise
            # what was sent goes; what came meanwhile (a proposal left to arrive after its step) stays for the next
            if request_id in self._context:
                del self._unsent[request_id][:sent_tokens]
                del self._features.setdefault(request_id, [])[:len(blocks)]
                if opens:
                    self._stale.discard(request_id)
            self._up()
            try:
                return tree_from_pb(answer.tree).truncated(budget)
            except InvalidArgument:
                log.warning("drafter %s sent a malformed tree; ignoring it", self.name)
                return TokenTree()
        return TokenTree()

    async def _answer(self, request: drafter_pb2.ProposeRequest) -> drafter_pb2.ProposeResponse:
        """The drafter's answer to one proposal, sent with the others of this event-loop turn; raises its
        failure (``AioRpcError``)."""
        if not self._batching:
            answer = await self._propose_one(request)
        else:
            loop = asyncio.get_running_loop()
            if not self._queued:  # the first of this turn: the others join it until the loop comes round
                loop.call_soon(self._send_queued)
            future = loop.create_future()
            self._queued.append((request, future))
            answer = await future
        if isinstance(answer, grpc.aio.AioRpcError):
            raise answer
        return answer

    def _send_queued(self) -> None:
        queued = [(r, f) for r, f in self._queued if not f.cancelled()]  # a caller gone: its item is not sent
        self._queued = []
        for chunk in _chunks(queued):
            task = asyncio.ensure_future(self._propose_many(chunk))
            self._calls.add(task)
            task.add_done_callback(self._calls.discard)

    async def _propose_many(self, chunk: list[tuple[drafter_pb2.ProposeRequest, asyncio.Future]]) -> None:
        """One ProposeMany call for ``chunk``; each item's answer goes to its own caller."""
        answers: list[Answer] = []
        try:
            answers = await self._call_many([request for request, _ in chunk])
        finally:  # a cancelled caller's answer is dropped; the others get theirs (CANCELLED if this was)
            for i, (_, future) in enumerate(chunk):
                if not future.done():
                    future.set_result(answers[i] if i < len(answers)
                                      else rpc_failure(grpc.StatusCode.CANCELLED, "the drafter's adapter stopped"))

    async def _call_many(self, requests: list[drafter_pb2.ProposeRequest]) -> list[Answer]:
        message, stream = drafter_pb2.ProposeManyRequest(items=requests), self._stream
        try:
            if stream is not None:
                reply = await stream.propose_many(message)
            else:
                reply = await self._stub.ProposeMany(message, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            if stream is not None and await self._off_stream(stream, exc):
                return await self._call_many(requests)
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # an older drafter: one call a proposal, for good
                self._batching = False
                return list(await asyncio.gather(*(self._propose_one(r) for r in requests)))
            self._mark_down(exc)  # the whole call failed: one failure of the drafter's, every item's answer
            return [rpc_failure(exc.code(), exc.details()) for _ in requests]
        return self._item_answers(reply, len(requests))

    async def _off_stream(self, stream: ProposalStream, exc: grpc.aio.AioRpcError) -> bool:
        """Whether a message that failed on ``stream`` goes again as a call: the stream was dropped meanwhile, or
        is refused (UNIMPLEMENTED: a proxy or an older drafter at the address, whatever the card said): calls
        from now on."""
        if self._stream is stream and exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            self._stream = None
            await stream.close()
        return self._stream is not stream

    def _item_answers(self, reply: drafter_pb2.ProposeManyResponse, items: int) -> list[Answer]:
        if len(reply.results) != items:
            why = f"{len(reply.results)} answers to {items} proposals"
            self._mark_down(rpc_failure(grpc.StatusCode.INTERNAL, why))
            return [rpc_failure(grpc.StatusCode.INTERNAL, why) for _ in range(items)]
        answers: list[Answer] = []
        for result in reply.results:
            if result.code == grpc.StatusCode.OK.value[0]:
                answers.append(result.answer)
                continue
            exc = rpc_failure(STATUS_OF_CODE.get(result.code, grpc.StatusCode.UNKNOWN), result.message)
            if exc.code() != grpc.StatusCode.NOT_FOUND:  # as a Propose call failing so would count
                self._mark_down(exc)
            answers.append(exc)
        return answers

    async def _propose_one(self, request: drafter_pb2.ProposeRequest) -> Answer:
        try:
            return await self._stub.Propose(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                self._mark_down(exc)
            return exc

    async def commit(self, request_id: str, new_token_ids: Sequence[int]) -> None:
        if request_id in self._context:  # sent with the next proposal: one call a step
            self._context[request_id].extend(new_token_ids)
            self._unsent[request_id].extend(new_token_ids)

    async def add_features(self, request_id: str, features: Features) -> None:
        """Kept and sent with the next proposal. Bounded: past ``MAX_PROMPT_FEATURES`` unsent positions (a
        request the drafter was not asked to draft for in a while) the oldest go, and the session is opened
        afresh so that the drafter takes the rest as a new start."""
        if request_id not in self._context or not self.feature_layers:
            return
        blocks = self._features.setdefault(request_id, [])
        expected = self._feature_end.get(request_id)
        if expected is not None and features.start != expected:  # a block was lost on the way: start afresh
            blocks.clear()
            self._stale.add(request_id)
        blocks.append(features)
        self._feature_end[request_id] = features.end
        while sum(len(b) for b in blocks) > MAX_PROMPT_FEATURES and len(blocks) > 1:
            blocks.pop(0)
            self._stale.add(request_id)

    async def end(self, request_id: str) -> None:
        self._context.pop(request_id, None)
        self._features.pop(request_id, None)
        self._feature_end.pop(request_id, None)
        self._refused.discard(request_id)
        self._stale.discard(request_id)
        unsent = self._unsent.pop(request_id, [])
        if request_id not in self._open:
            return
        self._open.discard(request_id)
        # closed without holding up the request's end: the step that ended it goes on (a stalled drafter
        # would hold the whole batch's next pass for its call deadline)
        task = asyncio.create_task(self._close_session(request_id, unsent))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _close_session(self, request_id: str, committed: list[int]) -> None:
        try:
            await self._stub.CloseSession(drafter_pb2.CloseSessionRequest(request_id=request_id, committed=committed),
                                          timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            self._mark_down(exc)

    async def _open_session(self, request_id: str) -> bool:
        request = drafter_pb2.OpenSessionRequest(request_id=request_id, prompt_ids=self._context[request_id])
        # counted open before the answer: a request cancelled meanwhile may have opened it there, and its
        # end must close it (closing a session the drafter never opened is harmless)
        self._open.add(request_id)
        try:
            await self._stub.OpenSession(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in MAY_HAVE_RUN:
                self._open.discard(request_id)
            self._mark_down(exc)
            return False
        self._unsent[request_id] = []
        self._stale.discard(request_id)
        return True

    def _mark_down(self, exc: grpc.aio.AioRpcError) -> None:
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:  # our bug or a mismatched node: say it, don't back off
            log.warning("drafter %s refused a call: %s", self.name, exc.details())
            return
        self.failures += 1
        delay = self._backoff.next()
        if self.healthy:
            log.warning("drafter %s unavailable (%s); retrying in %.1f s", self.name, exc.code().name, delay)
        self._down_until = time.monotonic() + delay
        # a drafter that comes back may have forgotten its sessions (restarted) or not (it was only slow):
        # each is opened afresh before its next proposal, and closed at its end either way
        self._stale |= self._open

    def _up(self) -> None:
        self._backoff.reset()


def _chunks(queued: list) -> list[list]:
    """``queued`` (proposals and their futures) cut into ProposeMany calls of at most ``MAX_PROPOSE_ITEMS``
    items and ``MAX_CALL_BYTES`` bytes (an item bigger than that goes alone)."""
    chunks: list[list] = []
    size = 0
    for item in queued:
        item_size = item[0].ByteSize()
        if not chunks or len(chunks[-1]) >= MAX_PROPOSE_ITEMS or size + item_size > MAX_CALL_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(item)
        size += item_size
    return chunks


def _joined(blocks: list[Features]) -> Features:
    """Consecutive blocks as one."""
    if len(blocks) == 1:
        return blocks[0]
    return Features(blocks[0].start, torch.cat([b.values for b in blocks]), blocks[0].layers)
