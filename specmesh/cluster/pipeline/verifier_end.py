"""The verifier's end of the pipeline queue: registration and heartbeats, reading jobs (its own stream
first, then the pool's), reclaiming a dead verifier's jobs, posting results and then acknowledging.

The pipeline as a whole (keys, delivery guarantees) is described in ``specmesh.cluster.pipeline``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import redis
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from specmesh.cluster.backoff import REDIS_DOWN
from specmesh.cluster.pipeline.messages import (
    CLOSE, GROUP, JOB, PROGRESS, RESULT, QueuedJob, QueueKeys, QueueSigner, decode_job, encode_pass_curve,
    encode_progress,
)
from specmesh.runtime.calibration import PassCurve

log = logging.getLogger("specmesh.cluster.pipeline")

RESULTS_MAXLEN = 10_000  # a results stream nobody reads stops growing here
RESULTS_TTL_S = 600  # ... and disappears when its router is gone

@dataclass
class Entry:
    stream: str
    entry_id: bytes
    queued: QueuedJob | None  # None: a close message or an unreadable entry
    close_request: str | None = None
    received: float = 0.0
    forged: bool = False  # without a valid queue tag: dropped unread

    @property
    def order(self) -> tuple[int, int]:
        """When Redis took the entry: ids of one server's streams are (ms, sequence), in the order posted."""
        text = self.entry_id.decode() if isinstance(self.entry_id, bytes) else self.entry_id
        ms, _, sequence = text.partition("-")
        return int(ms), int(sequence or 0)
    reported: float = 0.0  # when a prefill under way for it last reported progress (0: not yet)


class VerifierQueue:
    """A verifier's end of the queue: registration and heartbeats, reading jobs (its own stream first,
    then the pool's), reclaiming jobs from dead verifiers, posting results then acknowledging."""

    def __init__(
        self, redis: aioredis.Redis, keys: QueueKeys, verifier_id: str,
        heartbeat_ttl_s: float = 3.0, signer: QueueSigner | None = None, pass_curve: PassCurve | None = None,
        results_redis: redis.Redis | None = None,
    ) -> None:
        """``signer``: run only jobs (and closes) with a valid tag, and tag the results; ``pass_curve``: the
        runtime's measured passes, told to the routers with each heartbeat; ``results_redis``: a blocking
        client of the same Redis, with which the thread that ran a pass posts its results at once."""
        self.redis = redis
        self.results_redis = results_redis
        self.keys = keys
        self.verifier_id = verifier_id
        self.signer = signer or QueueSigner()
        self.own = keys.own_jobs(verifier_id)
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.beat = encode_pass_curve(pass_curve) if pass_curve is not None else b"1"

    async def register(self) -> None:
        for stream in (self.keys.jobs, self.own):
            try:
                await self.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        await self.heartbeat()

    async def heartbeat(self, renew_only: bool = False) -> bool:
        """I am alive (and a member: Redis may have restarted empty since registering). ``renew_only``: only
        if the alive key is still there; False when it was not (it expired: the others may have taken over
        what this verifier held, and it must not come back to life holding it)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.sadd(self.keys.members, self.verifier_id)
        pipe.set(self.keys.alive(self.verifier_id), self.beat, px=int(self.heartbeat_ttl_s * 1000), xx=renew_only)
        return bool((await pipe.execute())[1])

    async def keep_beating(self, until: asyncio.Event, on_lapse: Callable[[], None] | None = None,
                           renew_only: bool = False) -> None:
        """The heartbeat, on its own task (a pass of any length is not a death), every third of the TTL until
        ``until`` is set, so that the others then reclaim what this verifier held. ``on_lapse``: called when
        a beat came later than the TTL (stopped, SIGSTOP, or starved): the others presumed it dead meanwhile;
        ``renew_only``: also when the alive key had expired, which is then left to the worker to set again
        (``heartbeat``) once it let go of what it held."""
        last = time.monotonic()
        while not until.is_set():
            now = time.monotonic()
            if now - last > self.heartbeat_ttl_s and on_lapse is not None:
                on_lapse()
            last = now
            try:
                if not await self.heartbeat(renew_only) and on_lapse is not None:
                    on_lapse()
            except REDIS_DOWN:
                pass  # the worker's loop reconnects; the key expires meanwhile
            except Exception:
                log.exception("heartbeat failed")
            try:
                await asyncio.wait_for(until.wait(), self.heartbeat_ttl_s / 3)
            except asyncio.TimeoutError:
                pass

    async def held_before(self) -> list[Entry]:
        """Entries this verifier had taken and not answered (before it restarted under the same id, or lost
        Redis for a moment): served again."""
        entries: list[Entry] = []
        for stream in (self.keys.jobs, self.own):
            after = "0"
            while True:  # its pending entries, a page at a time
                try:
                    answer = await self.redis.xreadgroup(GROUP, self.verifier_id, {stream: after}, count=256)
                except ResponseError:  # no group yet
                    break
                page = [item for _, items in answer or () for item in items]
                if not page:
                    break
                entries += self._entries(answer)
                after = page[-1][0]
        if entries:
            log.info("serving again %d queue entries this verifier had taken before", len(entries))
        return entries

    async def unregister(self) -> None:
        """Stop being routed to; whatever is left in the own stream is adopted by the others."""
        await self.redis.delete(self.keys.alive(self.verifier_id))

    async def read(self, count: int, block_ms: int, include_pool: bool) -> list[Entry]:
        streams = {self.own: ">"}
        if include_pool:
            streams[self.keys.jobs] = ">"
        try:
            answer = await self.redis.xreadgroup(GROUP, self.verifier_id, streams, count=count, block=block_ms)
        except ResponseError as exc:
            # NOGROUP: Redis restarted empty; UNBLOCKED: a stream was deleted under this blocked read (the
            # others adopt the own stream of a verifier whose heartbeat stopped: one draining, or one
            # stalled past its TTL). Serving, it re-registers; draining, it has nothing more to read.
            if "NOGROUP" not in str(exc) and "UNBLOCKED" not in str(exc):
                raise
            if include_pool:
                await self.register()
            return []
        return self._entries(answer)

    async def _autoclaim(self, stream: str, min_idle_ms: int) -> list:
        """XAUTOCLAIM's claimed entries (its answer: next id, entries, deleted ids)."""
        answer = await self.redis.xautoclaim(stream, GROUP, self.verifier_id, min_idle_time=min_idle_ms, count=64)
        return answer[1]

    async def _dead_consumers_entries(self) -> list[Entry]:
        """Pool jobs held by verifiers whose heartbeat stopped (a live one's are its to finish, however long)."""
        summary = await self.redis.xpending(self.keys.jobs, GROUP)
        entries: list[Entry] = []
        for consumer in summary.get("consumers") or ():
            name = consumer["name"].decode() if isinstance(consumer["name"], bytes) else consumer["name"]
            if name == self.verifier_id or await self.redis.exists(self.keys.alive(name)):
                continue
            held = await self.redis.xpending_range(self.keys.jobs, GROUP, "-", "+", 64, consumername=name)
            if held:  # a claim resets an entry's idle time: a second verifier claiming at once gets nothing
                claimed = await self.redis.xclaim(self.keys.jobs, GROUP, self.verifier_id,
                                                  int(self.heartbeat_ttl_s * 1000 / 3), [h["message_id"] for h in held])
                if claimed:
                    log.info("took over %d job(s) %s held (its heartbeat stopped)", len(claimed), name)
                entries += self._entries([(self.keys.jobs.encode(), claimed)])
        return entries

    async def reclaim(self) -> list[Entry]:
        """Jobs a dead verifier had taken from the pool, and the own streams of dead verifiers."""
        try:
            entries = await self._dead_consumers_entries()
        except ResponseError:  # no group yet (Redis restarted empty): nothing is held
            entries = []
        members = [m.decode() for m in await self.redis.smembers(self.keys.members)]
        for member in members:
            if member == self.verifier_id or await self.redis.exists(self.keys.alive(member)):
                continue
            stream = self.keys.own_jobs(member)
            try:
                claimed = await self._autoclaim(stream, min_idle_ms=0)
                fresh = await self.redis.xreadgroup(GROUP, self.verifier_id, {stream: ">"}, count=64)
            except ResponseError:  # its stream or group is gone
                claimed, fresh = [], []
            adopted = self._entries([(stream.encode(), claimed)]) + self._entries(fresh)
            if not adopted and not await self.redis.xlen(stream):
                await self.redis.delete(stream)
                await self.redis.srem(self.keys.members, member)
            entries += adopted
        return entries

    async def post(self, answered: Iterable[tuple[Entry, bytes | None]]) -> int:
        """Post each result to its router, then acknowledge and delete the job (in that order). Returns how
        many results could not be posted (a ``reply_to`` naming a key that is not a stream): those jobs are
        acknowledged all the same, so one bad entry cannot stop the verifier.

        The results go alone in a first round trip: Redis answers a router's blocked read only once it has
        run every command of the write that woke it, so the acknowledgements follow in a second one."""
        answered = list(answered)
        replies = [(entry.queued.reply_to, payload) for entry, payload in answered
                   if payload is not None and entry.queued is not None and entry.queued.reply_to]
        failed = []
        if replies:
            pipe = self.redis.pipeline(transaction=False)
            for reply_to, payload in replies:
                self._reply(pipe, reply_to, RESULT, payload, expire=False)  # the TTL goes with the acks
            failed = self._failures(await pipe.execute(raise_on_error=False))
        pipe = self.redis.pipeline(transaction=False)
        for reply_to in {reply_to for reply_to, _ in replies}:
            pipe.expire(reply_to, RESULTS_TTL_S)
        for entry, _ in answered:
            pipe.xack(entry.stream, GROUP, entry.entry_id)
            pipe.xdel(entry.stream, entry.entry_id)
        self._failures(await pipe.execute(raise_on_error=False))  # an expire on a key not a stream: as above
        if failed:
            log.warning("%d result(s) could not be posted (%s); their jobs are acknowledged", len(failed), failed[0])
        return len(failed)

    def post_results_now(self, replies: list[tuple[str, bytes]]) -> list[Exception] | None:
        """Post results with the blocking client, from the thread that computed them: a thread hop and an
        event loop's turn sooner than ``post`` (the jobs are acknowledged by ``post`` afterwards). Returns the
        results Redis refused; None where nothing was posted (no blocking client, or Redis unreachable:
        ``post`` tries again and sees it)."""
        if self.results_redis is None:
            return None
        pipe = self.results_redis.pipeline(transaction=False)
        for reply_to, payload in replies:
            self._reply(pipe, reply_to, RESULT, payload)
        try:
            return self._failures(pipe.execute(raise_on_error=False))
        except REDIS_DOWN:
            return None

    @staticmethod
    def _failures(outcomes: list) -> list[Exception]:
        """A pipeline's failed commands; Redis unreachable is raised (nothing after it was done)."""
        failed = [outcome for outcome in outcomes if isinstance(outcome, Exception)]
        for outcome in failed:
            if isinstance(outcome, REDIS_DOWN):
                raise outcome
        return failed

    async def report_progress(self, entries: Iterable[Entry]) -> None:
        """Tell the routers of these jobs that their prefill goes on; a ``reply_to`` that cannot take it is
        skipped (the job's own result will say the same)."""
        pipe = self.redis.pipeline(transaction=False)
        for entry in entries:
            self._reply(pipe, entry.queued.reply_to, PROGRESS, encode_progress(entry.queued.job, self.verifier_id))
        for outcome in await pipe.execute(raise_on_error=False):
            if isinstance(outcome, REDIS_DOWN):
                raise outcome

    def _reply(self, pipe, reply_to: str, kind: bytes, payload: bytes, expire: bool = True) -> None:
        """Queue an entry for a router's results stream (field named by its kind: result or progress), and
        with ``expire`` the stream's TTL."""
        pipe.xadd(reply_to, {kind.decode(): payload, "tag": self.signer.tag(kind, payload)},
                  maxlen=RESULTS_MAXLEN, approximate=True)
        if expire:
            pipe.expire(reply_to, RESULTS_TTL_S)

    def _entries(self, answer) -> list[Entry]:
        entries = []
        now = time.monotonic()
        for stream, items in answer or ():
            name = stream.decode() if isinstance(stream, bytes) else stream
            for entry_id, fields in items:
                if not fields:  # deleted while pending: acknowledged, nothing to run
                    entries.append(Entry(name, entry_id, None, None, now))
                    continue
                kind, body = (CLOSE, fields[b"close"]) if b"close" in fields else (JOB, fields.get(b"job", b""))
                if not self.signer.valid(kind, body, fields.get(b"tag")):  # not a router's: acknowledged, not run
                    log.warning("dropping entry %s on %s: no valid queue tag", entry_id, name)
                    entries.append(Entry(name, entry_id, None, None, now, forged=True))
                    continue
                if kind == CLOSE:
                    entries.append(Entry(name, entry_id, None, body.decode(errors="replace"), now))
                    continue
                try:
                    queued = decode_job(fields[b"job"])
                except Exception as exc:  # garbage in the stream must not stop the verifier
                    log.warning("dropping unreadable job %s on %s: %s", entry_id, name, exc)
                    queued = None
                entries.append(Entry(name, entry_id, queued, None, now))
        return entries
