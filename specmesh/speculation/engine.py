"""The in-process engine: the speculation loop (``loop.speculate``) with local drafters and a local,
lock-step batching verifier. With no drafters (or a budget of 0) every tree is empty and each step is
exactly one step of plain batched decoding.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from dataclasses import dataclass
from typing import Sequence

from specmesh.drafters.base import Drafter
from specmesh.errors import InvalidArgument
from specmesh.runtime.target import TargetRuntime
from specmesh.runtime.tree_verifier import TreeVerifier
from specmesh.speculation.loop import (
    BatchingVerifier,
    LocalDrafter,
    Request,
    SpeculationStats,
    speculate,
    validate_request,
)
from specmesh.speculation.policy import FixedPolicy, SpeculationPolicy
from specmesh.tree import MAX_TREE_NODES

__all__ = ["Completion", "Request", "SpeculationStats", "SpeculativeEngine"]


@dataclass
class Completion:
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

    def validate(self, request: Request) -> None:
        validate_request(request, self.target.vocab_size, self.target.max_length, self.max_tree_nodes)

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        """Generate every request to completion, all of them in each target pass."""
        for request in requests:
            self.validate(request)
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise InvalidArgument("request_id", "two requests in one batch share an id")
        return asyncio.run(self._generate_all(requests))

    async def _generate_all(self, requests: Sequence[Request]) -> list[Completion]:
        batcher = BatchingVerifier(self.verifier)
        batcher.expect([r.request_id for r in requests])
        drafters = [LocalDrafter(d) for d in self.drafters] if self.max_tree_nodes > 0 else []
        return list(await asyncio.gather(*(self._run(r, drafters, batcher) for r in requests)))

    async def _run(self, request: Request, drafters: list[LocalDrafter], batcher: BatchingVerifier) -> Completion:
        stats = SpeculationStats()
        policy = None
        tokens: list[int] = []
        finish_reason = "length"
        try:
            policy = self.policy.begin(request.kind, self.max_tree_nodes)
            async with aclosing(speculate(request, drafters, batcher, policy, self.eos_token_ids, stats)) as steps:
                async for step in steps:
                    tokens.extend(step.token_ids)
                    finish_reason = step.finish_reason or finish_reason
        finally:
            if policy is not None:
                policy.end()
            await batcher.close(request.request_id)  # also when the loop never started: others must not wait for it
        return Completion(request.request_id, tokens, finish_reason, stats)
