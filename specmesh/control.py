"""Goodput-adaptive speculation (after SmartSpec): how many tree nodes a request's next step drafts.

Goodput is committed tokens per second. A step of one request with a tree of ``n`` nodes commits, in
expectation, ``1 + a1 + a1 a2 + ... + a1 ... an`` tokens when tree level ``i`` is accepted with
probability ``ai`` once the levels above it were (the request's measured conditional acceptance of its
fused trees, level by level; a budget of ``n`` nodes is counted as ``n`` levels). It costs the verification pass —
whose time depends on *every* row in the batch, the other requests' included — plus the time the
request waits for its drafters. The controller picks the ``n`` (0 = no speculation) that maximises

    goodput(n) = (E[tokens | n] + E[tokens of the others]) / (pass_ms(others' rows + 1 + n) + draft_ms(n) + overhead_ms)

so under load, when rows are no longer nearly free, it speculates less; with acceptance too low to pay
for drafting it chooses 0, which is exactly plain (batched) decoding. A request at 0 probes a small
tree now and then, so that it notices when speculation starts to pay again.

``pass_ms`` is a ``CostModel`` learned online from the verifier's own reports (rows in a pass and the
pass's time); it starts from a flat prior, which is what the lean runtime measures for small trees.
``draft_ms`` (a ``DraftCost``: a fixed round trip plus a cost per node) and the step's other overhead
are learned from what the requests wait for.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

DEFAULT_BUDGETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def expected_tokens(acceptance: float | Sequence[float], nodes: int) -> float:
    """1 + a1 + a1 a2 + ... + a1 ... an: committed tokens per step with ``nodes`` levels, level ``i``
    accepted with ``acceptance[i]`` given the levels above (one value: the same for every level; levels
    past the list's end take its last value)."""
    rates = [acceptance] if isinstance(acceptance, (int, float)) else list(acceptance) or [0.0]
    total, along = 1.0, 1.0
    for level in range(nodes):
        along *= min(max(rates[min(level, len(rates) - 1)], 0.0), 1.0)
        total += along
    return total


class CostModel:
    """Milliseconds of a verification pass as a function of the rows in it (every request's root and
    tree nodes), learned from observed passes: a moving average per row count, interpolated between
    the counts seen, never decreasing with rows; unseen sizes follow the prior ``base_ms + per_row_ms * rows``."""

    def __init__(self, base_ms: float = 25.0, per_row_ms: float = 0.25, decay: float = 0.9) -> None:
        self.base_ms = base_ms
        self.per_row_ms = per_row_ms
        self.decay = decay
        self._rows: list[int] = []  # sorted row counts observed
        self._ms: dict[int, float] = {}

    def observe(self, rows: int, ms: float) -> None:
        if rows < 1 or ms <= 0:
            return
        if rows not in self._ms:
            bisect.insort(self._rows, rows)
            self._ms[rows] = ms
        else:
            self._ms[rows] = self.decay * self._ms[rows] + (1 - self.decay) * ms

    def prior_ms(self, rows: int) -> float:
        return self.base_ms + self.per_row_ms * rows

    def pass_ms(self, rows: int) -> float:
        if not self._rows:
            return self.prior_ms(rows)
        i = bisect.bisect_left(self._rows, rows)
        if i < len(self._rows) and self._rows[i] == rows:
            estimate = self._ms[rows]
        elif i == 0:  # fewer rows than any pass seen: no more than the smallest seen
            estimate = min(self._ms[self._rows[0]], self.prior_ms(rows))
        elif i == len(self._rows):  # more rows than any pass seen: the prior's slope from the largest
            last = self._rows[-1]
            estimate = self._ms[last] + self.per_row_ms * (rows - last)
        else:
            lo, hi = self._rows[i - 1], self._rows[i]
            t = (rows - lo) / (hi - lo)
            estimate = self._ms[lo] + t * (self._ms[hi] - self._ms[lo])
        below = [self._ms[r] for r in self._rows[:i]]  # monotone: a pass with more rows is never cheaper
        return max([estimate, *below])


@dataclass(frozen=True)
class Load:
    """What else the verifier's passes carry besides this request."""

    other_rows: float = 0.0  # rows of the other requests in a pass
    other_tokens: float = 0.0  # tokens those requests commit per pass


class DraftCost:
    """Milliseconds a request waits for its drafters, as a function of the tree budget asked:
    ``fixed + per_node * nodes`` (a round trip, then a drafter step per level), 0 when nobody is asked.
    Fitted online by least squares over decayed sums, the slope held towards the prior's where the
    data cannot tell the two apart (requests that always ask the same budget)."""

    def __init__(self, fixed_ms: float = 1.0, per_node_ms: float = 0.5, decay: float = 0.97, prior_weight: float = 4.0) -> None:
        self.prior = (fixed_ms, per_node_ms)
        self.decay = decay
        self.prior_weight = prior_weight
        self._sums = [0.0] * 5  # weight, n, n^2, ms, n * ms
        self.fixed_ms, self.per_node_ms = fixed_ms, per_node_ms

    def observe(self, nodes: int, ms: float) -> None:
        if nodes <= 0 or ms < 0:
            return
        self._sums = [self.decay * s for s in self._sums]
        for i, value in enumerate((1.0, nodes, nodes * nodes, ms, nodes * ms)):
            self._sums[i] += value
        w, n, nn, y, ny = self._sums
        lam, b0 = self.prior_weight, self.prior[1]
        # the slope held towards the prior's: [w, n; n, nn + lam] [a, b] = [y, ny + lam b0]
        det = w * (nn + lam) - n * n
        a = (y * (nn + lam) - n * (ny + lam * b0)) / det
        b = (w * (ny + lam * b0) - n * y) / det
        self.fixed_ms, self.per_node_ms = max(a, 0.0), max(b, 0.0)

    def ms(self, nodes: int) -> float:
        return self.fixed_ms + self.per_node_ms * nodes if nodes > 0 else 0.0


class GoodputController:
    def __init__(self, cost: CostModel, drafting: DraftCost | None = None, budgets: Sequence[int] = DEFAULT_BUDGETS,
                 probe_every: int = 8, probe_budget: int = 2) -> None:
        self.cost = cost
        self.drafting = drafting or DraftCost()
        self.overhead_ms = 0.0  # per step besides the pass and the drafting: queue, transport, bookkeeping
        self.budgets = sorted(set(budgets) | {0})
        self.probe_every = probe_every
        self.probe_budget = probe_budget

    def goodput(self, nodes: int, acceptance: float | Sequence[float], load: Load = Load()) -> float:
        """Expected committed tokens per second of the whole batch with this request drafting ``nodes``."""
        tokens = expected_tokens(acceptance, nodes) + load.other_tokens
        ms = self.cost.pass_ms(round(load.other_rows) + 1 + nodes) + self.drafting.ms(nodes) + self.overhead_ms
        return tokens / ms * 1e3

    def choose(self, max_budget: int, acceptance: float | Sequence[float], load: Load = Load(), steps_without: int = 0) -> int:
        """The budget up to ``max_budget`` with the best goodput (the smaller one on a tie); a small
        probe after ``probe_every`` steps in a row without speculation."""
        candidates = [b for b in self.budgets if b < max_budget] + [max_budget]
        best = max(candidates, key=lambda n: (self.goodput(n, acceptance, load), -n))
        if best == 0 and self.probe_every and steps_without >= self.probe_every:
            return min(self.probe_budget, max_budget)
        return best
