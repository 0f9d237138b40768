"""``specmesh distill --kind feature``: the target's answers and hidden states -> a trained feature
drafter -> its measured agreement and cost -> a drafter directory."""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

import torch

from specmesh.distill.data import Example
from specmesh.distill.evaluate import agreement_by_category, interface_hits
from specmesh.distill.feature_data import FeatureStore, FeatureStoreCard
from specmesh.distill.feature_train import (
    FeatureTrainConfig,
    build_feature_head,
    feature_hits,
    layer_rms,
    train_feature_head,
)
from specmesh.distill.overlap import without_benchmark
from specmesh.distill.recipe import MTBENCH_ANSWER_TOKENS, target_step_ms
from specmesh.drafters.expert import round_to_stored, save_drafter, subset_for
from specmesh.drafters.eagle import write_eagle3
from specmesh.drafters.feature import FeatureDrafter, FeatureHead, FeatureSpec
from specmesh.prompts import Prompt, mtbench_prompts
from specmesh.runtime.features import Features
from specmesh.runtime.loading import cache_root, tokenizer_fingerprint
from specmesh.speculation.assembly import Assembly, eos_token_ids

DEFAULT_FEATURE_LAYERS_SHARE = (0.07, 0.5, 1.0)  # low, middle and top of the target (EAGLE-3's three)


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """Low, middle and top layers: after 2, 15 and 30 of the embedded default's 30."""
    return tuple(sorted({max(1, min(num_layers, round(share * num_layers))) for share in DEFAULT_FEATURE_LAYERS_SHARE}))


def store_card(assembly: Assembly, layers: Sequence[int]) -> FeatureStoreCard:
    target = assembly.target
    return FeatureStoreCard(target.name, tokenizer_fingerprint(target.tokenizer), assembly.runtime.precision,
                            tuple(layers), target.model.config.hidden_size)


def feature_store(assembly: Assembly, layers: Sequence[int], purpose: str) -> FeatureStore:
    """The cached store of one target, precision and layer set, for ``purpose`` (training prompts, or the
    MT-Bench evaluation set)."""
    card = store_card(assembly, layers)
    name = f"{assembly.target.name.replace('/', '_')}-{card.precision}-layers{'_'.join(map(str, layers))}-{purpose}"
    return FeatureStore(cache_root() / "features" / name, card)


def mtbench_features(assembly: Assembly, layers: Sequence[int],
                     max_tokens: int = MTBENCH_ANSWER_TOKENS) -> tuple[list[Example], list[torch.Tensor]]:
    """The target's greedy answers to MT-Bench's first turns with their features: the evaluation set."""
    store = feature_store(assembly, layers, f"mtbench{max_tokens}")
    examples = store.record(assembly.runtime, assembly.target.tokenizer, mtbench_prompts(), max_tokens,
                            eos_token_ids(assembly.target))
    return examples, list(store.features(examples))


def distill_feature(assembly: Assembly, prompts: Sequence[Prompt], out_dir: Path, config: FeatureTrainConfig,
                    layers: Sequence[int], command: str, max_answer_tokens: int = 128, eagle3: bool = False) -> FeatureSpec:
    """Train a feature head on the target's answers to ``prompts`` and write it to ``out_dir``: as a specmesh
    drafter directory, or (``eagle3``) as a published EAGLE-3 checkpoint (``--drafter eagle3:DIR``)."""
    prompts = without_benchmark(prompts)  # whatever their source: nothing trained on is measured on
    store = feature_store(assembly, layers, "train")
    examples = store.record(assembly.runtime, assembly.target.tokenizer, prompts, max_answer_tokens,
                            eos_token_ids(assembly.target))
    features = list(store.features(examples))
    order = list(range(len(examples)))
    random.Random(config.seed).shuffle(order)
    held = set(order[: max(1, len(order) // 20)])
    train_ids = [i for i in order if i not in held]
    bench, bench_features = mtbench_features(assembly, layers)
    vocab = assembly.target.model.config.vocab_size
    subset = subset_for([t for i in train_ids for t in examples[i].response_ids], vocab, config.subset_size)
    model = build_feature_head(assembly.target.model, layers, subset, eagle3=eagle3)
    if eagle3:
        model.feature_scales.copy_(layer_rms([features[i] for i in train_ids]))

    def validate(head: FeatureHead) -> dict:
        hits = feature_hits(head, bench, bench_features)[0]
        return {"mtbench": agreement_by_category(bench, hits)}

    result = train_feature_head(model, [examples[i] for i in train_ids], [features[i] for i in train_ids], config,
                                validate=validate)
    model.fold_feature_scales()
    round_to_stored(model)
    held_examples = [examples[i] for i in sorted(held)]
    held_hits = feature_hits(model, held_examples, [features[i] for i in sorted(held)])[0]
    target = assembly.target
    spec = FeatureSpec(
        name=out_dir.name,
        target={"name": target.name, "tokenizer_hash": tokenizer_fingerprint(target.tokenizer), "vocab_size": vocab,
                "hidden_size": target.model.config.hidden_size, "precision": assembly.runtime.precision},
        architecture=asdict(model.config) | {"feature_layers": list(layers)},
        measured={"held_out_agreement": agreement_by_category(held_examples, held_hits)["all"],
                  **measure_feature_drafter(assembly, model, bench, bench_features)},
        training=asdict(config) | {"command": command, "examples": len(train_ids),
                                   "answer_tokens": sum(len(examples[i].response_ids) for i in train_ids),
                                   "steps": result.steps, "epochs": round(result.epochs, 2),
                                   "seconds": round(result.seconds, 1), "history": result.history},
    )
    if eagle3:
        write_eagle3(model, out_dir, vocab, target.model.config.max_position_embeddings, target.tokenizer, asdict(spec))
    else:
        save_drafter(model, spec, out_dir)
    return spec


def measure_feature_drafter(assembly: Assembly, model: FeatureHead, bench: Sequence[Example],
                            bench_features: Sequence[torch.Tensor]) -> dict:
    """MT-Bench agreement by category (teacher forced), the agreement of guesses 2..4 past the last
    feature, expected tokens per step of a chain, and the cost of a guess as it runs (int8 on a CPU)."""
    hits = feature_hits(model, bench, bench_features, steps=4)
    by_depth = {str(j + 1): agreement_by_category(bench, h)["all"] for j, h in enumerate(hits)}
    _, cost_ms = interface_hits(FeatureDrafter(model, "measure"), bench[:8], bench_features[:8])
    further_ms = further_guess_ms(model, bench[:4], bench_features[:4])
    target_ms = target_step_ms(assembly, list(bench[0].prompt_ids))
    return {"mtbench_agreement": agreement_by_category(bench, hits[0]),
            "mtbench_agreement_by_depth": by_depth,
            "mtbench_expected_tokens_per_step": chained_tokens_per_step(hits),
            "cost_ms": round(cost_ms, 3), "further_guess_ms": round(further_ms, 3), "target_step_ms": round(target_ms, 3),
            "cost_fraction": round(cost_ms / target_ms, 4), "further_guess_fraction": round(further_ms / target_ms, 4)}


def further_guess_ms(model: FeatureHead, examples: Sequence[Example], features: Sequence[torch.Tensor],
                     depth: int = 5) -> float:
    """Median ms of each guess after a proposal's first (the first also feeds the newest target features):
    a chain of ``depth`` against one guess, at each answer position."""
    one, chain = FeatureDrafter(model, "one"), FeatureDrafter(model, "chain", max_depth=depth, branch_width=1)
    times = []
    for number, (example, feature) in enumerate(zip(examples, features)):
        first = len(example.prompt_ids) - 1
        for drafter in (one, chain):
            drafter.start(str(number), example.prompt_ids)
            drafter.add_features(str(number), Features(0, feature[:first], model.config.feature_layers))
        for offset, token in enumerate(example.response_ids[: feature.shape[0] - first]):
            spent = []
            for drafter, budget in ((one, 1), (chain, depth)):
                started = time.perf_counter()
                tree = drafter.propose(str(number), budget)
                spent.append((time.perf_counter() - started, len(tree)))
                drafter.commit(str(number), [token])
                drafter.add_features(str(number), Features(first + offset, feature[first + offset : first + offset + 1],
                                                           model.config.feature_layers))
            (single, _), (whole, guesses) = spent
            if guesses > 1:
                times.append((whole - single) / (guesses - 1))
        for drafter in (one, chain):
            drafter.end(str(number))
    return statistics.median(times) * 1e3 if times else 0.0


def chained_tokens_per_step(hits: Sequence[Sequence[Sequence[bool]]]) -> dict[str, float]:
    """1 + expected run of right guesses of a chain of k, where guess j is the head's j-th step past the
    last target feature (k up to the steps measured)."""
    runs = []
    for rows in zip(*hits):  # per example: per step, hits by position
        for p in range(len(rows[0])):
            run = 0
            for j, row in enumerate(rows):
                if p + j < len(row) and row[p + j]:
                    run += 1
                else:
                    break
            runs.append(run)
    if not runs:
        return {}
    return {str(k): round(1 + sum(min(r, k) for r in runs) / len(runs), 3) for k in range(1, len(hits) + 1)}
