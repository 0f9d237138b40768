"""A drafter that runs a small causal LM sharing the target's tokenizer; its guesses form a tree shaped
by its confidence (``shape.py``), or past what a path and its runners-up fill, the tree of its most
probable continuations grown best-first (SpecExec's draft model), one pass a round.

Per request it keeps the model's KV cache and the tokens it covers; before each proposal the cache is
cut back to the longest prefix shared with the committed tokens, so accepted guesses are never
recomputed and rejected ones are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from specmesh.drafters.base import DrafterBase
from specmesh.drafters.shape import (WIDE_DEPTH, WIDE_WIDTH, Step, best_first_tree, common_prefix, confident_tree,
                                     round_steps, round_visibility)
from specmesh.errors import InvalidArgument
from specmesh.tree import TokenTree


@dataclass
class _ModelState:
    committed: list[int]
    cache: object = None  # transformers DynamicCache
    cached: list[int] = field(default_factory=list)  # tokens whose K/V the cache holds, in order


class ModelDrafter(DrafterBase):
    kind = "model"

    def __init__(self, model: torch.nn.Module, vocab_size: int, name: str = "model", max_depth: int = 8,
                 branch_below: float = 0.5, branch_width: int = 2) -> None:
        """``vocab_size`` is the target's: rows past it (padding in some checkpoints) are never proposed."""
        model_vocab = model.get_output_embeddings().weight.shape[0]
        if model_vocab < vocab_size:
            raise InvalidArgument("drafter", f"drafter {name!r} has {model_vocab} output tokens, target has {vocab_size}")
        self.name = name
        self.model = model.eval()
        self.vocab_size = vocab_size
        self.max_depth = max_depth
        self.branch_below = branch_below
        self.branch_width = branch_width
        self.device = next(model.parameters()).device
        self._states: dict[str, _ModelState] = {}

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        self._states[request_id] = _ModelState(committed=[int(t) for t in prompt_ids])

    def commit(self, request_id: str, new_token_ids: Sequence[int]) -> None:
        self._states[request_id].committed.extend(int(t) for t in new_token_ids)

    def end(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    @torch.no_grad()
    def propose(self, request_id: str, budget: int, assumed: Sequence[int] = ()) -> TokenTree:
        from transformers import DynamicCache

        state = self._states[request_id]
        if budget <= 0:
            return TokenTree()
        if state.cache is None:
            state.cache = DynamicCache()
        context = [*state.committed, *assumed]
        # keep at least one context token uncached: its logits start the tree
        keep = min(common_prefix(state.cached, context), len(context) - 1)
        state.cache.crop(keep - len(state.cached))  # a negative count: how many entries to drop
        state.cached = context[:keep]
        first = Step(self._distribution(state, context[keep:]), None)
        if budget > self.max_depth * self.branch_width:
            slots: dict[int, int] = {}
            try:
                return best_first_tree(first, lambda grown, nodes: self._score(state, grown, nodes, slots), budget,
                                       WIDE_DEPTH, WIDE_WIDTH)
            finally:
                if slots:
                    state.cache.crop(-len(slots))  # the tree's entries were scratch
        return confident_tree(
            first, lambda token: Step(self._distribution(state, [token]), None), budget, self.max_depth,
            self.branch_below, self.branch_width,
        )

    def _score(self, state: _ModelState, grown: TokenTree, nodes: list[int], slots: dict[int, int]) -> list[Step]:
        """One best-first round: ``nodes`` fed in one pass after the context and the tree's earlier entries
        (``slots``: node -> cache index), each seeing the context, its ancestors and itself; returns the
        distributions after them."""
        context = len(state.cached)
        depths = grown.depths()
        visible = round_visibility(grown, nodes, context, slots)  # [n, cache entries so far]
        dtype = self.model.get_output_embeddings().weight.dtype
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)
        out = self.model(input_ids=torch.tensor([[grown.tokens[n] for n in nodes]], device=self.device),
                         position_ids=torch.tensor([[context - 1 + depths[n] for n in nodes]], device=self.device),
                         attention_mask=mask[None, None].to(self.device), past_key_values=state.cache, use_cache=True)
        return round_steps(out.logits[0, :, : self.vocab_size].float().softmax(-1), None)  # [n, vocab]

    def _distribution(self, state: _ModelState, feed: list[int]) -> torch.Tensor:
        return self._forward(state, feed)[: self.vocab_size].float().softmax(-1)

    def _forward(self, state: _ModelState, feed: list[int]) -> torch.Tensor:
        ids = torch.tensor([feed], device=self.device)
        out = self.model(input_ids=ids, past_key_values=state.cache, use_cache=True)
        state.cached.extend(feed)
        return out.logits[0, -1]

