"""What a feature head's guess costs against its target's one-token step, for any target shape.

`python -m specmesh.bench.head_cost --model random:llama-3-8b --device cuda` writes a head of the target's
shape in EAGLE-3's published layout with random weights (a guess's cost depends on shapes, not values),
reads it back as `--drafter eagle3:DIR` does, times its proposals at a few budgets (on CUDA with and
without the captured one-entry graphs), and checks greedy speculative decoding with it against plain
decoding. Exit 1 when an output differs. `specmesh drafters check` measures a real head's cost and
agreement; this is the cost alone, where no trained head exists for the shape.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch

from specmesh.bench.provenance import provenance
from specmesh.bench.report import write_json
from specmesh.distill.recipe import target_step_ms
from specmesh.drafters.catalog import load_drafter
from specmesh.drafters.eagle import default_layers, write_eagle3
from specmesh.drafters.feature import FeatureConfig, FeatureDrafter, FeatureHead
from specmesh.runtime.features import Features
from specmesh.runtime.loading import parts_of
from specmesh.sampling import SamplingParams
from specmesh.speculation.assembly import Assembly, assemble
from specmesh.speculation.engine import Request, SpeculativeEngine

CONTEXT = 150  # committed tokens before the timed proposals
DRAFT_VOCAB = 32000  # the published Llama-3 heads' draft vocabulary
WARMUP = 5  # proposals timed but not counted: the first compile kernels and fill caches


def random_head(assembly: Assembly, directory: Path, draft_vocab: int = DRAFT_VOCAB, seed: int = 0) -> str:
    """A random head of ``assembly``'s target's shape written in EAGLE-3's layout; its ``eagle3:`` spec."""
    config = assembly.target.model.config
    vocab = config.vocab_size
    torch.manual_seed(seed)
    subset = torch.randperm(vocab)[: min(draft_vocab, vocab)]
    shape = dataclasses.replace(FeatureConfig.for_target(config, default_layers(config.num_hidden_layers), len(subset)),
                                feature_norms=False, fallback=False)
    no_embedding = torch.empty(vocab, config.hidden_size, device="meta")  # not written: the target's is read
    write_eagle3(FeatureHead(shape, no_embedding, subset), directory, vocab, config.max_position_embeddings)
    return f"eagle3:{directory}"


def proposal_ms(drafter: FeatureDrafter, features: torch.Tensor, budget: int, repeats: int) -> dict:
    """Median ms of a proposal of ``budget`` nodes, each after one committed token and its feature (the
    steady state of a request); features [positions, layers, hidden]."""
    finish = torch.cuda.synchronize if features.device.type == "cuda" else (lambda: None)
    context = list(range(100, 100 + CONTEXT))
    drafter.start("cost", context)
    drafter.add_features("cost", Features(0, features[: CONTEXT - 1], drafter.feature_layers))
    times, nodes = [], []
    for i in range(repeats):
        finish()
        started = time.perf_counter()
        tree = drafter.propose("cost", budget)
        finish()
        times.append(time.perf_counter() - started)
        nodes.append(len(tree))
        drafter.commit("cost", [context[i % CONTEXT]])
        position = CONTEXT - 1 + i
        drafter.add_features("cost", Features(position, features[position : position + 1], drafter.feature_layers))
    drafter.end("cost")
    ms, size = statistics.median(times[WARMUP:]) * 1e3, statistics.median(nodes)
    return {"budget": budget, "ms": round(ms, 3), "nodes": size, "ms_per_node": round(ms / max(size, 1), 3)}


def greedy_matches(assembly: Assembly, drafter: FeatureDrafter, prompts: int = 3, max_tokens: int = 24) -> list[bool]:
    """Per random prompt: does greedy speculative decoding with ``drafter`` give plain decoding's tokens?"""
    vocab = assembly.runtime.vocab_size
    prompt_ids = [[random.Random(i).randrange(2, vocab) for _ in range(12 + 5 * i)] for i in range(prompts)]
    requests = lambda: [Request(tuple(p), SamplingParams(max_tokens=max_tokens)) for p in prompt_ids]  # noqa: E731
    drafted = SpeculativeEngine(assembly.runtime, drafters=[drafter], max_tree_nodes=16).generate(requests())
    plain = SpeculativeEngine(assembly.runtime, drafters=[], max_tree_nodes=16).generate(requests())
    return [a.token_ids == b.token_ids for a, b in zip(drafted, plain)]


def measure(model: str, device: str | None, repeats: int, draft_vocab: int, argv: Sequence[str]) -> dict:
    assembly = assemble(model, [], device=device)
    step = target_step_ms(assembly, [100 + t for t in range(CONTEXT)])
    with tempfile.TemporaryDirectory() as folder:
        head = load_drafter(random_head(assembly, Path(folder) / "head", draft_vocab), parts_of(assembly.target),
                            device, None)
    cuda = head.model.head.weight.device.type == "cuda"
    layers, hidden = len(head.feature_layers), head.config.hidden_size
    features = torch.randn(CONTEXT + repeats, layers, hidden, device=head.model.head.weight.device,
                           dtype=assembly.runtime.dtype)
    modes = {"graphs" if cuda else "default": head}
    if cuda:
        modes["eager"] = FeatureDrafter(head.model, head.name, static_entries=False)
    rows = []
    for mode, drafter in modes.items():
        for budget in (1, 8, 16, 64, 256):  # past 16: best-first trees, one pass a round
            row = {"mode": mode, **proposal_ms(drafter, features, budget, repeats)}
            row["vs_step"] = round(row["ms_per_node"] / step, 4)
            rows.append(row)
    return {"provenance": provenance(argv, "python -m specmesh.bench.head_cost"), "target": model,
            "device": str(head.model.head.weight.device), "target_dtype": str(assembly.runtime.dtype),
            "head_dtype": str(head.dtype), "feature_layers": list(head.feature_layers),
            "draft_vocab": len(head.subset_ids),
            "target_step_ms": round(step, 3), "proposals": rows, "greedy_equal": greedy_matches(assembly, head)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specmesh.bench.head_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:llama-3-8b", help="the target (random:<architecture> or a model)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda where there is one)")
    parser.add_argument("--repeats", type=int, default=40,
                        help=f"timed proposals at each budget, the first {WARMUP} not counted")
    parser.add_argument("--draft-vocab", type=int, default=DRAFT_VOCAB)
    parser.add_argument("--json", dest="json_out")
    args = parser.parse_args(argv)
    if args.repeats <= WARMUP:
        parser.error(f"--repeats must be more than {WARMUP} (the first {WARMUP} only warm up), got {args.repeats}")
    report = measure(args.model, args.device, args.repeats, args.draft_vocab, sys.argv[1:] if argv is None else argv)
    print(f"{report['target']} on {report['device']}: a one-token step {report['target_step_ms']:.3f} ms; "
          f"head in {report['head_dtype']}, draft vocabulary {report['draft_vocab']}")
    for row in report["proposals"]:
        print(f"  {row['mode']:>7}, budget {row['budget']:>3}: {row['ms']:.3f} ms for {row['nodes']} nodes = "
              f"{row['ms_per_node']:.3f} ms a drafted token ({row['vs_step']:.3f} of a step)")
    print(f"  greedy speculative == plain: {sum(report['greedy_equal'])}/{len(report['greedy_equal'])}")
    if args.json_out:
        print(f"written to {write_json(report, args.json_out)}")
    return 0 if all(report["greedy_equal"]) else 1


if __name__ == "__main__":
    sys.exit(main())
