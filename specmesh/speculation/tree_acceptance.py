"""What a tree of n nodes is expected to commit, when its nodes may be siblings as well as a chain.

A chain of n guesses commits ``1 + a1 + a1 a2 + ... + a1 ... an`` tokens (``goodput.expected_tokens``),
which stops growing near ``1 / (1 - a)``: where a pass costs the same for a thousand rows as for one
(an offloaded target), the rows past that buy nothing in a chain, and a wide tree pays. Positional
acceptance (after Sequoia): at depth d the target's token is the drafter's first guess with ``a_d``
(the chain's level acceptance) and its r-th guess (r >= 2) with ``(1 - a_d) g_r``, ``g_r`` the share
of the first guess's misses that rank r catches. A node is accepted with the product of these along
its path, so values only shrink downwards and across ranks, and the best tree of n nodes is the n
nodes of highest value (SpecExec's argument): its expected commit is 1 plus their sum.

``RankRecord`` learns ``g`` from verified trees, as hazards (the target's token at rank r given it was
at none of ranks 1..r-1, counted only where the tree had an r-th child), so a drafter's narrow trees
say nothing about ranks it never drafted, times how often the trees offer rank r at all (a drafter of
chains is credited with no runner-up). The router's levels count a level hit by any guess (routing and
trust read them); ``a_d`` is that times the share of the hits the first guess made, so that a drafter
of chains is weighed exactly as a chain.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Sequence

from specmesh.speculation.expertise import HitRecord
from specmesh.tree import TokenTree

MAX_RANKS = 8  # guesses a node's children are ranked over; later ranks are taken to catch nothing
# before evidence: a runner-up catches a fifth of the first guess's misses (a small LM's rank 2-3 share),
# held with the strength of a few observations so that a drafter's first wide trees correct it
HAZARD_PRIOR = 0.2
HAZARD_STRENGTH = 4.0
FIRST_STRENGTH = 2.0  # pseudo-hits of the first guess before a tree: trees start as chains


def walk_ranks(tree: TokenTree, committed: Sequence[int]) -> list[tuple[int, int | None]]:
    """Along the path the target accepted: at each node with children, (how many children, the rank of
    the committed token among them, 0-based in node order, or None when none holds it)."""
    kids = tree.children()
    row, walk = 0, []
    for token in committed:
        children = kids[row]
        if not children:
            break
        rank = next((r for r, c in enumerate(children) if tree.tokens[c] == token), None)
        walk.append((len(children), rank))
        if rank is None:
            break
        row = children[rank] + 1
    return walk


@dataclass
class RankRecord:
    """Decayed hazards of ranks 2..MAX_RANKS (index 0 is rank 2), and how often the team's trees offer
    each rank at all (a drafter of chains offers none: its trees are credited with no runner-up)."""

    hazards: list[HitRecord] = field(default_factory=lambda: [HitRecord() for _ in range(MAX_RANKS - 1)])
    offered: list[HitRecord] = field(default_factory=lambda: [HitRecord() for _ in range(MAX_RANKS - 1)])
    first: HitRecord = field(default_factory=HitRecord)  # of the levels the trees hit, those the first guess hit

    def add(self, walk: Sequence[tuple[int, int | None]], decay: float = 0.99) -> None:
        """One verified tree's walk (``walk_ranks``), counted as one observation per rank it tried."""
        hits, tries, offered = [0] * (MAX_RANKS - 1), [0] * (MAX_RANKS - 1), [0] * (MAX_RANKS - 1)
        for children, rank in walk:
            for r in range(1, min(children, MAX_RANKS)):
                offered[r - 1] += 1
            if rank == 0:
                continue  # the first guess held: nothing about the runners-up
            for r in range(1, min(children, MAX_RANKS)):  # ranks the tree had, until the one that held
                tries[r - 1] += 1
                if rank == r:
                    hits[r - 1] += 1
                    break
        caught = sum(rank is not None for _, rank in walk)
        if caught:
            self.first.add(sum(rank == 0 for _, rank in walk), caught, decay)
        for record, hit, tried in zip(self.hazards, hits, tries):
            if tried:
                record.add(hit, tried, decay)
        if walk:
            for record, count in zip(self.offered, offered):
                record.add(count, len(walk), decay)

    def first_share(self) -> float:
        """Of the levels the trees hit, the share the first guess hit (1 before any: chains)."""
        return self.first.mean(1.0, FIRST_STRENGTH)

    def shares(self) -> list[float]:
        """g_r for ranks 2..MAX_RANKS: the first guess's misses each rank catches where the trees offer it,
        times how often they do (none before a tree), never more than a higher rank's share."""
        shares, left = [], 1.0
        for hazard, offered in zip(self.hazards, self.offered):
            caught = left * hazard.mean(HAZARD_PRIOR, HAZARD_STRENGTH)
            left -= caught
            share = caught * offered.mean(0.0, 0.0) if offered.attempts else 0.0
            shares.append(min(share, shares[-1]) if shares else share)
        return shares


def tree_tokens_upto(levels: float | Sequence[float], shares: Sequence[float], nodes: int) -> list[float]:
    """Expected committed tokens of the best tree of n nodes, for every n in 0..nodes: 1 plus the n
    largest path values. ``levels``: a_d by depth (one value for all; past the list, its last value);
    ``shares``: g_r for ranks 2, 3, ... (empty: a chain, ``goodput.expected_tokens_upto``)."""
    rates = [levels] if isinstance(levels, (int, float)) else list(levels) or [0.0]

    def at(depth: int, rank: int) -> float:  # a node's acceptance given its parent's; depth 0 = the root's children
        a = min(max(rates[min(depth, len(rates) - 1)], 0.0), 1.0)
        return a if rank == 0 else (1.0 - a) * shares[rank - 1]

    totals = [1.0]
    frontier = [(-at(0, 0), 0, 0, 1.0)]  # (-value, depth, rank, the parent's value)
    while frontier and len(totals) <= nodes:
        negative, depth, rank, above = heapq.heappop(frontier)
        if not negative:
            break  # every node left is worth nothing
        totals.append(totals[-1] - negative)
        if rank < len(shares) and shares[rank]:  # the next sibling (ranks are taken in order)
            heapq.heappush(frontier, (-above * at(depth, rank + 1), depth, rank + 1, above))
        heapq.heappush(frontier, (negative * at(depth + 1, 0), depth + 1, 0, -negative))
    return totals + [totals[-1]] * (nodes + 1 - len(totals))
