"""Copying from the context: an expert drafter's second source of guesses.

Answers repeat their prompt and themselves: names and figures from the question, a paragraph to edit,
a phrase said a line ago. A few-layer drafter trained on a domain's answers learns little of that (on
MT-Bench about half of the writing expert's misses where the target was sure were tokens of the
prompt). Prompt lookup copies without learning: the *candidate* is the token that followed the most
recent earlier occurrence of the context's longest suffix (1..MAX_MATCH tokens). A learned gate says
how far to trust it over the model's own distribution (the pointer-generator mixture, See et al. 2017):

    p(v) = g * [v == candidate] + (1 - g) * p_model(v),   g = sigmoid(w_h . h + w_f . f + b)

from the model's final hidden state h (one more row of its head, so the gate costs no extra pass) and a
few features f of the match and of p_model. No candidate: g = 0, the model alone.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from specmesh.drafters.ngram import NgramIndex

MAX_MATCH = 4  # longest suffix looked up (longer ones measured no better)
FEATURES = MAX_MATCH + 1 + 6  # match length one-hot, then the six in ``gate_features``


def copy_candidates(tokens: Sequence[int], first: int) -> tuple[list[int], list[int]]:
    """For each input position p in [first, len - 1): the copy candidate after ``tokens[: p + 1]`` and
    its match length (-1 and 0 where there is none): what a drafter sees at each answer position under
    teacher forcing."""
    index = ContextIndex(tokens[: first + 1])
    candidates, lengths = [], []
    for p in range(first, len(tokens) - 1):
        candidate, length = index.candidate()
        candidates.append(candidate)
        lengths.append(length)
        index.extend([tokens[p + 1]])
    return candidates, lengths


class ContextIndex:
    """One request's tokens, indexed for copy candidates."""

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self._index = NgramIndex(1, MAX_MATCH)
        self._index.extend(0, tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        self._index.extend(0, tokens)

    def candidate(self, beyond: Sequence[int] = ()) -> tuple[int, int]:
        """(token, match length) after the indexed tokens followed by ``beyond`` (guesses not committed);
        (-1, 0) when nothing matches."""
        tokens = self._index.documents.get(0, [])
        context = [*tokens, *beyond] if beyond else tokens
        match = self._index.longest_match(context, skip=(0, len(tokens)))
        return (-1, 0) if match is None else (match[1], match[0])


def gate_features(probs: torch.Tensor, candidate_index: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """probs [..., subset + 1] (last = fallback), candidate_index [...] (its output, -1 outside the
    subset), length [...] -> features [..., FEATURES] float32."""
    probs = probs.float()
    top_p, top_index = probs.max(-1)
    candidate_p = _candidate_p(probs, candidate_index)
    return torch.cat([
        nn.functional.one_hot(length.clamp(0, MAX_MATCH).long(), MAX_MATCH + 1).float(),
        torch.stack([top_p, probs[..., -1], candidate_p, (top_index == candidate_index).float(), top_p.clamp_min(1e-6).log(),
                     (candidate_p + 1e-6).log()], dim=-1),
    ], dim=-1)


def position_features(probs: torch.Tensor, candidate_index: int, length: int) -> list[float]:
    """``gate_features`` of one position (probs [subset + 1]) as plain floats: a drafting step's gate
    costs a few scalar operations instead of a dozen tensor ones."""
    top_p, top_index = (float(x) for x in probs.max(-1))
    candidate_p = float(probs[candidate_index]) if candidate_index >= 0 else 0.0
    one_hot = [0.0] * (MAX_MATCH + 1)
    one_hot[min(max(length, 0), MAX_MATCH)] = 1.0
    return [*one_hot, top_p, float(probs[-1]), candidate_p, float(int(top_index) == candidate_index),
            math.log(max(top_p, 1e-6)), math.log(candidate_p + 1e-6)]


class CopyGate(nn.Module):
    """How far to trust the copy candidate: g = sigmoid(w_h . h + w_f . f + b); 0 for a match shorter than
    ``min_match`` tokens (short matches are where copying is least often right, and most often what the
    model guesses anyway)."""

    def __init__(self, hidden_size: int, min_match: int = 1) -> None:
        super().__init__()
        if not 1 <= min_match <= MAX_MATCH:
            raise ValueError(f"min_match must be in 1..{MAX_MATCH}, got {min_match}")
        self.min_match = min_match
        self.hidden = nn.Parameter(torch.zeros(hidden_size))
        self.features = nn.Parameter(torch.zeros(FEATURES))
        self.bias = nn.Parameter(torch.zeros(()))

    def forward(self, hidden_logit: torch.Tensor, features: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        """hidden_logit [...] (w_h . h), features [..., FEATURES], length [...] -> g [...]; 0 without a
        candidate of at least ``min_match`` tokens."""
        g = torch.sigmoid(hidden_logit.float() + features @ self.features.float() + self.bias.float())
        return torch.where(length >= self.min_match, g, torch.zeros_like(g))

    def scalar(self) -> "ScalarGate":
        """The gate as plain floats, for drafting one position at a time."""
        return ScalarGate(self.features.detach().float().tolist(), float(self.bias.detach()), self.min_match)


class ScalarGate:
    """``CopyGate`` over one position's ``position_features``, in plain floats (the caller skips matches
    shorter than ``min_match``)."""

    def __init__(self, feature_weights: list[float], bias: float, min_match: int = 1) -> None:
        self.feature_weights, self.bias, self.min_match = feature_weights, bias, min_match

    def __call__(self, hidden_logit: float, features: list[float]) -> float:
        z = hidden_logit + self.bias + sum(w * f for w, f in zip(self.feature_weights, features))
        return 1.0 / (1.0 + math.exp(-z)) if z > -60 else 0.0


def _candidate_p(probs: torch.Tensor, candidate_index: torch.Tensor) -> torch.Tensor:
    """probs [..., outputs], candidate_index [...] -> the model's probability of the candidate [...] (0 outside the subset)."""
    gathered = probs.gather(-1, candidate_index.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return torch.where(candidate_index >= 0, gathered, torch.zeros_like(gathered))


def copy_guess(probs: torch.Tensor, g: torch.Tensor, candidate_index: torch.Tensor, candidate: torch.Tensor,
               output_tokens: torch.Tensor) -> torch.Tensor:
    """Top-1 token of the mixture per position: probs [n, subset + 1], g / candidate_index / candidate [n],
    output_tokens [subset + 1] (the fallback's is -1) -> token ids [n] (-1: the fallback won, no guess)."""
    probs = probs.float()
    candidate_p = _candidate_p(probs, candidate_index)
    top_p, top_index = probs.max(-1)
    model_guess = output_tokens[top_index]
    copies = (g > 0) & (g + (1 - g) * candidate_p >= (1 - g) * top_p)
    return torch.where(copies, candidate, model_guess)
