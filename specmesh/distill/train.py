"""Distilling an expert drafter from the target's own answers.

The student starts as the target's first layers, final norm and (subset) head rows, over the target's
frozen input embeddings. Its loss mixes two views of the target at every answer position:
- hard: cross-entropy on the target's greedy next token (its own answer, so exactly what top-1
  agreement counts), mapped into the head's subset, the fallback class for tokens outside it;
- soft: cross-entropy against the target's top-k next-token distribution (mass outside the subset
  goes to the fallback class), which carries far more per token than the argmax alone.
Positions can carry weights: collective boost-tuning up-weights the positions that earlier drafters
of the set got wrong.
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

from specmesh.distill.data import Example, SoftLabels
from specmesh.drafters.expert import ExpertModel

IGNORE = -100


@dataclass(frozen=True)
class TrainConfig:
    layers: int = 3
    subset_size: int = 8192
    minutes: float = 10.0
    steps: int = 0  # above 0: exactly this many steps, whatever the time (a run that repeats on any machine)
    learning_rate: float = 2e-3
    soft_weight: float = 0.5  # share of the soft (distribution) loss; the rest is the hard-label loss
    tokens_per_batch: int = 2048
    max_length: int = 384
    seed: int = 0


@dataclass
class TrainResult:
    steps: int
    epochs: float
    seconds: float
    final_accuracy: float  # top-1 agreement on the last training batches (in-sample)
    best_held_out: float | None = None  # the kept weights' held-out agreement, when validated


def build_student(target_model: torch.nn.Module, subset_ids: torch.Tensor, layers: int) -> ExpertModel:
    """A student initialised from the target: its first ``layers`` layers, final norm and head rows; on
    the target's device (a GPU node trains it there)."""
    if not 1 <= layers <= target_model.config.num_hidden_layers:
        from specmesh.errors import InvalidArgument

        raise InvalidArgument("layers", f"must be in 1..{target_model.config.num_hidden_layers} (the target's depth), got {layers}")
    config = copy.deepcopy(target_model.config)
    config.num_hidden_layers = layers
    config.tie_word_embeddings = False
    inner = target_model.model
    model = ExpertModel(config, inner.embed_tokens.weight.detach().float(), subset_ids)
    with torch.no_grad():
        for index in range(layers):
            model.body.layers[index].load_state_dict(inner.layers[index].state_dict())
        model.body.norm.load_state_dict(inner.norm.state_dict())
        head = target_model.lm_head.weight.detach().float().cpu()  # [vocab, hidden]
        model.head.weight[: len(subset_ids)] = head[subset_ids]
        model.head.weight[len(subset_ids)] = 0.0  # fallback starts neutral
    return model.float().to(target_model.lm_head.weight.device)


def labels_for(example: Example, subset_index: dict[int, int], fallback: int) -> list[int]:
    """Per input position: the subset index of the target's greedy next token on answer positions, else IGNORE."""
    labels = [IGNORE] * len(example.token_ids)
    first = len(example.prompt_ids) - 1
    for offset, token in enumerate(example.response_ids):
        labels[first + offset] = subset_index.get(token, fallback)
    return labels


def soft_targets(example: Example, soft: SoftLabels, subset_index: dict[int, int], fallback: int, length: int):
    """Sparse soft targets: (positions [n], classes [n, k+1], probs [n, k+1]); the last column is the
    fallback's share (everything the subset does not hold, including the tail beyond the top-k)."""
    first = len(example.prompt_ids) - 1
    count = min(soft.token_ids.shape[0], max(length - first, 0))
    classes = torch.tensor([[subset_index.get(int(t), fallback) for t in row] for row in soft.token_ids[:count].tolist()],
                           dtype=torch.long).reshape(count, soft.token_ids.shape[1])  # count may be 0: a long prompt
    probs = soft.probs[:count].float().clone()
    probs[classes == fallback] = 0.0
    classes = torch.cat([classes, torch.full((count, 1), fallback, dtype=torch.long)], dim=1)
    probs = torch.cat([probs, (1.0 - probs.sum(dim=1, keepdim=True)).clamp_min(0.0)], dim=1)
    return torch.arange(first, first + count), classes, probs


def batches(rows: list[tuple], tokens_per_batch: int, generator: torch.Generator, device: torch.device):
    """Length-bucketed batches of about ``tokens_per_batch`` padded tokens, in random order, on ``device``."""
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
        soft = []  # (batch row, positions, classes, probs)
        for row, index in enumerate(group):
            tokens, label, weight, targets = rows[index]
            ids[row, : len(tokens)] = torch.tensor(tokens)
            labels[row, : len(tokens)] = torch.tensor(label)
            weights[row, : len(tokens)] = torch.tensor(weight)
            mask[row, : len(tokens)] = 1
            if targets is not None:
                soft.append((row, *(t.to(device) for t in targets)))
        yield *(t.to(device) for t in (ids, labels, weights, mask)), soft


def _soft_loss(log_q_all: torch.Tensor, weights: torch.Tensor, soft: list) -> torch.Tensor:
    """Weighted cross-entropy of the student (log-probabilities [batch, seq, subset + 1]) against the
    target's (subset-mapped) distribution."""
    total = log_q_all.new_zeros(())
    mass = log_q_all.new_zeros(())
    for row, positions, classes, probs in soft:
        log_q = log_q_all[row, positions]  # [n, subset + 1]
        w = weights[row, positions]  # [n]
        total = total - (w * (probs * log_q.gather(1, classes)).sum(-1)).sum()
        mass = mass + w.sum()
    return total / mass.clamp_min(1e-6)


def _training_rows(examples: Sequence[Example], config: TrainConfig, subset_index: dict[int, int], fallback: int,
                   position_weights: Sequence[Sequence[float]] | None,
                   soft_labels: Sequence[SoftLabels] | None) -> list[tuple]:
    """Each example cut to ``config.max_length``: (tokens, labels in the subset, position weights, soft targets
    or None)."""
    rows = []
    for n, example in enumerate(examples):
        tokens = example.token_ids[: config.max_length]
        labels = labels_for(example, subset_index, fallback)[: config.max_length]
        weights = list(position_weights[n][: config.max_length]) if position_weights else [1.0] * len(tokens)
        targets = soft_targets(example, soft_labels[n], subset_index, fallback, len(tokens)) if soft_labels else None
        rows.append((tokens, labels, weights, targets))
    return rows


class _BestKept:
    """The trainable weights with the best held-out agreement so far. A check is due every ``every_s``
    seconds or more, so that checking takes at most ``share`` of the time (checked every 30 s regardless,
    it took most of a run), or every tenth of a run by steps (so that it repeats exactly)."""

    def __init__(self, model: ExpertModel, validation: Sequence[Example], every_s: float, share: float, bar) -> None:
        self.model, self.validation, self.min_every_s, self.share, self.bar = model, validation, every_s, share, bar
        self.every_s, self.last_s = every_s, 0.0
        self.agreement, self.state = -1.0, None

    def due(self, config: TrainConfig, steps: int, elapsed_s: float) -> bool:
        if not self.validation:
            return False
        if config.steps:
            return steps > 0 and steps % max(1, config.steps // 10) == 0
        return elapsed_s - self.last_s >= self.every_s

    def check(self, elapsed_s: float) -> None:
        from specmesh.distill.evaluate import teacher_forced_hits

        checked_at = time.perf_counter()
        self.model.eval()
        hits = [h for row in teacher_forced_hits(self.model, self.validation) for h in row]
        self.model.train()
        agreement = sum(hits) / max(len(hits), 1)
        if agreement > self.agreement:
            self.agreement = agreement
            self.state = {k: v.detach().clone() for k, v in self.model.trainable_state().items()}
        self.bar.set_description(f"training (held-out best {self.agreement:.3f})")
        self.every_s = max(self.min_every_s, (time.perf_counter() - checked_at) / self.share)
        self.last_s = elapsed_s


def _train_step(model: ExpertModel, optimizer: torch.optim.Optimizer, params: list, batch: tuple, config: TrainConfig,
                progress: float, fallback: int) -> tuple[float, int, int]:
    """One optimiser step on ``batch`` at the learning rate of a cosine from 1 to 0.1 at ``progress``: the loss,
    the right guesses (fallback excluded) and the labels counted."""
    ids, labels, weights, mask, soft = batch
    lr = config.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
    for group in optimizer.param_groups:
        group["lr"] = lr
    log_q = model(ids, attention_mask=mask).log_softmax(-1)  # [batch, seq, subset + 1]
    per_token = F.nll_loss(log_q.transpose(1, 2), labels, ignore_index=IGNORE, reduction="none")
    counted = labels != IGNORE
    loss = (per_token * weights * counted).sum() / (weights * counted).sum().clamp_min(1e-6)
    if soft:
        loss = (1.0 - config.soft_weight) * loss + config.soft_weight * _soft_loss(log_q, weights, soft)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    with torch.no_grad():
        right = ((log_q.argmax(-1) == labels) & counted & (labels != fallback)).sum().item()
    return loss.item(), right, int(counted.sum())


def train_student(
    model: ExpertModel,
    examples: Sequence[Example],
    config: TrainConfig,
    position_weights: Sequence[Sequence[float]] | None = None,
    soft_labels: Sequence[SoftLabels] | None = None,
    validation: Sequence[Example] = (),
    validate_every_s: float = 30.0,
    validation_share: float = 0.1,
) -> TrainResult:
    """Train until the time budget is spent (or for ``config.steps`` steps); with ``validation``
    examples, keep the weights that had the best held-out agreement, checked at the end and as
    ``_BestKept`` says (every ``validate_every_s`` seconds or more, at most ``validation_share`` of the time)."""
    torch.manual_seed(config.seed)
    generator = torch.Generator().manual_seed(config.seed)
    subset_index = {token: i for i, token in enumerate(model.subset_ids.tolist())}
    fallback = len(subset_index)
    rows = _training_rows(examples, config, subset_index, fallback, position_weights, soft_labels)
    total_tokens = sum(sum(1 for l in r[1] if l != IGNORE) for r in rows)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=0.0, betas=(0.9, 0.98))
    budget = config.minutes * 60.0
    started = time.perf_counter()
    steps = seen = 0
    recent: list[tuple[int, int]] = []
    model.train()
    bar = tqdm(total=config.steps or int(budget), desc="training", unit="step" if config.steps else "s")
    best = _BestKept(model, validation, validate_every_s, validation_share, bar)
    done = False
    while not done:
        for batch in batches(rows, config.tokens_per_batch, generator, model.device):
            elapsed = time.perf_counter() - started
            progress = steps / config.steps if config.steps else elapsed / budget
            if progress >= 1.0:
                done = True
                break
            if best.due(config, steps, elapsed):
                best.check(elapsed)
            loss, right, counted = _train_step(model, optimizer, params, batch, config, progress, fallback)
            recent = (recent + [(right, counted)])[-20:]
            steps += 1
            seen += counted
            accuracy = sum(r for r, _ in recent) / max(sum(c for _, c in recent), 1)
            bar.set_postfix(loss=f"{loss:.3f}", acc=f"{accuracy:.3f}", epoch=f"{seen / total_tokens:.2f}")
            bar.n = steps if config.steps else int(min(time.perf_counter() - started, budget))
            bar.refresh()
    if validation:
        best.check(time.perf_counter() - started)
        model.load_state_dict(best.state, strict=False)
    bar.close()
    model.eval()
    accuracy = sum(r for r, _ in recent) / max(sum(c for _, c in recent), 1)
    return TrainResult(steps, seen / max(total_tokens, 1), time.perf_counter() - started, accuracy,
                       best.agreement if validation else None)
