"""The router service's domain logic, its ``Gateway``: turn a client's request into token ids, classify it,
admit it within the limits to the verifiers, which run its steps (``pipeline/engine_client.py``), and stream its answer. The
router's adaptive policy (expertise routing, trust-weighted fusion, goodput budget) learns from what the
verifiers report and is published to them (``pipeline/policy_sync.py``).

The servicer in ``services/router`` only converts messages; everything here is testable without gRPC.
"""

from __future__ import annotations

import asyncio
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Callable, Sequence, TypeVar

from jinja2 import TemplateError

from specmesh.cancellation import raise_if_cancelled
from specmesh.cluster.metrics import RequestClock, RouterMetrics
from specmesh.cluster.pipeline.engine_client import EngineClient
from specmesh.cluster.pipeline.verifier_watch import VerifierWatch
from specmesh.cluster.serving import Server
from specmesh.cluster.service_settings import RouterSettings
from specmesh.cluster.settings import default_of
from specmesh.errors import InvalidArgument, ResourceExhausted, Unavailable
from specmesh.prompts import check_text
from specmesh.sampling import SamplingParams
from specmesh.speculation.classifier import RequestClassifier
from specmesh.speculation.expertise import GENERAL
from specmesh.speculation.drafting import AsyncDrafter, one_per_name
from specmesh.speculation.requests import Request, SpeculationStats, StepOutput, validate_request
from specmesh.speculation.policy import AdaptivePolicy, adaptive_policy, check_speculation
from specmesh.tree import MAX_TREE_NODES

MAX_REQUEST_ID = 128
# A prompt's characters per token of context, at most: a longer text cannot fit the context, so it is
# refused before the tokenizer spends ~1 s per MB on it
PROMPT_CHARS_PER_TOKEN = 32
ROLES = ("system", "user", "assistant")
T = TypeVar("T")


@dataclass(frozen=True)
class ModelCard:
    name: str
    vocab_size: int
    max_length: int
    tokenizer_hash: str
    eos_token_ids: frozenset[int]


@dataclass
class GatewayLimits:
    """The router's limits and its defaults for requests: its settings of the same names."""

    max_concurrent: int = default_of(RouterSettings, "max_concurrent")
    max_queue_backlog: int = default_of(RouterSettings, "max_queue_backlog")  # admissions not taken yet
    default_max_tokens: int = default_of(RouterSettings, "default_max_tokens")
    max_tree_nodes: int = default_of(RouterSettings, "max_tree_nodes")  # a cap: adaptive picks smaller trees or none
    speculation: str = default_of(RouterSettings, "speculation")  # for requests that do not say


@dataclass(frozen=True)
class Ticket:
    """An admitted request and how to speculate for it."""

    request: Request
    budget: int  # at most this many tree nodes a step (0: plain decoding)
    speculation: str  # adaptive or fixed (ignored when the budget is 0)
    resumed: tuple[int, ...] = ()  # the answer's first tokens, which the client has (the prompt ends with them)


@dataclass
class RequestState:
    """A request in flight: its tokens so far and, when finished, why and its statistics."""

    request: Request
    prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: SpeculationStats = field(default_factory=SpeculationStats)

    @property
    def drafters(self) -> list[str]:
        """The drafters that drafted for the request."""
        return sorted(self.stats.drafter_steps)


class Gateway:
    """The router service's front door: requests in (validated, tokenized, classified, admitted), answers out."""

    def __init__(
        self, tokenizer, card: ModelCard, drafters: Sequence[AsyncDrafter], engine: EngineClient,
        limits: GatewayLimits | None = None, policy: AdaptivePolicy | None = None,
        classifier: RequestClassifier | None = None, metrics: RouterMetrics | None = None,
    ) -> None:
        """``engine``: the verifiers, which run the requests' steps: requests are admitted there and their
        answers read as deltas; ``drafters``: those the router reports and routes by (the verifiers draft);
        ``policy``: the adaptive policy over the drafters' names (default: built from their advertised
        domains); ``classifier``: the request kind from the prompt's text (default: none, every request is
        ``general`` and routing learns from acceptance alone); ``metrics``: where requests and latencies are
        counted (none: not counted)."""
        self.tokenizer = tokenizer
        self.card = card
        self.drafters = list(drafters)
        self.engine = engine
        self.limits = limits or GatewayLimits()
        check_speculation(self.limits.speculation)
        self.policy = policy or adaptive_policy({})
        self.classifier = classifier
        self.metrics = metrics  # the controller's state is exported where the steps run: the verifiers
        self.active = 0
        # one thread: encodings run one at a time (a fast tokenizer's encode may change its settings)
        self._inputs = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inputs")

    # ---- inputs ----

    async def prepare(self, fn: Callable[..., T], *args) -> T:
        """Run ``fn`` — reading a request: tokenizing, classifying, work that grows with the prompt — on the
        router's input thread, so that the event loop serves the others meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._inputs, fn, *args)

    def _check_length(self, field: str, characters: int) -> None:
        limit = self.card.max_length * PROMPT_CHARS_PER_TOKEN
        if characters > limit:
            raise InvalidArgument(field, f"is {characters} characters; a prompt the model's context of "
                                         f"{self.card.max_length} tokens can hold has at most {limit}")

    def encode_text(self, text: str) -> list[int]:
        if not text:
            raise InvalidArgument("prompt", "is empty")
        self._check_length("prompt", len(text))
        check_text("prompt", text)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        if not messages:
            raise InvalidArgument("chat", "has no messages")
        self._check_length("chat.messages", sum(len(content) for _, content in messages))
        for i, (role, content) in enumerate(messages):
            if role not in ROLES:
                raise InvalidArgument(f"chat.messages[{i}].role", f"is {role!r}; use one of {', '.join(ROLES)}")
            check_text(f"chat.messages[{i}].content", content)
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidArgument("chat", "this model has no chat template: send a prompt instead")
        try:
            rendered = self.tokenizer.apply_chat_template(
                [{"role": r, "content": c} for r, c in messages], add_generation_prompt=True, tokenize=True,
            )
        except TemplateError as exc:  # the template's own rules (roles must alternate, no system role, ...)
            raise InvalidArgument("chat.messages", f"the model's chat template refuses them: {exc}") from None
        return list(rendered["input_ids"] if isinstance(rendered, dict) or hasattr(rendered, "keys") else rendered)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def classify(self, text: str) -> str:
        return self.classifier.classify(text) if self.classifier is not None and text else GENERAL

    def make_request(
        self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str = "", max_tree_nodes: int | None = None,
        text: str = "", speculation: str | None = None, resume_ids: Sequence[int] = (),
    ) -> Ticket:
        """A validated request, its tree budget and speculation mode; ``text`` (the user's words, when
        known) is what the request is classified by for routing; ``resume_ids``: the answer's first tokens,
        which the client already has (a stream cut short): decoding goes on after them, and they count
        against ``params.max_tokens``."""
        speculation = check_speculation(speculation or self.limits.speculation)
        if len(request_id) > MAX_REQUEST_ID:
            raise InvalidArgument("request_id", f"is {len(request_id)} characters; at most {MAX_REQUEST_ID}")
        if max_tree_nodes is not None and not 0 <= max_tree_nodes <= MAX_TREE_NODES:
            raise InvalidArgument("max_tree_nodes", f"must be in 0..{MAX_TREE_NODES}, got {max_tree_nodes}")
        # a request may lower the router's cap, not raise it: every node of every tree lengthens the
        # batch's pass, so the cap is the operator's bound on what one client costs the others
        budget = self.limits.max_tree_nodes if max_tree_nodes is None else min(max_tree_nodes, self.limits.max_tree_nodes)
        # the internal id is always fresh: a client's id names its request to it, but two clients (or one
        # retrying) may reuse an id, and drafter and verifier state is keyed by it
        internal_id = f"{request_id}:{uuid.uuid4().hex}" if request_id else uuid.uuid4().hex
        if speculation == "off":
            budget = 0
        resumed = tuple(int(t) for t in resume_ids)
        if resumed:
            outside = [t for t in resumed if not 0 <= t < self.card.vocab_size]
            if outside:
                raise InvalidArgument("resume_ids", f"token ids {outside[:5]} are outside the vocabulary "
                                                    f"(0..{self.card.vocab_size - 1})")
            if len(resumed) >= params.max_tokens:
                raise InvalidArgument("resume_ids", f"holds {len(resumed)} tokens: the answer of at most "
                                      f"{params.max_tokens} tokens is already complete")
            if any(t in self.card.eos_token_ids for t in resumed):
                raise InvalidArgument("resume_ids", "holds an end-of-sequence token: the answer is already complete")
            params = replace(params, max_tokens=params.max_tokens - len(resumed))
        request = Request(tuple(int(t) for t in prompt_ids) + resumed, params, internal_id)
        validate_request(request, self.card.vocab_size, self.card.max_length, budget)  # first: decoding needs valid ids
        request = replace(request, kind=self.classify(text or self.decode(prompt_ids[-256:])))
        return Ticket(request, budget, speculation, resumed)

    def _unique_drafters(self) -> list[AsyncDrafter]:
        """One drafter per name, each advertising its domains to the policy."""
        unique = one_per_name(self.drafters)
        for drafter in unique:
            self.policy.expertise.register(drafter)
        return unique

    # ---- generation ----

    async def generate(self, ticket: Ticket, final_only: bool = False) -> AsyncIterator[tuple[RequestState, StepOutput]]:
        """Admit the request (or refuse it with ResourceExhausted) and yield each step's tokens (``final_only``:
        the whole answer once, for a caller that sends it whole: no wake-up a step)."""
        if self.active >= self.limits.max_concurrent:
            raise ResourceExhausted(
                f"{self.active} requests are in flight, the limit is {self.limits.max_concurrent}; retry later"
            )
        self.active += 1  # before any await: the requests arriving meanwhile count this one
        try:
            try:
                backlog = await self.engine.backlog()
                raise_if_cancelled()  # a Redis call (specmesh.cancellation): a client gone by now is not admitted
            except asyncio.CancelledError:  # it held a slot: it ends as aborted, as one that began would
                if self.metrics is not None:
                    self.metrics.finished.labels("aborted").inc()
                raise
            if backlog > self.limits.max_queue_backlog:
                raise ResourceExhausted(f"the queue holds {backlog} requests no verifier has taken; retry later")
            async with aclosing(self._run(ticket, final_only)) as steps:
                async for output in steps:
                    yield output
        finally:
            self.active -= 1

    async def _run(self, ticket: Ticket, final_only: bool) -> AsyncIterator[tuple[RequestState, StepOutput]]:
        """An admitted request's answer from the verifier that runs its steps, counted in the metrics."""
        request = ticket.request
        if ticket.budget > 0:
            self._unique_drafters()  # the drafters' advertised domains: the routing table's priors
        generation = RequestState(request, len(request.prompt_ids) - len(ticket.resumed), list(ticket.resumed))
        clock = None
        if self.metrics is not None:
            clock = RequestClock(self.metrics)
            self.metrics.requests_by_kind.labels(request.kind or GENERAL).inc()
            self.metrics.in_flight.inc()
        try:
            # the clock hears each step's tokens as they arrive; an answer sent whole, by the verifier's clock
            deltas = self.engine.generate(request, ticket.budget, ticket.speculation == "fixed", final_only=final_only,
                                          on_tokens=clock.tokens_arrived if clock is not None and not final_only
                                          else None)
            async with aclosing(deltas):
                async for delta in deltas:
                    if delta.stats is not None:
                        generation.stats = delta.stats
                        if clock is not None and final_only:
                            clock.answer_arrived(len(delta.tokens), delta.stats.first_token_s, delta.stats.total_s)
                    generation.token_ids.extend(delta.tokens)
                    generation.finish_reason = delta.finish_reason
                    yield generation, StepOutput(delta.tokens, delta.finish_reason, timing=delta.timing)
        finally:
            if self.metrics is not None:
                self.metrics.in_flight.dec()
                self.metrics.finished.labels(generation.finish_reason or "aborted").inc()


SPLIT_TOKENS = 3  # a character is 4 bytes at most: the tokens its first bytes may end an answer with
RESUMED_CONTEXT = 8  # tokens before a resumed stream's end read as its first window's context


class TextStream:
    """Incremental detokenization: the text of newly committed tokens, holding back a partial character.

    The text sent for tokens[:n] is the text of tokens[:k], k the last of n-3..n where no character is cut
    (n when none: the bytes are invalid, not cut), however the tokens were grouped into pushes: a resumed
    stream knows from its tokens alone where its text stopped. A push decodes a window, not the whole
    answer: the last piece's tokens (as context) and the new ones; the new text is what the window adds to
    its context's, so a token that decodes differently at the start of a decode (a SentencePiece word's
    space) is read the same way in both."""

    def __init__(self, decode: Callable[[Sequence[int]], str], sent_tokens: Sequence[int] = ()) -> None:
        """``sent_tokens``: tokens whose text the client has already (a resumed stream's), but for a
        character they left unfinished."""
        self.decode = decode
        self.tokens: list[int] = list(sent_tokens)
        self.start = max(0, len(self.tokens) - RESUMED_CONTEXT)  # tokens[start:sent]: the window's context
        self.sent = self.start
        self.sent = self._whole_end(False)[0]  # tokens[:sent]: their text is sent

    def _whole_end(self, final: bool) -> tuple[int, str]:
        """(k, the window's text through tokens[:k]): k the last end where no character is cut."""
        whole = self.decode(self.tokens[self.start :])
        end, text = len(self.tokens), whole
        for _ in range(SPLIT_TOKENS):
            if final or end <= self.sent or not text.endswith("\ufffd"):
                return end, text
            end -= 1
            text = self.decode(self.tokens[self.start : end])
        return (end, text) if not text.endswith("\ufffd") else (len(self.tokens), whole)

    def push(self, token_ids: Sequence[int], final: bool = False) -> str:
        self.tokens.extend(token_ids)
        end, text = self._whole_end(final)
        if end <= self.sent:
            return ""
        delta = text[len(self.decode(self.tokens[self.start : self.sent])) :]
        self.start, self.sent = self.sent, end
        return delta


async def watch_cluster(gateway: Gateway, verifier: VerifierWatch, metrics: RouterMetrics, every_s: float = 1.0,
                        server: Server | None = None, service: str = "") -> None:
    """Keep the cluster gauges current: queue depth, live verifiers, reachable drafters. With ``server``,
    the health of ``service`` (the Router service) says whether any verifier is live (the server's own, "", stays
    SERVING: requests wait for a verifier within their deadline, so the router itself is not unready)."""
    shown: set[tuple[str, str]] = set()
    while True:
        try:
            metrics.queue_depth.set(await gateway.engine.backlog())
        except Unavailable:
            pass  # Redis is down: the depth is unknown, the last value stays
        metrics.verifiers_alive.set(len(verifier.alive))
        if server is not None and not server.stopping.is_set() and verifier.looked.is_set():
            await server.set_serving(bool(verifier.alive), [service])
        now = {(d.name, d.address): d.healthy for d in gateway.drafters}
        for labels, healthy in now.items():
            metrics.drafter_up.labels(*labels).set(1 if healthy else 0)
        for labels in shown - set(now):  # a drafter that left (discovery) is not "down": its series goes
            metrics.drafter_up.remove(*labels)
        shown = set(now)
        await asyncio.sleep(every_s)
