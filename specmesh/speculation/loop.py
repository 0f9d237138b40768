"""The speculation loop of one request: draft, fuse, verify, commit — until a stop token or max_tokens.

Written once against two narrow asynchronous interfaces: drafters (``AsyncDrafter``) and a verifier
client (``VerifierClient``). In-process they are local objects (``LocalDrafter``,
``BatchingVerifier``); in the cluster they are adapters over gRPC and the Redis pipeline queue. Many
requests run this loop concurrently; the verifier side groups their jobs into batches.

The loop holds the request's whole token history, so a verifier that lost the request's KV cache
(evicted, restarted, replaced) only costs a resync: the job is sent again with its history.

A drafter's failure costs speculation, never the request, wherever the drafter runs: a remote drafter
(``cluster/remote_drafter.py``) that is down or late proposes nothing; any drafter whose ``start``,
``propose`` or ``commit`` raises is logged with the exception, counted (``drafter_failures``), and
drafts nothing that step. The target verifies every token, so what drafters say never changes the output.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol, Sequence

from specmesh.cancellation import raise_if_cancelled
from specmesh.drafters.base import Drafter
from specmesh.errors import InvalidArgument, RequestFailed, Unavailable
from specmesh.fusion import fuse_trees
from specmesh.runtime.features import Features
from specmesh.runtime.tree_verifier import TreeVerifier, VerifyJob, VerifyResult
from specmesh.sampling import SamplingParams
from specmesh.speculation.expertise import GENERAL
from specmesh.speculation.policy import FixedPolicy, RequestPolicy, StepOutcome, StepPlan
from specmesh.tree import TokenTree

log = logging.getLogger(__name__)

MAX_RESYNCS_PER_STEP = 3  # a verifier that keeps asking for history is broken, not slow


@dataclass(frozen=True)
class Request:
    prompt_ids: tuple[int, ...]
    params: SamplingParams = SamplingParams()
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    kind: str = ""  # what the request is about, for routing to expert drafters ("" = not known)


def validate_request(request: Request, vocab_size: int, max_length: int, max_tree_nodes: int) -> None:
    """Refuse what no step could serve: an empty prompt, unknown tokens, no room for the answer."""
    if not request.prompt_ids:
        raise InvalidArgument("prompt", "is empty; give at least one token")
    bad = [t for t in request.prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument("prompt", f"token ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})")
    needed = len(request.prompt_ids) + request.params.max_tokens + max_tree_nodes
    if needed > max_length:
        raise InvalidArgument(
            "max_tokens" if len(request.prompt_ids) < max_length else "prompt",
            f"prompt ({len(request.prompt_ids)} tokens) + max_tokens ({request.params.max_tokens}) + tree "
            f"({max_tree_nodes}) exceed the model's context of {max_length} tokens",
        )



@dataclass
class SpeculationStats:
    target_steps: int = 0  # verification passes that committed tokens (prefill included in the first)
    drafted_nodes: int = 0  # tree nodes sent to verification
    accepted_tokens: int = 0  # drafted tokens the target kept
    committed_tokens: int = 0  # accepted + recovered/bonus tokens
    resyncs: int = 0  # steps sent again with the history (a verifier lost or changed)
    drafter_failures: int = 0  # drafter calls that raised (each cost that step's proposal, not the request)
    first_token_s: float = 0.0  # time to the first committed token (includes the prefill)
    total_s: float = 0.0
    draft_s: float = 0.0  # time spent waiting for drafters
    drafted_ahead: int = 0  # steps whose tree was drafted during the previous verification
    verify_s: float = 0.0  # time spent waiting for verification (queue + target pass)
    verifier_s: float = 0.0  # of verify_s, the verifier's own work (prefill, passes); the rest is queue and transport
    request_kind: str = ""  # the request kind its drafters were routed by
    drafter_steps: dict[str, int] = field(default_factory=dict)  # drafter -> steps it drafted for

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per target forward (1.0 = plain decoding)."""
        return self.committed_tokens / self.target_steps if self.target_steps else 0.0


@dataclass
class StepOutput:
    token_ids: list[int]  # newly committed tokens, in order
    finish_reason: str | None  # "stop", "length", or None while generating
    outcome: StepOutcome | None = None  # how the step went (budget, tree, timings), for the stream's timeline


IN_PROCESS = "in-process"  # the address of a drafter that runs in the caller's process


class AsyncDrafter(Protocol):
    """A drafter as the loop calls it: in this process (``LocalDrafter``) or a service (``RemoteDrafter``).
    A feature drafter reads the target's hidden states of ``feature_layers``: the loop asks the verifier
    for them and hands each step's block over after the commit (``add_features``)."""

    name: str
    kind: str  # as ``Drafter.kind``
    domains: tuple[str, ...]  # the request kinds it is an expert in (empty: none in particular)
    feature_layers: tuple[int, ...]
    address: str  # where it runs (``IN_PROCESS``, or its service's host:port)

    @property
    def healthy(self) -> bool:
        """Whether it may be asked now (a service in back-off after failing is not)."""

    async def start(self, request_id: str, prompt_ids: Sequence[int]) -> None: ...

    async def propose(self, request_id: str, budget: int, assumed: Sequence[int] = ()) -> TokenTree: ...

    async def commit(self, request_id: str, new_token_ids: Sequence[int]) -> None: ...

    async def add_features(self, request_id: str, features: Features) -> None: ...

    async def end(self, request_id: str) -> None: ...


class VerifierClient(Protocol):
    async def verify(self, job: VerifyJob) -> VerifyResult: ...

    async def backlog(self) -> int:
        """Jobs waiting for a verifier (0 where nothing queues)."""

    async def close(self, request_id: str) -> None: ...


class LocalDrafter:
    """An in-process drafter behind the asynchronous interface (runs inline: deterministic, no threads).

    It keeps each request's committed tokens, so after one of its drafter's calls raised (and left the
    drafter's session in an unknown state) the next proposal re-opens the session with the whole context,
    as a remote drafter's session is re-opened after a restart. Exceptions still reach the loop, which
    logs and counts them and drafts without this drafter for that step.
    """

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self.name = drafter.name
        self.kind = drafter.kind
        self.domains = tuple(drafter.domains)
        self.feature_layers = tuple(drafter.feature_layers)
        self.address = IN_PROCESS
        self.healthy = True
        self._context: dict[str, list[int]] = {}  # request -> every committed token
        self._stale: set[str] = set()  # requests whose session a failed call may have left inconsistent

    async def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        self._context[request_id] = list(prompt_ids)
        self._call(request_id, self.drafter.start, request_id, prompt_ids)

    async def propose(self, request_id: str, budget: int, assumed: Sequence[int] = ()) -> TokenTree:
        if request_id in self._stale:
            self._call(request_id, self.drafter.end, request_id)
            self._call(request_id, self.drafter.start, request_id, self._context[request_id])
            self._stale.discard(request_id)
        return self._call(request_id, self.drafter.propose, request_id, budget, assumed)

    async def commit(self, request_id: str, new_token_ids: Sequence[int]) -> None:
        self._context[request_id].extend(new_token_ids)
        self._call(request_id, self.drafter.commit, request_id, new_token_ids)

    async def add_features(self, request_id: str, features: Features) -> None:
        self._call(request_id, self.drafter.add_features, request_id, features)

    async def end(self, request_id: str) -> None:
        self._context.pop(request_id, None)
        self._stale.discard(request_id)
        self.drafter.end(request_id)

    def _call(self, request_id: str, method, *args):
        try:
            return method(*args)
        except Exception:
            self._stale.add(request_id)
            raise


class BatchingVerifier:
    """In-process verifier client: once every expected request has a job in, verify them in one pass.

    ``expect`` names the requests that will send jobs; a request leaves the count when it closes. This
    reproduces lock-step batched decoding: each target pass carries one tree of every live request.
    """

    def __init__(self, verifier: TreeVerifier) -> None:
        self.verifier = verifier
        self._expected: set[str] = set()
        self._pending: list[tuple[VerifyJob, asyncio.Future]] = []

    def expect(self, request_ids: Sequence[str]) -> None:
        self._expected.update(request_ids)

    async def verify(self, job: VerifyJob) -> VerifyResult:
        future = asyncio.get_running_loop().create_future()
        self._pending.append((job, future))
        self._flush_if_complete()
        return await future

    async def close(self, request_id: str) -> None:
        self._expected.discard(request_id)
        self.verifier.close(request_id)
        self._flush_if_complete()

    def _flush_if_complete(self) -> None:
        if not self._pending or len(self._pending) < len(self._expected):
            return
        batch, self._pending = self._pending, []
        try:
            results = self.verifier.verify([job for job, _ in batch])
        except Exception as exc:  # every waiter hears of it, none hangs
            for _, future in batch:
                future.set_exception(exc)
            return
        for (_, future), result in zip(batch, results):
            future.set_result(result)


@dataclass(frozen=True)
class Draft:
    """One step's drafting: the plan, each asked drafter's own tree, and their fusion."""

    plan: StepPlan
    trees: tuple[TokenTree, ...]  # aligned with plan.drafters
    fused: TokenTree
    drafter_ms: tuple[float, ...] = ()  # each drafter's time (aligned with plan.drafters)
    fuse_ms: float = 0.0  # merging their trees into one

    def below(self, token: int) -> Draft | None:
        """What this draft says after ``token`` (a draft made ahead, once the verdict confirmed its path)."""
        fused = self.fused.below(token)
        if fused is None:
            return None
        return Draft(self.plan, tuple(t.below(token) or TokenTree() for t in self.trees), fused)


async def speculate(
    request: Request,
    drafters: Sequence[AsyncDrafter],
    verifier: VerifierClient,
    policy: RequestPolicy | int,
    eos_token_ids: frozenset[int] = frozenset(),
    stats: SpeculationStats | None = None,
    draft_ahead: bool = False,
) -> AsyncIterator[StepOutput]:
    """Run one request to completion, yielding the tokens each step commits.

    ``policy`` plans each step — which drafters, their trust, the tree budget — and learns from its
    outcome (``policy.py``); an int is a fixed budget with every drafter. With ``draft_ahead``, while a
    tree is being verified the asked drafters already draft the next one as if the tree's likeliest
    path were accepted; when the verdict accepts that whole path, the draft's subtree under the bonus
    token is the next tree, else it is thrown away. Closing the iterator early (cancellation, a client
    that went away) still frees every drafter session and the verifier's KV cache.
    """
    stats = stats if stats is not None else SpeculationStats()
    if isinstance(policy, int):
        policy = FixedPolicy().begin(GENERAL, policy)
    by_name = {d.name: d for d in drafters}
    if len(by_name) != len(drafters):
        raise ValueError(f"drafter names must be unique: {[d.name for d in drafters]}")
    stats.request_kind = policy.kind
    feature_layers = tuple(sorted({n for d in drafters for n in d.feature_layers}))
    started = time.perf_counter()
    context = list(request.prompt_ids)  # every committed token; the last one is the next tree's root
    produced = 0
    rid = request.request_id
    pending: list[asyncio.Future] = []  # verification and draft-ahead in flight, cancelled on exit
    try:
        await asyncio.gather(*(_guarded(d, "start", rid, stats, request.prompt_ids) for d in drafters))
        step = 0
        send_history = True  # the first job always prefills
        ahead: Draft | None = None  # a draft made during the last verification and confirmed by its verdict
        while True:
            room = request.params.max_tokens - produced
            plan = policy.plan(room, [d.name for d in drafters if d.healthy], len(context))
            step_started = time.perf_counter()
            if ahead is not None and plan.budget > 0:  # its drafting time was hidden behind the last verification
                draft = Draft(ahead.plan, ahead.trees, ahead.fused.truncated(plan.budget).within_depth(room - 1))
                draft_ms = 0.0
                stats.drafted_ahead += 1
            else:
                drafted_at = time.perf_counter()
                draft = await _draft(by_name, plan, rid, stats, max_depth=room - 1)
                raise_if_cancelled()  # a client that left stops the request here, whatever swallowed it below
                draft_ms = (time.perf_counter() - drafted_at) * 1e3
                stats.draft_s += draft_ms / 1e3
            for name in draft.plan.drafters:
                stats.drafter_steps[name] = stats.drafter_steps.get(name, 0) + 1
            tree = draft.fused
            verified_at = time.perf_counter()
            verifying = asyncio.ensure_future(_verify(verifier, request, step, context, tree, send_history, stats,
                                                      feature_layers))
            pending = [verifying]
            assumed = tree.likeliest_path() if draft_ahead and len(tree) else []
            if assumed:
                pending.append(asyncio.ensure_future(
                    _draft(by_name, plan, rid, stats, max_depth=room - len(assumed) - 2, assumed=assumed)))
            result = await verifying
            raise_if_cancelled()  # the verification task may have swallowed it (see specmesh.cancellation)
            stats.verify_s += time.perf_counter() - verified_at
            stats.verifier_s += result.verify_ms / 1e3
            send_history = False
            verdict = result.verdict
            new = list(verdict.tokens)
            finish_reason = None
            stop_at = next((i for i, t in enumerate(new) if t in eos_token_ids), None)
            if stop_at is not None and stop_at < room:
                new, finish_reason = new[: stop_at + 1], "stop"
            elif len(new) >= room:
                new, finish_reason = new[:room], "length"
            stats.target_steps += 1
            stats.drafted_nodes += len(tree)
            stats.accepted_tokens += min(verdict.num_accepted, len(new))
            stats.committed_tokens += len(new)
            if not produced:
                stats.first_token_s = time.perf_counter() - started
            produced += len(new)
            context.extend(new)
            step += 1
            ahead = None
            if assumed:
                drafted_ahead = await pending[1]  # the drafters finish before they hear the verdict
                if finish_reason is None and new[:-1] == assumed:
                    ahead = drafted_ahead.below(new[-1])
            pending = []
            step_ms = (time.perf_counter() - step_started) * 1e3
            outcome = StepOutcome(draft.plan, draft.trees, tree, tuple(new), draft_ms, draft.drafter_ms, step_ms,
                                  result.pass_ms, result.batch_rows, result.batch_size, result.batch_trees,
                                  draft.fuse_ms, result.prefilled_tokens, result.verify_ms, result.queue_ms)
            policy.observe(outcome)
            if log.isEnabledFor(logging.DEBUG):  # why a request speculated as it did, step by step
                log.debug("%s step %d at %d: drafters %s budget %d -> tree %d, committed %d; draft %.1f ms "
                          "(%s), pass %.1f ms, step %.1f ms, batch %d", rid, step, len(context) - len(new),
                          ",".join(draft.plan.drafters) or "-", draft.plan.budget, len(tree), len(new), draft_ms,
                          " ".join(f"{ms:.1f}" for ms in draft.drafter_ms), result.pass_ms, step_ms, result.batch_size)
            for drafter in drafters:  # also the last: history drafters keep answers
                # bookkeeping, sent with the next proposal: one at a time costs no gather
                await _guarded(drafter, "commit", rid, stats, new)
                layers = drafter.feature_layers
                if layers and result.features is not None and finish_reason is None:
                    await _guarded(drafter, "add_features", rid, stats, result.features.of_layers(layers))
            yield StepOutput(new, finish_reason, outcome)
            if finish_reason is not None:
                return
    finally:
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        stats.total_s = time.perf_counter() - started
        policy.end()
        await asyncio.shield(_release(drafters, verifier, rid))


async def _guarded(drafter: AsyncDrafter, call: str, request_id: str, stats: SpeculationStats, *args):
    """Await the drafter's ``call`` for the request; if it raises, log it with its traceback, count it, and
    return None. The call is made here, not by the caller: one cancelled before this ran makes none."""
    try:
        return await getattr(drafter, call)(request_id, *args)
    except Exception:
        stats.drafter_failures += 1
        log.warning("drafter %s failed in %s for request %s; the request goes on without its draft",
                    drafter.name, call, request_id, exc_info=True)
        return None


async def _draft(
    drafters: dict[str, AsyncDrafter], plan: StepPlan, request_id: str, stats: SpeculationStats, max_depth: int,
    assumed: Sequence[int] = (),
) -> Draft:
    # a step commits at most depth + 1 tokens: deeper guesses than the answer has room for are waste
    if plan.budget <= 0 or max_depth <= 0 or not plan.drafters:
        return Draft(StepPlan(), (), TokenTree())

    async def timed(name: str) -> tuple[TokenTree, float]:
        started = time.perf_counter()
        drafter = drafters[name]
        tree = await _guarded(drafter, "propose", request_id, stats, plan.budget, assumed)
        return tree if tree is not None else TokenTree(), (time.perf_counter() - started) * 1e3

    answers = await asyncio.gather(*(timed(n) for n in plan.drafters))
    trees = [tree for tree, _ in answers]
    fusing = time.perf_counter()
    fused = fuse_trees(trees, plan.budget, plan.weights).within_depth(max_depth)
    return Draft(plan, tuple(trees), fused, tuple(ms for _, ms in answers), (time.perf_counter() - fusing) * 1e3)


async def _verify(
    verifier: VerifierClient, request: Request, step: int, context: list[int], tree: TokenTree,
    send_history: bool, stats: SpeculationStats, feature_layers: tuple[int, ...] = (),
) -> VerifyResult:
    for attempt in range(MAX_RESYNCS_PER_STEP + 1):
        with_history = send_history or attempt > 0
        job = VerifyJob(
            request.request_id, step, position=len(context) - 1, root=context[-1], tree=tree,
            params=request.params, history=tuple(context[:-1]) if with_history else None,
            feature_layers=feature_layers,
        )
        result = await verifier.verify(job)
        if result.failed:
            raise RequestFailed(f"the target could not verify this request at {result.failed}")
        if not result.resync:
            return result
        stats.resyncs += 1
    raise Unavailable(
        f"the verifiers asked for this request's history {MAX_RESYNCS_PER_STEP + 1} times in one step; retry later"
    )


async def _release(drafters: Sequence[AsyncDrafter], verifier: VerifierClient, request_id: str) -> None:
    parts = [*(d.end(request_id) for d in drafters), verifier.close(request_id)]
    ends = await asyncio.gather(*parts, return_exceptions=True)
    for part, outcome in zip([d.name for d in drafters] + ["the verifier"], ends):
        if isinstance(outcome, Exception):
            log.warning("%s failed to free request %s", part, request_id, exc_info=outcome)
