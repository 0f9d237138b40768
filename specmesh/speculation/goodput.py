"""Goodput-adaptive speculation (after SmartSpec): how many tree nodes a request's next step drafts.

Goodput is committed tokens per second of the whole batch. The controller picks the budget ``n``
(0 = no speculation: exactly plain batched decoding) that maximises

    goodput(n) = (E[tokens | n] + E[tokens of the others]) / (pass_ms(requests, others' rows + 1 + n) + draft_ms(n) + overhead_ms(n))

``E[tokens | n] = 1 + a1 + a1 a2 + ... + a1 ... an``, ``ai`` the request's conditional acceptance of
tree level ``i`` (a budget of ``n`` nodes counts as ``n`` levels); ``pass_ms`` a ``CostModel`` learned
from the verifier's reports of its passes; ``draft_ms`` the asked drafters' ``DraftCost`` added up (on
one machine they share the cores with the verifier); ``overhead_ms`` (queue, transport) learned from
lone requests' steps, apart for steps with a tree and without. Under load it speculates less; a
request at 0 probes a small tree now and then. See docs/design.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

DEFAULT_BUDGETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


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
        self.weights = self.prior.copy()
        self.coefficients = self.weights.tolist()  # the same as plain floats: predictions run for every budget of every step

    def observe(self, x: Sequence[float], y: float) -> None:
        x = np.asarray(x, dtype=np.float64)
        self._xx = self.decay * self._xx + np.outer(x, x)
        self._xy = self.decay * self._xy + x * y
        weights = np.linalg.lstsq(self._xx + np.diag(self.ridge), self._xy + self.ridge * self.prior, rcond=None)[0]
        weights[1:] = np.maximum(weights[1:], 0.0)
        self.weights = weights
        self.coefficients = weights.tolist()

    def predict(self, x: Sequence[float]) -> float:
        return sum(w * v for w, v in zip(self.coefficients, x))


FLAT_ROWS = 16  # rows a pass's matrix products take at about the cost of one (the verify curve's flat part)


class CostModel:
    """Milliseconds of a verification pass, learned from the verifier's reports of its passes:

        base + per_request * (requests - 1) + per_tree * trees + per_row * (rows - requests)
             + per_row_past_flat * max(0, rows - FLAT_ROWS)

    Each further request costs what the runtime spends per request (on a CPU attention runs request by
    request); a request with a tree costs its tree mask; rows (roots and tree nodes) cost little each
    while the matrix products stay flat, and more past that. The prior charges a tree's first rows about
    0.2 of a one-request pass, as measured on 2 CPU cores: a loaded batch rarely has the trees to learn
    it from (docs/design.md)."""

    def __init__(self, base_ms: float = 25.0, per_request_ms: float = 2.0, per_tree_ms: float = 4.0,
                 per_row_ms: float = 0.25, per_row_past_flat_ms: float = 0.5) -> None:
        self.fit = OnlineLinear([base_ms, per_request_ms, per_tree_ms, per_row_ms, per_row_past_flat_ms],
                                prior_weight=2.0, decay=0.98)

    @staticmethod
    def _features(requests: int, trees: int, rows: int) -> list[float]:
        return [1.0, requests - 1.0, trees, rows - requests, max(0, rows - FLAT_ROWS)]

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


class GoodputController:
    def __init__(self, cost: CostModel, budgets: Sequence[int] = DEFAULT_BUDGETS, probe_every: int = 8,
                 probe_budget: int = 2) -> None:
        self.cost = cost
        # per step besides the pass and the drafting (queue, transport, bookkeeping): without a tree, with
        # one; None until seen (the other one stands in)
        self.overhead_ms: list[float | None] = [None, None]
        self.budgets = sorted(set(budgets) | {0})
        self.probe_every = probe_every
        self.probe_budget = probe_budget

    def goodput(self, nodes: int, acceptance: float | Sequence[float], draft_ms: float, load: Load = Load()) -> float:
        """Expected committed tokens per second of the whole batch with this request drafting ``nodes``."""
        return self._goodput(nodes, expected_tokens(acceptance, nodes), draft_ms, load)

    def _goodput(self, nodes: int, own_tokens: float, draft_ms: float, load: Load) -> float:
        tokens = own_tokens + load.other_tokens
        requests, trees = 1 + round(load.other_requests), round(load.other_trees) + (1 if nodes else 0)
        ms = self.cost.pass_ms(requests, trees, round(load.other_rows) + 1 + nodes) + draft_ms + self.overhead(nodes > 0)
        return tokens / ms * 1e3

    def overhead(self, with_tree: bool) -> float:
        own, other = self.overhead_ms[with_tree], self.overhead_ms[not with_tree]
        return own if own is not None else other if other is not None else 0.0

    def learn_overhead(self, with_tree: bool, ms: float, weight_of_past: float) -> None:
        old = self.overhead_ms[with_tree]
        self.overhead_ms[with_tree] = ms if old is None else weight_of_past * old + (1 - weight_of_past) * ms

    def choose(self, max_budget: int, acceptance: float | Sequence[float], draft_ms: Callable[[int], float],
               load: Load = Load()) -> tuple[int, float]:
        """The budget up to ``max_budget`` with the best goodput (the smaller one on a tie), and that goodput.
        ``draft_ms(n)``: what drafting ``n`` nodes costs (0 at 0)."""
        candidates = [b for b in self.budgets if b < max_budget] + [max_budget]
        tokens = expected_tokens_upto(acceptance, max_budget)
        goodput, _, budget = max((self._goodput(n, tokens[n], draft_ms(n) if n else 0.0, load), -n, n) for n in candidates)
        return budget, goodput

    def should_probe(self, steps_without: int, load: Load = Load()) -> bool:
        """After ``probe_every`` steps in a row without speculation, a small tree, to see if it pays again.
        In a busy batch each request probes proportionally less often (a probe slows the whole pass, and
        what it teaches is shared by its kind), so the batch as a whole probes at the same rate."""
        return bool(self.probe_every) and steps_without >= self.probe_every * (1.0 + load.other_requests)
