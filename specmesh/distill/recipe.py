"""``specmesh distill``: target answers -> trained expert -> evaluation -> a drafter directory."""

from __future__ import annotations

import copy
import random
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

import torch

from specmesh.distill.data import Example, generate_examples, recorded_soft_labels
from specmesh.distill.evaluate import (
    agreement_by_category,
    expected_tokens_per_step,
    interface_hits,
    teacher_forced_hits,
    union_hits,
)
from specmesh.distill.overlap import without_benchmark
from specmesh.distill.synthesis import classified_prompts, synthesize_requests
from specmesh.distill.train import TrainConfig, build_student, train_student
from specmesh.drafters.catalog import load_expert_for
from specmesh.drafters.expert import (
    ExpertDrafter,
    ExpertModel,
    ExpertSpec,
    drafter_dtype,
    round_to_stored,
    save_drafter,
    subset_for,
)
from specmesh.prompts import Prompt, mtbench_prompts
from specmesh.runtime.llama import TreeBatch
from specmesh.runtime.loading import cache_root, tokenizer_fingerprint
from specmesh.runtime.target import prefilled_session
from specmesh.speculation.assembly import Assembly, eos_token_ids
from specmesh.speculation.classifier import default_classifier
from specmesh.tree import TokenTree, compile_tree

BOOST = 2.0  # extra weight of a position every earlier drafter of the set got wrong
MTBENCH_ANSWER_TOKENS = 64


def target_step_ms(assembly: Assembly, context: Sequence[int], steps: int = 30) -> float:
    """Median milliseconds of one plain decode step of the target (one token, KV cached), to its end on the
    device (a CUDA pass returns once queued)."""
    runtime = assembly.runtime
    session = prefilled_session(runtime, context[:-1])
    finish = torch.cuda.synchronize if runtime.device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(steps):
        finish()
        started = time.perf_counter()
        runtime.forward(TreeBatch.build([session], [compile_tree(context[-1], TokenTree())]))
        finish()
        times.append(time.perf_counter() - started)
    session.free()
    return statistics.median(times[5:]) * 1e3


def mtbench_examples(assembly: Assembly, max_tokens: int = MTBENCH_ANSWER_TOKENS) -> list[Example]:
    """The target's greedy answers to MT-Bench's first turns (cached): the evaluation set."""
    name = assembly.target.name.replace("/", "_")
    cache = cache_root() / "eval" / f"mtbench-{name}-{max_tokens}.jsonl"
    return generate_examples(assembly.runtime, assembly.target.tokenizer, mtbench_prompts(), cache, max_tokens,
                             eos_token_ids(assembly.target))


def target_written_requests(assembly: Assembly, count: int, seed: int = 0) -> list[str]:
    """``count`` requests the target writes itself (one cached pool per target and seed, grown as needed),
    never sharing a long word run with an MT-Bench question."""
    name = assembly.target.name.replace("/", "_")
    pool = cache_root() / "synthesized" / f"requests-{name}-seed{seed}.jsonl"
    return synthesize_requests(assembly.runtime, assembly.target.tokenizer, count, pool, eos_token_ids(assembly.target),
                               seed=seed)


def synthesized_prompts(assembly: Assembly, domain: str, count: int, seed: int = 0) -> list[Prompt]:
    """Of ``count`` target-written requests, those the request classifier puts in ``domain``'s kinds."""
    return classified_prompts(target_written_requests(assembly, count, seed), domain, default_classifier().classify)


def boost_weights(assembly: Assembly, examples: Sequence[Example], earlier_dirs: Sequence[str | Path]) -> list[list[float]]:
    """Collective boost-tuning: per input position, 1 + BOOST where every earlier drafter of the set
    misses the target's next token (answer positions only), else 1."""
    earlier = [load_expert_for(directory, assembly.target)[0].float() for directory in earlier_dirs]
    covered = union_hits([teacher_forced_hits(model, examples) for model in earlier])
    weights = []
    for example, row in zip(examples, covered):
        w = [1.0] * len(example.token_ids)
        for offset, hit in enumerate(row):
            w[len(example.prompt_ids) - 1 + offset] = 1.0 if hit else 1.0 + BOOST
        weights.append(w)
    return weights


def distill(
    assembly: Assembly,
    domain: str,
    prompts: Sequence[Prompt],
    out_dir: Path,
    config: TrainConfig,
    boost_from: Sequence[str | Path] = (),
    max_answer_tokens: int = 128,
) -> ExpertSpec:
    prompts = without_benchmark(prompts)  # whatever their source: nothing trained on is measured on
    out_dir.mkdir(parents=True, exist_ok=True)
    answers_file = out_dir / "answers.jsonl"
    examples = generate_examples(assembly.runtime, assembly.target.tokenizer, prompts, answers_file, max_answer_tokens,
                                 eos_token_ids(assembly.target))
    rng = random.Random(config.seed)
    shuffled = examples[:]
    rng.shuffle(shuffled)
    held_out = max(1, len(shuffled) // 10)
    validation, training = shuffled[:held_out], shuffled[held_out:]
    soft = None
    if config.soft_weight > 0:
        soft = recorded_soft_labels(answers_file, training)
    vocab = assembly.target.model.config.vocab_size
    subset = subset_for([t for e in training for t in e.response_ids], vocab, config.subset_size)
    weights = boost_weights(assembly, training, boost_from) if boost_from else None
    model = build_student(assembly.target.model, subset, config.layers)
    result = train_student(model, training, config, position_weights=weights, soft_labels=soft, validation=validation)
    round_to_stored(model)  # measure the weights as saved
    spec = ExpertSpec(
        name=out_dir.name,
        domain=domain,
        target={"name": assembly.target.name, "tokenizer_hash": tokenizer_fingerprint(assembly.target.tokenizer),
                "vocab_size": vocab},
        architecture=model.config.to_dict() | {"vocab_size": vocab},
        measured=measure_expert(assembly, model, out_dir.name, domain, validation),
        training=asdict(config) | {"examples": len(training), "answer_tokens": sum(len(e.response_ids) for e in training),
                                   "steps": result.steps, "epochs": round(result.epochs, 2),
                                   "seconds": round(result.seconds, 1), "train_accuracy": round(result.final_accuracy, 4),
                                   "best_held_out_agreement": result.best_held_out,
                                   "boosted_from": [Path(d).name for d in boost_from], "subset_size": len(subset)},
    )
    save_drafter(model, spec, out_dir)
    return spec


def measure_expert(assembly: Assembly, model: ExpertModel, name: str, domain: str, held_out: Sequence[Example]) -> dict:
    """``drafter.json``'s measurements: held-out and MT-Bench agreement (the latter through the drafter
    interface, as it will run: its precision, int8 linears on a CPU), expected tokens per step, cost."""
    held_out_hits = teacher_forced_hits(model, held_out)
    bench = mtbench_examples(assembly)
    deployed = copy.deepcopy(model).to(drafter_dtype(assembly.runtime.device))
    drafter = ExpertDrafter(deployed, name=name, domain=domain)
    bench_hits, cost_ms = interface_hits(drafter, bench)  # cost: median ms per guess, as `specmesh bench` counts it
    target_ms = target_step_ms(assembly, list(bench[0].prompt_ids))
    return {
        "held_out_agreement": agreement_by_category(held_out, held_out_hits)["all"],
        "mtbench_agreement": agreement_by_category(bench, bench_hits),
        "mtbench_expected_tokens_per_step": expected_tokens_per_step(bench_hits),
        "cost_ms": round(cost_ms, 3),
        "target_step_ms": round(target_ms, 3),
        "cost_fraction": round(cost_ms / target_ms, 4),
    }
