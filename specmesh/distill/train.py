"""Distilling an expert drafter from the target's own answers.

The student starts as the target's first layers, final norm and (subset) head rows, over the target's
frozen input embeddings; it is trained with cross-entropy on the target's greedy next tokens (its own
answers, so the labels are exactly what top-1 agreement counts), mapped into the head's subset, with
the fallback class for tokens outside it. Positions can carry weights: collective boost-tuning
up-weights the positions that earlier drafters of the set got wrong.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from specmesh.distill.data import Example
from specmesh.drafters.expert import ExpertModel

IGNORE = -100


@dataclass(frozen=True)
class TrainConfig:
    layers: int = 2
    subset_size: int = 8192
    minutes: float = 10.0
    learning_rate: float = 1e-3
    tokens_per_batch: int = 4096
    max_length: int = 384
    seed: int = 0


@dataclass
class TrainResult:
    steps: int
    epochs: float
    seconds: float
    final_accuracy: float  # top-1 agreement on the last training batches (in-sample)


def build_student(target_model: torch.nn.Module, subset_ids: torch.Tensor, layers: int) -> ExpertModel:
    """A student initialised from the target: its first ``layers`` layers, final norm and head rows."""
    config = copy.deepcopy(target_model.config)
    config.num_hidden_layers = layers
    config.tie_word_embeddings = False
    inner = target_model.model
    model = ExpertModel(config, inner.embed_tokens.weight.detach().float(), subset_ids)
    with torch.no_grad():
        for index in range(layers):
            model.body.layers[index].load_state_dict(inner.layers[index].state_dict())
        model.body.norm.load_state_dict(inner.norm.state_dict())
        head = target_model.lm_head.weight.detach().float()
        model.head.weight[: len(subset_ids)] = head[subset_ids]
        model.head.weight[len(subset_ids)] = 0.0  # fallback starts neutral
    return model.float()


def labels_for(example: Example, subset_index: dict[int, int], fallback: int) -> list[int]:
    """Per input position: the subset index of the target's next token on answer positions, else IGNORE."""
    tokens = example.token_ids
    labels = [IGNORE] * len(tokens)
    for position in range(len(example.prompt_ids) - 1, len(tokens) - 1):
        labels[position] = subset_index.get(tokens[position + 1], fallback)
    return labels


def batches(rows: list[tuple[list[int], list[int], list[float]]], tokens_per_batch: int, generator: torch.Generator):
    """Length-bucketed batches of about ``tokens_per_batch`` padded tokens, in random order."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))
    groups, current = [], []
    for index in order:
        longest = max([len(rows[i][0]) for i in current] + [len(rows[index][0])])
        if current and longest * (len(current) + 1) > tokens_per_batch:
            groups.append(current)
            current = []
        current.append(index)
    if current:
        groups.append(current)
    for g in torch.randperm(len(groups), generator=generator).tolist():
        group = groups[g]
        width = max(len(rows[i][0]) for i in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        labels = torch.full((len(group), width), IGNORE, dtype=torch.long)
        weights = torch.zeros(len(group), width)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for row, index in enumerate(group):
            tokens, label, weight = rows[index]
            ids[row, : len(tokens)] = torch.tensor(tokens)
            labels[row, : len(tokens)] = torch.tensor(label)
            weights[row, : len(tokens)] = torch.tensor(weight)
            mask[row, : len(tokens)] = 1
        yield ids, labels, weights, mask


def train_student(
    model: ExpertModel,
    examples: Sequence[Example],
    config: TrainConfig,
    position_weights: Sequence[Sequence[float]] | None = None,
) -> TrainResult:
    """Train until the time budget is spent (whole epochs or not); returns what was done."""
    torch.manual_seed(config.seed)
    generator = torch.Generator().manual_seed(config.seed)
    subset = model.subset_ids.tolist()
    subset_index = {token: i for i, token in enumerate(subset)}
    fallback = len(subset)
    rows = []
    for n, example in enumerate(examples):
        tokens = example.token_ids[: config.max_length]
        labels = labels_for(example, subset_index, fallback)[: config.max_length]
        weights = list(position_weights[n][: config.max_length]) if position_weights else [1.0] * len(tokens)
        rows.append((tokens, labels, weights))
    total_tokens = sum(sum(1 for l in r[1] if l != IGNORE) for r in rows)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=0.0, betas=(0.9, 0.98))
    budget = config.minutes * 60.0
    started = time.perf_counter()
    steps = seen = 0
    recent: list[tuple[int, int]] = []
    model.train()
    bar = tqdm(total=int(budget), desc="training", unit="s")
    done = False
    while not done:
        for ids, labels, weights, mask in batches(rows, config.tokens_per_batch, generator):
            elapsed = time.perf_counter() - started
            if elapsed >= budget:
                done = True
                break
            lr = config.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(elapsed / budget, 1.0))))
            for group in optimizer.param_groups:
                group["lr"] = lr
            logits = model(ids, attention_mask=mask)  # [batch, seq, subset + 1]
            per_token = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE, reduction="none")
            counted = labels != IGNORE
            loss = (per_token * weights * counted).sum() / (weights * counted).sum().clamp_min(1e-6)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            with torch.no_grad():
                right = ((logits.argmax(-1) == labels) & counted & (labels != fallback)).sum().item()
            recent = (recent + [(right, int(counted.sum()))])[-20:]
            steps += 1
            seen += int(counted.sum())
            accuracy = sum(r for r, _ in recent) / max(sum(c for _, c in recent), 1)
            bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{accuracy:.3f}", epoch=f"{seen / total_tokens:.2f}")
            bar.n = int(min(time.perf_counter() - started, budget))
            bar.refresh()
    bar.close()
    model.eval()
    accuracy = sum(r for r, _ in recent) / max(sum(c for _, c in recent), 1)
    return TrainResult(steps, seen / max(total_tokens, 1), time.perf_counter() - started, accuracy)
