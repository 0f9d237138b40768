"""The router's end of the pipeline queue: posting verification jobs, waiting for their results on the
router's own stream, posting a job again that Redis lost, and closing requests on their verifiers.

The pipeline as a whole (keys, delivery guarantees, the delivery protocol's states) is described in
``specmesh.cluster.pipeline`` and docs/design.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from specmesh.acceptance import Verdict
from specmesh.cancellation import raise_if_cancelled
from specmesh.cluster.backoff import REDIS_DOWN, redis_reconnect
from specmesh.cluster.pipeline.messages import (
    CLOSE, GROUP, JOB, PROGRESS, RESULT, QueueKeys, QueueSigner, decode_pass_curve, encode_job,
)
from specmesh.cluster.wire import features_from_pb
from specmesh.errors import InvalidArgument, ResourceExhausted, Unavailable
from specmesh.runtime.calibration import PassCurve
from specmesh.runtime.tree_verifier import VerifyJob, VerifyResult
from specmesh.v1 import verifier_pb2

log = logging.getLogger("specmesh.cluster.pipeline")

LISTEN_BLOCK_MS = 500  # a router's blocking read of its results: also how soon it notices a stop
# the results read are trimmed from the stream every TRIM_EVERY entries or TRIM_EVERY_S seconds, not after
# each read: a trim is a round trip sent before the next read
TRIM_EVERY, TRIM_EVERY_S = 64, 1.0
CLOSED_REMEMBERED = 4096  # recently closed requests a router remembers, to close what late results opened
CLOSE_RECALL_S = 10.0  # a close posted this long before Redis went away may be lost with it: posted again
OWED_CLOSE_S = 60.0  # a close Redis could not take is tried again this long (then the verifier's idle eviction frees it)


def queue_unreachable(exc: BaseException) -> Unavailable:
    """The client's error for a Redis call that failed; where Redis is and why goes to the log only."""
    log.warning("the pipeline queue (Redis) is unreachable: %s", exc)
    return Unavailable("the pipeline queue is unreachable; retry later")


@dataclass
class _Posted:
    """Where a job waits: its stream and entry, and until when its router waits for it."""

    stream: str
    entry_id: bytes
    deadline: float  # time.monotonic()


class QueueVerifierClient:
    """The loop's verifier client in the cluster: posts jobs to the pool (or to the verifier that holds
    the request's cache) and waits for results on this router's own stream.

    Every ``resend_after_s`` without an answer the job is looked up in its stream: still there, it waits
    (queued, or held by a verifier: the live one's pass ends, a dead one's jobs are reclaimed by the
    others); gone unanswered (Redis restarted empty), it is posted to the pool again. A job unanswered by
    ``job_timeout_s`` — Redis down, no verifier alive — fails with ``Unavailable``.
    """

    def __init__(
        self, redis: aioredis.Redis, keys: QueueKeys, router_id: str,
        job_timeout_s: float = 30.0, resend_after_s: float = 3.0, liveness_every_s: float = 0.5,
        signer: QueueSigner | None = None, on_forged: Callable[[], None] | None = None,
        on_resend: Callable[[], None] | None = None,
        on_pass_curve: Callable[[list[PassCurve]], None] | None = None,
    ) -> None:
        """``signer``: tag jobs and take only results with a valid tag; ``on_forged`` counts each dropped
        one, ``on_resend`` each job posted again; ``on_pass_curve`` hears the live verifiers' measured pass
        curves whenever they change."""
        self.redis = redis
        self.keys = keys
        self.router_id = router_id
        self.signer = signer or QueueSigner()
        self.on_forged = on_forged
        self.on_resend = on_resend
        self.forged_results = 0
        self.resent_jobs = 0
        self.reply_to = keys.results(router_id)
        self.job_timeout_s = job_timeout_s
        self.resend_after_s = resend_after_s
        self.liveness_every_s = liveness_every_s
        self.affinity: dict[str, str] = {}  # request -> the verifier that holds its cache
        self.alive: set[str] = set()
        self.on_pass_curve = on_pass_curve
        self.pass_curves: dict[str, PassCurve] = {}  # live verifier -> its pass curve
        self.looked = asyncio.Event()  # ``alive`` has been read from Redis at least once
        self.redis_ok = True
        self._waiting: dict[tuple[str, int], asyncio.Future] = {}
        self._progressed: dict[tuple[str, int], float] = {}  # job -> when its verifier last reported progress
        # requests closed here: a late result opened a session on its verifier, which is closed at once
        self._closed: OrderedDict[str, None] = OrderedDict()
        self._closing: set[asyncio.Task] = set()
        # closes not delivered (Redis down, or restarted before the verifier registered again): request ->
        # (verifier, since); sent again while that verifier is alive
        self._owed: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._posted_closes: OrderedDict[str, tuple[str, float]] = OrderedDict()  # request -> (verifier, when)
        # requests whose pool job was posted again, or let go unanswered: a verifier this router never heard
        # from may hold a session for a copy of it (its answer lost with a restarted Redis)
        self._strays: OrderedDict[str, None] = OrderedDict()
        # ... closed on every live verifier but the request's holder, for a while: request -> (since, closed on)
        self._everywhere: OrderedDict[str, tuple[float, set[str]]] = OrderedDict()
        self._tasks: list[asyncio.Task] = []
        self._stopping = asyncio.Event()

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._listen()), asyncio.create_task(self._watch_verifiers())]

    async def stop(self) -> None:
        # the loops notice within one blocking read; cancelling redis-py in the middle of a blocking
        # XREAD can leave the task stuck in its connection clean-up, so cancelling is the fallback only
        self._stopping.set()
        _, late = await asyncio.wait(self._tasks, timeout=LISTEN_BLOCK_MS / 1000 + 2.0)
        for task in late:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*self._closing, return_exceptions=True)
        try:
            await self.redis.delete(self.reply_to)
        except REDIS_DOWN:
            pass

    async def backlog(self) -> int:
        """Entries in the pool stream: jobs waiting for a verifier, or held by one (answered ones are deleted)."""
        try:
            return await self.redis.xlen(self.keys.jobs)
        except REDIS_DOWN as exc:
            raise queue_unreachable(exc) from None

    async def verify(self, job: VerifyJob) -> VerifyResult:
        key = (job.request_id, job.step)
        future = asyncio.get_running_loop().create_future()
        self._waiting[key] = future
        posted = None
        try:
            posted = await self._post_job(job, time.monotonic() + self.job_timeout_s)
            message = await self._answer(job, future, posted)
        finally:
            self._waiting.pop(key, None)
            self._progressed.pop(key, None)
            # posted to the pool (or not known to be posted) and unanswered: a copy may open a session somewhere
            if (posted is None or posted.stream == self.keys.jobs) and not future.done():
                self._remember(self._strays, job.request_id, None)
        return await self._take(job, message)

    async def _post_job(self, job: VerifyJob, deadline: float) -> _Posted:
        """Post the job to the verifier that holds the request's cache, else (none, or its stream is gone:
        it died, another adopted it) to the pool."""
        verifier = self.affinity.get(job.request_id)
        stream = self.keys.own_jobs(verifier) if verifier in self.alive else self.keys.jobs
        payload = encode_job(job, self.reply_to, int((time.time() + deadline - time.monotonic()) * 1000))
        entry_id = await self._post(stream, payload, deadline)
        raise_if_cancelled()
        if entry_id is None:
            stream = self.keys.jobs
            entry_id = await self._post(stream, payload, deadline)
        if stream == self.keys.jobs:  # wherever it lands holds the request now; a close to every other
            self._everywhere.pop(job.request_id, None)  # verifier would race it
        return _Posted(stream, entry_id, deadline)

    async def _answer(self, job: VerifyJob, future: asyncio.Future, posted: _Posted) -> verifier_pb2.VerifyResult:
        """Wait for the job's result. Every ``resend_after_s`` without one: a job still in its stream (queued,
        or held by a verifier) is waited for; one gone unanswered (Redis lost it) is posted to the pool again;
        past the deadline (moved on by a prefill's progress reports) the step fails ``Unavailable``."""
        key = (job.request_id, job.step)
        while True:
            raise_if_cancelled()  # Redis calls below may swallow a cancellation (specmesh.cancellation)
            left = posted.deadline - time.monotonic()
            await asyncio.wait((future,), timeout=min(self.resend_after_s, max(left, 0.0)))
            if future.done():
                return future.result()
            if time.monotonic() >= posted.deadline and key in self._progressed:  # a long prefill going on
                posted.deadline = max(posted.deadline, self._progressed[key] + self.job_timeout_s)
            if time.monotonic() >= posted.deadline:
                where = await self._whereabouts(posted.stream, posted.entry_id)
                log.warning("request %s step %d: no answer within %.0f s; the job: %s", job.request_id, job.step,
                            self.job_timeout_s, where)
                raise Unavailable(f"no verifier answered step {job.step} within {self.job_timeout_s:.0f} s "
                                  f"({len(self.alive)} verifiers alive); retry later")
            if await self._still_queued(posted.stream, posted.entry_id) or future.done():
                continue
            # answered and deleted a moment ago: its result may still be on its way
            await asyncio.wait((future,), timeout=LISTEN_BLOCK_MS / 1000 + 0.5)
            if future.done():
                continue
            log.info("request %s step %d: the job left the queue unanswered; posting it again", job.request_id, job.step)
            self.resent_jobs += 1
            if self.on_resend is not None:
                self.on_resend()
            self._remember(self._strays, job.request_id, None)
            # with the deadline as it stands now (progress may have moved it)
            payload = encode_job(job, self.reply_to, int((time.time() + posted.deadline - time.monotonic()) * 1000))
            posted.stream = self.keys.jobs
            posted.entry_id = await self._post(posted.stream, payload, posted.deadline)

    async def _take(self, job: VerifyJob, message: verifier_pb2.VerifyResult) -> VerifyResult:
        """The step's result from its answer; the verifier that answered holds the request's cache now."""
        if job.request_id in self._strays:  # its holder is known now; the others close what a copy opened
            self._strays.pop(job.request_id)
            self._remember(self._everywhere, job.request_id, (time.monotonic(), set()))
        if message.status == verifier_pb2.VerifyResult.EXHAUSTED:
            raise ResourceExhausted(f"a verifier refused step {job.step}: {message.message}")
        if message.status == verifier_pb2.VerifyResult.ERROR:
            log.warning("verifier %s cannot verify step %d of %s: %s", message.verifier_id, job.step, job.request_id,
                        message.message)
            raise Unavailable(f"a verifier cannot verify step {job.step}: {message.message}")
        if message.status == verifier_pb2.VerifyResult.RESYNC:  # the history goes where the cache may still be
            return VerifyResult(job.request_id, job.step, None)
        if message.status == verifier_pb2.VerifyResult.FAILED:
            return VerifyResult(job.request_id, job.step, None, failed=message.message)
        previous = self.affinity.get(job.request_id)
        if previous is not None and previous != message.verifier_id:
            await self._close_on(previous, job.request_id)  # its copy of the cache is stale now
        self.affinity[job.request_id] = message.verifier_id
        verdict = Verdict(tuple(message.accepted_nodes), tuple(message.tokens))
        features = None
        if job.feature_layers and message.HasField("features"):
            try:
                features = features_from_pb(message.features)
            except InvalidArgument as exc:  # the feature drafters go without this block; the request does not
                log.warning("request %s step %d: verifier %s sent malformed features (%s); dropped",
                            job.request_id, job.step, message.verifier_id, exc)
        return VerifyResult(job.request_id, job.step, verdict, message.prefilled_tokens, message.pass_ms,
                            message.batch_rows, message.batch_size, message.batch_trees, message.verify_ms,
                            queue_ms=message.queue_ms, features=features)

    async def close(self, request_id: str) -> None:
        """Free the request's cache on its verifier now (idle sessions are also evicted there); a result
        still on its way (the request was abandoned mid-step) closes the session it opened when it comes."""
        self._remember(self._closed, request_id, None)
        verifier = self.affinity.pop(request_id, None)
        if verifier is not None:
            await self._close_on(verifier, request_id)
        if request_id in self._strays:
            del self._strays[request_id]
            self._remember(self._everywhere, request_id, (time.monotonic(), {verifier} - {None}))
            await self._close_everywhere(request_id)

    @staticmethod
    def _remember(memory: OrderedDict, request_id: str, value) -> None:
        memory[request_id] = value
        while len(memory) > CLOSED_REMEMBERED:
            memory.popitem(last=False)

    async def _still_queued(self, stream: str, entry_id: bytes) -> bool:
        """Whether the job is still in its stream (waiting, or held by a verifier); unknown (Redis
        unreachable) counts as yes: the next look decides."""
        try:
            return bool(await self.redis.xrange(stream, entry_id, entry_id))
        except REDIS_DOWN:
            return True

    async def _whereabouts(self, stream: str, entry_id: bytes) -> str:
        """Where an unanswered job is, for the error and the log."""
        try:
            held = await asyncio.wait_for(self.redis.xpending_range(stream, GROUP, entry_id, entry_id, 1), 1.0)
            if held:
                consumer = held[0]["consumer"]
                return (f"held by {consumer.decode() if isinstance(consumer, bytes) else consumer} for "
                        f"{held[0]['time_since_delivered'] / 1e3:.1f} s, delivered {held[0]['times_delivered']} time(s)")
            if await asyncio.wait_for(self.redis.xrange(stream, entry_id, entry_id), 1.0):
                return f"waiting in {stream}, taken by no verifier"
            return "taken and acknowledged, its result not received"
        except ResponseError:
            return f"waiting in {stream}, which no verifier reads (no consumer group)"
        except (asyncio.TimeoutError, *REDIS_DOWN):
            return "unknown (Redis unreachable)"

    async def _post_close(self, verifier: str, request_id: str) -> bool:
        closing = request_id.encode()
        try:  # NOMKSTREAM: a dead verifier's removed stream is not created again
            return await self.redis.xadd(self.keys.own_jobs(verifier),
                                         {"close": closing, "tag": self.signer.tag(CLOSE, closing)},
                                         nomkstream=True) is not None
        except REDIS_DOWN:
            return False

    async def _close_on(self, verifier: str, request_id: str) -> None:
        if await self._post_close(verifier, request_id):
            self._owed.pop(request_id, None)
            self._remember(self._posted_closes, request_id, (verifier, time.monotonic()))
        elif request_id not in self._owed:
            self._remember(self._owed, request_id, (verifier, time.monotonic()))

    async def _pay_owed_closes(self) -> None:
        """Closes Redis could not take, sent again to the verifiers alive now (a dead one's cache went with
        it); and those of requests a stray copy may have opened a session for, sent to each live verifier
        but the request's holder."""
        now = time.monotonic()
        for request_id, (verifier, since) in list(self._owed.items()):
            if now - since > OWED_CLOSE_S:
                self._owed.pop(request_id, None)
            elif verifier in self.alive:
                await self._close_on(verifier, request_id)
        for request_id, (since, _) in list(self._everywhere.items()):
            if now - since > OWED_CLOSE_S:
                self._everywhere.pop(request_id, None)
            else:
                await self._close_everywhere(request_id)

    async def _close_everywhere(self, request_id: str) -> None:
        """Close the request on each live verifier but its holder, once each (one not alive now, once it is)."""
        remembered = self._everywhere.get(request_id)
        if remembered is None:
            return
        closed_on = remembered[1]
        for verifier in self.alive - closed_on - {self.affinity.get(request_id)}:
            if await self._post_close(verifier, request_id):
                closed_on.add(verifier)

    async def _post(self, stream: str, payload: bytes, deadline: float) -> bytes | None:
        """Post a job; returns its entry id (None: a verifier's own stream that no longer exists; only the
        pool's stream is created here, so that no job lands where no verifier reads)."""
        backoff = redis_reconnect()
        while True:
            try:
                return await self.redis.xadd(stream, {"job": payload, "tag": self.signer.tag(JOB, payload)},
                                             nomkstream=stream != self.keys.jobs)
            except REDIS_DOWN as exc:
                self.redis_ok = False
                if time.monotonic() + backoff.delay_s >= deadline:
                    raise queue_unreachable(exc) from None
                await asyncio.sleep(backoff.next())

    async def _listen(self) -> None:
        last_id = "0-0"
        unread, trim_at = 0, 0.0  # results read since the stream was last trimmed; when it is next due
        backoff = redis_reconnect()
        while not self._stopping.is_set():
            try:
                answer = await self.redis.xread({self.reply_to: last_id}, count=256, block=LISTEN_BLOCK_MS)
                self.redis_ok = True
                backoff.reset()
            except REDIS_DOWN:
                self.redis_ok = False
                await asyncio.sleep(backoff.next())
                continue
            for _, entries in answer or ():
                for entry_id, fields in entries:
                    last_id = entry_id
                    if b"progress" in fields:
                        self._progress(fields[b"progress"], fields.get(b"tag"))
                    else:
                        self._deliver(fields.get(b"result"), fields.get(b"tag"))
                    unread += 1
            if answer:
                await asyncio.sleep(0)  # the requests whose results came go on before the next read is sent
            if unread >= TRIM_EVERY or (unread and time.monotonic() >= trim_at):
                try:  # what was read is no longer needed: the stream stays as short as the backlog
                    await self.redis.xtrim(self.reply_to, minid=last_id)
                    unread, trim_at = 0, time.monotonic() + TRIM_EVERY_S
                except REDIS_DOWN:
                    pass

    def _read_result(self, kind: bytes, payload: bytes | None, tag: bytes | None):
        """The VerifyResult in an entry of the results stream, or None (empty, forged or unreadable)."""
        if not payload:
            return None
        if not self.signer.valid(kind, payload, tag):  # not a verifier's: never reaches a client
            self.forged_results += 1
            if self.on_forged is not None:
                self.on_forged()
            log.warning("dropping a %s without a valid queue tag (%d so far)", kind.decode(), self.forged_results)
            return None
        try:
            return verifier_pb2.VerifyResult.FromString(payload)
        except Exception:
            log.warning("dropping an unreadable %s", kind.decode())
            return None

    def _progress(self, payload: bytes | None, tag: bytes | None) -> None:
        """A verifier is still prefilling a job: its timeout starts again; a request closed here meanwhile
        gets its prefill stopped."""
        message = self._read_result(PROGRESS, payload, tag)
        if message is None:
            return
        key = (message.request_id, message.step)
        if key in self._waiting:
            self._progressed[key] = time.monotonic()
        elif message.request_id in self._closed:
            self._close_soon(message.verifier_id, message.request_id)

    def _deliver(self, payload: bytes | None, tag: bytes | None) -> None:
        message = self._read_result(RESULT, payload, tag)
        if message is None:
            return
        future = self._waiting.get((message.request_id, message.step))
        if future is not None and not future.done():  # duplicates and late answers are ignored
            future.set_result(message)
            return
        if message.status != verifier_pb2.VerifyResult.OK:
            return
        # a late or second answer opened a session no one will use: the request was closed, or another
        # verifier's answer was taken
        taken = (future.result().verifier_id if future is not None and not future.cancelled()
                 else self.affinity.get(message.request_id))
        if message.request_id in self._closed or (taken is not None and taken != message.verifier_id):
            self._close_soon(message.verifier_id, message.request_id)

    def _close_soon(self, verifier: str, request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._close_on(verifier, request_id))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _recall_closes(self, down_since: float) -> None:
        """Redis was away (restarted empty, perhaps): the closes of ended requests posted shortly before may
        never have been read. They are owed again (a second close of a request is a no-op)."""
        for request_id, (verifier, when) in self._posted_closes.items():
            if when >= down_since - CLOSE_RECALL_S and request_id in self._closed and request_id not in self._owed:
                self._remember(self._owed, request_id, (verifier, time.monotonic()))
        self._posted_closes.clear()
        for _, closed_on in self._everywhere.values():
            closed_on.clear()

    async def _watch_verifiers(self) -> None:
        # a restart quicker than a round is seen by the server's run id, not as an error
        down_since, seen_at, run_id, readable = None, time.monotonic(), None, True
        while not self._stopping.is_set():
            try:
                if readable:
                    try:
                        server = (await self.redis.info("server")).get("run_id")
                    except ResponseError as exc:  # a user made before INFO was the router's, or INFO renamed
                        log.warning("Redis refuses INFO (%s): a restart between two looks goes unseen "
                                    "(`specmesh redis-acl` gives the router INFO)", exc)
                        readable, server = False, None
                    if run_id is not None and server != run_id and down_since is None:
                        down_since = seen_at
                    run_id = server
                seen_at = time.monotonic()
                members = [m.decode() for m in await self.redis.smembers(self.keys.members)]
                beats = await asyncio.gather(*(self.redis.get(self.keys.alive(m)) for m in members))
                self.alive = {m for m, beat in zip(members, beats) if beat is not None}
                self._learn_curves({m: decode_pass_curve(b) for m, b in zip(members, beats) if b is not None})
                self.redis_ok = True
                self.looked.set()
                if down_since is not None:
                    self._recall_closes(down_since)
                    down_since = None
                await self._pay_owed_closes()
            except REDIS_DOWN:
                self.redis_ok = False
                self.alive = set()
                down_since = down_since or time.monotonic()
            try:
                await asyncio.wait_for(self._stopping.wait(), self.liveness_every_s)
            except asyncio.TimeoutError:
                pass

    def _learn_curves(self, curves: dict[str, PassCurve | None]) -> None:
        curves = {m: c for m, c in curves.items() if c is not None}
        if curves != self.pass_curves:
            self.pass_curves = curves
            if self.on_pass_curve is not None and curves:
                self.on_pass_curve([curves[m] for m in sorted(curves)])
