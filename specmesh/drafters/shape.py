"""Shaping a model drafter's guesses into a tree by its confidence.

Expand the top-1 path; where the top-1 probability is below ``branch_below`` the drafter is unsure,
so its runners-up join as siblings (leaves) of the guess. Stop when the path's confidence (the product
of its top-1 probabilities) falls below ``stop_below``: deeper guesses would rarely be accepted and each
costs a drafter step. SpecInfer's static expansion configs are the special case of a fixed width per
depth.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch

from specmesh.tree import ROOT, TokenTree


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
        probs, token_ids, ranked = step
        if ranked is None:
            top = probs.topk(min(branch_width, probs.shape[-1]))
            ranked = list(zip(top.indices.tolist(), top.values.tolist()))  # two reads from a GPU, not one per number
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


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share: what a drafter's cache may keep of its last guesses."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
