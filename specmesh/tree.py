"""Token trees: a drafter's guesses as data, compiled once into what a verification pass needs.

A tree hangs below the *root*, the last committed token, which is not yet in the KV cache. Node ``i``
(0-based, ``0 .. num_nodes-1``) holds a drafted token, its parent (``-1`` for the root) and the draft
probability of that token given its parent's context (the drafter's confidence). Parents come before
their children, so any prefix of the node list is itself a tree.

Compiled, the verification input is ``[root] + nodes``: row 0 is the root, row ``i + 1`` is node ``i``.
A chain of k guesses is a tree whose node ``i`` has parent ``i - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

ROOT = -1
# The most nodes any one tree may have, on the wire and in a verification pass: SpecExec-sized trees,
# for targets whose pass costs about the same for a thousand rows as for one (weights streamed per pass)
MAX_TREE_NODES = 1024


@dataclass(frozen=True)
class TokenTree:
    """Drafted tokens below the root. The empty tree means "no guess" (plain decoding)."""

    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()  # parent node index, ROOT for children of the root
    draft_probs: tuple[float, ...] = ()  # q(token | parent context) as the proposer saw it

    def __post_init__(self) -> None:
        if not (len(self.tokens) == len(self.parents) == len(self.draft_probs)):
            raise ValueError(
                f"token tree fields differ in length: tokens {len(self.tokens)}, "
                f"parents {len(self.parents)}, draft_probs {len(self.draft_probs)}"
            )
        for i, parent in enumerate(self.parents):
            if not ROOT <= parent < i:
                raise ValueError(f"token tree node {i} has parent {parent}; parents must precede children")

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: Sequence[int], draft_probs: Sequence[float] | None = None) -> TokenTree:
        probs = tuple(draft_probs) if draft_probs is not None else (1.0,) * len(tokens)
        return cls(tuple(int(t) for t in tokens), tuple(range(-1, len(tokens) - 1)), tuple(float(p) for p in probs))

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]], draft_probs: Sequence[Sequence[float]] | None = None) -> TokenTree:
        """Trie of token paths below the root; shared prefixes become one node (first probability wins)."""
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        for p, path in enumerate(paths):
            parent = ROOT
            for d, token in enumerate(path):
                key = (parent, int(token))
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(int(token))
                    parents.append(parent)
                    probs.append(float(draft_probs[p][d]) if draft_probs is not None else 1.0)
                parent = index[key]
        return cls(tuple(tokens), tuple(parents), tuple(probs))

    def children(self) -> list[list[int]]:
        """Children of every row of the compiled input: entry 0 is the root, entry i + 1 is node i."""
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, parent in enumerate(self.parents):
            kids[parent + 1].append(i)
        return kids

    def depths(self) -> list[int]:
        """Depth of each node; children of the root have depth 1."""
        depth: list[int] = []
        for parent in self.parents:
            depth.append(1 if parent == ROOT else depth[parent] + 1)
        return depth

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node``."""
        path = []
        while node != ROOT:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def within_depth(self, max_depth: int) -> TokenTree:
        """Only the nodes at depth <= ``max_depth`` (renumbered; still a tree)."""
        keep = [i for i, d in enumerate(self.depths()) if d <= max_depth]
        return self if len(keep) == len(self) else self.kept(keep)

    def kept(self, nodes: Sequence[int]) -> TokenTree:
        """Only ``nodes`` (increasing, each node's parent among them), renumbered in that order."""
        remap = {old: new for new, old in enumerate(nodes)}
        return TokenTree(
            tuple(self.tokens[i] for i in nodes),
            tuple(ROOT if self.parents[i] == ROOT else remap[self.parents[i]] for i in nodes),
            tuple(self.draft_probs[i] for i in nodes),
        )

    def likeliest_path(self) -> list[int]:
        """Tokens of the path that follows, from the root, the most confident child at every level."""
        kids = self.children()
        tokens: list[int] = []
        row = 0
        while kids[row]:
            node = max(kids[row], key=lambda c: self.draft_probs[c])
            tokens.append(self.tokens[node])
            row = node + 1
        return tokens

    def below(self, token: int) -> TokenTree | None:
        """The subtree under the root's child ``token``, re-rooted there (that child becomes the root);
        None when the root has no such child."""
        top = next((i for i, (t, p) in enumerate(zip(self.tokens, self.parents)) if p == ROOT and t == token), None)
        if top is None:
            return None
        remap = {top: ROOT}
        keep = []
        for i in range(top + 1, len(self)):
            if self.parents[i] in remap:
                remap[i] = len(keep)
                keep.append(i)
        return TokenTree(
            tuple(self.tokens[i] for i in keep),
            tuple(remap[self.parents[i]] for i in keep),
            tuple(self.draft_probs[i] for i in keep),
        )

    def truncated(self, budget: int) -> TokenTree:
        """The first ``budget`` nodes (still a tree, since parents precede children)."""
        return TokenTree(self.tokens[:budget], self.parents[:budget], self.draft_probs[:budget])


@dataclass(frozen=True)
class CompiledTree:
    """What one verification pass needs for one request, over the ``[root] + nodes`` rows."""

    input_ids: torch.Tensor  # [num_nodes + 1] long: root token, then node tokens
    depths: torch.Tensor  # [num_nodes + 1] long: 0 for the root; position = cache_len + depth
    mask: torch.Tensor  # [num_nodes + 1, num_nodes + 1] bool: row i may attend row j (ancestor-or-self)
    retrieve_indices: torch.Tensor  # [num_leaves, max_depth + 1] long: root-to-leaf rows, padded with -1
    children: list[list[int]] = field(repr=False)  # children per row, as node indices (row = node + 1)
    tree: TokenTree = field(repr=False)

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])


def compile_tree(root_token: int, tree: TokenTree, device: torch.device | str = "cpu") -> CompiledTree:
    n = len(tree) + 1
    parent_rows = [-1] + [p + 1 for p in tree.parents]  # row of each row's parent; -1 for the root
    # each row's path from the root, itself last (parents precede their children: already ordered); built in
    # lists and written to the mask at once, as tensor ops row by row cost a step's Python at 64 requests
    ancestors: list[list[int]] = []
    for row, parent in enumerate(parent_rows):
        ancestors.append((ancestors[parent] if parent >= 0 else []) + [row])
    depths = [len(path) - 1 for path in ancestors]
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[[row for row, path in enumerate(ancestors) for _ in path], [c for path in ancestors for c in path]] = True
    is_leaf = [True] * n
    for parent in parent_rows[1:]:
        is_leaf[parent] = False
    max_depth = max(depths)
    paths = [path + [-1] * (max_depth + 1 - len(path)) for row, path in enumerate(ancestors) if is_leaf[row]]
    return CompiledTree(
        input_ids=torch.tensor([root_token, *tree.tokens], dtype=torch.long, device=device),
        depths=torch.tensor(depths, dtype=torch.long, device=device),
        mask=mask.to(device),
        retrieve_indices=torch.tensor(paths, dtype=torch.long, device=device),
        children=tree.children(),
        tree=tree,
    )


def chained(tokens: Sequence[int], tree: CompiledTree | None = None) -> CompiledTree:
    """``tokens`` as a chain of rows (a chunk of a history being cached), then ``tree``'s rows below its last:
    ``compile_tree`` of that whole tree, built from tensors (a chunk runs to hundreds of rows, whose ancestor
    lists cost ``compile_tree`` O(rows²) of Python: 35 ms at 512)."""
    if not tokens:
        if tree is None:
            raise ValueError("nothing to chain: no tokens and no tree")
        return tree
    m, device = len(tokens), tree.input_ids.device if tree is not None else "cpu"
    chain = torch.arange(m, device=device)
    if tree is None:
        whole = TokenTree.chain(tokens[1:])
        return CompiledTree(
            input_ids=torch.tensor(tokens, dtype=torch.long, device=device), depths=chain,
            mask=torch.ones(m, m, dtype=torch.bool, device=device).tril(), retrieve_indices=chain[None],
            children=whole.children(), tree=whole,
        )
    n = m + tree.num_rows
    below = tree.tree
    whole = TokenTree(  # nodes: tokens[1:], the tree's root, the tree's nodes
        tuple(int(t) for t in tokens[1:]) + (int(tree.input_ids[0]),) + below.tokens,
        tuple(range(-1, m - 1)) + tuple(m - 1 if p == ROOT else m + p for p in below.parents),
        (1.0,) * m + below.draft_probs,
    )
    mask = torch.zeros(n, n, dtype=torch.bool, device=device)
    mask[:m, :m] = torch.ones(m, m, dtype=torch.bool, device=device).tril()
    mask[m:, :m] = True
    mask[m:, m:] = tree.mask
    paths = tree.retrieve_indices
    return CompiledTree(
        input_ids=torch.cat([torch.tensor(tokens, dtype=torch.long, device=device), tree.input_ids]),
        depths=torch.cat([chain, tree.depths + m]),
        mask=mask,
        retrieve_indices=torch.cat([chain.expand(paths.shape[0], m), torch.where(paths >= 0, paths + m, paths)], 1),
        children=whole.children(),
        tree=whole,
    )
