"""Expertise routing: which drafters draft for a request, and how much the fusion trusts each.

The router learns, per (request kind, drafter), how often the drafter's guesses are the target's
tokens, level by level along its own tree (``LevelRecord``: each level's rate given the levels above;
measured on the drafter's own tree, not the fused one). Two decayed estimates are kept: per (kind,
drafter) across requests, starting from the drafter's advertised domains, and per (request, drafter),
so a misclassified request switches experts mid-way. Selection is greedy with exploration (a bandit):
the best few model drafters, every useful model-free one, and now and then one more. The request's
estimates are also the fusion's trust weights. See docs/design.md.

Where verifiers run the step loop, the per-kind records are shared (``cluster/pipeline/policy_sync.py``):
a ``Tally`` keeps the per-level counts not yet in the pool's shared table, ``learn`` takes in counts
observed elsewhere, and ``adopt`` puts a shared table in place of this one's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from specmesh.errors import InvalidArgument
from specmesh.tree import TokenTree

GENERAL = "general"
MODEL_FREE_KINDS = ("ngram", "history")  # drafters with no model: next to no cost, so asked whenever useful


def team_key(names: Sequence[str]) -> str:
    """The name a set of drafters drafting together is recorded under."""
    return "+".join(sorted(names))


def level_hits(tree: TokenTree, committed: Sequence[int]) -> tuple[int, int]:
    """(hits, attempts) of a tree against the tokens the target committed after its root.

    Walks from the root along ``committed``: a level where the current node has children is an
    attempt; it is a hit when one child holds the committed token (the walk then goes on below it).
    """
    kids = tree.children()
    row, hits, attempts = 0, 0, 0
    for token in committed:
        if not kids[row]:
            break
        attempts += 1
        child = next((c for c in kids[row] if tree.tokens[c] == token), None)
        if child is None:
            break
        hits += 1
        row = child + 1
    return hits, attempts


@dataclass
class HitRecord:
    """Decayed counts of hits and attempts."""

    hits: float = 0.0
    attempts: float = 0.0

    def add(self, hits: int, attempts: int, decay: float) -> None:
        self.hits = self.hits * decay + hits
        self.attempts = self.attempts * decay + attempts

    def mean(self, prior: float, strength: float) -> float:
        """Posterior mean: the record seen through ``strength`` pseudo-attempts at rate ``prior``."""
        return (self.hits + strength * prior) / (self.attempts + strength)


@dataclass
class LevelRecord:
    """Decayed hits and attempts per tree level (0 = the root's children), each level's counted only
    when every level above it was hit: the conditional acceptance of each depth. Deeper levels are
    usually accepted more often than shallow ones (a drafter on the right track tends to stay on it),
    which one rate for all levels would miss."""

    levels: list[HitRecord] = field(default_factory=list)

    def add(self, hits: int, attempts: int, decay: float) -> None:
        """One walk's outcome (``level_hits``): levels below ``hits`` were hit, level ``hits`` missed if attempted."""
        while len(self.levels) < attempts:
            self.levels.append(HitRecord())
        for level in range(hits):
            self.levels[level].add(1, 1, decay)
        if attempts > hits:
            self.levels[hits].add(0, 1, decay)

    def means(self, count: int, prior: float | Sequence[float], strength: float) -> list[float]:
        """Posterior mean acceptance of levels ``0 .. count-1``. ``prior``: one value for the top level,
        or one per level; a level with no prior of its own takes the level above's estimate."""
        one_prior = isinstance(prior, (int, float))
        estimates: list[float] = []
        for level in range(count):
            if one_prior:
                level_prior = estimates[-1] if estimates else float(prior)
            else:
                level_prior = prior[level] if level < len(prior) else estimates[-1]
            if level < len(self.levels):
                record = self.levels[level]
                estimates.append((record.hits + strength * level_prior) / (record.attempts + strength))
            else:
                estimates.append(level_prior)  # no record: the prior itself
        return estimates

    def add_counts(self, counts: LevelCounts, decay: float) -> None:
        """Many walks' outcomes at once, as if spread evenly over them: n walks at a level decay the old
        record by decay^n and add their hits at the weight their mean age gives (one walk: ``add``'s sum)."""
        while len(self.levels) < len(counts.attempts):
            self.levels.append(HitRecord())
        for record, hits, attempts in zip(self.levels, counts.hits, counts.attempts):
            if attempts <= 0:
                continue
            kept = decay ** attempts
            weight = (1.0 - kept) / (attempts * (1.0 - decay)) if decay < 1.0 else 1.0
            record.hits = record.hits * kept + hits * weight
            record.attempts = record.attempts * kept + attempts * weight


@dataclass
class LevelCounts:
    """Per-level hits and attempts summed over many walks, each level counted as ``LevelRecord.add`` counts
    it (level ``l`` attempted only when every level above was hit): what a ``LevelRecord`` takes in at once."""

    hits: list[float] = field(default_factory=list)
    attempts: list[float] = field(default_factory=list)

    def add(self, hits: int, attempts: int) -> None:
        """One walk's outcome (``level_hits``)."""
        while len(self.attempts) < attempts:
            self.hits.append(0)
            self.attempts.append(0)
        for level in range(hits):
            self.hits[level] += 1
            self.attempts[level] += 1
        if attempts > hits:
            self.attempts[hits] += 1

    def merge(self, other: LevelCounts) -> None:
        while len(self.attempts) < len(other.attempts):
            self.hits.append(0)
            self.attempts.append(0)
        for level, (hits, attempts) in enumerate(zip(other.hits, other.attempts)):
            self.hits[level] += hits
            self.attempts[level] += attempts


@dataclass
class Tally:
    """Counts of the per-kind records (drafters' and teams') that the pool's shared table does not hold yet,
    as far as this node knows: a verifier's own observations until it reports them, a router's received
    reports until it publishes them. Keys: (kind, drafter name) and (kind, team key)."""

    drafters: dict[tuple[str, str], LevelCounts] = field(default_factory=dict)
    teams: dict[tuple[str, str], LevelCounts] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.drafters or self.teams)

    def take(self) -> Tally:
        """What it holds; it starts afresh."""
        taken = Tally(self.drafters, self.teams)
        self.drafters, self.teams = {}, {}
        return taken

    def merge(self, other: Tally) -> None:
        for mine, theirs in ((self.drafters, other.drafters), (self.teams, other.teams)):
            for key, counts in theirs.items():
                mine.setdefault(key, LevelCounts()).merge(counts)


@dataclass(frozen=True)
class RoutingConfig:
    max_drafters: int = 1  # model drafters asked per step (besides the model-free ones, and one when exploring)
    explore: float = 0.1  # chance per step of asking one more drafter, outside the chosen ones
    min_acceptance: float = 0.04  # a drafter expected to be right less often than this is not asked
    kind_decay: float = 0.995  # per observation, across requests: ~200 attempts of memory
    request_decay: float = 0.8  # per step, within a request: the last few steps dominate
    kind_strength: float = 4.0  # pseudo-attempts of the domain prior behind a kind's record
    request_strength: float = 4.0  # pseudo-attempts of the kind's estimate behind a request's record
    domain_prior: float = 0.5  # expected acceptance of an expert on its own domain, before evidence
    general_prior: float = 0.3  # ... of an unspecialised drafter (prompt lookup, a small LM)
    other_prior: float = 0.1  # ... of an expert off its domain

    def __post_init__(self) -> None:
        if self.max_drafters < 1:
            raise InvalidArgument("max_drafters", f"must be >= 1, got {self.max_drafters}")
        if not 0.0 <= self.explore <= 1.0:
            raise InvalidArgument("explore", f"must be in [0, 1], got {self.explore}")


@dataclass
class Route:
    """One request's routing state: its kind and what each drafter got accepted on it so far."""

    kind: str
    records: dict[str, LevelRecord] = field(default_factory=dict)
    explored: str | None = None  # the drafter the last selection added to explore, if any
    teams: dict[str, LevelRecord] = field(default_factory=dict)  # team_key -> its fused trees' record


class Expertise:
    """Routes requests to drafters by learned acceptance per request kind (see the module doc)."""

    def __init__(self, domains: Mapping[str, Sequence[str]], config: RoutingConfig | None = None, seed: int | None = None,
                 free: Sequence[str] = ()) -> None:
        """``domains``: drafter name -> the domains it advertises (``general`` or none: unspecialised);
        ``free``: the names of model-free drafters."""
        self.domains = {name: tuple(d) for name, d in domains.items()}
        self.free = set(free)
        self.config = config or RoutingConfig()
        self._kinds: dict[tuple[str, str], LevelRecord] = {}
        self._teams: dict[tuple[str, str], LevelRecord] = {}  # (kind, team_key) -> fused trees' record
        self._random = random.Random(seed)
        self.learned = 0  # how many times its table changed: a weighing since then would read the same
        self.tally: Tally | None = None  # kept where the table is shared (policy_sync); None: not kept

    def add(self, name: str, domains: Sequence[str], free: bool = False) -> None:
        """A drafter that joined (or re-advertised its domains)."""
        self.domains[name] = tuple(domains)
        self.learned += 1
        if free:
            self.free.add(name)
        else:
            self.free.discard(name)

    def register(self, drafter) -> None:
        """A drafter (``AsyncDrafter``), by what it advertises: its ``domains``; model-free by its ``kind``."""
        self.add(drafter.name, drafter.domains or (GENERAL,), free=drafter.kind in MODEL_FREE_KINDS)

    def prior(self, kind: str, name: str) -> float:
        domains = self.domains.get(name, ())
        if kind in domains:
            return self.config.domain_prior
        if not domains or GENERAL in domains:
            return self.config.general_prior
        return self.config.other_prior

    def kind_levels(self, kind: str, name: str, count: int) -> list[float]:
        record = self._kinds.get((kind, name), LevelRecord())
        return record.means(count, self.prior(kind, name), self.config.kind_strength)

    def levels(self, route: Route, name: str, count: int) -> list[float]:
        """Expected acceptance of ``name``'s guesses at tree levels ``0 .. count-1`` on this request,
        each given the levels above."""
        record = route.records.get(name, LevelRecord())
        return record.means(count, self.kind_levels(route.kind, name, count), self.config.request_strength)

    def team_levels(self, route: Route, names: Sequence[str], count: int) -> list[float]:
        """Expected acceptance of the fused tree of ``names`` at levels ``0 .. count-1``, each given the
        levels above. Before evidence, a level is right when any member is (independence); then the
        team's own record of fused trees takes over, per kind and per request like a drafter's: drafters
        are right and wrong on the same tokens, so independence flatters a team (docs/design.md)."""
        if len(names) == 1:
            return self.levels(route, names[0], count)
        missed = [1.0] * count
        for name in names:
            for level, rate in enumerate(self.levels(route, name, count)):
                missed[level] *= 1.0 - rate
        independent = [1.0 - m for m in missed]
        key = team_key(names)
        kind_record = self._teams.get((route.kind, key), LevelRecord())
        kind_estimate = kind_record.means(count, independent, self.config.kind_strength)
        return route.teams.get(key, LevelRecord()).means(count, kind_estimate, self.config.request_strength)

    def observe_team(self, route: Route, names: Sequence[str], hits: int, attempts: int) -> None:
        """One step's fused tree of ``names`` against the committed tokens (``level_hits``)."""
        if len(names) < 2 or not attempts:
            return
        key = team_key(names)
        self.learned += 1
        route.teams.setdefault(key, LevelRecord()).add(hits, attempts, self.config.request_decay)
        self._teams.setdefault((route.kind, key), LevelRecord()).add(hits, attempts, self.config.kind_decay)
        if self.tally is not None:
            self.tally.teams.setdefault((route.kind, key), LevelCounts()).add(hits, attempts)

    def estimate(self, route: Route, name: str) -> float:
        """Expected acceptance of ``name``'s first guess on this request."""
        return self.levels(route, name, 1)[0]

    def open(self, kind: str) -> Route:
        return Route(kind)

    def select(self, route: Route, available: Sequence[str], at_least_one: bool = False) -> list[str]:
        """The drafters to ask this step, best first: up to ``max_drafters`` model drafters and every
        model-free one worth asking, and now and then one more, drawn from the rest, to keep learning.
        ``at_least_one``: the best is asked even when none seems worth it (a probe)."""
        cfg = self.config
        ranked = sorted(available, key=lambda n: (-self.estimate(route, n), n))
        models = [n for n in ranked if n not in self.free][: cfg.max_drafters]
        chosen = [n for n in ranked if (n in self.free or n in models) and self.estimate(route, n) >= cfg.min_acceptance]
        if not chosen and at_least_one and ranked:
            chosen = ranked[:1]
        rest = [n for n in ranked if n not in chosen]
        route.explored = None
        if rest and self._random.random() < cfg.explore:
            route.explored = self._random.choice(rest)
            chosen.append(route.explored)
        return chosen

    def outguessed(self, route: Route, names: Sequence[str]) -> list[str]:
        """``names`` less the model drafters that a model-free one among them out-guesses on this request:
        its guesses cost next to nothing, theirs a forward pass a node."""
        free = [self.estimate(route, n) for n in names if n in self.free]
        if not free:
            return list(names)
        best = max(free)
        return [n for n in names if n in self.free or self.estimate(route, n) > best]

    def weights(self, route: Route, names: Sequence[str]) -> list[float]:
        """Fusion trust per drafter: its expected acceptance on this request."""
        return [self.estimate(route, n) for n in names]

    def observe(self, route: Route, name: str, hits: int, attempts: int) -> None:
        """One step's outcome for one drafter that drafted (attempts 0: it had nothing to say)."""
        self.learned += 1
        route.records.setdefault(name, LevelRecord()).add(hits, attempts, self.config.request_decay)
        if attempts:
            self._kinds.setdefault((route.kind, name), LevelRecord()).add(hits, attempts, self.config.kind_decay)
            if self.tally is not None:
                self.tally.drafters.setdefault((route.kind, name), LevelCounts()).add(hits, attempts)

    def shared(self) -> tuple[dict[tuple[str, str], LevelRecord], dict[tuple[str, str], LevelRecord]]:
        """The per-kind records, (kind, drafter) and (kind, team key): what a snapshot of the table holds."""
        return self._kinds, self._teams

    def learn(self, counts: Tally) -> None:
        """Counts observed elsewhere (a verifier's report), taken into the per-kind records (and the tally)."""
        self._add(counts)
        if self.tally is not None:
            self.tally.merge(counts)

    def adopt(self, drafters: dict[tuple[str, str], LevelRecord], teams: dict[tuple[str, str], LevelRecord]) -> None:
        """A shared table in place of this one's per-kind records; what the tally holds (not in it yet)
        is added again. Requests' own records stay."""
        self._kinds, self._teams = dict(drafters), dict(teams)
        if self.tally:
            self._add(self.tally)
        self.learned += 1

    def _add(self, counts: Tally) -> None:
        decay = self.config.kind_decay
        for table, entries in ((self._kinds, counts.drafters), (self._teams, counts.teams)):
            for key, levels in entries.items():
                table.setdefault(key, LevelRecord()).add_counts(levels, decay)
        self.learned += 1

    def table(self) -> dict[str, dict[str, float]]:
        """Kind -> drafter -> current estimate, for every pair with evidence (for Info and metrics)."""
        table: dict[str, dict[str, float]] = {}
        for kind, name in self._kinds:
            table.setdefault(kind, {})[name] = round(self.kind_levels(kind, name, 1)[0], 4)
        return table
