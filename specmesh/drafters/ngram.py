"""Prompt lookup: guess that the text repeats itself.

Find earlier occurrences of the request's last n tokens (longest n first) and propose what followed
them. Distinct continuations become branches of the tree; a node's confidence is the share of matches
that agree with it. Costs no model, and pays where the answer quotes the prompt (code, extraction,
math).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

from specmesh.tree import TokenTree


@dataclass
class _Context:
    tokens: list[int] = field(default_factory=list)
    # n -> n-gram -> end positions (exclusive) of its occurrences, oldest first
    index: dict[int, dict[tuple[int, ...], list[int]]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(list)))


class NgramDrafter:
    def __init__(self, min_n: int = 1, max_n: int = 3, max_matches: int = 4, name: str = "ngram") -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.name = name
        self.min_n, self.max_n, self.max_matches = min_n, max_n, max_matches
        self._contexts: dict[str, _Context] = {}

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        self._contexts[request_id] = _Context()
        self.commit(request_id, prompt_ids)

    def commit(self, request_id: str, new_token_ids: Sequence[int]) -> None:
        ctx = self._contexts[request_id]
        for token in new_token_ids:
            ctx.tokens.append(int(token))
            end = len(ctx.tokens)
            for n in range(self.min_n, self.max_n + 1):
                if end >= n:
                    ctx.index[n][tuple(ctx.tokens[end - n : end])].append(end)

    def propose(self, request_id: str, budget: int) -> TokenTree:
        ctx = self._contexts[request_id]
        tokens, length = ctx.tokens, len(ctx.tokens)
        if budget <= 0:
            return TokenTree()
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            ends = [e for e in ctx.index[n].get(tuple(tokens[length - n :]), ()) if e < length]
            if not ends:
                continue
            recent = ends[-self.max_matches :][::-1]  # newest first: recent text predicts best
            paths = [tokens[e : e + budget] for e in recent]
            paths = [p for p in paths if p]
            if paths:
                return _tree_by_agreement(paths, budget)
        return TokenTree()

    def end(self, request_id: str) -> None:
        self._contexts.pop(request_id, None)


def _tree_by_agreement(paths: list[list[int]], budget: int) -> TokenTree:
    """Trie of continuations; a node's confidence is the fraction of paths through it, given its parent.

    Nodes are kept best-first (highest share of all paths) so the budget keeps the most agreed guesses.
    """
    tree = TokenTree.from_paths(paths)
    through = [0] * len(tree)
    for path in paths:
        node = -1
        for token in path:
            node = next(c for c in range(len(tree)) if tree.parents[c] == node and tree.tokens[c] == token)
            through[node] += 1
    total = len(paths)
    share = [count / total for count in through]
    parent_count = [total if p == -1 else through[p] for p in tree.parents]
    probs = [through[i] / parent_count[i] for i in range(len(tree))]
    order = sorted(range(len(tree)), key=lambda i: (-share[i], i))[:budget]  # ancestors have >= share
    order.sort()  # parents keep preceding children
    remap = {old: new for new, old in enumerate(order)}
    return TokenTree(
        tokens=tuple(tree.tokens[i] for i in order),
        parents=tuple(-1 if tree.parents[i] == -1 else remap[tree.parents[i]] for i in order),
        draft_probs=tuple(probs[i] for i in order),
    )
