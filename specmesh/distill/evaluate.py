"""Measuring drafters against the target: agreement, expected tokens per step, cost.

Under teacher forcing on the target's own greedy answers, a drafter is *right* at a position when its
top-1 guess is the target's next token. A greedy chain of k guesses starting at position t is accepted
for exactly as many tokens as the run of right positions starting at t (each guess is conditioned on
the earlier ones, which were right, i.e. on the true prefix), so the expected tokens per verification
step for a chain of k is 1 + mean over t of min(run length at t, k).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Sequence

import torch

from specmesh.distill.data import Example
from specmesh.drafters.expert import ExpertModel
from specmesh.runtime.features import Features

MAX_K = 8


@torch.no_grad()
def teacher_forced_states(model: ExpertModel, examples: Sequence[Example], tokens_per_batch: int = 4096):
    """Per example (in order of length): (its index, the model's hidden states [answer_len, hidden] at its
    answer positions' inputs). Examples of similar length go through together, right-padded (causal
    attention keeps every real position's output what it is alone)."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].token_ids))
    device = model.device
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and len(examples[order[end]].token_ids) * (end - start + 1) <= tokens_per_batch:
            end += 1
        group = [examples[i] for i in order[start:end]]
        width = max(len(e.token_ids) for e in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for row, example in enumerate(group):
            ids[row, : len(example.token_ids)] = torch.tensor(example.token_ids)
            mask[row, : len(example.token_ids)] = 1
        hidden = model.hidden_states(ids.to(device), attention_mask=mask.to(device))  # [batch, width, hidden]
        for row, (index, example) in enumerate(zip(order[start:end], group)):
            first, last = len(example.prompt_ids) - 1, len(example.token_ids) - 1
            yield index, hidden[row, first:last]
        start = end


@torch.no_grad()
def teacher_forced_hits(model: ExpertModel, examples: Sequence[Example], tokens_per_batch: int = 4096) -> list[list[bool]]:
    """Per example, per answer position: whether the drafter's top-1 guess is the target's next token."""
    hits: list[list[bool]] = [[] for _ in examples]
    for index, hidden in teacher_forced_states(model, examples, tokens_per_batch):
        example = examples[index]
        guessed = model.guesses(hidden)  # token ids; -1 = no guess
        hits[index] = (guessed.cpu() == torch.tensor(example.response_ids)).tolist()
    return hits


def agreement_by_category(examples: Sequence[Example], hits: Sequence[Sequence[bool]]) -> dict[str, float]:
    right, total = defaultdict(int), defaultdict(int)
    for example, row in zip(examples, hits):
        right[example.category] += sum(row)
        total[example.category] += len(row)
    result = {c: round(right[c] / total[c], 4) for c in sorted(total) if total[c]}
    result["all"] = round(sum(right.values()) / max(sum(total.values()), 1), 4)
    return result


def union_hits(hit_sets: Sequence[Sequence[Sequence[bool]]]) -> list[list[bool]]:
    """Right where any drafter of the set is right."""
    return [[any(column) for column in zip(*rows)] for rows in zip(*hit_sets)]


def expected_tokens_per_step(hits: Sequence[Sequence[bool]], max_k: int = MAX_K) -> dict[str, float]:
    """1 + E[min(run of right guesses from t, k)] for k = 1..max_k, over every answer position t."""
    runs = []
    for row in hits:
        run = 0
        row_runs = []
        for hit in reversed(row):
            run = run + 1 if hit else 0
            row_runs.append(run)
        runs.extend(row_runs)
    if not runs:
        return {str(k): 1.0 for k in range(1, max_k + 1)}
    return {str(k): round(1 + sum(min(r, k) for r in runs) / len(runs), 3) for k in range(1, max_k + 1)}


def interface_hits(drafter, examples: Sequence[Example],
                   features: Sequence[torch.Tensor] | None = None) -> tuple[list[list[bool]], float]:
    """Teacher-forced hits of any drafter, through its interface: at each answer position, is its
    first guess the target's next token? (No guess counts as wrong.) Also the median ms per guess.
    A feature drafter also needs each example's ``features`` ([tokens - 1, layers, hidden]): it hears
    the prompt's at the start and one position more with each committed token, as in a run."""
    layers = tuple(drafter.feature_layers)
    hits, times = [], []
    for number, example in enumerate(examples):
        request = f"eval-{number}"
        drafter.start(request, example.prompt_ids)
        first = len(example.prompt_ids) - 1  # the prompt's features: positions 0 .. first - 1
        if layers:
            drafter.add_features(request, Features(0, features[number][:first], layers))
        row = []
        try:
            for offset, token in enumerate(example.response_ids):
                started = time.perf_counter()
                tree = drafter.propose(request, 1)
                times.append(time.perf_counter() - started)
                row.append(len(tree) > 0 and tree.tokens[0] == token)
                drafter.commit(request, [token])
                if layers and first + offset < features[number].shape[0]:
                    drafter.add_features(request, Features(first + offset, features[number][first + offset :
                                                                                             first + offset + 1], layers))
        finally:
            drafter.end(request)
        hits.append(row)
    return hits, (statistics.median(times) * 1e3 if times else 0.0)
