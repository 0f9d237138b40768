"""The verifier's worker: takes jobs from its own stream (requests whose KV cache it holds) and from the
pool's, lets the batch scheduler choose a batch, verifies it in one target pass (on the torch thread, so
heartbeats and control calls go on), posts each result, and only then acknowledges the jobs. It also
beats the heartbeat, reclaims a dead verifier's jobs, gives a long prefill its share of the passes, and
answers a job sent again from the results it remembers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import replace

from specmesh.cluster.backoff import REDIS_DOWN, redis_reconnect
from specmesh.cluster.metrics import VerifierMetrics
from specmesh.cluster.pipeline.messages import encode_error, encode_result
from specmesh.cluster.pipeline.scheduling import PassRhythm, plan_batch
from specmesh.cluster.pipeline.verifier_end import Entry, VerifierQueue
from specmesh.cluster.serving import TorchThread
from specmesh.cluster.service_settings import SESSION_IDLE_S
from specmesh.errors import InvalidArgument
from specmesh.runtime.calibration import PassCurve
from specmesh.runtime.tree_verifier import TreeVerifier

log = logging.getLogger("specmesh.verifier")
RECENT_RESULTS = 4096  # per-request last results kept to answer re-sent jobs without a second pass
PROGRESS_EVERY_S = 1.0  # a prefill under way tells its router so this often (well inside a job timeout)


# A prefill beside other requests earns SHARE of each of their tree passes as credit and runs a chunk when
# the credit reaches CHUNK_MS: their steps slow down by about SHARE on average (within 2x, however fast the
# passes), and no chunk is so small that the forward's fixed cost (the weights read once more) outweighs
# its tokens. ALONE: a chunk's time when the prefill has the verifier to itself.
PREFILL_SHARE = 0.5
PREFILL_CHUNK_MS = 25.0
ALONE_PREFILL_MS = 250.0
# A pass the curve predicts longer than this holds fewer jobs (a burst of new requests' first chunks on
# a CPU would take seconds): a step, and a client's leaving, wait for one pass at most this long.
MAX_PASS_MS = 250.0
HELD_READ_MS = 20  # a held prefill waits on a blocking read for the jobs that earn its credit, not a spin


class VerifierWorker:
    def __init__(self, verifier: TreeVerifier, queue: VerifierQueue, torch_thread: TorchThread,
                 max_batch_rows: int = 2048, max_jobs_per_read: int = 64, session_idle_s: float = SESSION_IDLE_S,
                 metrics: VerifierMetrics | None = None, pass_curve: PassCurve | None = None) -> None:
        """``pass_curve``: the runtime's, measured; a pass then holds at most the rows it says take
        ``MAX_PASS_MS`` (and ``max_batch_rows`` in any case)."""
        self.verifier = verifier
        self.metrics = metrics or VerifierMetrics()
        self.metrics.watch(verifier.runtime)
        self.torch_thread = torch_thread
        self.queue = queue
        within = pass_curve.rows_within(MAX_PASS_MS) if pass_curve is not None else None
        self.max_batch_rows = min(max_batch_rows, within or max_batch_rows)
        self.max_jobs_per_read = max_jobs_per_read
        self.session_idle_s = session_idle_s
        self.draining = False
        self.stopped = asyncio.Event()
        self.finished = asyncio.Event()
        self.unready = asyncio.Event()  # draining, or the worker has ended: health says NOT_SERVING
        self._recent: OrderedDict[str, tuple[int, bytes]] = OrderedDict()  # request -> (step, posted result)
        self.rhythm = PassRhythm()
        self.prefill_credit_ms = 0.0  # prefill time earned beside other requests' passes, not yet spent
        self.lapsed = False  # the process stood still past the heartbeat's TTL: the others took its work over
        self.held_only = False  # the last turn ran nothing: all it has are prefills waiting for credit

    def _prefill_turn(self, runnable: list[Entry]) -> tuple[list[Entry], list[Entry], float | None, bool]:
        """(this pass's jobs, prefills held back for a later pass, the pass's prefill budget in ms, whether
        its prefill time is paid from the credit)."""
        prefills = [e for e in runnable if self.verifier.next_prefill(e.queued.job)]
        if not prefills:
            return runnable, [], None, False
        if any(not self.verifier.resuming(e.queued.job) for e in prefills):  # a new request's first chunk is
            return runnable, [], PREFILL_CHUNK_MS, False  # part of its traffic: it waits for no credit
        if len(prefills) == len(runnable) and not self.rhythm.busy():
            return runnable, [], ALONE_PREFILL_MS, False
        if self.prefill_credit_ms < PREFILL_CHUNK_MS:
            return [e for e in runnable if e not in prefills], prefills, None, False
        return runnable, [], PREFILL_CHUNK_MS, True

    @property
    def verifier_id(self) -> str:
        return self.queue.verifier_id

    async def run(self) -> None:
        beat = asyncio.create_task(self.queue.keep_beating(self.unready, self._lapse))
        try:
            await self._loop()
        finally:
            self.unready.set()
            self.finished.set()
            beat.cancel()

    def _lapse(self) -> None:
        self.lapsed = True

    async def _loop(self) -> None:
        backlog: list[Entry] = []
        next_reclaim = 0.0
        registered = recovered = False
        backoff = redis_reconnect()
        while not self.stopped.is_set():
            try:
                if self.lapsed:  # its requests went to the others: its sessions and jobs in hand are stale
                    log.warning("this verifier stood still past its heartbeat; dropping %d session(s) and %d "
                                "job(s) in hand", self.verifier.num_sessions, len(backlog))
                    self.lapsed, backlog, recovered = False, [], False  # what is still its own is read again
                    self._recent.clear()
                    await self.torch_thread.run(self.verifier.close_all)
                if not registered:
                    await self.queue.register()
                    registered = True
                if not recovered:  # restarted with the same id: what it held before is still its to answer
                    backlog += await self.queue.held_before()
                    recovered = True
                now = time.monotonic()
                if now >= next_reclaim and not self.draining:
                    reclaimed = await self.queue.reclaim()
                    self.metrics.reclaimed.inc(len(reclaimed))
                    backlog += reclaimed
                    await self.torch_thread.run(self.verifier.evict_idle, self.session_idle_s)
                    self.metrics.kv_sessions.set(self.verifier.num_sessions)
                    self.metrics.kv_bytes.set(self.verifier.cache_bytes)
                    next_reclaim = now + 1.0
                block_ms = 100 if not backlog else HELD_READ_MS if self.held_only else 1
                backlog += await self.queue.read(self.max_jobs_per_read, block_ms, not self.draining)
                backlog = await self._serve(await self._gather(backlog))
                self.metrics.pending.set(len(backlog))
                backoff.reset()
            except REDIS_DOWN as exc:  # keep the KV sessions; routers re-send what was lost
                if registered:
                    log.warning("Redis unreachable (%s); retrying", exc)
                registered = recovered = False  # the jobs in hand are still pending here: read again
                backlog = []
                await asyncio.sleep(backoff.next())
            except Exception:  # a bug or an entry nobody foresaw: logged, the jobs in hand are acknowledged
                # unanswered (their routers post them again), the worker lives on
                log.exception("the worker's loop failed; dropping %d job(s) in hand and carrying on", len(backlog))
                self.metrics.worker_errors.inc()
                backlog, recovered = await self._drop(backlog), False
                await asyncio.sleep(backoff.next())

    async def _drop(self, backlog: list[Entry]) -> list[Entry]:
        try:
            await self.queue.post([(entry, None) for entry in backlog])
        except Exception:  # Redis down: the entries stay pending, served again when this verifier restarts
            log.warning("could not acknowledge the dropped jobs")
        return []

    async def _gather(self, backlog: list[Entry]) -> list[Entry]:
        """With jobs waiting, wait a moment for those of the last pass's requests that are on their way
        (``PassRhythm``), so that one round of requests is one pass, not two."""
        def arrived(entries: list[Entry]) -> list[str]:
            for entry in entries:
                if entry.close_request is not None:
                    self.rhythm.ended(entry.close_request)
            return [e.queued.job.request_id for e in entries if e.queued is not None]

        ready = arrived(backlog)
        if not ready:
            return backlog
        deadline = time.monotonic() + self.rhythm.wait_ms() / 1e3
        while self.rhythm.missing(ready) and not self.draining:
            left_ms = int((deadline - time.monotonic()) * 1e3)
            if left_ms < 1:
                break
            more = await self.queue.read(self.max_jobs_per_read, left_ms, True)
            backlog += more
            ready += arrived(more)
        return backlog

    async def _serve(self, backlog: list[Entry]) -> list[Entry]:
        answered: list[tuple[Entry, bytes | None]] = []
        runnable: list[Entry] = []
        now_ms = time.time() * 1000
        closed: dict[str, tuple[int, int]] = {}  # request -> its last close here (a job posted after it is new)
        for entry in backlog:
            if entry.close_request is not None:
                closed[entry.close_request] = max(closed.get(entry.close_request, (0, 0)), entry.order)
        for entry in backlog:
            if entry.queued is not None and entry.order < closed.get(entry.queued.job.request_id, (0, 0)):
                self.metrics.jobs.labels("closed").inc()  # its router has let the request go: a prefill stops
                answered.append((entry, None))
            elif entry.close_request is not None:
                await self.torch_thread.run(self.verifier.close, entry.close_request)
                self._recent.pop(entry.close_request, None)
                answered.append((entry, None))
            elif entry.forged:
                self.metrics.jobs.labels("forged").inc()
                answered.append((entry, None))
            elif entry.queued is None or 0 < entry.queued.deadline_unix_ms < now_ms:
                self.metrics.jobs.labels("expired").inc()
                answered.append((entry, None))  # unreadable, or its router has given up on it
                if entry.queued is not None:  # a prefill under way for it is dropped too
                    await self.torch_thread.run(self.verifier.abandon, entry.queued.job)
            elif (repeat := self._repeat(entry)) is not False:
                self.metrics.jobs.labels("repeat").inc()
                answered.append((entry, repeat))
            else:
                try:
                    self.verifier.check(entry.queued.job)
                    runnable.append(entry)
                except InvalidArgument as exc:
                    self.metrics.jobs.labels("error").inc()
                    job = entry.queued.job
                    answered.append((entry, encode_error(job.request_id, job.step, self.verifier_id, str(exc))))
        runnable, held, budget_ms, paid = self._prefill_turn(runnable)
        # steps and new requests' first chunks are planned first, a prefill under way gets the rows they leave
        # (its chunk cut to the budget): one sized for a pass of its own must not keep them out of this one
        chunks = self.verifier.prefill_chunks([e.queued.job for e in runnable], budget_ms)
        rows = {id(e): 1 + len(e.queued.job.tree) + chunk for e, chunk in zip(runnable, chunks)}
        resuming = [e for e in runnable if self.verifier.resuming(e.queued.job)]
        batch, rest = plan_batch([e for e in runnable if e not in resuming] + resuming, lambda e: rows[id(e)],
                                 lambda e: e.queued.job.request_id, self.max_batch_rows)
        prefilling: list[Entry] = []
        if batch:
            done, prefilling = await self._verify(batch, budget_ms, paid, sum(rows[id(e)] for e in batch))
            answered += done
        self.held_only = not batch and not answered
        if answered:
            self.metrics.jobs.labels("undeliverable").inc(await self.queue.post(answered))
        await self._report_progress(prefilling + held)
        return prefilling + held + rest  # a prefill under way goes on first

    async def _report_progress(self, prefilling: list[Entry]) -> None:
        """A prefill longer than the job timeout is not a lost job: its router hears that it goes on, and the
        time spent on it since the last report does not count against the job's deadline here either."""
        now = time.monotonic()
        due = [e for e in prefilling if e.queued.reply_to and now - (e.reported or e.received) >= PROGRESS_EVERY_S]
        if not due:
            return
        await self.queue.report_progress(due)
        for entry in due:
            queued = entry.queued
            entry.queued = replace(queued, deadline_unix_ms=queued.deadline_unix_ms
                                   + int((now - (entry.reported or entry.received)) * 1000))
            entry.reported = now

    def _repeat(self, entry: Entry) -> bytes | None | bool:
        """A job already answered: its result again (a re-send), None (stale), or False (new)."""
        job = entry.queued.job
        recent = self._recent.get(job.request_id)
        if recent is None or job.step > recent[0]:
            return False
        return recent[1] if job.step == recent[0] else None

    async def _verify(self, batch: list[Entry], prefill_ms: float | None, paid: bool,
                      rows: int) -> tuple[list[tuple[Entry, bytes]], list[Entry]]:
        """(answered jobs, jobs whose prefill goes on in the next pass). ``prefill_ms``: the pass's budget
        for prefills (None: no prefill under way in it); ``paid``: its prefill time is taken from the credit;
        ``rows``: the target rows planned for it."""
        jobs = [e.queued.job for e in batch]
        started = time.monotonic()
        try:
            results, payloads, verify_ms, refused = await self.torch_thread.run(self._pass, batch, prefill_ms, started)
        except Exception as exc:  # a failing pass fails its jobs, not the service
            log.exception("verification pass failed")
            self.metrics.jobs.labels("error").inc(len(batch))
            return [(e, encode_error(j.request_id, j.step, self.verifier_id,
                                           f"its verification pass failed ({type(exc).__name__}; the verifier's log has it)"))
                    for e, j in zip(batch, jobs)], []
        if verify_ms > 1e3 * self.queue.heartbeat_ttl_s:  # routers see their steps late; worth knowing why
            log.warning("a pass took %.1f s (%d jobs, %d target rows)", verify_ms / 1e3, len(batch), rows)
        if refused is not None:
            self.metrics.jobs.labels("undeliverable").inc(len(refused))
        prefilling = [e for e, r in zip(batch, results) if r.prefilling]
        done = [i for i, r in enumerate(results) if not r.prefilling]
        batch, jobs, results = [batch[i] for i in done], [jobs[i] for i in done], [results[i] for i in done]
        payloads = [payloads[i] for i in done]
        self._count_pass(batch, results, started, verify_ms, rows)
        stepped = [j.request_id for j, r in zip(jobs, results) if r.verdict is not None]
        if stepped:  # a pass of prefill chunks only says nothing of the steps' rhythm
            self.rhythm.passed(stepped, verify_ms)
        tree_ms = next((r.pass_ms for r in results if r.verdict is not None), 0.0)
        if paid:  # the pass's time beyond its trees
            self.prefill_credit_ms -= max(verify_ms - tree_ms, 0.0)
        self.prefill_credit_ms = min(self.prefill_credit_ms + PREFILL_SHARE * tree_ms, PREFILL_CHUNK_MS)
        for job, result, payload in zip(jobs, results, payloads):
            if result.verdict is not None:
                self._recent[job.request_id] = (job.step, payload)
                self._recent.move_to_end(job.request_id)
                while len(self._recent) > RECENT_RESULTS:
                    self._recent.popitem(last=False)
        # results the pass's thread posted are only acknowledged now
        return [(entry, None if refused is not None else payload) for entry, payload in zip(batch, payloads)], prefilling

    def _pass(self, batch: list[Entry], prefill_ms: float | None, started: float):
        """On the torch thread: the pass, its results' wire form, and (with a blocking client) their posting:
        (results, payloads (None for a prefill going on), the pass's ms, the results Redis refused, or None
        where they are still to post)."""
        results = self.verifier.verify([e.queued.job for e in batch], prefill_ms)
        verify_ms = (time.monotonic() - started) * 1e3
        answered = sum(not r.prefilling for r in results)
        payloads = [None if r.prefilling else encode_result(
            r, self.verifier_id, queue_ms=(started - e.received) * 1e3, verify_ms=verify_ms, batch_size=answered)
            for e, r in zip(batch, results)]
        replies = [(e.queued.reply_to, p) for e, p in zip(batch, payloads) if p is not None and e.queued.reply_to]
        return results, payloads, verify_ms, self.queue.post_results_now(replies) if replies else None

    def _count_pass(self, batch: list[Entry], results, started: float, verify_ms: float, rows: int) -> None:
        m = self.metrics
        m.batch_requests.observe(len(batch))
        m.batch_rows.observe(rows)
        m.pass_seconds.observe(verify_ms / 1e3)
        for entry, result in zip(batch, results):
            m.queue_wait.observe(max(started - entry.received, 0.0))
            m.jobs.labels("refused" if result.refused else "failed" if result.failed else
                          "resync" if result.resync else "ok").inc()
        m.kv_sessions.set(self.verifier.num_sessions)
        m.kv_bytes.set(self.verifier.cache_bytes)

    async def drain(self) -> int:
        """Stop taking pool jobs and heartbeats (routers move requests elsewhere), finish what is held."""
        self.draining = True
        self.unready.set()
        try:
            await self.queue.unregister()
        except REDIS_DOWN:
            pass
        await asyncio.sleep(0.3)  # a read in flight completes and is served
        self.stopped.set()
        await self.finished.wait()  # no pass is running when the sessions go
        released = self.verifier.num_sessions
        await self.torch_thread.run(self.verifier.close_all)
        return released
