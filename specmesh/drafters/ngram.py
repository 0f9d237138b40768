"""Model-free drafting: guess that text repeats itself.

``NgramIndex`` maps every n-gram (min_n..max_n tokens) of a set of documents to where it ended, so
that what followed earlier occurrences of a context's last n tokens can be proposed, longest n first.
Distinct continuations become branches of the tree; a node's confidence is the share of matches that
agree with it.

- ``NgramDrafter`` (prompt lookup) indexes each request's own prompt and output: pays where the answer
  quotes the prompt (code, extraction, math).
- ``HistoryDrafter`` indexes earlier requests of the same deployment (prompt and answer), bounded in
  tokens: repeated workloads get long accepted runs for free.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from typing import Sequence

from specmesh.drafters.base import DrafterBase
from specmesh.tree import TokenTree


class NgramIndex:
    def __init__(self, min_n: int = 1, max_n: int = 3) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.documents: dict[int, list[int]] = {}
        # n -> n-gram -> [(document, end position)], oldest first
        self._ends: dict[int, dict[tuple[int, ...], list[tuple[int, int]]]] = {
            n: defaultdict(list) for n in range(min_n, max_n + 1)
        }

    def extend(self, document: int, tokens: Sequence[int]) -> None:
        """Append tokens to a document (created on first use) and index the n-grams they complete."""
        doc = self.documents.setdefault(document, [])
        for token in tokens:
            doc.append(int(token))
            end = len(doc)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._ends[n][tuple(doc[end - n : end])].append((document, end))

    def continuations(self, context: Sequence[int], length: int, limit: int, skip: tuple[int, int] | None = None) -> list[list[int]]:
        """What followed the most recent occurrences of the longest matching suffix of ``context``.

        ``skip`` = (document, end) excludes the context's own occurrence (a request looking itself up).
        """
        found: list[list[int]] = []
        longest = 0
        for n, document, end in self._matches(context, skip):
            if n < longest:
                break  # only the longest matching suffix speaks
            longest = n
            found.append(self.documents[document][end : end + length])
            if len(found) >= limit:
                break
        return found

    def longest_match(self, context: Sequence[int], skip: tuple[int, int] | None = None) -> tuple[int, int] | None:
        """(n, next token) of the most recent occurrence of the longest suffix of ``context`` seen before
        (with a token after it); None when not even its last token was."""
        for n, document, end in self._matches(context, skip):
            return n, self.documents[document][end]
        return None

    def _matches(self, context: Sequence[int], skip: tuple[int, int] | None):
        """(n, document, end) of earlier occurrences of the context's last n tokens that something followed:
        longest n first, newest first within an n."""
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            for document, end in reversed(self._ends[n].get(tuple(context[len(context) - n :]), ())):  # recent text predicts best
                if (document, end) != skip and end < len(self.documents.get(document, ())):
                    yield n, document, end

    def drop(self, document: int) -> None:
        """Forget a document; its index entries are skipped lazily and purged by ``compact``."""
        self.documents.pop(document, None)

    def compact(self) -> None:
        for grams in self._ends.values():
            for gram in list(grams):
                kept = [entry for entry in grams[gram] if entry[0] in self.documents]
                if kept:
                    grams[gram] = kept
                else:
                    del grams[gram]


def tree_by_agreement(paths: list[list[int]], budget: int) -> TokenTree:
    """Trie of continuations; a node's confidence is the fraction of its parent's paths through it.

    Nodes are kept best-first (highest share of all paths) so the budget keeps the most agreed guesses;
    an ancestor's share is never below its descendants', so the result is still a tree.
    """
    tree = TokenTree.from_paths(paths)
    through = [0] * len(tree)
    child_of: dict[tuple[int, int], int] = {(p, t): i for i, (p, t) in enumerate(zip(tree.parents, tree.tokens))}
    for path in paths:
        node = -1
        for token in path:
            node = child_of[(node, token)]
            through[node] += 1
    total = len(paths)
    parent_count = [total if p == -1 else through[p] for p in tree.parents]
    order = sorted(range(len(tree)), key=lambda i: (-through[i], i))[:budget]
    order.sort()  # parents keep preceding children
    remap = {old: new for new, old in enumerate(order)}
    return TokenTree(
        tokens=tuple(tree.tokens[i] for i in order),
        parents=tuple(-1 if tree.parents[i] == -1 else remap[tree.parents[i]] for i in order),
        draft_probs=tuple(through[i] / parent_count[i] for i in order),
    )


class NgramDrafter(DrafterBase):
    """Prompt lookup over each request's own tokens, indexed when it is drafted for: a request decoded
    plainly (its batch's arm, a budget of 0) costs a list of tokens, not an index (at 64 requests in
    process, ~9 % of every step)."""

    kind = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 3, max_matches: int = 4, name: str = "ngram") -> None:
        self.name = name
        self.min_n, self.max_n, self.max_matches = min_n, max_n, max_matches
        self._indexes: dict[str, NgramIndex] = {}
        self._unindexed: dict[str, list[int]] = {}  # request -> tokens committed since it was last drafted for

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        self._indexes[request_id] = NgramIndex(self.min_n, self.max_n)
        self._unindexed[request_id] = list(prompt_ids)

    def commit(self, request_id: str, new_token_ids: Sequence[int]) -> None:
        self._unindexed[request_id].extend(new_token_ids)

    def propose(self, request_id: str, budget: int, assumed: Sequence[int] = ()) -> TokenTree:
        if budget <= 0:
            return TokenTree()
        index, unindexed = self._indexes[request_id], self._unindexed[request_id]
        if unindexed:
            index.extend(0, unindexed)
            unindexed.clear()
        tokens = index.documents.get(0, [])
        context = [*tokens, *assumed] if assumed else tokens
        paths = index.continuations(context, budget, self.max_matches, skip=(0, len(tokens)))
        return tree_by_agreement(paths, budget) if paths else TokenTree()

    def end(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)
        self._unindexed.pop(request_id, None)


class HistoryDrafter(DrafterBase):
    """Lookup over earlier requests (prompt + answer) of this deployment, up to ``capacity_tokens``."""

    kind = "history"

    def __init__(self, min_n: int = 2, max_n: int = 6, max_matches: int = 4, capacity_tokens: int = 1_000_000,
                 name: str = "history") -> None:
        self.name = name
        self.max_matches = max_matches
        self.capacity_tokens = capacity_tokens
        self._index = NgramIndex(min_n, max_n)
        self._active: dict[str, list[int]] = {}
        self._finished: OrderedDict[int, int] = OrderedDict()  # document -> tokens, oldest first
        self._stored_tokens = 0
        self._evicted_tokens = 0  # since the index was last compacted
        self._next_document = 0

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        self._active[request_id] = [int(t) for t in prompt_ids]

    def commit(self, request_id: str, new_token_ids: Sequence[int]) -> None:
        self._active[request_id].extend(int(t) for t in new_token_ids)

    def propose(self, request_id: str, budget: int, assumed: Sequence[int] = ()) -> TokenTree:
        if budget <= 0:
            return TokenTree()
        paths = self._index.continuations([*self._active[request_id], *assumed], budget, self.max_matches)
        return tree_by_agreement(paths, budget) if paths else TokenTree()

    def end(self, request_id: str) -> None:
        """A finished request becomes history that later requests can draft from."""
        tokens = self._active.pop(request_id, None)
        if not tokens:
            return
        document = self._next_document
        self._next_document += 1
        self._index.extend(document, tokens)
        self._finished[document] = len(tokens)
        self._stored_tokens += len(tokens)
        while self._stored_tokens > self.capacity_tokens and len(self._finished) > 1:
            old, size = self._finished.popitem(last=False)
            self._index.drop(old)
            self._stored_tokens -= size
            self._evicted_tokens += size
        if self._evicted_tokens > self.capacity_tokens // 4:  # purge stale entries now and then, not per request
            self._index.compact()
            self._evicted_tokens = 0

    @property
    def stored_tokens(self) -> int:
        return self._stored_tokens
