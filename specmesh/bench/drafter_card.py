"""A drafter's card (`specmesh drafters check --model M --drafter D ...`): whether it fits the target (or
why not), what a drafted token costs against the target's one-token step, and how often its first guess
is the target's next token, teacher-forced on the target's own greedy answers to a prompt file (MT-Bench's
first turns by default), with the tokens a step would keep at chain lengths 1-8. What an operator needs
to choose which drafters to deploy, measured on the machine that runs it."""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

from specmesh.bench.provenance import provenance
from specmesh.bench.report import write_json
from specmesh.distill.data import generate_examples
from specmesh.distill.evaluate import agreement_by_category, expected_tokens_per_step, interface_hits
from specmesh.distill.feature_recipe import feature_store, mtbench_features
from specmesh.distill.recipe import mtbench_examples, target_step_ms
from specmesh.drafters.catalog import load_drafter
from specmesh.errors import InvalidArgument
from specmesh.prompts import load_prompts
from specmesh.runtime.loading import cache_root, configure_threads
from specmesh.speculation.assembly import Assembly, assemble, eos_token_ids

STEP_CONTEXT = 150  # committed tokens while the target's step is timed


def answers(assembly: Assembly, prompts_file: str | None, max_tokens: int, layers: tuple[int, ...]):
    """The target's greedy answers to the prompts (cached per file's content), with their features when a
    drafter reads ``layers``."""
    if prompts_file is None:
        if layers:
            return mtbench_features(assembly, layers, max_tokens)
        return mtbench_examples(assembly, max_tokens), None
    prompts = load_prompts(prompts_file)
    digest = hashlib.sha256(Path(prompts_file).read_bytes()).hexdigest()[:12]
    eos = eos_token_ids(assembly.target)
    if layers:
        store = feature_store(assembly, layers, f"check-{digest}-{max_tokens}")
        examples = store.record(assembly.runtime, assembly.target.tokenizer, prompts, max_tokens, eos)
        return examples, list(store.features(examples))
    name = assembly.target.name.replace("/", "_")
    cache = cache_root() / "eval" / f"check-{name}-{assembly.runtime.precision}-{digest}-{max_tokens}.jsonl"
    return generate_examples(assembly.runtime, assembly.target.tokenizer, prompts, cache, max_tokens, eos), None


def card(assembly: Assembly, spec: str, args: argparse.Namespace, step_ms: float) -> dict:
    try:
        drafter = load_drafter(spec, assembly.target, args.drafter_device, None)
    except InvalidArgument as exc:
        return {"drafter": spec, "compatible": False, "reason": str(exc)}
    layers = tuple(drafter.feature_layers)
    examples, features = answers(assembly, args.prompts, args.max_tokens, layers)
    if args.limit:
        examples, features = examples[: args.limit], (features[: args.limit] if features else features)
    hits, ms_per_guess = interface_hits(drafter, examples, features)
    return {
        "drafter": spec, "compatible": True, "name": drafter.name, "kind": drafter.kind,
        "domains": list(drafter.domains), "feature_layers": list(layers),
        "agreement": agreement_by_category(examples, hits),
        "ms_per_drafted_token": round(ms_per_guess, 3), "cost_vs_target_step": round(ms_per_guess / step_ms, 4),
        "expected_tokens_per_step": expected_tokens_per_step(hits),
    }


def run_check(args: argparse.Namespace) -> int:
    configure_threads(args.threads)
    assembly = assemble(args.model, [], device=args.device, dtype=args.dtype, precision=args.precision,
                        kv_cache_gb=args.kv_cache_gb or None, batch_invariant=args.batch_invariant)
    context = [int(t) % assembly.runtime.vocab_size for t in range(100, 100 + STEP_CONTEXT)]
    step_ms = target_step_ms(assembly, context)
    report = {"provenance": provenance(args.argv), "target": assembly.target.name,
              "precision": assembly.runtime.precision, "target_step_ms": round(step_ms, 3),
              "prompts": args.prompts or "MT-Bench first turns", "max_tokens": args.max_tokens,
              "drafters": [card(assembly, spec, args, step_ms) for spec in args.drafter]}
    print(f"target {report['target']} ({report['precision']}): a one-token step {step_ms:.2f} ms; "
          f"agreement on {report['prompts']}")
    for row in report["drafters"]:
        if not row["compatible"]:
            print(f"  {row['drafter']}: REFUSED: {row['reason']}")
            continue
        print(f"  {row['drafter']} ({row['kind']}): agreement {row['agreement']['all']:.3f}, "
              f"{row['ms_per_drafted_token']:.2f} ms a drafted token ({row['cost_vs_target_step']:.3f} of a step), "
              f"a chain of 4 keeps {row['expected_tokens_per_step']['4']:.2f} tokens a step")
    if args.json_out:
        print(f"written to {write_json(report, args.json_out)}")
    return 0 if all(row["compatible"] for row in report["drafters"]) else 1
