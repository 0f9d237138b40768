"""Speculation policies: what each step of a request drafts — which drafters, how much the fusion
trusts each, how many tree nodes — and what the policy learns from the step's outcome.

``FixedPolicy``: every drafter, equal trust, the same budget every step (0 = plain decoding).
``AdaptivePolicy``: expertise routing and trust (``expertise.Expertise``) and a goodput-chosen
budget (``goodput.GoodputController``). Each step it weighs the routed set, the model-free drafters
alone and no speculation by the goodput each would give, and learns from the outcome (each drafter's
tree against the committed tokens, its drafting time, the verifier's pass). See docs/design.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

from specmesh.errors import InvalidArgument
from specmesh.runtime.calibration import PassCurve
from specmesh.speculation.expertise import GENERAL, Expertise, Route, RoutingConfig, level_hits, team_key
from specmesh.speculation.goodput import CostModel, DraftCost, GoodputController, Load, Realism
from specmesh.speculation.tree_acceptance import RankRecord, tree_tokens_upto, walk_ranks
from specmesh.tree import TokenTree

RECHECK_EVERY = 4  # steps between weighings of a request at budget 0
RECHECK_UNCHANGED_EVERY = 32  # the same while nothing was learned since its last weighing chose 0
PROBE_BACKOFF_MOST = 8  # probes that keep nothing stretch the probe interval up to this many times
CATCH_UP_SPREAD = 8  # at most this many steps share the cost of a drafter's catch-up
# In a shared pass, the least predicted gain in the batch's goodput that a tree must promise, in shares of
# one request's part of it (goodput / requests): there the cost model is optimistic. A lone request needs
# none (docs/design.md; measured: docs/bench.md).
SPECULATION_MARGIN = 0.3
# Tree nodes a step: adaptive's cap (it drafts fewer where they do not pay), and the whole budget of fixed k
# (the load sweep's baseline). These three are chosen by `specmesh tune` on held-out prompts (docs/bench.md).
DEFAULT_TREE_NODES = 16
DEFAULT_FIXED_TREE_NODES = 4

SPECULATION_MODES = ("adaptive", "fixed", "off")  # budget by goodput; the whole budget; plain decoding


def check_margin(margin: float, name: str = "margin") -> float:
    if margin < 0:
        raise InvalidArgument(name, f"must be >= 0, got {margin}")
    return margin


def check_speculation(mode: str) -> str:
    if mode not in SPECULATION_MODES:
        raise InvalidArgument("speculation", f"is {mode!r}; use one of {', '.join(SPECULATION_MODES)}")
    return mode


@dataclass(frozen=True)
class StepPlan:
    drafters: tuple[str, ...] = ()  # the drafters asked this step, by name
    weights: tuple[float, ...] = ()  # the fusion's trust in each of them
    budget: int = 0  # tree nodes; 0 = no speculation (nobody is asked)
    predicted_accepted: float = 0.0  # drafted tokens the controller expected the target to keep (0: no prediction)
    probe: bool = False  # a small tree where the controller chose 0, to see whether that still holds


@dataclass(frozen=True)
class StepOutcome:
    plan: StepPlan
    trees: tuple[TokenTree, ...]  # each asked drafter's own tree, as proposed (aligned with plan.drafters)
    fused: TokenTree  # the tree that was verified
    committed: tuple[int, ...]  # the tokens the step committed (accepted, then the bonus)
    draft_ms: float = 0.0  # time the request waited for its drafters (0 when drafted ahead)
    drafter_ms: tuple[float, ...] = ()  # each asked drafter's own time (aligned with plan.drafters; none when drafted ahead)
    step_ms: float = 0.0  # the whole step: drafting, queue, transport, the pass
    pass_ms: float = 0.0  # the verification pass's time, as the verifier reports it (0: unknown)
    batch_rows: int = 0  # rows of that pass, every request's root and nodes
    batch_size: int = 0  # requests in that pass
    batch_trees: int = 0  # requests of that pass with a tree
    fuse_ms: float = 0.0  # of draft_ms: merging the drafters' trees into one
    prefilled: int = 0  # tokens of the request's history the verifier took in before the pass (its KV cache was new)
    verify_ms: float = 0.0  # the verifier's whole work in that pass (any prefill, the tree pass; 0: unknown)
    queue_ms: float = 0.0  # how long the job waited on its verifier before the pass


class RequestPolicy(Protocol):
    kind: str
    adapts: bool  # whether its budget may follow the batch's measured choice (``batch_budget.py``)

    def plan(self, room: int, available: Sequence[str], position: int, budget: int | None = None) -> StepPlan:
        """The next step's plan; ``room``: tokens the answer may still take; ``available``: live
        drafters; ``position``: tokens committed so far, the prompt's included; ``budget``: the nodes the
        batch chose for this step (None: the policy's own choice; ignored where ``adapts`` is False)."""

    def observe(self, outcome: StepOutcome) -> None: ...

    def end(self) -> None:
        """The request is over (idempotent: the loop and its caller may both say so)."""


class SpeculationPolicy(Protocol):
    def begin(self, kind: str, max_budget: int) -> RequestPolicy:
        """A request of this kind starts, with at most ``max_budget`` tree nodes a step."""


class FixedPolicy:
    """Every live drafter, equal trust, the request's whole budget every step."""

    def begin(self, kind: str, max_budget: int) -> RequestPolicy:
        return _FixedRequest(kind or GENERAL, max_budget)


@dataclass
class _FixedRequest:
    kind: str
    budget: int
    adapts = False

    def plan(self, room: int, available: Sequence[str], position: int, budget: int | None = None) -> StepPlan:
        if self.budget <= 0 or not available:
            return StepPlan()
        return StepPlan(tuple(available), (1.0,) * len(available), self.budget)

    def observe(self, outcome: StepOutcome) -> None:
        pass

    def end(self) -> None:
        pass


@dataclass
class PolicyState:
    """What the adaptive policy has learned across requests, besides the expertise table."""

    drafting: dict[str, DraftCost] = field(default_factory=dict)  # drafter -> what drafting costs it
    batch_size: float = 1.0  # moving averages: requests in the verifier's recent passes (fast: load changes),
    rows_per_request_step: float = 1.0  # a request's rows in one (its root and tree),
    trees_per_request_step: float = 0.0  # how often a request's step has a tree,
    tokens_per_request_step: float = 1.0  # and the tokens one step commits
    active: int = 0  # requests of this policy in flight
    realism: Realism = field(default_factory=Realism)  # accepted tokens really kept over those predicted
    ranks: dict[str, RankRecord] = field(default_factory=dict)  # team -> what its trees' runners-up catch
    last_pass: tuple = ()  # the last verification pass learned from (each request of a pass reports it)
    # request steps in a row without a tree, whichever request: probes are the batch's (requests may be
    # shorter than a busy batch's probe interval)
    steps_without: int = 0
    # the probe interval's multiple: doubled by each probe that kept no drafted token (at most
    # PROBE_BACKOFF_MOST), back to 1 when one keeps something
    probe_backoff: int = 1


class AdaptivePolicy:
    """Expertise routing, trust-weighted fusion and goodput-adaptive budgets (see the module doc)."""

    def __init__(self, expertise: Expertise, controller: GoodputController, adapt_budget: bool = True,
                 average: float = 0.9, margin: float = SPECULATION_MARGIN) -> None:
        """``adapt_budget`` False keeps routing and trust but always drafts the whole budget
        (the "fixed k" baseline of the benchmark's load sweep); ``margin``: see SPECULATION_MARGIN."""
        check_margin(margin)
        self.expertise = expertise
        self.controller = controller
        self.adapt_budget = adapt_budget
        self.margin = margin
        self.average = average  # weight of the past in the moving averages
        self.state = PolicyState()

    def begin(self, kind: str, max_budget: int, fixed_budget: bool | None = None) -> RequestPolicy:
        """``fixed_budget`` True: routing and trust, but the whole budget every step (None: the policy's setting)."""
        fixed = not self.adapt_budget if fixed_budget is None else fixed_budget
        self.state.active += 1
        return _AdaptiveRequest(self, self.expertise.open(kind or GENERAL), max_budget, adapt_budget=not fixed)

    def draft_cost(self, name: str) -> DraftCost:
        return self.state.drafting.setdefault(name, DraftCost())

    def tree_model(self, names: Sequence[str], levels: Sequence[float]) -> tuple[list[float], list[float]]:
        """The team's trees as ``tree_acceptance`` weighs them: its first guesses' acceptance by level (the
        router's levels, hit by any guess, times the hits the first guess made) and what the runners-up
        catch of their misses."""
        record = self.state.ranks.get(team_key(names)) or RankRecord()
        first = record.first_share()
        return [a * first for a in levels], record.shares()

    def _moving(self, old: float, new: float) -> float:
        return self.average * old + (1 - self.average) * new

    def learn_step(self, outcome: StepOutcome) -> None:
        """What every step says about the verifier's passes, the drafters' costs and the overhead."""
        state, controller = self.state, self.controller
        this_pass = (outcome.batch_size, outcome.batch_trees, outcome.batch_rows, outcome.pass_ms)
        new_pass = bool(outcome.batch_size and outcome.batch_rows and outcome.pass_ms > 0
                        and this_pass != state.last_pass)
        if new_pass:
            state.last_pass = this_pass  # learnt once, not once per request in it
            controller.cost.observe(outcome.batch_size, outcome.batch_trees, outcome.batch_rows, outcome.pass_ms)
            state.batch_size = 0.5 * state.batch_size + 0.5 * outcome.batch_size
        state.rows_per_request_step = self._moving(state.rows_per_request_step, 1 + len(outcome.fused))
        state.trees_per_request_step = self._moving(state.trees_per_request_step, 1.0 if len(outcome.fused) else 0.0)
        state.tokens_per_request_step = self._moving(state.tokens_per_request_step, len(outcome.committed))
        if new_pass and outcome.step_ms > 0 and not outcome.prefilled:
            # the rest of the step is overhead at this load (the verifier's own work beside the pass: prefill
            # calls); the same for every request of the pass, so learnt once a pass, for the whole cycle (at 64
            # in flight, once a request cost the loop ~2 %). A step that prefilled says nothing here.
            # Learnt against the load the choice weighs, each tree in it charged its share
            overhead = max(outcome.step_ms - outcome.draft_ms - outcome.pass_ms, 0.0)
            load = self.load()
            controller.overhead.observe(overhead, 1.0 + load.other_requests,
                                        load.other_trees + (1.0 if len(outcome.fused) else 0.0), weight=1.0)

    def calibrate(self, curves: Sequence[PassCurve]) -> None:
        """The verifiers' measured pass curves: the cost model's prior from the first request on; and
        whether drafting takes cores the verifiers' passes need (a verifier computing on CPU)."""
        self.controller.cost.calibrate([s for curve in curves for s in curve.samples])
        self.controller.drafting_shares_cores = any(curve.device == "cpu" for curve in curves)

    def evidence(self) -> tuple:
        """What a weighing reads that moves only with what is learned (the expertise table, drafting costs,
        the requests in flight and the passes' batch), not with every pass's time."""
        state = self.state
        return self.expertise.learned, len(state.drafting), state.active, round(state.batch_size)

    def load(self) -> Load:
        """The rest of a typical pass: this policy's other requests in flight, or what the verifier's
        recent passes carried when that is more (other routers' requests)."""
        state = self.state
        others = max(state.active - 1.0, state.batch_size - 1.0, 0.0)
        return Load(others, others * state.trees_per_request_step, others * state.rows_per_request_step,
                    others * state.tokens_per_request_step)


@dataclass
class _AdaptiveRequest:
    policy: AdaptivePolicy
    route: Route
    max_budget: int
    adapt_budget: bool = True
    steps_without: int = 0  # steps in a row at budget 0
    ended: bool = False
    drafted_at: dict[str, int] = field(default_factory=dict)  # drafter -> the position it last drafted from
    position: int = 0  # of the step being planned
    evidence_at_zero: tuple | None = None  # what the last weighing read, when it chose plain decoding

    @property
    def kind(self) -> str:
        return self.route.kind

    @property
    def adapts(self) -> bool:
        return self.adapt_budget

    def catch_up(self, name: str) -> int:
        """Tokens ``name`` has to take in before it can draft: those committed since it last drafted."""
        return self.position - self.drafted_at.get(name, 0)

    def charged_catch_up(self, name: str, room: int) -> float:
        """The part of ``name``'s catch-up one step is charged: taking the context in serves every later
        step it drafts, so it is spread over the steps the answer has left (at most ``CATCH_UP_SPREAD``);
        charged whole, an expert not asked from the start would look dearer as the context grew and never
        be asked again (docs/design.md)."""
        steps_left = room / max(self.policy.state.tokens_per_request_step, 1.0)
        return self.catch_up(name) / min(max(steps_left, 1.0), CATCH_UP_SPREAD)

    def plan(self, room: int, available: Sequence[str], position: int, budget: int | None = None) -> StepPlan:
        policy, expertise = self.policy, self.policy.expertise
        self.position = position
        budget = budget if self.adapt_budget else None
        if self.max_budget <= 0 or room <= 1 or not available or budget == 0:
            return StepPlan()
        if budget is not None:  # the batch's measured choice: routing and trust only
            names = expertise.select(self.route, available, at_least_one=True)
            names = expertise.outguessed(self.route, names)  # a budget given is drafted by what guesses best for free
            return StepPlan(tuple(names), tuple(expertise.weights(self.route, names)), min(budget, self.max_budget))
        load = policy.load()
        if self.adapt_budget and self.steps_without % RECHECK_EVERY:
            # a request without speculation weighs it again only every few steps: what the weighing reads
            # moves only with speculative steps, and its time (~4 % of a one-row step on the embedded
            # default) is spent on the cores the verifier's passes need
            return StepPlan()
        names = expertise.select(self.route, available, at_least_one=True)
        if not self.adapt_budget:
            return StepPlan(tuple(names), tuple(expertise.weights(self.route, names)), self.max_budget)
        # the routed set, or its model-free part alone (an expert whose guesses do not pay for its time)
        core = [n for n in names if n != self.route.explored]
        options = [core]
        free = [n for n in core if n in expertise.free]
        if free and len(free) < len(core):
            options.append(free)
        budget, chosen, levels, shares = 0, core, [], []
        evidence = policy.evidence()
        if self.steps_without % RECHECK_UNCHANGED_EVERY == 0 or evidence != self.evidence_at_zero:
            # else nothing was learned since a weighing chose plain decoding: that stands (a probe may follow)
            plain_goodput = policy.controller.goodput(0, [], 0.0, load)
            best_goodput, realism = plain_goodput, policy.state.realism.ratio
            for option in options:
                costs = [(policy.draft_cost(n), self.charged_catch_up(n, room)) for n in option]
                option_levels, option_shares = policy.tree_model(option, expertise.team_levels(self.route, option,
                                                                                             self.max_budget))
                n, goodput = policy.controller.choose(self.max_budget, option_levels,
                                                      lambda nodes: sum(c.ms(nodes, t) for c, t in costs), load,
                                                      realism, option_shares)
                if n > 0 and goodput > best_goodput:
                    best_goodput, budget, chosen, levels, shares = goodput, n, option, option_levels, option_shares
            share = plain_goodput / (1.0 + load.other_requests)  # this request's part of the batch's goodput
            if budget and load.other_requests >= 0.5 and best_goodput - plain_goodput < policy.margin * share:
                budget = 0  # a gain within the model's error: plain decoding (or a probe, below)
        self.evidence_at_zero = evidence if budget == 0 else None
        probe = budget == 0
        if probe:
            if not policy.controller.should_probe(policy.state.steps_without / policy.state.probe_backoff, load):
                return StepPlan()
            policy.state.steps_without = 0  # this request probes: the others wait for the next interval
            # the cheapest look: in a busy batch an expert's catch-up would hold up every request
            budget, chosen = min(policy.controller.probe_budget, self.max_budget), free or core
            levels, shares = policy.tree_model(chosen, expertise.team_levels(self.route, chosen, budget))
        elif self.route.explored:
            chosen = [*chosen, self.route.explored]
        predicted = tree_tokens_upto(levels, shares, budget)[budget] - 1.0  # as the levels say, before realism
        return StepPlan(tuple(chosen), tuple(expertise.weights(self.route, chosen)), budget, predicted, probe)

    def observe(self, outcome: StepOutcome) -> None:
        policy = self.policy
        policy.learn_step(outcome)
        for name, ms in zip(outcome.plan.drafters, outcome.drafter_ms):  # none when drafted ahead
            policy.draft_cost(name).observe(outcome.plan.budget, self.catch_up(name), ms)
        for name in outcome.plan.drafters:
            self.drafted_at[name] = self.position
        if not outcome.plan.budget:
            self.steps_without += 1
            policy.state.steps_without += 1
            return
        self.steps_without = 0
        policy.state.steps_without = 0
        if outcome.plan.probe:  # probes that keep nothing come less often: each costs a bigger pass
            kept = len(outcome.committed) > 1
            policy.state.probe_backoff = 1 if kept else min(2 * policy.state.probe_backoff, PROBE_BACKOFF_MOST)
        policy.state.realism.observe(outcome.plan.predicted_accepted, max(len(outcome.committed) - 1, 0))
        for name, tree in zip(outcome.plan.drafters, outcome.trees):
            policy.expertise.observe(self.route, name, *level_hits(tree, outcome.committed))
        team = [n for n in outcome.plan.drafters if n != self.route.explored]  # the option the budget was chosen for
        policy.expertise.observe_team(self.route, team, *level_hits(outcome.fused, outcome.committed))
        policy.state.ranks.setdefault(team_key(team), RankRecord()).add(walk_ranks(outcome.fused, outcome.committed))

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.policy.state.active -= 1


def adaptive_policy(domains: dict[str, Sequence[str]], adapt_budget: bool = True, seed: int | None = None,
                    routing: RoutingConfig | None = None, free: Sequence[str] = (),
                    margin: float = SPECULATION_MARGIN) -> AdaptivePolicy:
    """The router's policy over drafters named in ``domains`` (name -> advertised domains), of which
    ``free`` are model-free."""
    return AdaptivePolicy(Expertise(domains, routing, seed=seed, free=free), GoodputController(CostModel()),
                          adapt_budget, margin=margin)
