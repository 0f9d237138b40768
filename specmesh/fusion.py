"""Fusing several drafters' trees into one tree within a node budget.

Identical prefixes merge into one trie node. A node's score is the sum, over the drafters that proposed
it, of that drafter's weight times its confidence in the whole path (the product of draft
probabilities from the root down). Since every supporter of a child also supports its parent with at
least that path probability, scores never grow downwards, and taking nodes best-first from the root's
frontier keeps the tree closed under ancestors.

Exactness does not depend on any of this: merged nodes are verified with a one-hot draft distribution.
"""

from __future__ import annotations

import heapq
from typing import Sequence

from specmesh.tree import ROOT, TokenTree


def fuse_trees(trees: Sequence[TokenTree], budget: int, weights: Sequence[float] | None = None) -> TokenTree:
    """One tree of at most ``budget`` nodes, best-scored first (children after their parents)."""
    if budget <= 0 or not trees:
        return TokenTree()
    weights = list(weights) if weights is not None else [1.0] * len(trees)
    # trie over all trees: node -> (parent, token); scores and best single-drafter confidence per node
    trie_parent: list[int] = []
    trie_token: list[int] = []
    score: list[float] = []
    confidence: list[float] = []  # max over drafters of the node's own draft probability
    children: dict[int, list[int]] = {ROOT: []}
    index: dict[tuple[int, int], int] = {}
    for tree, weight in zip(trees, weights):
        mapped: list[int] = []
        path_prob: list[float] = []
        for token, parent, prob in zip(tree.tokens, tree.parents, tree.draft_probs):
            trie_par = ROOT if parent == ROOT else mapped[parent]
            along = prob * (1.0 if parent == ROOT else path_prob[parent])
            key = (trie_par, token)
            node = index.get(key)
            if node is None:
                node = index[key] = len(trie_token)
                trie_parent.append(trie_par)
                trie_token.append(token)
                score.append(0.0)
                confidence.append(0.0)
                children[node] = []
                children[trie_par].append(node)
            score[node] += weight * along
            confidence[node] = max(confidence[node], prob)
            mapped.append(node)
            path_prob.append(along)
    frontier = [(-score[c], c) for c in children[ROOT]]
    heapq.heapify(frontier)
    chosen: list[int] = []
    new_index: dict[int, int] = {}
    parents: list[int] = []
    while frontier and len(chosen) < budget:
        _, node = heapq.heappop(frontier)
        new_index[node] = len(chosen)
        chosen.append(node)
        parents.append(ROOT if trie_parent[node] == ROOT else new_index[trie_parent[node]])
        for child in children[node]:
            heapq.heappush(frontier, (-score[child], child))
    return TokenTree(
        tokens=tuple(trie_token[n] for n in chosen),
        parents=tuple(parents),
        draft_probs=tuple(confidence[n] for n in chosen),
    )
