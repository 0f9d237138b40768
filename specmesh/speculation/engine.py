"""The in-process engine: the engine core (``engine_core.EngineCore``) with local drafters and the
target's tree verifier in this process, driven until every request is done. Each target pass carries
one tree of every running request. With no drafters (or a budget of 0) every tree is empty and each step
is exactly one step of plain batched decoding.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Sequence

from specmesh.drafters.base import Drafter
from specmesh.errors import InvalidArgument
from specmesh.runtime.target import TargetRuntime
from specmesh.runtime.tree_verifier import TreeVerifier, VerifyJob, VerifyResult
from specmesh.speculation.batch_budget import BatchBudget
from specmesh.speculation.drafting import LocalDrafter
from specmesh.speculation.engine_core import EngineCore
from specmesh.speculation.requests import Request, SpeculationStats, validate_request
from specmesh.speculation.policy import FixedPolicy, SpeculationPolicy
from specmesh.tree import MAX_TREE_NODES

__all__ = ["FinishedRequest", "Request", "SpeculationStats", "SpeculativeEngine"]


@dataclass
class FinishedRequest:
    request_id: str
    token_ids: list[int]
    finish_reason: str  # "stop" (an end-of-sequence token) or "length" (max_tokens reached)
    stats: SpeculationStats


class SpeculativeEngine:
    def __init__(
        self,
        target: TargetRuntime,
        drafters: Sequence[Drafter] = (),
        max_tree_nodes: int = 8,
        eos_token_ids: Sequence[int] = (),
        policy: SpeculationPolicy | None = None,
    ) -> None:
        """``policy`` plans every step (default: every drafter, the whole budget, every step)."""
        if not 0 <= max_tree_nodes <= MAX_TREE_NODES:
            raise InvalidArgument("max_tree_nodes", f"must be in 0..{MAX_TREE_NODES}, got {max_tree_nodes}")
        self.target = target
        self.drafters = list(drafters)
        self.max_tree_nodes = max_tree_nodes
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.policy = policy or FixedPolicy()
        self.verifier = TreeVerifier(target, max_tree_nodes=MAX_TREE_NODES)
        self.budget = BatchBudget()  # what each arm gave, kept from one call to the next as the policy's learning is

    def validate(self, request: Request) -> None:
        validate_request(request, self.target.vocab_size, self.target.max_length, self.max_tree_nodes)

    def generate(self, requests: Sequence[Request], concurrency: int | None = None) -> list[FinishedRequest]:
        """Generate every request to completion: all of them in each target pass, or at most ``concurrency``
        at a time, the next joining at the step one ends (as a server's stream of requests would)."""
        if concurrency is not None and concurrency < 1:
            raise InvalidArgument("concurrency", f"must be >= 1, got {concurrency}")
        for request in requests:
            self.validate(request)
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise InvalidArgument("request_id", "two requests in one batch share an id")
        return asyncio.run(self._generate_all(requests, min(concurrency or len(requests), self.verifier.max_sessions)))

    async def _generate_all(self, requests: Sequence[Request], concurrency: int) -> list[FinishedRequest]:
        core = EngineCore(InlineExecutor(self.verifier), self.eos_token_ids, max_running=concurrency,
                          budget=self.budget)
        drafters = [LocalDrafter(d) for d in self.drafters] if self.max_tree_nodes > 0 else []
        completions = {r.request_id: FinishedRequest(r.request_id, [], "length", SpeculationStats()) for r in requests}
        try:
            for request in requests:
                core.add(request, self.policy.begin(request.kind, self.max_tree_nodes), drafters,
                         completions[request.request_id].stats)
            while core.num_requests:
                for output in await core.step():
                    if output.error is not None:
                        raise output.error
                    completion = completions[output.request_id]
                    completion.token_ids.extend(output.token_ids)
                    completion.finish_reason = output.finish_reason or completion.finish_reason
        finally:
            await core.close()
        return [completions[r.request_id] for r in requests]


class InlineExecutor:
    """The tree verifier of this process, as the engine core calls it."""

    def __init__(self, verifier: TreeVerifier) -> None:
        self.verifier = verifier

    async def verify(self, jobs: list[VerifyJob]) -> list[VerifyResult]:
        return self.verifier.verify(jobs)

    async def close(self, request_id: str) -> None:
        self.verifier.close(request_id)
