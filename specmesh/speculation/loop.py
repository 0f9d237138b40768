"""The router's speculation loop of one request: draft, fuse, verify, commit — until a stop token or
max_tokens. (The in-process engine runs the engine core instead, ``engine_core.py``, one loop for every
request; this per-request loop goes once the verifiers run that core too.)

Written against two narrow asynchronous interfaces: drafters (``AsyncDrafter``) and a verifier client
(``VerifierClient``), in the cluster adapters over gRPC and the Redis pipeline queue. Many requests run
this loop concurrently; the verifier side groups their jobs into batches.

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
from typing import AsyncIterator, Protocol, Sequence

from specmesh.cancellation import raise_if_cancelled
from specmesh.errors import RequestFailed, Unavailable
from specmesh.runtime.tree_verifier import VerifyJob, VerifyResult
from specmesh.speculation.drafting import AsyncDrafter, Draft, draft_step, guarded
from specmesh.speculation.expertise import GENERAL
from specmesh.speculation.policy import FixedPolicy, RequestPolicy, StepOutcome
from specmesh.speculation.requests import Request, SpeculationStats, StepOutput
from specmesh.tree import TokenTree

log = logging.getLogger(__name__)

MAX_RESYNCS_PER_STEP = 3  # a verifier that keeps asking for history is broken, not slow


class VerifierClient(Protocol):
    async def verify(self, job: VerifyJob) -> VerifyResult: ...

    async def backlog(self) -> int:
        """Jobs waiting for a verifier (0 where nothing queues)."""

    async def close(self, request_id: str) -> None: ...


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
        await asyncio.gather(*(guarded(d, "start", rid, stats, request.prompt_ids) for d in drafters))
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
                draft = await draft_step(by_name, plan, rid, stats, max_depth=room - 1)
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
                    draft_step(by_name, plan, rid, stats, max_depth=room - len(assumed) - 2, assumed=assumed)))
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
                await guarded(drafter, "commit", rid, stats, new)
                layers = drafter.feature_layers
                if layers and result.features is not None and finish_reason is None:
                    await guarded(drafter, "add_features", rid, stats, result.features.of_layers(layers))
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
