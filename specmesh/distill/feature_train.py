"""Training a feature drafter on the target's answers and hidden states (``feature_data.py``).

Labels are the target's own greedy tokens, so top-1 agreement is what the loss aims at. Each batch runs
the head's training-time-test unroll (``FeatureHead.unrolled``): step j drafts its (j+1)-th token past the
target's last feature, and its loss weighs ``decay ** j`` (later guesses matter only when earlier ones
were right). The head starts from the target's own LM head rows and final norm, so that a feature like the
target's top layer already reads as the target would.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, replace
from typing import Sequence

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from specmesh.distill.data import Example
from specmesh.drafters.feature import FeatureConfig, FeatureHead, subset_head_rows

IGNORE = -100


@dataclass(frozen=True)
class FeatureTrainConfig:
    subset_size: int = 8192
    unroll: int = 3  # training-time-test steps
    decay: float = 0.8  # weight of step j's loss: decay ** j
    epochs: float = 4.0
    minutes: float = 0.0  # above 0: stop after this long, whatever the epochs
    learning_rate: float = 1e-3
    tokens_per_batch: int = 4096
    seed: int = 0


@dataclass
class FeatureTrainResult:
    steps: int
    epochs: float
    seconds: float
    history: list[dict]  # validation measurements along the way


def build_feature_head(target_model: torch.nn.Module, feature_layers: Sequence[int], subset_ids: torch.Tensor,
                       eagle3: bool = False) -> FeatureHead:
    """A head that starts as the target's own reading of its top layer: the fused feature is the (normed)
    last layer read, the residual branches add nothing, the final norm and head rows are the target's.
    Its first guesses are then the target's next token, one position early: a sensible scale to learn from.
    ``eagle3``: in EAGLE-3's published layout (the layers fused raw, no fallback class)."""
    config = FeatureConfig.for_target(target_model.config, feature_layers, len(subset_ids))
    if eagle3:
        config = replace(config, feature_norms=False, fallback=False)
    inner = target_model.model
    model = FeatureHead(config, inner.embed_tokens.weight.detach().float().cpu(), subset_ids)
    hidden = config.hidden_size
    with torch.no_grad():
        rows = subset_head_rows(target_model.lm_head.weight, subset_ids)
        model.head.weight.copy_(rows if config.fallback else rows[:-1])
        model.final_norm.weight.copy_(inner.norm.weight.detach().float())
        model.fuse.weight.zero_()
        top = len(feature_layers) - 1  # the layers are ascending: the last is the highest
        model.fuse.weight[:, top * hidden : (top + 1) * hidden] = torch.eye(hidden)
        for linear in (model.qkv, model.gate_up):
            linear.weight.normal_(0.0, 0.02)
        for linear in (model.out, model.down):  # residual branches start silent
            linear.weight.zero_()
    return model


def layer_rms(features: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each target layer's RMS over ``features`` (each [tokens, layers, hidden]) -> [layers]: the fixed scales
    a head without per-layer norms trains under (layers' scales differ by orders of magnitude)."""
    squares = sum(f.float().pow(2).sum(dim=(0, 2)) for f in features)
    count = sum(f.shape[0] * f.shape[2] for f in features)
    return (squares / count).sqrt().clamp_min(1e-6)


def batch_tensors(examples: Sequence[Example], features: Sequence[torch.Tensor], subset_index: dict[int, int],
                  outside: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded features [batch, T, layers, hidden], next ids [batch, T] and labels [batch, T]: the subset
    index of the token after next where that token is part of the answer (``outside`` for a token not in
    the subset: the fallback class, IGNORE, or an index no guess takes), else IGNORE."""
    length = max(f.shape[0] for f in features)
    batch = len(examples)
    layers, hidden = features[0].shape[1:]
    x = torch.zeros(batch, length, layers, hidden, dtype=torch.float16)
    next_ids = torch.zeros(batch, length, dtype=torch.long)
    labels = torch.full((batch, length), IGNORE, dtype=torch.long)
    for row, (example, f) in enumerate(zip(examples, features)):
        ids = example.token_ids
        n = f.shape[0]  # len(ids) - 1
        x[row, :n] = f
        next_ids[row, :n] = torch.tensor(ids[1:])
        answer_from = len(example.prompt_ids)
        for t in range(max(0, answer_from - 2), n - 1):  # position t predicts ids[t + 2]
            labels[row, t] = subset_index.get(ids[t + 2], outside)
    return x, next_ids, labels


def batches(order: Sequence[int], lengths: Sequence[int], tokens_per_batch: int) -> list[list[int]]:
    """Groups of examples of similar length, each within ``tokens_per_batch`` padded positions."""
    by_length = sorted(order, key=lambda i: lengths[i])
    groups, group = [], []
    for i in by_length:
        if group and (len(group) + 1) * max(lengths[j] for j in [*group, i]) > tokens_per_batch:
            groups.append(group)
            group = []
        group.append(i)
    if group:
        groups.append(group)
    return groups


def unroll_loss(model: FeatureHead, x, next_ids, labels, unroll: int, decay: float) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The weighted loss of every unrolled step, and per step (right, counted) top-1 guesses."""
    outputs = model.unrolled(x, next_ids, unroll)
    total = torch.zeros(())
    counts = []
    for j, out in enumerate(outputs):
        valid = labels != IGNORE
        valid[:, :j] = False  # no position before j has j own guesses behind it
        wanted = labels[valid]  # [n]: the head runs on labelled positions only (it is most of the cost)
        logits = model.logits(out[valid])  # [n, subset + 1]
        total = total + decay**j * F.cross_entropy(logits, wanted)
        right = (logits.argmax(-1) == wanted) & (wanted != _outside(model))
        counts.append((int(right.sum()), int(wanted.numel())))
    return total, counts


def train_feature_head(model: FeatureHead, examples: Sequence[Example], features: Sequence[torch.Tensor],
                       config: FeatureTrainConfig, validate=None, validate_every: int = 200) -> FeatureTrainResult:
    """AdamW with warm-up and cosine decay over the planned steps. ``validate(model) -> dict`` is called
    every ``validate_every`` steps and at the end."""
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    subset_index = {int(t): i for i, t in enumerate(model.subset_ids.tolist())}
    lengths = [f.shape[0] for f in features]
    groups = batches(range(len(examples)), lengths, config.tokens_per_batch)
    planned = max(1, int(len(groups) * config.epochs))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate, weight_decay=0.0, betas=(0.9, 0.95))
    warmup = min(100, planned // 10 + 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, planned) / planned)))
    history: list[dict] = []
    started = time.perf_counter()
    step = 0
    window: list[list[tuple[int, int]]] = []
    model.train()
    with tqdm(total=planned, desc="training the feature drafter", unit="step") as bar:
        while step < planned:
            rng.shuffle(groups)
            for group in groups:
                if step >= planned or (config.minutes and time.perf_counter() - started > config.minutes * 60):
                    planned = step
                    break
                x, next_ids, labels = batch_tensors([examples[i] for i in group], [features[i] for i in group],
                                                    subset_index, _outside(model, IGNORE))
                loss, counts = unroll_loss(model, x, next_ids, labels, config.unroll, config.decay)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(trainable, 1.0)
                optimizer.step()
                schedule.step()
                step += 1
                window = (window + [counts])[-50:]
                accuracy = [sum(c[j][0] for c in window) / max(1, sum(c[j][1] for c in window)) for j in range(config.unroll)]
                bar.set_postfix(loss=f"{loss.item():.3f}", top1="/".join(f"{a:.2f}" for a in accuracy))
                bar.update(1)
                if validate is not None and step % validate_every == 0:
                    history.append({"step": step, **_validated(model, validate)})
    if validate is not None:
        history.append({"step": step, **_validated(model, validate)})
    model.eval()
    return FeatureTrainResult(step, step / max(1, len(groups)), time.perf_counter() - started, history)


def _validated(model: FeatureHead, validate) -> dict:
    model.eval()
    try:
        with torch.no_grad():
            return validate(model)
    finally:
        model.train()


@torch.no_grad()
def _outside(model: FeatureHead, without_fallback: int | None = None) -> int:
    """The label of a token outside the head's subset: its fallback class; for a head without one (EAGLE-3's
    layout) ``without_fallback`` (IGNORE in training), else an index no guess takes (a miss when measured)."""
    if model.fallback is not None:
        return model.fallback
    return without_fallback if without_fallback is not None else model.head.out_features


def feature_hits(model: FeatureHead, examples: Sequence[Example], features: Sequence[torch.Tensor],
                 steps: int = 1, tokens_per_batch: int = 8192) -> list[list[list[bool]]]:
    """Teacher-forced hits: per unrolled step, per example, per answer token (all but the first, which the
    prefill gives): is the head's top-1 guess the target's token? Step j guesses a token j positions past
    the target's last feature (with the earlier tokens right)."""
    subset_index = {int(t): i for i, t in enumerate(model.subset_ids.tolist())}
    hits: list[list[list[bool]]] = [[[] for _ in examples] for _ in range(steps)]
    lengths = [f.shape[0] for f in features]
    for group in batches(range(len(examples)), lengths, tokens_per_batch):
        x, next_ids, labels = batch_tensors([examples[i] for i in group], [features[i] for i in group],
                                            subset_index, _outside(model))
        outputs = model.unrolled(x, next_ids, steps)
        for j, out in enumerate(outputs):
            guessed = model.logits(out).argmax(-1)
            for row, i in enumerate(group):
                first = len(examples[i].prompt_ids) - 1  # predicts the answer's second token
                valid = labels[row, first:] != IGNORE
                right = (guessed[row, first:] == labels[row, first:]) & (labels[row, first:] != _outside(model))
                hits[j][i] = right[valid].tolist()
    return hits
