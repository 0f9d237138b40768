"""A request to the speculation engine, its validation, and what each of its steps gives back."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from specmesh.errors import InvalidArgument
from specmesh.sampling import SamplingParams
from specmesh.speculation.policy import StepOutcome


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
    late_drafts: int = 0  # proposals dropped for coming after their deadline (``draft_deadline.py``)
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
    outcome: StepOutcome | None = None  # how the step went (plan, trees, timings), where the step ran here
    timing: StepTiming | None = None  # the stream's timeline entry (from ``outcome`` where there is one)

    def __post_init__(self) -> None:
        if self.timing is None and self.outcome is not None:
            self.timing = StepTiming.of(self.outcome)


@dataclass(frozen=True)
class StepTiming:
    """A step as a stream's timeline shows it."""

    budget: int  # tree nodes the controller allowed
    tree_nodes: int  # nodes verified
    draft_ms: float
    pass_ms: float
    step_ms: float
    batch_size: int  # requests in the pass

    @classmethod
    def of(cls, outcome: StepOutcome) -> StepTiming:
        return cls(outcome.plan.budget, len(outcome.fused), outcome.draft_ms, outcome.pass_ms, outcome.step_ms,
                   outcome.batch_size)
