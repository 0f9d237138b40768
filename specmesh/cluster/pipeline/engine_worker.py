"""A verifier's engine loop: the step loop of every request this verifier holds runs here, beside the
target, and the router is the front door.

Two listeners wait in Redis for what comes: new requests from the pool's admissions stream while there is
room (the consumer group hands each to one verifier), and the pool's aborts. Each turn takes what they
brought, runs one ``EngineCore`` step for every request held (its pass on the torch thread), then posts one
``StepOutputs`` message per router with requests in the step (a request whose router sends its answer whole
is posted at its end only) and acknowledges the admissions of finished requests — one round trip a step
however many requests moved, and no read.

Nothing is lost when a verifier dies: a request's admission stays pending under the verifier that took it
until the request ends, and each step's outputs are also logged on the verifier's commit log, in the same
transaction. A verifier that sees another's heartbeat stop (or restarts under its own id) claims its pending
admissions and rebuilds each request from its prompt and logged tokens; routers drop what they already have.

Keys (all of them: ``pipeline/__init__.py``): ``specmesh:P:admissions`` (consumer group
``verifiers``), ``specmesh:P:aborts`` (read by every verifier), ``specmesh:outputs:<router>``,
``specmesh:P:log:<verifier>`` (the commit log, trimmed to what the requests held need), ``specmesh:P:routing``
(the routers' routing snapshot, read about once a second).

Routing and fusion follow the routers' policy (``policy_sync.py``): the per-level hit counts its steps
observe ride to the routers on one of a step's outputs messages, about every half second; the snapshot the
routers publish from them is applied here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from redis.exceptions import ResponseError

from specmesh.cancellation import cancel_all
from specmesh.cluster.backoff import REDIS_DOWN, redis_reconnect
from specmesh.cluster.metrics import MeteredRequest, VerifierMetrics
from specmesh.cluster.pipeline.messages import ABORT, ADMISSION, GROUP, OUTPUTS, QueueKeys, QueueSigner
from specmesh.cluster.pipeline.policy_sync import RoutingFollower
from specmesh.cluster.pipeline.verifier_end import QueueMember
from specmesh.cluster.serving import TorchThread
from specmesh.cluster.wire import sampling_from_pb, stats_to_pb, trace_to_pb
from specmesh.errors import InvalidArgument
from specmesh.runtime.tree_verifier import TreeVerifier, VerifyJob, VerifyResult
from specmesh.speculation.drafting import AsyncDrafter, one_per_name
from specmesh.speculation.engine_core import DraftAhead, EngineCore, RequestOutput
from specmesh.speculation.policy import AdaptivePolicy, FixedPolicy
from specmesh.speculation.requests import Request, SpeculationStats, StepTiming, validate_request
from specmesh.tree import MAX_TREE_NODES
from specmesh.v1 import verifier_pb2

log = logging.getLogger(__name__)

LISTEN_BLOCK_MS = 1000  # the admissions' and aborts' listeners: a blocking read's longest wait
IDLE_WAIT_S = 0.1  # with nothing to step, the loop wakes this often (to look after the others)
FULL_WAIT_S = 0.01  # with no room, the admissions' listener looks again this often
# with other verifiers alive, admissions a read takes at most; the next read waits for the step that takes
# them in, so each takes at the pace of its steps and a burst spreads over those free to take it
TAKE_AT_ONCE = 8
# beside decoding requests, prefills take on average this share of a decode pass's time (a long prompt's over
# several passes): its neighbours' tokens come ~1.5x slower on average while it is cached; within these bounds
PREFILL_SHARE = 0.5
PREFILL_MS = (2.0, 25.0)
# a prompt cached with no one decoding still goes in passes this long: newcomers join the next (admissions are
# read between passes: beside 200 ms passes on 2 cores, short requests waited 0.4-1.1 s to be taken)
PREFILL_ALONE_MS = 50.0
# an answer sent whole is logged this often: no one has seen its tokens, so a verifier's death costs at most
# this much work again, and its steps need neither a round trip nor a log entry of their own
LOG_WITHHELD_S = 0.2
OUTPUTS_MAXLEN = 100_000  # entries kept on a router's outputs stream (approximate trim)
ABORTED_MEMORY = 4096  # aborted ids remembered, so that an admission read after its abort is dropped
DRAIN_S = 20.0  # a drain finishes the requests held within this, the others adopt the rest
ADOPT_EVERY_S = 1.0  # how often the others' heartbeats are looked at (and the commit log trimmed)

# A step's outputs: logged on the verifier's commit log, posted to each router's stream, and the finished
# requests' admissions acknowledged, all at once, and only while the verifier's alive key lives: once it
# expired the others may have adopted its requests, and a verifier back from a stall must not answer them.
# KEYS: alive, commit log, admissions, the routers' outputs streams. ARGV: the log entry ('' none) and its
# tag, the outputs streams' length, the group, n, n admission ids, then a payload and tag per outputs stream.
PUBLISH = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local logged = ''
if ARGV[1] ~= '' then logged = redis.call('XADD', KEYS[2], '*', 'outputs', ARGV[1], 'tag', ARGV[2]) end
local done = tonumber(ARGV[5])
local at = 6 + done
for i = 4, #KEYS do
  redis.call('XADD', KEYS[i], 'MAXLEN', '~', ARGV[3], '*', 'outputs', ARGV[at], 'tag', ARGV[at + 1])
  at = at + 2
end
if done > 0 then
  redis.call('XACK', KEYS[3], ARGV[4], unpack(ARGV, 6, 5 + done))
  redis.call('XDEL', KEYS[3], unpack(ARGV, 6, 5 + done))
end
return logged
"""
FENCED = -1


class TorchThreadExecutor:
    """The tree verifier as the engine core calls it, its passes on the torch thread, counted."""

    def __init__(self, verifier: TreeVerifier, torch_thread: TorchThread, metrics: VerifierMetrics,
                 on_pass: Callable[[], None] | None = None) -> None:
        self.verifier = verifier
        self.torch_thread = torch_thread
        self.metrics = metrics
        self.on_pass = on_pass  # called as a pass starts: the event loop's work meanwhile
        # read when scraped, not set at each pass: what the caches hold now, closes and evictions included
        metrics.kv_sessions.set_function(lambda: verifier.num_sessions)
        metrics.kv_bytes.set_function(lambda: verifier.cache_bytes)

    def prefill_budget_ms(self, rows: int) -> float:
        """Prefills' share of a pass of ``rows`` tree rows: of what the verifier measured a decode pass of them costs."""
        low, high = PREFILL_MS
        decode_ms = self.verifier.decode_cost.ms(rows)
        return high if decode_ms <= 0 else min(max(PREFILL_SHARE * decode_ms, low), high)

    async def verify(self, jobs: list[VerifyJob]) -> list[VerifyResult]:
        # prefills share a pass with decoding requests within a budget; with no one verified, within a larger one
        rows = sum(1 + len(job.tree) for job in jobs)
        if self.torch_thread.inline and self.on_pass is not None:
            self.on_pass()
            await asyncio.sleep(0)  # the publish's request out to Redis before the pass holds the thread
        started = time.monotonic()
        passing = self.torch_thread.submit(self.verifier.verify, jobs, self.prefill_budget_ms(rows), PREFILL_ALONE_MS)
        if not self.torch_thread.inline and self.on_pass is not None:
            self.on_pass()
        results = await passing
        seconds = time.monotonic() - started
        m = self.metrics
        m.batch_requests.observe(len(jobs))
        m.batch_rows.observe(rows)
        m.pass_seconds.observe(seconds)
        for result in results:
            m.jobs.labels("refused" if result.refused else "failed" if result.failed else "prefilling"
                          if result.prefilling else "resync" if result.resync else "ok").inc()
        return results

    async def close(self, request_id: str) -> None:
        await self.torch_thread.run(self.verifier.close, request_id)


@dataclass
class _Held:
    """A request this verifier took: where its outputs go, and its admission entry (acknowledged at its end)."""

    reply_to: str
    entry_id: bytes
    stats: SpeculationStats
    logged: int = 0  # answer tokens logged (a streamed answer's with their post, one sent whole's by time)
    logged_from: bytes | None = None  # the first commit log entry holding its tokens
    answer: list[int] | None = None  # an answer sent whole (final-only): its tokens so far, posted at its end


class EngineWorker:
    def __init__(self, verifier: TreeVerifier, queue: QueueMember, torch_thread: TorchThread,
                 policy: AdaptivePolicy, drafters: list[AsyncDrafter], eos_token_ids: frozenset[int],
                 metrics: VerifierMetrics | None = None, draft_ahead: DraftAhead = "auto") -> None:
        self.verifier = verifier
        self.queue = queue
        self.torch_thread = torch_thread
        self.redis = queue.redis
        self.keys: QueueKeys = queue.keys
        self.signer: QueueSigner = queue.signer
        self.policy = policy
        self.drafters = drafters
        self.metrics = metrics or VerifierMetrics()
        self.metrics.watch(verifier.runtime)
        # the routers own the routing table: this one's steps' counts go to them, their snapshots come here
        self.routing = RoutingFollower(policy.expertise, self.signer, self.metrics)
        self._unsent: tuple[list[RequestOutput], list[bytes]] | None = None  # the last step's outputs, to publish
        self._publishing: asyncio.Task | None = None  # their publish, once started (``_send``: at the next pass)
        self._log_due = 0.0  # when the answers sent whole are next logged (``_log_withheld``)
        threaded = TorchThreadExecutor(verifier, torch_thread, self.metrics, on_pass=self._send)
        self.core = EngineCore(threaded, eos_token_ids, max_running=verifier.max_sessions, draft_ahead=draft_ahead)
        self.metrics.watch_policy(policy, self.core.budget)  # what the controller learned, where it plans
        self._held: dict[str, _Held] = {}
        self._aborted: dict[str, None] = {}  # insertion-ordered, bounded
        self._aborts_after = "0-0"
        # what the listeners took since the loop last looked: admission entries, aborted request ids
        self._new_admissions: list = []
        self._new_aborts: list[str] = []
        self._arrived = asyncio.Event()
        self._stepped = asyncio.Event()  # the step that took the listener's last admissions in has ended
        self._joined = asyncio.Event()  # registered: the admissions' group exists
        self._rejoin = False  # a listener found the group gone (Redis restarted empty)
        self._listeners: list[asyncio.Task] = []  # the admissions' and the aborts'
        self.commit_log = self.keys.commit_log(queue.verifier_id)
        self._next_adoption = 0.0
        self._others_alive = 0  # other verifiers with a live heartbeat, at the last look (``_look_after_the_others``)
        self.stopped = asyncio.Event()
        self.unready = asyncio.Event()
        self.finished = asyncio.Event()
        self.draining = False
        self.lapsed = False  # its heartbeat lapsed: the others may have adopted what it holds
        self._publish_script = self.redis.register_script(PUBLISH)

    @property
    def verifier_id(self) -> str:
        return self.queue.verifier_id

    async def run(self) -> None:
        beat = asyncio.create_task(self.queue.keep_beating(self.unready, self._lapse, renew_only=True))
        self._listeners = [asyncio.create_task(self._listen_admissions()), asyncio.create_task(self._listen_aborts())]
        try:
            await self._loop()
        finally:
            self.unready.set()
            self.finished.set()
            beat.cancel()
            await cancel_all(*self._listeners)
            await self.core.close()

    def _lapse(self) -> None:
        self.lapsed = True

    async def _register(self) -> None:
        """Join the pool, at the start or after losing Redis or its heartbeat. Its alive key gone (expired, or
        Redis restarted empty), the others may have adopted its requests: it lets them all go first, then
        takes back from its log those still its own (all of them after a restart under the same id)."""
        self.lapsed = False
        # renewed only if still there, in one command: a stall between a look and a write would slip through
        if self.core.num_requests and not await self.queue.heartbeat(renew_only=True):
            await self._let_go()
        if not self.core.num_requests:
            await self.queue.register()
        try:
            await self.redis.xgroup_create(self.keys.admissions, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        # the recent aborts too: an admission still unread may be of a client that left before any verifier ran
        recent = await self.redis.xrevrange(self.keys.aborts, count=ABORTED_MEMORY)
        self._aborts_after = recent[0][0] if recent else "0-0"
        dropped: list[bytes] = []
        for rid in self._aborts_in(reversed(recent)):
            await self._abort(rid, dropped)
        if dropped:
            await self._publish([], dropped)
        if not self.core.num_requests:
            self._new_admissions.clear()  # pending under this verifier: taken back with the others
            self._stepped.set()
            await self._adopt(self.verifier_id)

    async def _let_go(self) -> None:
        log.warning("this verifier stood still past its heartbeat: letting its %d request(s) go (those still its "
                    "own are taken back from its log)", self.core.num_requests)
        self._held.clear()
        self._new_admissions.clear()  # pending under this verifier: taken back from its log with the others
        self._stepped.set()
        await self.core.close()

    async def _loop(self) -> None:
        """Each turn: what the listeners took (admissions, aborts), one core step, its outputs published. A
        step's publish starts once the next pass has (``TorchThreadExecutor.on_pass``): its work on this thread
        runs while the torch thread passes, not between passes. Publishes go out one after another, in step
        order. No Redis read a step: the listeners wait in Redis for what comes."""
        registered = False
        backoff = redis_reconnect()
        while not self.stopped.is_set():
            try:
                if not registered or self.lapsed or self._rejoin:
                    self._joined.clear()
                    self._rejoin = False
                    await self._flush()  # its acknowledgements first: what is pending is taken back
                    await self._register()
                    registered = True
                    self._joined.set()
                if time.monotonic() >= self._next_adoption:
                    await self._look_after_the_others()
                    self._next_adoption = time.monotonic() + ADOPT_EVERY_S
                # the routers' routing snapshot, about once a second, for the drafters it has
                await self.routing.poll(self.redis, self.keys.routing, self._drafter_names)
                if not self.core.num_requests:
                    self._send()  # no pass to wait for
                    if self._publishing is None:
                        await _wait(self._arrived, IDLE_WAIT_S)
                admissions, aborts = self._arrivals()
                dropped: list[bytes] = []  # admission entries acknowledged unserved
                for rid in aborts:
                    await self._abort(rid, dropped)
                refused = [r for r in (self._admit(e, fields, dropped) for e, fields in admissions) if r is not None]
                outputs = refused + await self.core.step()
                if admissions:
                    self._stepped.set()
                self._send()  # where this turn ran no pass
                if self._publishing is not None:
                    publishing, self._publishing = self._publishing, None
                    await publishing  # the last step's, sent while this one's pass ran
                self._forget_unheld(outputs, dropped)
                if outputs or dropped:
                    self._unsent = (outputs, dropped)
                backoff.reset()
            except REDIS_DOWN as exc:
                await self._flush()
                if registered:
                    log.warning("Redis unreachable (%s); retrying", exc)
                registered = False
                await asyncio.sleep(backoff.next())
            except Exception:
                await self._flush()
                log.exception("the engine loop failed; carrying on")
                self.metrics.worker_errors.inc()
                await asyncio.sleep(backoff.next())
        await self._flush()  # the last step's outputs go out

    def _send(self) -> None:
        """Start publishing the last step's outputs, if not yet started."""
        if self._unsent is not None:
            self._publishing = asyncio.create_task(self._publish(*self._unsent))
            self._unsent = None

    async def _flush(self) -> None:
        """The last step's outputs sent, whatever came of it (the loop logs or retries a failure)."""
        self._send()
        await _settled(self._publishing)
        self._publishing = None

    def _arrivals(self) -> tuple[list, list[str]]:
        """What the listeners took since the last turn: admissions (none while draining: they stay pending
        for another verifier) and aborts."""
        admissions, aborts = self._new_admissions, self._new_aborts
        self._new_admissions, self._new_aborts = [], []
        self._arrived.clear()
        return ([] if self.draining else admissions), aborts

    async def _listen_admissions(self) -> None:
        """Take admissions as they come, while there is room: a read waits in Redis until one comes, so a
        running step reads nothing (the consumer group hands each admission to one verifier). With other
        verifiers alive, ``TAKE_AT_ONCE`` at most, then none until a step has taken them in: what arrives
        while this one steps its newcomers goes to the others. Alone, it takes all it has room for at once."""
        backoff = redis_reconnect()
        while not self.stopped.is_set():
            await self._joined.wait()
            shared = self._others_alive > 0
            room = self.core.max_running - self.core.num_requests - len(self._new_admissions)
            room = min(room, TAKE_AT_ONCE) if shared else room
            if self.draining or room <= 0:
                await asyncio.sleep(FULL_WAIT_S)
                continue
            items = await self._listened(lambda: self.redis.xreadgroup(
                GROUP, self.verifier_id, {self.keys.admissions: ">"}, count=room, block=LISTEN_BLOCK_MS),
                "admissions", backoff)
            if items:
                self._new_admissions += items
                self._stepped.clear()
                self._arrived.set()
                if shared:
                    await _wait(self._stepped, LISTEN_BLOCK_MS / 1e3)

    async def _listen_aborts(self) -> None:
        """Take the pool's aborts as they come (every verifier reads them all)."""
        backoff = redis_reconnect()
        while not self.stopped.is_set():
            await self._joined.wait()
            entries = await self._listened(lambda: self.redis.xread(
                {self.keys.aborts: self._aborts_after}, count=1024, block=LISTEN_BLOCK_MS), "aborts", backoff)
            if entries:
                self._aborts_after = entries[-1][0]
                self._new_aborts += self._aborts_in(entries)
                self._arrived.set()

    async def _listened(self, read, what: str, backoff) -> list:
        """The entries a blocking ``read`` of the ``what`` stream brought; none, after a pause, when it failed,
        whatever failed: a listener that died would leave the verifier looking alive and taking nothing."""
        try:
            answer = await read()
            backoff.reset()
            return [entry for _, entries in answer or () for entry in entries]
        except ResponseError as exc:
            if "NOGROUP" in str(exc):  # Redis restarted empty: the loop joins again
                self._rejoin = True
                self._arrived.set()
            else:
                log.warning("reading the %s failed: %s", what, exc)
        except REDIS_DOWN:
            pass
        except Exception:
            log.exception("reading the %s failed; retrying", what)
        await asyncio.sleep(backoff.next())
        return []

    def _aborts_in(self, entries) -> list[str]:
        """The request ids of the validly signed aborts among the stream's ``entries``."""
        aborts = []
        for _, fields in entries:
            payload = fields.get(b"abort")
            if payload is not None and self.signer.valid(ABORT, payload, fields.get(b"tag")):
                abort = _parsed(verifier_pb2.Abort, payload)
                if abort is not None:
                    aborts.append(abort.request_id)
        return aborts

    async def _abort(self, request_id: str, dropped: list[bytes]) -> None:
        self._aborted[request_id] = None
        while len(self._aborted) > ABORTED_MEMORY:
            self._aborted.pop(next(iter(self._aborted)))
        if await self.core.abort(request_id):
            dropped.append(self._held.pop(request_id).entry_id)

    def _admit(self, entry_id: bytes, fields: dict, dropped: list[bytes],
               logged: list[int] | None = None) -> RequestOutput | None:
        """Take an admitted request into the core; a forged or unreadable entry is dropped, and an invalid
        request answered with its failure (returned). ``logged``: the answer's tokens so far (a request
        adopted from a verifier that died), after which it goes on."""
        payload = fields.get(b"admission")
        if payload is None or not self.signer.valid(ADMISSION, payload, fields.get(b"tag")):
            self.metrics.jobs.labels("forged").inc()
            dropped.append(entry_id)
            return None
        admission = _parsed(verifier_pb2.Admission, payload)
        rid = admission.request_id if admission is not None else ""
        if admission is None or not admission.reply_to.startswith(self.keys.outputs("")) or not rid:
            self.metrics.jobs.labels("error").inc()
            dropped.append(entry_id)
            return None
        held = self._held.get(rid)
        if held is not None and held.entry_id == entry_id:  # this very admission runs (taken back from the log)
            return None
        if rid in self._aborted or held is not None:
            dropped.append(entry_id)
            return None
        logged = logged or []
        held = _Held(admission.reply_to, entry_id, SpeculationStats(), logged=len(logged),
                     answer=list(logged) if admission.final_only else None)
        self._held[rid] = held
        try:
            budget = min(max(admission.max_tree_nodes, 0), MAX_TREE_NODES)
            params = sampling_from_pb(admission.sampling)
            if logged:
                if len(logged) >= params.max_tokens:
                    raise InvalidArgument("max_tokens", "the answer was complete when its verifier stopped")
                params = replace(params, max_tokens=params.max_tokens - len(logged))
            request = Request(tuple(admission.prompt.ids) + tuple(logged), params, rid, admission.kind)
            validate_request(request, self.verifier.runtime.vocab_size, self.verifier.runtime.max_length, budget)
        except (InvalidArgument, ValueError) as exc:
            self.metrics.jobs.labels("error").inc()
            return RequestOutput(rid, [], "failed", error=exc)
        if budget > 0:
            policy = self.policy.begin(request.kind, budget, fixed_budget=admission.fixed_budget)
            drafters = self._unique_drafters()
        else:
            policy, drafters = FixedPolicy().begin(request.kind, 0), []
        self.core.add(request, MeteredRequest(policy, self.metrics), drafters, held.stats)
        return None

    def _drafter_names(self) -> set[str]:
        return {drafter.name for drafter in self.drafters}

    def _forget_unheld(self, outputs: list[RequestOutput], dropped: list[bytes]) -> None:
        """The core is the authority on what runs here: a request it no longer holds whose end no publish
        carried (a publish Redis did not take) is forgotten and its admission acknowledged with ``dropped``."""
        known = self.core.request_ids | {o.request_id for o in outputs}
        for rid in [rid for rid in self._held if rid not in known]:
            log.warning("request %s ended here unpublished; its admission is acknowledged", rid)
            dropped.append(self._held.pop(rid).entry_id)

    def _unique_drafters(self) -> list[AsyncDrafter]:
        unique = one_per_name(self.drafters)
        for drafter in unique:
            self.policy.expertise.register(drafter)
        return unique

    async def _publish(self, outputs: list[RequestOutput], dropped: list[bytes]) -> None:
        """The step's tokens logged, one StepOutputs message per router with something for it (an answer sent
        whole goes at its end only, its tokens logged by time), and the finished (or ``dropped``) requests'
        admissions acknowledged: one round trip, or none when a step has nothing of these."""
        by_router: dict[str, verifier_pb2.StepOutputs] = {}
        tokened: list[verifier_pb2.RequestDelta] = []  # the step's log entry
        done = list(dropped)
        for output in outputs:
            held = self._held.get(output.request_id)
            if held is None:
                continue
            finished = output.finish_reason is not None
            reason, message = output.finish_reason or "", str(output.error) if output.error is not None else ""
            if held.answer is not None:  # sent whole: the answer so far, posted at its end (logged by time)
                held.answer += output.token_ids
                if not finished:
                    continue
                delta = verifier_pb2.RequestDelta(request_id=output.request_id, position=0, tokens=held.answer,
                                                  finish_reason=reason, message=message)
            else:
                delta = verifier_pb2.RequestDelta(request_id=output.request_id, position=held.logged,
                                                  tokens=output.token_ids, finish_reason=reason, message=message)
                held.logged += len(output.token_ids)
                if delta.tokens:
                    tokened.append(delta)
            if output.outcome is not None:
                delta.step.CopyFrom(trace_to_pb(StepTiming.of(output.outcome)))
            if finished:
                delta.stats.CopyFrom(stats_to_pb(held.stats))
                done.append(held.entry_id)
                del self._held[output.request_id]
            by_router.setdefault(held.reply_to, verifier_pb2.StepOutputs(verifier_id=self.verifier_id)).deltas.append(delta)
        withheld = self._log_withheld(tokened) if time.monotonic() >= self._log_due else False
        if not (by_router or done or tokened):
            return  # nothing to post, acknowledge or log: no round trip
        report = self.routing.report(flush=any(o.finish_reason for o in outputs)) if by_router else None
        if report is not None:  # on one router's message: no Redis command of its own
            next(iter(by_router.values())).report.CopyFrom(report)
        posts = [(payload, self.signer.tag(OUTPUTS, payload), reply_to)
                 for reply_to, message in by_router.items() for payload in (message.SerializeToString(),)]
        # one router with every delta: its message is the log entry too (a delta without tokens, or a step
        # trace, changes no answer read back)
        if len(posts) == 1 and tokened and not withheld:
            logged, logged_tag = posts[0][:2]
        else:
            step = verifier_pb2.StepOutputs(verifier_id=self.verifier_id, deltas=tokened)
            logged = step.SerializeToString() if tokened else b""
            logged_tag = self.signer.tag(OUTPUTS, logged) if logged else b""
        logged_at = await self._publish_script(
            keys=[self.keys.alive(self.verifier_id), self.commit_log, self.keys.admissions, *(r for *_, r in posts)],
            args=[logged, logged_tag, OUTPUTS_MAXLEN, GROUP, len(done), *done,
                  *(part for payload, tag, _ in posts for part in (payload, tag))])
        if logged_at == FENCED:
            self.lapsed = True  # nothing was posted: the next turn lets every request go
            return
        for delta in tokened:
            held = self._held.get(delta.request_id)
            if held is not None and held.logged_from is None:
                held.logged_from = logged_at

    def _log_withheld(self, tokened: list[verifier_pb2.RequestDelta]) -> bool:
        """The tokens of answers sent whole not yet logged, added to ``tokened`` (the step's log entry); True if
        any were."""
        self._log_due = time.monotonic() + LOG_WITHHELD_S
        withheld = False
        for rid, held in self._held.items():
            if held.answer is not None and len(held.answer) > held.logged:
                tokened.append(verifier_pb2.RequestDelta(request_id=rid, position=held.logged,
                                                         tokens=held.answer[held.logged:]))
                held.logged, withheld = len(held.answer), True
        return withheld

    def _log(self, pipe, step: verifier_pb2.StepOutputs) -> None:
        payload = step.SerializeToString()
        pipe.xadd(self.commit_log, {"outputs": payload, "tag": self.signer.tag(OUTPUTS, payload)})

    async def _look_after_the_others(self) -> None:
        """Adopt what verifiers whose heartbeat stopped held; trim this one's commit log to what its requests
        need; free the KV caches of requests the core does not hold (the core is the authority)."""
        unheld = self.verifier.session_ids - self.core.request_ids
        if unheld:
            log.warning("freeing the KV caches of %d request(s) no longer running here", len(unheld))
            for rid in unheld:
                await self.core.verifier.close(rid)
        if not self.draining:
            others = 0
            for member in await self.redis.smembers(self.keys.members):
                name = member.decode()
                if name == self.verifier_id:
                    continue
                if await self.redis.exists(self.keys.alive(name)):
                    others += 1
                else:
                    await self._adopt(name)
            self._others_alive = others
        oldest = [h.logged_from for h in self._held.values() if h.logged_from is not None]
        if oldest:
            await self.redis.xtrim(self.commit_log, minid=min(oldest, key=_entry_order))
        elif not self._held:
            await self.redis.xtrim(self.commit_log, maxlen=0)

    async def _adopt(self, verifier_id: str) -> None:
        """Claim the admissions ``verifier_id`` held (a dead verifier, or this one before it restarted) and go on
        with each request from its prompt and logged tokens."""
        try:
            pending = await self.redis.xpending_range(self.keys.admissions, GROUP, "-", "+", self.core.max_running,
                                                      consumername=verifier_id)
        except ResponseError:  # no group yet
            return
        if not pending:
            if verifier_id != self.verifier_id:
                await self.redis.delete(self.keys.commit_log(verifier_id))
            return
        # a claim resets an entry's idle time: of two verifiers claiming at once, the second gets nothing
        idle = min(p["time_since_delivered"] for p in pending)
        claimed = await self.redis.xclaim(self.keys.admissions, GROUP, self.verifier_id, max(idle - 1, 0),
                                          [p["message_id"] for p in pending])
        if not claimed:
            return
        answers, first = await self._logged(verifier_id)
        dropped: list[bytes] = []
        refused, snapshot = [], verifier_pb2.StepOutputs(verifier_id=self.verifier_id)
        for entry_id, fields in claimed:
            if not fields:  # deleted meanwhile
                dropped.append(entry_id)
                continue
            admission = _parsed(verifier_pb2.Admission, fields.get(b"admission") or b"")
            rid = admission.request_id if admission is not None else ""
            logged = answers.get(rid, [])
            output = self._admit(entry_id, fields, dropped, logged)
            if output is not None:
                refused.append(output)
            elif rid in self._held and logged:
                snapshot.deltas.append(verifier_pb2.RequestDelta(request_id=rid, position=0, tokens=logged))
                self._held[rid].logged_from = first[rid]  # its own log (a restart) keeps it from there
        log.info("took over %d request(s) %s held%s", len(claimed), verifier_id,
                 "" if verifier_id == self.verifier_id else " (its heartbeat stopped)")
        if verifier_id != self.verifier_id:
            self.metrics.reclaimed.inc(len(claimed))
        if snapshot.deltas and verifier_id != self.verifier_id:  # this log holds their whole answers from now on
            pipe = self.redis.pipeline(transaction=True)
            self._log(pipe, snapshot)
            if len(claimed) == len(pending):  # else the other took some back (a stall, not a death): its log stays
                pipe.delete(self.keys.commit_log(verifier_id))
            first = (await pipe.execute())[0]
            for delta in snapshot.deltas:
                self._held[delta.request_id].logged_from = first
        if refused or dropped:
            await self._publish(refused, dropped)

    async def _logged(self, verifier_id: str) -> tuple[dict[str, list[int]], dict[str, bytes]]:
        """Each request's answer so far from a verifier's commit log, and the first entry that holds it."""
        answers: dict[str, list[int]] = {}
        first: dict[str, bytes] = {}
        for entry_id, fields in await self.redis.xrange(self.keys.commit_log(verifier_id)):
            payload = fields.get(b"outputs")
            if payload is None or not self.signer.valid(OUTPUTS, payload, fields.get(b"tag")):
                continue
            for delta in getattr(_parsed(verifier_pb2.StepOutputs, payload), "deltas", ()):
                first.setdefault(delta.request_id, entry_id)
                tokens = answers.setdefault(delta.request_id, [])
                del tokens[delta.position:]
                tokens.extend(delta.tokens)
        return answers, first

    async def drain(self) -> int:
        """Stop taking admissions and finish the requests held, for at most ``DRAIN_S``: what is left stays
        pending, for another verifier (or this one restarted) to adopt."""
        self.draining = True
        await cancel_all(*self._listeners[:1])  # no more admissions: a read under way would take some
        try:
            await self.queue.unregister()
        except REDIS_DOWN:
            pass
        deadline = time.monotonic() + DRAIN_S
        while self.core.num_requests and not self.finished.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.stopped.set()
        self.unready.set()
        await self.finished.wait()
        released = self.verifier.num_sessions
        await self.torch_thread.run(self.verifier.close_all)
        return released


async def _settled(*tasks: asyncio.Task | None) -> None:
    """Wait for ``tasks`` (None: none) to end, whatever their outcome (the loop has logged or will retry it)."""
    await asyncio.gather(*(t for t in tasks if t is not None), return_exceptions=True)


async def _wait(event: asyncio.Event, timeout_s: float) -> None:
    """Until ``event`` is set, for at most ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        pass


def _entry_order(entry_id: bytes) -> tuple[int, int]:
    milliseconds, sequence = entry_id.split(b"-")
    return int(milliseconds), int(sequence)


def _parsed(message_type, payload: bytes):
    """The message, or None where the bytes are not one."""
    try:
        return message_type.FromString(payload)
    except Exception:
        return None
