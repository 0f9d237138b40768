"""Shaping a model drafter's guesses into a tree by its confidence.

``confident_tree``: expand the top-1 path; where the top-1 probability is below ``branch_below`` the
drafter is unsure, so its runners-up join as siblings (leaves) of the guess. Stop when the path's
confidence (the product of its top-1 probabilities) falls below ``stop_below``: deeper guesses would
rarely be accepted and each costs a drafter step. SpecInfer's static expansion configs are the special
case of a fixed width per depth.

``best_first_tree`` (SpecExec): for budgets past what one path and its runners-up can fill, the nodes of
highest path probability, however they split between depth and width, expanded in rounds of one
drafter pass each over every node that may still place a child among the best.
"""

from __future__ import annotations

import heapq
from typing import Callable, NamedTuple, Sequence

import torch

from specmesh.tree import ROOT, TokenTree

# trees past what one path and its runners-up fill (budgets beyond max_depth x branch_width, where passes are
# flat) are grown best-first: this deep at most, this many children tried under each expanded node
WIDE_DEPTH = 16
WIDE_WIDTH = 4


class Step(NamedTuple):
    """A drafter's next-token distribution and the token each of its outputs names (an expert's head
    covers a subset of the vocabulary)."""

    probs: torch.Tensor  # [outputs]
    token_ids: Sequence[int] | None  # output index -> token id (None: indices are token ids)
    ranked: list[tuple[int, float]] | None = None  # the top outputs (index, p), where the drafter read them


def confident_tree(
    first: Step,  # the drafter's distribution after the committed tokens
    advance: Callable[[int], Step],  # feed a guessed token id, get the next distribution
    budget: int,
    max_depth: int,
    branch_below: float,
    branch_width: int,
    stop_index: int | None = None,  # an output meaning "no guess" (an expert's fallback class)
    stop_below: float = 0.0,
) -> TokenTree:
    tokens: list[int] = []
    parents: list[int] = []
    confidences: list[float] = []
    step, parent, path_confidence = first, ROOT, 1.0
    for depth in range(1, max_depth + 1):
        if len(tokens) >= budget:
            break
        token_ids, ranked = step.token_ids, _top(step, branch_width)
        if ranked[0][0] == stop_index:
            break  # the drafter expects something it cannot name: say nothing more
        ranked = [(i, p) for i, p in ranked if i != stop_index]
        (best, best_p), runners_up = ranked[0], ranked[1:]
        path_confidence *= best_p
        if tokens and path_confidence < stop_below:
            break
        as_token = (lambda i: token_ids[i]) if token_ids is not None else (lambda i: i)
        tokens.append(as_token(best))
        parents.append(parent)
        confidences.append(best_p)
        guess = len(tokens) - 1
        if best_p < branch_below:
            for index, p in runners_up:
                if len(tokens) >= budget:
                    break
                tokens.append(as_token(index))
                parents.append(parent)
                confidences.append(p)
        parent = guess
        if len(tokens) >= budget or depth == max_depth:
            break  # no further guess will be made: skip the drafter step
        step = advance(as_token(best))
    return TokenTree(tuple(tokens), tuple(parents), tuple(confidences))


def _top(step: Step, width: int) -> list[tuple[int, float]]:
    """A step's ``width`` best outputs as (output index, p): those it brings, else read in one go."""
    if step.ranked is None or len(step.ranked) < min(width, step.probs.shape[-1]):
        top = step.probs.topk(min(width, step.probs.shape[-1]))
        return list(zip(top.indices.tolist(), top.values.tolist()))  # two reads from a GPU, not one per number
    return step.ranked[:width]


def _ranked(step: Step, width: int, stop_index: int | None) -> list[tuple[int, float]]:
    """A step's ``width`` best outputs as (token id, p), the "no guess" output left out."""
    as_token = (lambda i: step.token_ids[i]) if step.token_ids is not None else (lambda i: i)
    return [(as_token(i), p) for i, p in _top(step, width + 1) if i != stop_index][:width]


def best_first_tree(
    first: Step,  # the drafter's distribution after the committed tokens
    score: Callable[[TokenTree, list[int]], list[Step]],  # (the tree so far, nodes to expand) -> their distributions
    budget: int,
    max_depth: int,
    width: int,  # children tried below each expanded node
    stop_index: int | None = None,
) -> TokenTree:
    """The ``budget`` nodes of highest path probability (the product of the drafter's probabilities from
    the root), parents before children and siblings best first. Each round scores, in one ``score``
    call, the nodes among the current best ``budget`` that have not been expanded; at most ``max_depth``
    rounds. The tree ``score`` sees only grows: a node keeps its index from round to round, and every
    node it is asked for has its parent expanded in an earlier round."""
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    value: list[float] = []  # path probability of each generated node
    depth: list[int] = []
    expanded: set[int] = set()

    def add_children(parent: int, step: Step) -> None:
        for token, p in _ranked(step, width, stop_index):
            tokens.append(token)
            parents.append(parent)
            probs.append(p)
            value.append(p * (value[parent] if parent != ROOT else 1.0))
            depth.append(1 + (depth[parent] if parent != ROOT else 0))

    add_children(ROOT, first)
    for _ in range(max_depth - 1):
        # a child never beats its parent, and nodes come after their parents: the best set is a tree
        best = heapq.nsmallest(budget, range(len(tokens)), key=lambda n: (-value[n], n))
        to_expand = sorted(n for n in best if n not in expanded and depth[n] < max_depth)
        if not to_expand:
            break
        grown = TokenTree(tuple(tokens), tuple(parents), tuple(probs))
        for node, step in zip(to_expand, score(grown, to_expand)):
            expanded.add(node)
            add_children(node, step)
    chosen = sorted(heapq.nsmallest(budget, range(len(tokens)), key=lambda n: (-value[n], n)))
    return TokenTree(tuple(tokens), tuple(parents), tuple(probs)).kept(chosen)


def round_steps(probs: torch.Tensor, token_ids: Sequence[int] | None) -> list[Step]:
    """A round's distributions [rows, outputs] as Steps, each with its top ``WIDE_WIDTH + 1`` outputs read
    from the device in one go for every row."""
    top = probs.topk(min(WIDE_WIDTH + 1, probs.shape[-1]))
    return [Step(p, token_ids, list(zip(i, v))) for p, i, v in zip(probs, top.indices.tolist(), top.values.tolist())]


def round_visibility(grown: TokenTree, nodes: list[int], context: int, slots: dict[int, int]) -> torch.Tensor:
    """For a drafter that keeps its best-first entries in its cache after ``context`` entries: the cache
    entries each of this round's ``nodes`` sees [n, context + len(slots) + n] (the context, its ancestors'
    entries, its own). ``slots`` (node -> cache index, earlier rounds') gains this round's, placed next."""
    start = context + len(slots)
    visible = torch.zeros(len(nodes), start + len(nodes), dtype=torch.bool)
    visible[:, :context] = True
    for row, node in enumerate(nodes):
        visible[row, [slots[a] for a in grown.path_to(node)[:-1]] + [start + row]] = True
        slots[node] = start + row
    return visible


def with_ancestors(tree: TokenTree, nodes: list[int]) -> tuple[TokenTree, list[int]]:
    """The subtree of ``nodes`` and their ancestors (what their rows attend to), and where ``nodes`` are in it:
    for a drafter that scores a round by running that subtree anew."""
    keep = sorted({a for node in nodes for a in tree.path_to(node)})
    index = {n: i for i, n in enumerate(keep)}
    return tree.kept(keep), [index[n] for n in nodes]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share: what a drafter's cache may keep of its last guesses."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
