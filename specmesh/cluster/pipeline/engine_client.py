"""A router's end of the pipeline: it admits a request once and reads its answer as deltas; the step loop
runs in the verifier that took it (``engine_worker.py``).

One listener reads the router's outputs stream (one message a verifier step, every request of this router
in it) and hands each delta to its request's receiver, which wakes the request at each delta or, for an
answer sent whole, at the last. A delta carries its answer position, so a delta seen
twice adds nothing. A request whose client left is aborted on the pool's aborts stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError

from specmesh.cancellation import raise_if_cancelled
from specmesh.cluster.backoff import REDIS_DOWN, queue_unreachable, redis_reconnect
from specmesh.cluster.pipeline.messages import ABORT, ADMISSION, GROUP, OUTPUTS, QueueKeys, QueueSigner
from specmesh.cluster.service_settings import RouterSettings
from specmesh.cluster.settings import default_of
from specmesh.cluster.wire import sampling_to_pb, stats_from_pb, trace_from_pb
from specmesh.errors import RequestFailed, Unavailable
from specmesh.speculation.requests import Request, SpeculationStats, StepTiming
from specmesh.v1 import common_pb2, verifier_pb2

log = logging.getLogger(__name__)

LISTEN_BLOCK_MS = 1000
TRIM_EVERY = 256  # entries read between trims of the outputs stream
BACKLOG_FRESH_S = 0.05  # a reading of the admissions backlog stands this long (plus what was admitted since)


@dataclass
class Delta:
    """Tokens a verifier step added to a request's answer."""

    tokens: list[int]
    finish_reason: str | None
    stats: SpeculationStats | None  # with the last one
    timing: StepTiming | None  # the step's, for the stream's timeline


class _Receiver:
    """A request's answer as the listener hands its deltas over, each token once (deltas carry their
    position), and the wake-up of whoever waits: at each delta, or (``final_only``: an answer sent whole) at
    the last, or at a gap (a step's message lost)."""

    __slots__ = ("tokens", "last", "gap", "arrived", "final_only", "on_tokens", "heard", "seen")

    def __init__(self, final_only: bool, on_tokens: Callable[[int], None] | None) -> None:
        self.tokens: list[int] = []  # new since the last take
        self.last: verifier_pb2.RequestDelta | None = None  # the latest delta: its end, stats and step timing
        self.gap = False
        self.arrived = asyncio.Event()
        self.final_only = final_only
        self.on_tokens = on_tokens  # told how many new tokens each delta brought, as it arrives
        self.heard = 0  # deltas handed over: a final-only wait that hears steps is not silent
        self.seen = 0  # answer tokens handed over

    def put(self, delta: verifier_pb2.RequestDelta) -> None:
        self.heard += 1
        if self.gap or (self.last is not None and self.last.finish_reason):
            return  # nothing after a gap or the end counts
        if delta.position > self.seen:
            self.gap = True
        elif delta.finish_reason != "failed":  # a failure's tokens are not the answer's
            new = delta.tokens[self.seen - delta.position:]
            if new:
                self.tokens += new
                self.seen += len(new)
                if self.on_tokens is not None:
                    self.on_tokens(len(new))
        self.last = delta
        if not self.final_only or delta.finish_reason or self.gap:
            self.arrived.set()

    def take(self) -> tuple[list[int], verifier_pb2.RequestDelta, bool]:
        """The tokens since the last take, the latest delta, and whether a step was lost."""
        tokens, self.tokens = self.tokens, []
        self.arrived.clear()
        return tokens, self.last, self.gap


class EngineClient:
    def __init__(self, redis: aioredis.Redis, keys: QueueKeys, router_id: str, timeout_s: float = default_of(RouterSettings, "job_timeout"),
                 signer: QueueSigner | None = None, on_forged=None, on_report=None) -> None:
        """``timeout_s``: a request that hears nothing this long, and whose admission is gone from the stream
        (a Redis that lost it), fails UNAVAILABLE; one still admitted waits on (a lone verifier restarting).
        ``on_report``: takes the routing reports that verifiers' messages carry (``policy_sync.py``)."""
        self.redis = redis
        self.keys = keys
        self.router_id = router_id
        self.outputs = keys.outputs(router_id)
        self.timeout_s = timeout_s
        self.signer = signer or QueueSigner()
        self.on_forged = on_forged
        self.on_report = on_report
        self._receivers: dict[str, _Receiver] = {}
        self._listener: asyncio.Task | None = None
        self._warned_xlen = False
        self._backlog = self._admitted_since = 0
        self._backlog_until = 0.0  # time.monotonic() until which the last reading stands
        self._reading_backlog: asyncio.Task | None = None

    async def start(self) -> None:
        self._listener = asyncio.create_task(self._listen())

    async def stop(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            await asyncio.gather(self._listener, return_exceptions=True)

    async def backlog(self) -> int:
        """Admissions no verifier has taken yet: Redis is asked at most every ``BACKLOG_FRESH_S`` (requests
        arriving together share one reading), plus those this router admitted since."""
        if time.monotonic() >= self._backlog_until:
            if self._reading_backlog is None or self._reading_backlog.done():
                self._reading_backlog = asyncio.create_task(self._read_backlog())
            await asyncio.shield(self._reading_backlog)  # its error reaches every request waiting for it
        return self._backlog + self._admitted_since

    async def _read_backlog(self) -> None:
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.xlen(self.keys.admissions)
            pipe.xinfo_groups(self.keys.admissions)
            length, groups = await pipe.execute(raise_on_error=False)
        except REDIS_DOWN as exc:
            raise queue_unreachable(exc) from None
        if isinstance(length, NoPermissionError):  # a router user made before XLEN was its right
            if not self._warned_xlen:
                log.warning("this router's Redis user may not XLEN the admissions: the backlog before any verifier "
                            "joined is not counted (make the ACL users again: specmesh redis-acl)")
                self._warned_xlen = True
            length = 0
        elif isinstance(length, Exception):
            raise length
        group = next((g for g in groups if g.get("name") in (GROUP, GROUP.encode())), None) \
            if not isinstance(groups, Exception) else None
        if group is None:  # no verifier ever joined: every admission waits
            backlog = length
        elif group.get("lag") is not None:
            backlog = int(group["lag"])
        else:  # Redis cannot tell the lag after deletions
            backlog = max(length - int(group.get("pending") or 0), 0)
        self._backlog, self._admitted_since = backlog, 0
        self._backlog_until = time.monotonic() + BACKLOG_FRESH_S

    async def generate(self, request: Request, budget: int, fixed_budget: bool, final_only: bool = False,
                       on_tokens: Callable[[int], None] | None = None) -> AsyncIterator[Delta]:
        """Admit the request and yield its answer's deltas until the last (``final_only``: the whole answer
        once, as vLLM's FINAL_ONLY outputs: the verifier logs its tokens by time and posts only the end, so
        neither Redis nor this router handles a message a step for it); leaving early aborts it. ``on_tokens``: told
        each delta's new tokens as they arrive (a clock of the request's latencies)."""
        rid = request.request_id
        receiver = _Receiver(final_only, on_tokens)
        self._receivers[rid] = receiver
        finished = False
        try:
            admission = verifier_pb2.Admission(
                request_id=rid, prompt=common_pb2.TokenIds(ids=request.prompt_ids),
                sampling=sampling_to_pb(request.params), max_tree_nodes=budget, fixed_budget=fixed_budget,
                kind=request.kind, reply_to=self.outputs, final_only=final_only)
            payload = admission.SerializeToString()
            try:
                entry_id = await self.redis.xadd(self.keys.admissions, {"admission": payload,
                                                                        "tag": self.signer.tag(ADMISSION, payload)})
            except REDIS_DOWN as exc:
                raise queue_unreachable(exc) from None
            self._admitted_since += 1
            raise_if_cancelled()  # redis-py may have swallowed it (specmesh.cancellation)
            while not finished:
                tokens, delta, gap = await self._next_deltas(receiver, entry_id)  # since the last turn, as one
                if gap:
                    raise Unavailable("a step of this request was lost on its way; retry")
                if delta.finish_reason == "failed":
                    if tokens:
                        yield Delta(tokens, None, None, None)
                    raise RequestFailed(delta.message or "the verifier could not serve this request")
                finished = bool(delta.finish_reason)
                yield Delta(tokens, delta.finish_reason or None,
                            stats_from_pb(delta.stats) if delta.HasField("stats") else None,
                            trace_from_pb(delta.step) if delta.HasField("step") else None)
        finally:
            self._receivers.pop(rid, None)
            if not finished:
                await asyncio.shield(self._abort(rid))

    async def _next_deltas(self, receiver: _Receiver,
                           entry_id: bytes) -> tuple[list[int], verifier_pb2.RequestDelta, bool]:
        """What arrived since the last call (``_Receiver.take``), waiting for it: a request that hears nothing
        for ``timeout_s`` is asked after (a router behind by a few steps takes them in one turn)."""
        while not receiver.arrived.is_set():
            heard = receiver.heard
            try:
                async with asyncio.timeout(self.timeout_s):  # no task a wait, unlike wait_for
                    await receiver.arrived.wait()
            except TimeoutError:
                if receiver.heard > heard:  # steps came (an answer sent whole): not silent
                    continue
                still = await self._still_admitted(entry_id)
                raise_if_cancelled()
                if not still:  # else waiting for a verifier, or its restart: not lost
                    raise Unavailable(f"no verifier answered this request for {self.timeout_s:.0f} s; retry later") from None
        return receiver.take()

    async def _still_admitted(self, entry_id: bytes) -> bool:
        """Whether the request's admission is still on the stream (queued, or held by a verifier that will
        finish it or whose requests another will adopt)."""
        try:
            return bool(await self.redis.xrange(self.keys.admissions, entry_id, entry_id))
        except REDIS_DOWN as exc:
            raise queue_unreachable(exc) from None

    async def _abort(self, request_id: str) -> None:
        payload = verifier_pb2.Abort(request_id=request_id).SerializeToString()
        try:
            await self.redis.xadd(self.keys.aborts, {"abort": payload, "tag": self.signer.tag(ABORT, payload)},
                                  maxlen=10_000, approximate=True)
        except REDIS_DOWN:
            log.warning("could not post the abort of %s: its verifier finishes it unheard", request_id)

    async def _listen(self) -> None:
        last_id, unread = "0-0", 0  # the stream is this router's alone, named afresh at each start
        backoff = redis_reconnect()
        while True:
            try:
                answer = await self.redis.xread({self.outputs: last_id}, count=256, block=LISTEN_BLOCK_MS)
                backoff.reset()
            except REDIS_DOWN:
                await asyncio.sleep(backoff.next())
                continue
            for _, entries in answer or ():
                for entry_id, fields in entries:
                    last_id = entry_id
                    unread += 1
                    self._deliver(fields.get(b"outputs"), fields.get(b"tag"))
            if unread >= TRIM_EVERY:
                try:
                    await self.redis.xtrim(self.outputs, minid=last_id)
                    unread = 0
                except REDIS_DOWN:
                    pass

    def _deliver(self, payload: bytes | None, tag: bytes | None) -> None:
        if payload is None or not self.signer.valid(OUTPUTS, payload, tag):
            if self.on_forged is not None:
                self.on_forged()
            return
        try:
            message = verifier_pb2.StepOutputs.FromString(payload)
        except Exception:
            log.warning("an unreadable outputs message on %s", self.outputs)
            return
        if self.on_report is not None and message.HasField("report"):
            self.on_report(message.report)
        for delta in message.deltas:
            receiver = self._receivers.get(delta.request_id)
            if receiver is not None:
                try:
                    receiver.put(delta)
                except Exception:  # a caller's on_tokens: the listener serves every other request on
                    log.exception("handing over a delta of %s failed", delta.request_id)

