"""Target runtime for any Hugging Face causal LM, through its own forward with a custom 4D tree mask.

Slower than the lean Llama path (one forward per request in a batch, Hugging Face's linear layers),
but it verifies trees for every architecture whose attention accepts a prepared 4D mask and explicit
position ids. Each session is a ``DynamicCache`` whose committed entries are the first ``length``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specmesh.errors import InvalidArgument
from specmesh.runtime.llama import TreeBatch


@dataclass
class HFSession:
    cache: object  # transformers DynamicCache
    max_length: int
    length: int = 0

    @property
    def nbytes(self) -> int:
        """Memory held by the cache's keys and values."""
        return sum(t.numel() * t.element_size() for layer in self.cache.layers
                   for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None)

    def reserve(self, extra: int) -> None:
        if self.length + extra > self.max_length:
            raise InvalidArgument(
                "max_tokens", f"the request needs {self.length + extra} positions but the model's context is {self.max_length}"
            )
        self._drop_scratch()

    def keep_rows(self, rows: list[int]) -> None:
        """Commit scratch rows ``rows`` (relative to ``length``), packed into place; drop the rest."""
        index = torch.tensor(list(range(self.length)) + [self.length + r for r in rows], dtype=torch.long)
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            layer.keys = layer.keys.index_select(-2, index.to(layer.keys.device))
            layer.values = layer.values.index_select(-2, index.to(layer.values.device))
        self.length += len(rows)

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: session holds {self.length} entries")
        self.length = length
        self._drop_scratch()

    def free(self) -> None:
        self.cache = type(self.cache)()
        self.length = 0

    def _drop_scratch(self) -> None:
        extra = self.cache.get_seq_length() - self.length
        if extra > 0:
            self.cache.crop(-extra)


class HFRuntime:
    """Same interface as ``LlamaRuntime``: ``new_session`` and ``forward(TreeBatch) -> logits``."""

    def __init__(self, hf_model: torch.nn.Module) -> None:
        config = hf_model.config
        self.model = hf_model.eval()
        self.config = config
        self.device = next(hf_model.parameters()).device
        self.dtype = next(hf_model.parameters()).dtype
        self.vocab_size = config.vocab_size
        self.max_length = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 2048)
        self.precision = str(self.dtype).removeprefix("torch.")

    def new_session(self) -> HFSession:
        from transformers import DynamicCache

        return HFSession(cache=DynamicCache(), max_length=self.max_length)

    @torch.no_grad()
    def forward(self, batch: TreeBatch, logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [total_rows, vocab] (or ``logits_rows`` of them), fp32; each tree's K/V left as scratch."""
        pieces = []
        blocked = torch.finfo(self.dtype).min
        for session, mask, start, end in zip(batch.sessions, batch.masks, batch.cu_rows, batch.cu_rows[1:]):
            session.reserve(end - start)
            allowed = torch.cat([torch.ones(end - start, session.length, dtype=torch.bool), mask.cpu()], dim=1)
            additive = torch.zeros(allowed.shape, dtype=self.dtype).masked_fill(~allowed, blocked)
            out = self.model(
                input_ids=batch.input_ids[start:end].unsqueeze(0).to(self.device),
                position_ids=batch.positions[start:end].unsqueeze(0).to(self.device),
                attention_mask=additive[None, None].to(self.device),  # [1, 1, rows, cached + rows]
                past_key_values=session.cache,
                use_cache=True,
            )
            pieces.append(out.logits[0, :, : self.vocab_size].float())
        logits = torch.cat(pieces)
        return logits[logits_rows.to(logits.device)] if logits_rows is not None else logits
