"""The speculation loop: draft, fuse, verify a batch of trees in one target pass, commit, repeat.

This is the one code path that generates tokens; the services wrap it with remote drafters and
verifiers. With no drafters (or a budget of 0) every tree is empty and each step is exactly one
step of plain batched decoding.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Sequence

import torch

from specmesh.acceptance import Verdict, verify_greedy, verify_mss
from specmesh.drafters.base import Drafter
from specmesh.errors import InvalidArgument
from specmesh.fusion import fuse_trees
from specmesh.models.llama import TreeBatch
from specmesh.models.runtime import TargetRuntime
from specmesh.sampling import SamplingParams, target_probabilities
from specmesh.tree import TokenTree, compile_tree

MAX_TREE_NODES = 64
PREFILL_CHUNK = 512  # prompt tokens per prefill pass: bounds the attention scores' memory


@dataclass(frozen=True)
class Request:
    prompt_ids: tuple[int, ...]
    params: SamplingParams = SamplingParams()
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass
class SpeculationStats:
    target_steps: int = 0  # target forward passes after the prefill
    drafted_nodes: int = 0  # tree nodes sent to verification
    accepted_tokens: int = 0  # drafted tokens the target kept
    committed_tokens: int = 0  # accepted + recovered/bonus tokens
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per target forward (1.0 = plain decoding)."""
        return self.committed_tokens / self.target_steps if self.target_steps else 0.0


@dataclass
class Completion:
    request_id: str
    token_ids: list[int]
    finish_reason: str  # "stop" (an end-of-sequence token) or "length" (max_tokens reached)
    stats: SpeculationStats


@dataclass
class _Active:
    request: Request
    session: object  # the runtime's KV session
    generator: torch.Generator | None
    pending: int  # the last committed token: the root of the next tree, not yet in the KV cache
    output: list[int] = field(default_factory=list)
    stats: SpeculationStats = field(default_factory=SpeculationStats)
    finish_reason: str | None = None


class SpeculativeEngine:
    def __init__(
        self,
        target: TargetRuntime,
        drafters: Sequence[Drafter] = (),
        max_tree_nodes: int = 8,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        if not 0 <= max_tree_nodes <= MAX_TREE_NODES:
            raise InvalidArgument("max_tree_nodes", f"must be in 0..{MAX_TREE_NODES}, got {max_tree_nodes}")
        self.target = target
        self.drafters = list(drafters)
        self.max_tree_nodes = max_tree_nodes
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)

    def validate(self, request: Request) -> None:
        if not request.prompt_ids:
            raise InvalidArgument("prompt", "is empty; give at least one token")
        bad = [t for t in request.prompt_ids if not 0 <= t < self.target.vocab_size]
        if bad:
            raise InvalidArgument("prompt", f"token ids {bad[:5]} are outside the vocabulary (0..{self.target.vocab_size - 1})")
        needed = len(request.prompt_ids) + request.params.max_tokens + self.max_tree_nodes
        if needed > self.target.max_length:
            raise InvalidArgument(
                "max_tokens" if len(request.prompt_ids) < self.target.max_length else "prompt",
                f"prompt ({len(request.prompt_ids)} tokens) + max_tokens ({request.params.max_tokens}) + tree "
                f"({self.max_tree_nodes}) exceed the model's context of {self.target.max_length} tokens",
            )

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        """Generate every request to completion, all of them in each target pass."""
        for request in requests:
            self.validate(request)
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise InvalidArgument("request_id", "two requests in one batch share an id")
        active: list[_Active] = []
        try:
            self._admit(requests, active)
            while any(a.finish_reason is None for a in active):
                self.step([a for a in active if a.finish_reason is None])
        finally:
            for a in active:
                self._release(a)
        return [Completion(a.request.request_id, a.output, a.finish_reason or "length", a.stats) for a in active]

    def _admit(self, requests: Sequence[Request], active: list[_Active]) -> None:
        """Open sessions (into ``active``, so a failure still frees them) and prefill every prompt but
        its last token, which becomes the first root."""
        for request in requests:
            session = self.target.new_session()
            generator = None if request.params.greedy else request.params.generator(self.target.device)
            active.append(_Active(request, session, generator, pending=request.prompt_ids[-1]))
            for drafter in self.drafters:
                drafter.start(request.request_id, request.prompt_ids)
        self._prefill(active)

    def _prefill(self, active: list[_Active]) -> None:
        """Cache every prompt but its last token, in chunks so attention memory stays bounded."""
        started = time.perf_counter()
        while True:
            pending = [a for a in active if a.session.length < len(a.request.prompt_ids) - 1]
            if not pending:
                break
            trees = []
            for a in pending:
                chunk = a.request.prompt_ids[a.session.length : len(a.request.prompt_ids) - 1][:PREFILL_CHUNK]
                trees.append(compile_tree(chunk[0], TokenTree.chain(chunk[1:])))
            self.target.forward(
                TreeBatch.build([a.session for a in pending], trees), logits_rows=torch.empty(0, dtype=torch.long)
            )
            for a, tree in zip(pending, trees):
                a.session.keep_rows(list(range(tree.num_rows)))
        for a in active:
            a.stats.prefill_s = time.perf_counter() - started

    def step(self, active: list[_Active]) -> None:
        """One speculation step for every active request: one target forward for all of them."""
        started = time.perf_counter()
        trees = [compile_tree(a.pending, self._draft(a)) for a in active]
        logits = self.target.forward(TreeBatch.build([a.session for a in active], trees))  # [total_rows, vocab]
        offset = 0
        for a, tree in zip(active, trees):
            rows = logits[offset : offset + tree.num_rows]
            offset += tree.num_rows
            params = a.request.params
            if params.greedy:
                verdict = verify_greedy(tree, rows)
            else:
                verdict = verify_mss(tree, target_probabilities(rows, params), a.generator)
            a.session.keep_rows([0] + [node + 1 for node in verdict.accepted_nodes])
            a.stats.target_steps += 1
            a.stats.drafted_nodes += len(tree.tree)
            self._commit(a, verdict)
        elapsed = time.perf_counter() - started
        for a in active:
            a.stats.decode_s += elapsed

    def _draft(self, a: _Active) -> TokenTree:
        # a step commits at most depth + 1 tokens: deeper guesses than the answer has room for are waste
        max_depth = a.request.params.max_tokens - len(a.output) - 1
        if self.max_tree_nodes <= 0 or max_depth <= 0 or not self.drafters:
            return TokenTree()
        trees = [d.propose(a.request.request_id, self.max_tree_nodes) for d in self.drafters]
        return fuse_trees(trees, self.max_tree_nodes).within_depth(max_depth)

    def _commit(self, a: _Active, verdict: Verdict) -> None:
        new = list(verdict.tokens)
        room = a.request.params.max_tokens - len(a.output)
        stop_at = next((i for i, t in enumerate(new) if t in self.eos_token_ids), None)
        if stop_at is not None and stop_at < room:
            new = new[: stop_at + 1]
            a.finish_reason = "stop"
        elif len(new) >= room:
            new = new[:room]
            a.finish_reason = "length"
        a.stats.accepted_tokens += min(verdict.num_accepted, len(new))
        a.stats.committed_tokens += len(new)
        a.output.extend(new)
        # the previous root is now committed (in the KV cache); the newest token is the next root
        for drafter in self.drafters:
            drafter.commit(a.request.request_id, new)
        a.pending = new[-1]

    def _release(self, a: _Active) -> None:
        a.session.free()
        for drafter in self.drafters:
            drafter.end(a.request.request_id)
