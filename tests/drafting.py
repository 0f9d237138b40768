"""Test drafters: random trees that contain, at a random place, a guess that is right for a while."""

from __future__ import annotations

import random
from typing import Sequence

from specmesh.drafters.base import DrafterBase
from specmesh.tree import ROOT, TokenTree


class OracleTreeDrafter(DrafterBase):
    """Proposes random trees; one branch follows a known continuation (``answers[prompt]``) for a random
    number of tokens, so acceptance lengths, branch choices and KV compaction vary from step to step."""

    name = "oracle-tree"

    def __init__(self, answers: dict[tuple[int, ...], list[int]], vocab_size: int, seed: int = 0,
                 full: bool = False) -> None:
        """``full``: every tree has ``budget`` nodes (random ones around the right path)."""
        self.answers = answers
        self.full = full
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.contexts: dict[str, tuple[int, list[int]]] = {}  # request -> (prompt length, committed tokens)

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        self.contexts[request_id] = (len(prompt_ids), list(prompt_ids))

    def commit(self, request_id: str, new_token_ids: Sequence[int]) -> None:
        self.contexts[request_id][1].extend(new_token_ids)

    def end(self, request_id: str) -> None:
        self.contexts.pop(request_id, None)

    def propose(self, request_id: str, budget: int, assumed: Sequence[int] = ()) -> TokenTree:
        prompt_len, committed = self.contexts[request_id]
        answer = self.answers.get(tuple(committed[:prompt_len]), [])
        done = len(committed) + len(assumed) - prompt_len
        truth = answer[done : done + budget]
        rng = self.rng
        tokens: list[int] = []
        parents: list[int] = []
        # a random tree first, then splice the true path in below a random existing node or the root
        right = rng.randint(0, len(truth)) if self.full else None
        for i in range(budget - right if self.full else rng.randint(0, budget)):
            tokens.append(rng.randrange(self.vocab_size))
            parents.append(rng.randint(-1, i - 1))
        if right is None:
            right = rng.randint(0, len(truth))
        parent = ROOT
        for token in truth[:right]:
            if len(tokens) >= budget:
                break
            tokens.append(token)
            parents.append(parent)
            parent = len(tokens) - 1
        if rng.random() < 0.5 and len(tokens) < budget:  # a wrong guess after the right ones
            tokens.append(rng.randrange(self.vocab_size))
            parents.append(parent)
        return TokenTree(tuple(tokens), tuple(parents), tuple(rng.random() for _ in tokens))
