"""The engine core: one step loop for every running request (continuous batching).

Each ``step()`` plans every running request's budget, drafts and fuses its tree, verifies all the trees
in one call to the verifier, commits what each verdict keeps, and gives back one ``RequestOutput`` per
request that moved. Requests join (``add``) and leave (``abort``, or their end) between steps; more than
``max_running`` wait their turn. The in-process engine drives it to completion; a verifier service drives
it for the requests the routers hand it. The loop is the same, only the processes around it differ.

The adaptive requests of a step draft as the batch's measured arm says (``batch_budget.py``): their policy's
choice, plain decoding or a fixed budget, whichever committed the most tokens a second at this load and kind.

A drafter's failure costs that request's proposal for the step (``drafting.guarded``), and so does a late
answer: a step waits for a proposal only as long as its drafter usually takes (``draft_deadline.py``). A
request whose numbers break the acceptance rule fails alone (``RequestOutput.error``), the others go on.

Drafting ahead (``draft_ahead``): while a pass verifies a request's tree, its drafters already draft the next
one, assuming the tree's likeliest path is accepted; when the verdict confirms it (that path, then a token the
draft has a branch for) the next step takes that draft without waiting. It pays where drafters run on other
machines than the pass; on the verifier's own cores it takes them from the pass.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol, Sequence

from specmesh.cancellation import cancel_all
from specmesh.errors import RequestFailed, Unavailable
from specmesh.runtime.tree_verifier import VerifyJob, VerifyResult
from specmesh.speculation.batch_budget import MIXED, POLICY, BatchBudget
from specmesh.speculation.draft_deadline import DraftDeadlines
from specmesh.speculation.drafting import NO_DRAFT, AsyncDrafter, Draft, draft_step, drafts, guarded, runs_apart
from specmesh.speculation.policy import RequestPolicy, StepOutcome, StepPlan
from specmesh.speculation.requests import Request, SpeculationStats
from specmesh.tree import TokenTree

log = logging.getLogger(__name__)

MAX_RESYNCS = 3  # a request whose verifier keeps losing its cache is failing, not slow
MAX_REFUSALS = 100  # steps a request may wait for room in the KV cache before it is failed
# proposals drafted ahead leave after a few event-loop turns (queued, batched, called); a pass on the loop's
# own thread holds it, so the core yields these turns before the pass
SEND_TURNS = 5
# a draft made ahead is waited for after the pass at most this share of the pass again
AHEAD_WAIT_SHARE = 0.5
# drafting ahead goes on while at least this share of the drafts made ahead lately were confirmed (below it,
# the drafters' extra work and the step's own overhead cost more than the few drafts it saves: 13 % confirmed
# lost 4-8 % on 2 cores, docs/experiments/2026-12-02-drafting-ahead-in-the-engine-core.md); below it, one
# step in AHEAD_PROBE_EVERY drafts ahead still, so the share stays measured
AHEAD_MIN_CONFIRMED = 0.3
AHEAD_PROBE_EVERY = 16
AHEAD_ALPHA = 0.1  # weight of the newest draft made ahead in the share
DraftAhead = Literal["auto", "on", "off"]  # auto: with drafters on other machines (``drafting.runs_apart``)


class PassExecutor(Protocol):
    """The verifier as the core calls it: one call a step for every request's job."""

    async def verify(self, jobs: list[VerifyJob]) -> list[VerifyResult]: ...

    async def close(self, request_id: str) -> None: ...


@dataclass
class RequestOutput:
    """What one step gave one request."""

    request_id: str
    token_ids: list[int]  # newly committed, in order
    finish_reason: str | None = None  # "stop", "length", "failed", "aborted", or None while generating
    outcome: StepOutcome | None = None  # how the step went (plan, trees, timings)
    error: Exception | None = None  # why it failed (finish_reason "failed")


@dataclass
class _Running:
    request: Request
    policy: RequestPolicy
    drafters: dict[str, AsyncDrafter]
    stats: SpeculationStats
    context: list[int]  # every committed token; the last one is the next tree's root
    started: float
    produced: int = 0
    step: int = 0
    send_history: bool = True  # the first job prefills
    resyncs: int = 0  # in a row
    refusals: int = 0  # in a row
    waiting: Draft | None = None  # a job held over (its prefill goes on): verified again with the same tree
    ready: Draft | None = None  # drafted ahead during the last pass, which confirmed its path
    ready_ms: float = 0.0  # ... and waited for after that pass (0 when it was in by the pass's end)
    late: dict[str, asyncio.Future] = field(default_factory=dict)  # proposals past their wait, still on their way
    features: tuple[int, ...] = ()

    def askable(self, name: str) -> bool:
        """Whether ``name`` may be asked: no proposal of this request's still on its way there."""
        call = self.late.get(name)
        if call is not None and call.done():
            del self.late[name]
            call = None
        return call is None

    @property
    def room(self) -> int:
        return self.request.params.max_tokens - self.produced

    def job(self, tree: TokenTree) -> VerifyJob:
        history = tuple(self.context[:-1]) if self.send_history else None
        return VerifyJob(self.request.request_id, self.step, position=len(self.context) - 1, root=self.context[-1],
                         tree=tree, params=self.request.params, history=history, feature_layers=self.features)


@dataclass
class _Stepping:
    """One request's part of a step: its draft and job, and then its result."""

    running: _Running
    draft: Draft
    draft_ms: float
    job: VerifyJob = field(init=False)
    assumed: list[int] = field(default_factory=list)  # the path the draft made ahead assumes accepted
    ahead: asyncio.Future | None = None  # that draft, being made while the pass runs

    def __post_init__(self) -> None:
        self.job = self.running.job(self.draft.fused)


class EngineCore:
    def __init__(self, verifier: PassExecutor, eos_token_ids: frozenset[int] = frozenset(),
                 max_running: int = 256, draft_ahead: DraftAhead = "off", budget: BatchBudget | None = None) -> None:
        """``budget``: how adaptive requests' budgets follow the batch's measured goodput (default: a new one)."""
        self.verifier = verifier
        self.eos_token_ids = eos_token_ids
        self.max_running = max_running
        self.draft_ahead = draft_ahead
        self.deadlines = DraftDeadlines()
        self.budget = budget or BatchBudget()
        self._pass_s = 0.0  # the last pass's time
        self._ahead_ms = 0.0  # the last step's wait for drafts made ahead, after its pass
        self.ahead_confirmed = 1.0  # share of the drafts made ahead lately that the verdict confirmed
        self._steps = 0
        self._running: dict[str, _Running] = {}
        self._waiting: deque[_Running] = deque()

    @property
    def num_requests(self) -> int:
        """Requests running or waiting their turn."""
        return len(self._running) + len(self._waiting)

    @property
    def request_ids(self) -> set[str]:
        """The requests running or waiting their turn."""
        return {*self._running, *(r.request.request_id for r in self._waiting)}

    def add(self, request: Request, policy: RequestPolicy, drafters: Sequence[AsyncDrafter] = (),
            stats: SpeculationStats | None = None) -> None:
        """``request`` joins at the next step it has room in, drafted for by ``drafters`` as ``policy`` plans."""
        rid = request.request_id
        if rid in self._running or any(r.request.request_id == rid for r in self._waiting):
            raise ValueError(f"request {rid} is already in the engine")
        by_name = {d.name: d for d in drafters}
        if len(by_name) != len(drafters):
            raise ValueError(f"drafter names must be unique: {[d.name for d in drafters]}")
        stats = stats if stats is not None else SpeculationStats()
        stats.request_kind = policy.kind
        features = tuple(sorted({n for d in drafters for n in d.feature_layers}))
        self._waiting.append(_Running(request, policy, by_name, stats, list(request.prompt_ids), time.perf_counter(),
                                      features=features))

    async def abort(self, request_id: str) -> bool:
        """Let the request go (its client left): its drafter sessions and KV cache are freed. False: not here."""
        for running in self._waiting:
            if running.request.request_id == request_id:
                self._waiting.remove(running)
                running.policy.end()
                return True
        running = self._running.pop(request_id, None)
        if running is None:
            return False
        await self._release(running)
        return True

    async def close(self) -> None:
        """Abort every request."""
        for rid in [r.request.request_id for r in self._waiting] + list(self._running):
            await self.abort(rid)

    async def step(self) -> list[RequestOutput]:
        """One step of every running request: at most one output each (none while its prefill goes on)."""
        await self._admit()
        if not self._running:
            return []
        kinds = {r.policy.kind for r in self._running.values() if r.policy.adapts}
        adaptive = bool(kinds)
        arm = self.budget.arm(len(self._running), kinds.pop() if len(kinds) == 1 else MIXED) if adaptive else POLICY
        stepping = await self._draft_all(arm)
        if await self._draft_ahead(stepping):
            for _ in range(SEND_TURNS):
                await asyncio.sleep(0)
        verified_at = time.perf_counter()
        try:
            results = await self.verifier.verify([s.job for s in stepping])
        except asyncio.CancelledError:
            await self._cancel_ahead(stepping)
            raise
        except Exception as exc:  # the pass failed: every request in it fails with it, the core goes on
            log.exception("a verification pass failed")
            failed = RequestFailed(f"its verification pass failed ({type(exc).__name__}; the verifier's log has it)")
            await self._cancel_ahead(stepping)
            return [await self._fail(s.running, failed) for s in stepping]
        verify_s = self._pass_s = time.perf_counter() - verified_at
        # the drafts made ahead are in (or left to arrive, their drafters not asked again meanwhile) before the
        # drafters hear the verdict: a session hears its calls in order
        ahead = [s.ahead for s in stepping if s.ahead is not None]
        if ahead:
            waited_at = time.perf_counter()
            await asyncio.wait(ahead)
            self._ahead_ms = (time.perf_counter() - waited_at) * 1e3
            for part in stepping:
                if part.ahead is not None and not part.ahead.cancelled() and part.ahead.exception() is None:
                    part.running.late.update(part.ahead.result().late)
        outputs = []
        for part, result in zip(stepping, results):
            output = await self._take(part, result, verify_s)
            if output is not None:
                outputs.append(output)
        if adaptive:  # a step that cached prompts, or beside proposals still on their way, scores no arm
            late = any(not call.done() for r in self._running.values() for call in r.late.values())
            self.budget.measured(sum(len(o.token_ids) for o in outputs),
                                 clean=not late and all(s.job.history is None for s in stepping))
            if not self._running:
                self.budget.idle()
        return outputs

    async def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_running:
            running = self._waiting.popleft()
            self._running[running.request.request_id] = running
            rid, prompt = running.request.request_id, running.request.prompt_ids
            await asyncio.gather(*(guarded(d, "start", rid, running.stats, prompt) for d in running.drafters.values()))

    async def _draft_all(self, arm: int) -> list[_Stepping]:
        """Every running request's part of the step, in order, adaptive ones by the batch's ``arm``
        (``batch_budget.py``); only those that draft wait for drafters (together): a step of plain requests
        makes no task."""
        stepping: list[_Stepping | None] = []
        drafting: list[tuple[int, _Running, StepPlan]] = []
        for running in self._running.values():
            if running.waiting is not None:  # the same job again: its prefill goes on
                stepping.append(_Stepping(running, running.waiting, 0.0))
                continue
            ready, running.ready = running.ready, None
            budget = arm if running.policy.adapts and arm != POLICY else None  # 0: plain at once, no weighing
            plan = running.policy.plan(running.room, [n for n, d in running.drafters.items()
                                                      if d.healthy and running.askable(n)],
                                       len(running.context), budget)
            if not drafts(plan, max_depth=running.room - 1):
                stepping.append(_Stepping(running, NO_DRAFT, 0.0))
            elif ready is not None:  # its drafting was hidden behind the last pass
                running.stats.drafted_ahead += 1
                running.stats.draft_s += running.ready_ms / 1e3
                fused = ready.fused.truncated(plan.budget).within_depth(running.room - 1)
                asked = replace(plan, drafters=ready.plan.drafters, weights=ready.plan.weights)
                stepping.append(_Stepping(running, Draft(asked, ready.trees, fused), running.ready_ms))
            else:
                drafting.append((len(stepping), running, plan))
                stepping.append(None)
        if drafting:
            drafted = await asyncio.gather(*(self._draft(running, plan) for _, running, plan in drafting))
            for (index, _, _), part in zip(drafting, drafted):
                stepping[index] = part
        return stepping

    async def _draft(self, running: _Running, plan: StepPlan) -> _Stepping:
        drafted_at = time.perf_counter()
        draft = await draft_step(running.drafters, plan, running.request.request_id, running.stats,
                                 max_depth=running.room - 1, wait_s=self.deadlines.wait_s(plan.drafters),
                                 deadlines=self.deadlines)
        running.late.update(draft.late)
        draft_ms = (time.perf_counter() - drafted_at) * 1e3
        running.stats.draft_s += draft_ms / 1e3
        return _Stepping(running, draft, draft_ms)

    async def _draft_ahead(self, stepping: list[_Stepping]) -> bool:
        """Start drafting, during the pass, the next tree of each request whose drafters draft ahead; True when
        some did."""
        self._steps += 1
        if self.ahead_confirmed < AHEAD_MIN_CONFIRMED and self._steps % AHEAD_PROBE_EVERY:
            return False
        started = False
        for part in stepping:
            running, tree = part.running, part.draft.fused
            names = part.draft.plan.drafters
            if (not tree or running.send_history or running.waiting is not None
                    or not all(running.askable(n) for n in names) or not self._ahead_with(running, names)):
                continue
            part.assumed = tree.likeliest_path()
            # no pace learnt from these: an inline pass holds the loop, and their answers are read after it
            part.ahead = asyncio.ensure_future(draft_step(
                running.drafters, part.draft.plan, running.request.request_id, running.stats,
                max_depth=running.room - len(part.assumed) - 2, assumed=part.assumed,
                wait_s=max(self.deadlines.wait_s(names) or 0.0, (1 + AHEAD_WAIT_SHARE) * self._pass_s)))
            started = True
        return started

    def _ahead_with(self, running: _Running, names: Sequence[str]) -> bool:
        """Whether to draft ahead with ``names``: as ``draft_ahead`` says, and only with drafters that usually
        answer within a pass (a slower one's draft would hold the next step after the pass, and most of them
        are thrown away: the verdict confirms a whole path far less often than not)."""
        if self.draft_ahead == "off" or (self.draft_ahead == "auto"
                                         and not any(runs_apart(running.drafters[n].address) for n in names)):
            return False
        pass_ms = self._pass_s * 1e3
        return all((usual := self.deadlines.usual_ms(n)) is not None and usual <= pass_ms for n in names)

    async def _cancel_ahead(self, stepping: list[_Stepping]) -> None:
        await cancel_all(*(s.ahead for s in stepping if s.ahead is not None))

    def _confirmed(self, part: _Stepping, new: list[int], finish_reason: str | None) -> Draft | None:
        """The draft made ahead, below the token the verdict added past the path it assumed; None when the
        verdict took another path (or the request ended)."""
        if part.ahead is None or part.ahead.cancelled() or finish_reason is not None or new[:-1] != part.assumed:
            return None
        if part.ahead.exception() is not None:
            log.warning("drafting ahead failed for request %s", part.running.request.request_id,
                        exc_info=part.ahead.exception())
            return None
        return part.ahead.result().below(new[-1])

    async def _take(self, part: _Stepping, result: VerifyResult, verify_s: float) -> RequestOutput | None:
        running, rid = part.running, part.running.request.request_id
        running.stats.verify_s += verify_s
        running.stats.verifier_s += result.verify_ms / 1e3
        running.waiting = part.draft if result.prefilling else None
        if result.failed:
            return await self._fail(running, RequestFailed(f"the target could not verify this request at {result.failed}"))
        if result.verdict is None:
            if result.prefilling:
                return None
            if result.refused:
                running.refusals += 1
                if running.refusals > MAX_REFUSALS:
                    return await self._fail(running, Unavailable(f"no room for this request's cache: {result.refused}"))
                return None
            running.stats.resyncs += 1
            running.resyncs += 1
            running.send_history = True
            if running.resyncs > MAX_RESYNCS:
                return await self._fail(running, Unavailable(
                    f"the verifier lost this request's cache {running.resyncs} times in a row; retry later"))
            return None
        running.send_history, running.resyncs, running.refusals = False, 0, 0
        return await self._commit(part, result)

    async def _commit(self, part: _Stepping, result: VerifyResult) -> RequestOutput:
        running, draft, stats = part.running, part.draft, part.running.stats
        rid, room = running.request.request_id, running.room
        verdict = result.verdict
        new = list(verdict.tokens)
        finish_reason = None
        stop_at = next((i for i, t in enumerate(new) if t in self.eos_token_ids), None)
        if stop_at is not None and stop_at < room:
            new, finish_reason = new[: stop_at + 1], "stop"
        elif len(new) >= room:
            new, finish_reason = new[:room], "length"
        tree = draft.fused
        stats.target_steps += 1
        stats.drafted_nodes += len(tree)
        stats.accepted_tokens += min(verdict.num_accepted, len(new))
        stats.committed_tokens += len(new)
        for name in draft.plan.drafters:
            stats.drafter_steps[name] = stats.drafter_steps.get(name, 0) + 1
        if not running.produced:
            stats.first_token_s = time.perf_counter() - running.started
        running.produced += len(new)
        running.context.extend(new)
        running.step += 1
        running.ready, running.ready_ms = self._confirmed(part, new, finish_reason), self._ahead_ms
        if part.ahead is not None and finish_reason is None:
            self.ahead_confirmed += AHEAD_ALPHA * ((running.ready is not None) - self.ahead_confirmed)
        outcome = StepOutcome(draft.plan, draft.trees, tree, tuple(new), part.draft_ms, draft.drafter_ms,
                              part.draft_ms + result.verify_ms, result.pass_ms, result.batch_rows, result.batch_size,
                              result.batch_trees, draft.fuse_ms, result.prefilled_tokens, result.verify_ms,
                              result.queue_ms)
        running.policy.observe(outcome)
        for drafter in running.drafters.values():  # also the last step: history drafters keep answers
            await guarded(drafter, "commit", rid, stats, new)
            layers = drafter.feature_layers
            if layers and result.features is not None and finish_reason is None:
                await guarded(drafter, "add_features", rid, stats, result.features.of_layers(layers))
        if finish_reason is not None:
            del self._running[rid]
            await self._release(running)
        return RequestOutput(rid, new, finish_reason, outcome)

    async def _fail(self, running: _Running, error: Exception) -> RequestOutput:
        rid = running.request.request_id
        self._running.pop(rid, None)
        await self._release(running)
        return RequestOutput(rid, [], "failed", error=error)

    async def _release(self, running: _Running) -> None:
        running.stats.total_s = time.perf_counter() - running.started
        await cancel_all(*running.late.values())  # done before the drafters hear of the end
        running.policy.end()
        rid = running.request.request_id
        names = list(running.drafters)
        parts = [*(d.end(rid) for d in running.drafters.values()), self.verifier.close(rid)]
        for name, outcome in zip(names + ["the verifier"], await asyncio.gather(*parts, return_exceptions=True)):
            if isinstance(outcome, Exception):
                log.warning("%s failed to free request %s", name, rid, exc_info=outcome)
