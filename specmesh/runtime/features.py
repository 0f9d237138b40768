"""The target's hidden states at consecutive positions: what a verifier returns to feature drafters."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_PROMPT_FEATURES = 512  # positions of a prefill sent back: a long prompt's tail, so no result is huge


@dataclass(frozen=True)
class Features:
    start: int  # position of the first row
    values: torch.Tensor  # [positions, layers, hidden]: row i is the hidden state at position start + i
    layers: tuple[int, ...]  # hidden states after this many decoder layers (before the final norm)

    def __len__(self) -> int:
        return self.values.shape[0]

    @property
    def end(self) -> int:
        return self.start + len(self)

    def of_layers(self, layers: tuple[int, ...]) -> Features:
        """The same positions, only ``layers`` (which this block must hold), in their order."""
        if layers == self.layers:
            return self
        index = [self.layers.index(n) for n in layers]
        return Features(self.start, self.values[:, index], layers)
