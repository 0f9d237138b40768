"""The router's domain logic: turn a client's request into token ids, admit it within the limits, and
run the speculation loop with the remote drafters and the queue-backed verifier client.

The servicer in ``services/router`` only converts messages; everything here is testable without gRPC.
"""

from __future__ import annotations

import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence

from specmesh.engine import MAX_TREE_NODES, validate_request
from specmesh.errors import InvalidArgument, ResourceExhausted
from specmesh.loop import AsyncDrafter, Request, SpeculationStats, StepOutput, VerifierClient, speculate
from specmesh.sampling import SamplingParams

MAX_REQUEST_ID = 128
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ModelCard:
    name: str
    vocab_size: int
    max_length: int
    tokenizer_hash: str
    eos_token_ids: frozenset[int]


@dataclass
class RouterLimits:
    max_concurrent_requests: int = 64
    max_queue_backlog: int = 256  # pool jobs no verifier has taken yet: beyond this, new requests wait elsewhere
    default_max_tokens: int = 256
    max_tree_nodes: int = 8
    draft_ahead: bool = True  # draft the next tree while the current one is verified


@dataclass
class Generation:
    """A request in flight: its tokens so far and, when finished, why and its statistics."""

    request: Request
    prompt_tokens: int
    drafters: list[str]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: SpeculationStats = field(default_factory=SpeculationStats)


class Router:
    def __init__(
        self, tokenizer, card: ModelCard, drafters: Sequence[AsyncDrafter], verifier: VerifierClient,
        limits: RouterLimits | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.card = card
        self.drafters = list(drafters)
        self.verifier = verifier
        self.limits = limits or RouterLimits()
        self.active = 0

    # ---- inputs ----

    def encode_text(self, text: str) -> list[int]:
        if not text:
            raise InvalidArgument("prompt", "is empty")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        if not messages:
            raise InvalidArgument("chat", "has no messages")
        for i, (role, _) in enumerate(messages):
            if role not in ROLES:
                raise InvalidArgument(f"chat.messages[{i}].role", f"is {role!r}; use one of {', '.join(ROLES)}")
        rendered = self.tokenizer.apply_chat_template(
            [{"role": r, "content": c} for r, c in messages], add_generation_prompt=True, tokenize=True,
        )
        return list(rendered["input_ids"] if isinstance(rendered, dict) or hasattr(rendered, "keys") else rendered)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def make_request(
        self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str = "", max_tree_nodes: int | None = None,
    ) -> tuple[Request, int]:
        """A validated request and its tree budget."""
        if len(request_id) > MAX_REQUEST_ID:
            raise InvalidArgument("request_id", f"is {len(request_id)} characters; at most {MAX_REQUEST_ID}")
        budget = self.limits.max_tree_nodes if max_tree_nodes is None else max_tree_nodes
        if not 0 <= budget <= MAX_TREE_NODES:
            raise InvalidArgument("max_tree_nodes", f"must be in 0..{MAX_TREE_NODES}, got {budget}")
        # the internal id is always fresh: a client's id names its request to it, but two clients (or one
        # retrying) may reuse an id, and drafter and verifier state is keyed by it
        internal_id = f"{request_id}:{uuid.uuid4().hex}" if request_id else uuid.uuid4().hex
        request = Request(tuple(int(t) for t in prompt_ids), params, internal_id)
        validate_request(request, self.card.vocab_size, self.card.max_length, budget)
        return request, budget

    # ---- generation ----

    async def generate(self, request: Request, budget: int) -> AsyncIterator[tuple[Generation, StepOutput]]:
        """Admit the request (or refuse it with ResourceExhausted) and yield each step's tokens."""
        if self.active >= self.limits.max_concurrent_requests:
            raise ResourceExhausted(
                f"{self.active} requests are in flight, the limit is {self.limits.max_concurrent_requests}; retry later"
            )
        backlog = await self.verifier.backlog() if hasattr(self.verifier, "backlog") else 0
        if backlog > self.limits.max_queue_backlog:
            raise ResourceExhausted(f"the verification queue holds {backlog} jobs; retry later")
        drafters = [d for d in self.drafters if getattr(d, "healthy", True)] if budget > 0 else []
        generation = Generation(request, len(request.prompt_ids), [d.name for d in drafters])
        self.active += 1
        try:
            steps = speculate(request, drafters, self.verifier, budget, self.card.eos_token_ids, generation.stats,
                              draft_ahead=self.limits.draft_ahead)
            async with aclosing(steps):
                async for step in steps:
                    generation.token_ids.extend(step.token_ids)
                    generation.finish_reason = step.finish_reason
                    yield generation, step
        finally:
            self.active -= 1


class TextStream:
    """Incremental detokenization: the text of newly committed tokens, holding back a partial character."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.tokens: list[int] = []
        self.sent = 0  # characters already emitted

    def push(self, token_ids: Sequence[int], final: bool = False) -> str:
        self.tokens.extend(token_ids)
        text = self.router.decode(self.tokens)
        if not final and text.endswith("\ufffd"):  # a multi-byte character split across tokens
            return ""
        delta, self.sent = text[self.sent :], len(text)
        return delta
