"""Sampling parameters and the target distribution they define.

Temperature, top-k and top-p shape the *target's* distribution before verification; speculative
decoding then reproduces exactly that distribution. Temperature 0 means greedy decoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specmesh.errors import InvalidArgument


# Below this a temperature is greedy decoding: logits / 1e-40 overflow to inf and the softmax to NaN, and
# at 1e-5 the tempered distribution is already the argmax but for ties closer than 1e-5 nats (as vLLM does)
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 (or below MIN_TEMPERATURE) = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None
    max_tokens: int = 64

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidArgument("temperature", f"must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        if self.top_k < 0:
            raise InvalidArgument("top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidArgument("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise InvalidArgument("max_tokens", f"must be >= 1, got {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A per-request generator: seeded when a seed is given, so the request is reproducible."""
        gen = torch.Generator(device=device)
        if self.seed is not None:
            gen.manual_seed(self.seed)
        else:
            gen.seed()
        return gen


def target_probabilities(
    logits: torch.Tensor,  # [rows, vocab]
    params: SamplingParams,
) -> torch.Tensor:  # [rows, vocab] float32, each row sums to 1
    """Softmax of the logits after temperature, then top-k, then top-p (the order HF applies them)."""
    if params.greedy:
        raise ValueError("greedy decoding has no sampling distribution; use argmax")
    scores = logits.float() / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        sorted_probs = sorted_scores.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [rows, vocab]
        drop_sorted = mass_before >= params.top_p  # the first token always stays (mass before it is 0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(dim=-1)
