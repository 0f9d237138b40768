"""Goodput-adaptive speculation (after SmartSpec): how many tree nodes a request's next step drafts.

Goodput is committed tokens per second of the whole batch. The controller picks the budget ``n``
(0 = no speculation: exactly plain batched decoding) that maximises

    goodput(n) = E[tokens | n] / (cycle(n) + draft_ms(n)) + E[tokens of the others] / cycle(n)
    cycle(n) = pass_ms(requests, trees, others' rows + 1 + n) + overhead_ms(requests, trees)   [+ draft_ms(n), see below]

``E[tokens | n] = 1 + a1 + a1 a2 + ... + a1 ... an`` for a chain, ``ai`` the request's conditional
acceptance of level ``i``'s first guess; with the share of its misses each runner-up catches, the
best tree of ``n`` nodes (``tree_acceptance``: wide trees where rows are cheap); ``trees`` the others' and, when
``n > 0``, this one; ``pass_ms`` a ``CostModel`` calibrated on the verifier's measured pass curve and
learned from its reports of its passes; ``draft_ms`` the asked drafters' ``DraftCost`` added up;
``overhead_ms`` (queue, transport, the router's own work: ``StepOverhead``) learned from every step, by
load, with what each tree of a pass adds to it. Drafting delays this request's steps only, the verifier
passing the others' meanwhile, except where drafting takes the cores the verifier's passes need (a
verifier on CPU): there drafting is in everyone's cycle. A tree that only slows the others' passes is
not drafted; a request at 0 probes a small tree now and then. See docs/design.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from specmesh.runtime.calibration import PassSample
from specmesh.speculation.tree_acceptance import tree_tokens_upto

# tree sizes the controller weighs (up to a request's cap): beyond 64 only where passes are flat in rows
DEFAULT_BUDGETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


def expected_tokens(acceptance: float | Sequence[float], nodes: int) -> float:
    """1 + a1 + a1 a2 + ... + a1 ... an: committed tokens per step with ``nodes`` levels, level ``i``
    accepted with ``acceptance[i]`` given the levels above (one value: the same for every level; levels
    past the list's end take its last value)."""
    return expected_tokens_upto(acceptance, nodes)[nodes]


def expected_tokens_upto(acceptance: float | Sequence[float], nodes: int) -> list[float]:
    """``expected_tokens(acceptance, n)`` for every n in 0..nodes, in one walk down the levels."""
    rates = [acceptance] if isinstance(acceptance, (int, float)) else list(acceptance) or [0.0]
    totals, along = [1.0], 1.0
    for level in range(nodes):
        along *= min(max(rates[min(level, len(rates) - 1)], 0.0), 1.0)
        totals.append(totals[-1] + along)
    return totals


MIN_PASS_MS = 0.01


class OnlineLinear:
    """y = w . x fitted online by least squares over decayed sums. Each weight is held towards its
    prior with ``prior_weight`` pseudo-observations (one number: every weight but the first, the
    intercept, which is then free; or one per weight), so a model whose inputs never varied (requests
    that always ask the same budget) stays near the prior's split between them; slopes are kept >= 0
    (more work never costs less)."""

    def __init__(self, prior: Sequence[float], prior_weight: float | Sequence[float] = 4.0, decay: float = 0.97) -> None:
        self.prior = np.asarray(prior, dtype=np.float64)  # [features]
        self.decay = decay
        if isinstance(prior_weight, (int, float)):
            self.ridge = np.full(len(prior), float(prior_weight))
            self.ridge[0] = 0.0
        else:
            self.ridge = np.asarray(prior_weight, dtype=np.float64)  # [features]
            if self.ridge.shape != self.prior.shape:
                raise ValueError(f"{len(self.ridge)} prior weights for {len(self.prior)} features")
        self._xx = np.zeros((len(prior), len(prior)))  # decayed sum of x x^T
        self._xy = np.zeros(len(prior))  # decayed sum of x y
        self._coefficients: list[float] | None = self.prior.tolist()  # None: to be solved when next read

    def restart(self, prior: Sequence[float], prior_weight: float | None = None) -> None:
        """Forget what was observed and hold the weights to a new prior (with ``prior_weight`` when given)."""
        self.prior = np.asarray(prior, dtype=np.float64)
        if prior_weight is not None:
            self.ridge = np.full(len(self.prior), float(prior_weight))
            self.ridge[0] = 0.0
        self._xx = np.zeros((len(self.prior), len(self.prior)))
        self._xy = np.zeros(len(self.prior))
        self._coefficients = self.prior.tolist()

    def observe(self, x: Sequence[float], y: float, weight: float = 1.0) -> None:
        """``weight``: what this observation counts for, in whole observations (the past decays by as much)."""
        x = np.asarray(x, dtype=np.float64)  # [features]
        decay = self.decay ** weight
        self._xx *= decay  # in place: every step observes, and small arrays cost their allocations
        self._xx += weight * (x[:, None] * x)
        self._xy *= decay
        self._xy += (weight * y) * x
        self._coefficients = None  # solved when read: every step observes, far fewer steps weigh a tree

    @property
    def coefficients(self) -> list[float]:
        """The fitted weights, slopes >= 0, as plain floats (predictions run for every budget weighed)."""
        if self._coefficients is None:
            a, b = self._xx + np.diag(self.ridge), self._xy + self.ridge * self.prior
            try:  # positive definite once the intercept has data (the slopes have their ridge): ~8x lstsq's speed
                weights = np.linalg.solve(a, b)
            except np.linalg.LinAlgError:
                weights = np.linalg.lstsq(a, b, rcond=None)[0]
            weights[1:] = np.maximum(weights[1:], 0.0)
            self._coefficients = weights.tolist()
        return self._coefficients

    def predict(self, x: Sequence[float]) -> float:
        return sum(w * v for w, v in zip(self.coefficients, x))


FLAT_ROWS = 16  # rows a pass's matrix products take at about the cost of one (the verify curve's flat part)
KNEES = (16, 32, 64, 128, 256, 512)  # where a calibration may find the flat part ends (a GPU's is far out)
CALIBRATED_PRIOR_WEIGHT = 8.0  # pseudo-passes holding each slope to the measured curve (real traffic rarely varies them all)


class CostModel:
    """Milliseconds of a verification pass, learned from the verifier's reports of its passes:

        base + per_request * (requests - 1) + per_tree * trees + per_row * (rows - requests)
             + per_row_past_flat * max(0, rows - FLAT_ROWS)

    Each further request costs what the runtime spends per request (on a CPU attention runs request by
    request); a request with a tree costs its tree mask; rows (roots and tree nodes) cost little each
    while the matrix products stay flat, and more past that. The prior charges a tree's first rows about
    0.2 of a one-request pass, as measured on 2 CPU cores: a loaded batch rarely has the trees to learn
    it from (docs/design.md); ``calibrate`` replaces the prior with the verifier's measured curve."""

    def __init__(self, base_ms: float = 25.0, per_request_ms: float = 2.0, per_tree_ms: float = 4.0,
                 per_row_ms: float = 0.25, per_row_past_flat_ms: float = 0.5) -> None:
        self.fit = OnlineLinear([base_ms, per_request_ms, per_tree_ms, per_row_ms, per_row_past_flat_ms],
                                prior_weight=2.0, decay=0.98)
        self.flat_rows = FLAT_ROWS

    def _features(self, requests: int, trees: int, rows: int, flat_rows: int | None = None) -> list[float]:
        return [1.0, requests - 1.0, trees, rows - requests, max(0, rows - (flat_rows or self.flat_rows))]

    def calibrate(self, samples: Sequence[PassSample]) -> None:
        """Take the verifier's measured pass curve as the prior (what was learned before is dropped: it was
        learned against the old prior), then keep learning from real passes."""
        usable = [s for s in samples if s.requests >= 1 and s.rows >= s.requests and s.ms > 0]
        if len(usable) < 2:
            return
        y = np.array([s.ms for s in usable])  # [samples]
        best = None
        for knee in KNEES:  # where the flat part ends: the one that fits best, in relative error
            x = np.array([self._features(s.requests, s.trees, s.rows, knee) for s in usable]) / y[:, None]
            # a light ridge (the grid may not vary every feature); slopes >= 0 as in OnlineLinear
            ridge = np.diag([0.0] + [1e-6] * (x.shape[1] - 1))
            weights = np.linalg.lstsq(x.T @ x + ridge, x.T @ np.ones(len(y)), rcond=None)[0]
            weights[1:] = np.maximum(weights[1:], 0.0)
            error = float(np.sum((x @ weights - 1.0) ** 2))
            if best is None or error < best[0]:
                best = (error, knee, weights)
        _, self.flat_rows, weights = best
        self.fit.restart(weights, CALIBRATED_PRIOR_WEIGHT)

    def observe(self, requests: int, trees: int, rows: int, ms: float) -> None:
        if requests >= 1 and rows >= requests and ms > 0:
            self.fit.observe(self._features(requests, trees, rows), ms)

    def pass_ms(self, requests: int, trees: int, rows: int) -> float:
        return max(self.fit.predict(self._features(requests, trees, rows)), MIN_PASS_MS)  # a line fit can dip below 0


@dataclass(frozen=True)
class Load:
    """What else the verifier's passes carry besides this request."""

    other_requests: float = 0.0  # requests in a pass besides this one
    other_trees: float = 0.0  # how many of them have a tree
    other_rows: float = 0.0  # their rows
    other_tokens: float = 0.0  # tokens they commit per pass


class DraftCost:
    """Milliseconds one drafter takes to propose: ``fixed + per_node * nodes + per_token * catch_up``
    — a round trip, a drafter step per level, and first the tokens committed since it last drafted for
    the request (a model drafter feeds them through its model: the whole prompt at its first proposal,
    a long stretch when it comes back after other drafters served the request); 0 when not asked.

    The round trip is held (loosely) to its prior, so that a first proposal's cost goes to the catch-up
    rather than making the drafter look too dear to ask again (docs/design.md)."""

    def __init__(self, fixed_ms: float = 1.0, per_node_ms: float = 0.5, per_token_ms: float = 0.05) -> None:
        self.fit = OnlineLinear([fixed_ms, per_node_ms, per_token_ms], prior_weight=(0.5, 4.0, 4.0), decay=0.97)

    @property
    def fixed_ms(self) -> float:
        return max(self.fit.coefficients[0], 0.0)

    @property
    def per_node_ms(self) -> float:
        return self.fit.coefficients[1]

    @property
    def per_token_ms(self) -> float:
        return self.fit.coefficients[2]

    def observe(self, nodes: int, catch_up: int, ms: float) -> None:
        if nodes > 0 and ms >= 0:
            self.fit.observe([1.0, nodes, catch_up], ms)

    def ms(self, nodes: int, catch_up: float = 0) -> float:
        return self.fixed_ms + self.per_node_ms * nodes + self.per_token_ms * catch_up if nodes > 0 else 0.0


class Realism:
    """Accepted tokens that steps with a tree really got, over those the controller predicted when it chose
    them: decayed sums, starting at 1 (trusted) with ``prior_steps`` of weight. The choice takes the best
    of several predictions, so it favours the overestimated ones (the winner's curse), and the acceptance
    estimates share the errors of their priors (teams, kinds); scaling the prediction by what came true
    keeps the controller from choosing trees that lose."""

    def __init__(self, prior_steps: float = 4.0, decay: float = 0.97, floor: float = 0.05) -> None:
        self.decay, self.floor = decay, floor
        self.predicted = self.realized = prior_steps

    def observe(self, predicted_accepted: float, accepted: int) -> None:
        if predicted_accepted > 0:
            self.predicted = self.decay * self.predicted + predicted_accepted
            self.realized = self.decay * self.realized + accepted

    @property
    def ratio(self) -> float:
        return min(max(self.realized / self.predicted, self.floor), 1.5)


class StepOverhead:
    """What a step takes besides its pass and its drafting (in the engine core: the verify call's work
    beside the pass, prefill chunks), by load (requests in flight, in powers of two):

        base(load) + per_tree(load) * trees in flight

    Each tree adds its fusion, a bigger job and verdict to every step of the cycle; fitted on steps with
    and without trees, so that steps taken while every request drafted charge one tree its share, not the
    whole batch's (the policy observes once a pass, for the whole cycle). A load never seen starts from
    the nearest one seen."""

    def __init__(self, decay: float = 0.95, per_tree_prior_weight: float = 2.0) -> None:
        self.decay = decay
        self.per_tree_prior_weight = per_tree_prior_weight
        self.by_load: dict[int, OnlineLinear] = {}  # load class -> [base, per tree]

    @staticmethod
    def load_class(requests: float) -> int:
        return max(int(round(requests)), 1).bit_length()  # 1, 2-3, 4-7, 8-15, ...

    def learned(self) -> list[tuple[int, float, float]]:
        """(the fewest requests of each load seen, base ms, ms per tree), by load."""
        return [(1 << (load - 1), max(fit.coefficients[0], 0.0), fit.coefficients[1])
                for load, fit in sorted(self.by_load.items())]

    def _nearest(self, requests: float) -> OnlineLinear | None:
        if not self.by_load:
            return None
        wanted = self.load_class(requests)
        return self.by_load[min(self.by_load, key=lambda load: (abs(load - wanted), load))]

    def ms(self, requests: float = 1, trees: float = 0.0) -> float:
        """0 before any step."""
        fit = self._nearest(requests)
        return max(fit.predict([1.0, trees]), 0.0) if fit is not None else 0.0

    def per_tree_ms(self, requests: float = 1) -> float:
        fit = self._nearest(requests)
        return fit.coefficients[1] if fit is not None else 0.0

    def observe(self, ms: float, requests: float = 1, trees: float = 0.0, weight: float | None = None) -> None:
        """``weight``: what the observation counts for (default: one request's share of its cycle)."""
        key = self.load_class(requests)
        if key not in self.by_load:
            near = self._nearest(requests)
            per_tree = near.coefficients[1] if near is not None else 0.0
            # the base is free (the first step sets it); the slope is held to the nearest load's
            self.by_load[key] = OnlineLinear([max(ms - per_tree * trees, 0.0), per_tree],
                                             prior_weight=(0.0, self.per_tree_prior_weight), decay=self.decay)
        # the steps of one cycle tell much the same: each counts for its share of the cycle, so the
        # memory spans cycles (several regimes of drafting, to tell the trees' part from the rest)
        self.by_load[key].observe([1.0, trees], ms, weight=1.0 / max(requests, 1.0) if weight is None else weight)


class GoodputController:
    def __init__(self, cost: CostModel, budgets: Sequence[int] = DEFAULT_BUDGETS, probe_every: int = 8,
                 probe_budget: int = 2) -> None:
        self.cost = cost
        self.overhead = StepOverhead()
        # drafting slows the verifier's passes too (it takes the cores they need): a CPU verifier, or no
        # curve yet; the router cannot see where its drafters run, so it assumes so then
        self.drafting_shares_cores = True
        self.budgets = sorted(set(budgets) | {0})
        self.probe_every = probe_every
        self.probe_budget = probe_budget

    def goodput(self, nodes: int, acceptance: float | Sequence[float], draft_ms: float, load: Load = Load()) -> float:
        """Expected committed tokens per second of the whole batch with this request drafting ``nodes``."""
        return self._goodput(nodes, expected_tokens(acceptance, nodes), draft_ms, load)

    def _goodput(self, nodes: int, own_tokens: float, draft_ms: float, load: Load) -> float:
        requests, trees = 1 + round(load.other_requests), round(load.other_trees) + (1 if nodes else 0)
        # a tree's own work (fusion, a bigger job, the router's turn) is in every step of the pass
        cycle = self.cost.pass_ms(requests, trees, round(load.other_rows) + 1 + nodes) + self.overhead.ms(requests, trees)
        if self.drafting_shares_cores:
            cycle += draft_ms
        # on cores of their own, drafting delays this request's next step only: the verifier passes the
        # others' meanwhile
        own = cycle + (0.0 if self.drafting_shares_cores else draft_ms)
        return (own_tokens / own + load.other_tokens / cycle) * 1e3

    def choose(self, max_budget: int, acceptance: float | Sequence[float], draft_ms: Callable[[int], float],
               load: Load = Load(), realism: float = 1.0, shares: Sequence[float] = ()) -> tuple[int, float]:
        """The budget up to ``max_budget`` with the best goodput (the smaller one on a tie), and that goodput.
        ``draft_ms(n)``: what drafting ``n`` nodes costs (0 at 0); ``realism``: the accepted tokens steps
        really got over those predicted (``Realism``), applied to the prediction; ``shares``: what each
        runner-up rank catches of the first guess's misses (``tree_acceptance``; none: chains)."""
        candidates = [b for b in self.budgets if b < max_budget] + [max_budget]
        tokens = [1.0 + realism * (t - 1.0) for t in tree_tokens_upto(acceptance, shares, max_budget)]
        goodput, _, budget = max((self._goodput(n, tokens[n], draft_ms(n) if n else 0.0, load), -n, n) for n in candidates)
        return budget, goodput

    def should_probe(self, steps_without: int, load: Load = Load()) -> bool:
        """After ``probe_every`` steps in a row without speculation, a small tree, to see if it pays again.
        ``steps_without`` counts every request's steps: in a busy batch the batch as a whole probes at a
        lone request's rate (a probe slows the whole pass, and what it teaches is shared)."""
        return bool(self.probe_every) and steps_without >= self.probe_every * (1.0 + load.other_requests)
