"""``specmesh tune``: the speculation constants measured on prompts the benchmark does not judge on.

A constant chosen on the prompts a benchmark judges on flatters that benchmark. The defaults are chosen
here instead, on held-out prompts (default: ``tuning_prompts.jsonl``, templated prompts of their own seed,
disjoint from the experts' training prompts, the classifier's examples and MT-Bench), and only judged by
``specmesh bench`` on MT-Bench. Four sweeps, each candidate interleaved with the others and rotated
prompt by prompt (bench/modes.py's rule), each speed relative to plain decoding in the same sweep:

- ``tree_nodes`` (adaptive's budget cap) and ``fixed_tree_nodes`` (the load sweep's fixed k): one request
  at a time, in process;
- ``margin`` (``SPECULATION_MARGIN``): ``batch`` requests a pass, in process, where it applies;
- ``cluster``: the settings only a cluster has, drafting ahead and the verifiers' OpenMP spin count, one
  local cluster per setting, in mirrored order;
- ``load``: the margin where it matters most, under concurrent load through a local cluster (one per
  margin), adaptive against no speculation in the same cluster, paired round by round.

It prints and writes what it measured and changes nothing: the defaults are set by hand, from its output
(docs/bench.md records the last run).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from importlib.resources import files

from tqdm.auto import tqdm

from specmesh.bench.grounded import named_or_file
from specmesh.bench.provenance import provenance
from specmesh.bench.arguments import number_list
from specmesh.bench.load_sweep import MAX_CONCURRENCY, load_sweep, non_inferiority
from specmesh.bench.modes import WARMUP_PROMPT, ModeRecord, mode_order
from specmesh.bench.report import write_json
from specmesh.client import Client
from specmesh.cluster.launcher import DEFAULT_DRAFTERS, OPENMP_SPIN_COUNT, ClusterSpec, LocalCluster
from specmesh.distill.overlap import overlapped_questions
from specmesh.errors import InvalidArgument
from specmesh.prompts import Prompt, load_prompts
from specmesh.runtime.loading import configure_threads
from specmesh.sampling import SamplingParams
from specmesh.speculation.assembly import Assembly, assemble
from specmesh.speculation.classifier import default_classifier
from specmesh.speculation.engine import Request, SpeculativeEngine
from specmesh.speculation.policy import DEFAULT_FIXED_TREE_NODES, DEFAULT_TREE_NODES, SPECULATION_MARGIN
from specmesh.tree import MAX_TREE_NODES

TUNING_PROMPTS = files("specmesh.bench") / "tuning_prompts.jsonl"  # `make tuning-prompts` writes it

# What the cluster sweep compares: each setting's name and what it changes in the cluster's spec
LIBGOMP_DEFAULT_SPIN = "300000"
CLUSTER_SETTINGS = {
    "shipped": {},
    f"spin_{LIBGOMP_DEFAULT_SPIN}": {"extra_env": {"GOMP_SPINCOUNT": LIBGOMP_DEFAULT_SPIN}},
    "draft_ahead_on": {"extra_env": {"SPECMESH_DRAFT_AHEAD": "on"}},  # the verifier's --draft-ahead (auto: off here)
}


SWEEPS = ("budget", "margin", "cluster", "load")
MARGIN_LOAD_POLICIES = ("none", "adaptive")  # the load sweep weighs each margin against no speculation


def held_out(prompts: list[Prompt]) -> list[Prompt]:
    """``prompts`` if none shares a word 8-gram with MT-Bench: tuning on the judged prompts is what this
    command exists to avoid."""
    overlapping = [i for i, p in enumerate(prompts, start=1) if overlapped_questions(p.text)]
    if overlapping:
        raise InvalidArgument("prompts", f"{len(overlapping)} of them (lines {overlapping[:5]}) share a word 8-gram "
                                         "with MT-Bench, which the bench judges on; tune on other prompts")
    return prompts


Run = Callable[[Prompt, Request], tuple[list[int], int | None]]  # output tokens, target passes


@dataclass
class Sweep:
    records: dict[str, ModeRecord]  # per run, over every prompt
    speeds: dict[str, list[float]]  # per run, each prompt's tokens/s (paired across runs by position)
    same: dict[str, int]  # per run, prompts answered token for token as the first run did (each should be all)


def interleaved(runs: dict[str, Run], prompts: list[Prompt], requests: list[Request], warmup: tuple[Prompt, Request],
                desc: str) -> Sweep:
    """Every prompt through every run, in ``mode_order`` after one untimed warm-up of each."""
    for run in runs.values():
        run(*warmup)
    sweep = Sweep({name: ModeRecord() for name in runs}, {name: [] for name in runs}, {})
    outputs: dict[str, list[list[int]]] = {name: [] for name in runs}
    for index, (prompt, request) in enumerate(tqdm(list(zip(prompts, requests)), desc=desc, unit="prompt")):
        for name in mode_order(list(runs), index):
            started = time.perf_counter()
            tokens, steps = runs[name](prompt, request)
            seconds = time.perf_counter() - started
            sweep.records[name].add(prompt.category, tokens, seconds, steps, None)
            sweep.speeds[name].append(len(tokens) / seconds)
            outputs[name].append(tokens)
    first = next(iter(runs))
    sweep.same = {name: sum(a == b for a, b in zip(outputs[name], outputs[first])) for name in runs}
    return sweep


def versus(speeds: list[float], base: list[float]) -> dict:
    """The mean of the paired relative differences to ``base`` and its 95 % interval (bench/load_sweep.py's test)."""
    test = non_inferiority(speeds, base)
    return {"paired_vs_plain": round(test.mean, 4),
            "paired_vs_plain_ci95": None if test.low is None else [round(test.low, 4), round(test.high, 4)]}


def _rows(sweep: Sweep, plain: str, count: int) -> dict[str, dict]:
    base = sweep.records[plain].speed()
    return {name: {"tokens_per_s": round(r.speed(), 2), "vs_plain": round(r.speed() / base, 3),
                   **versus(sweep.speeds[name], sweep.speeds[plain]),
                   "mean_accepted_length": round(r.accepted_length(), 3) if r.steps else None,
                   "identical_to_plain": f"{sweep.same[name]}/{count}"} for name, r in sweep.records.items()}


def engine_sweep(assembly: Assembly, prompts: list[Prompt], requests: list[Request], warmup: tuple[Prompt, Request],
                 caps: list[int], fixed: list[int]) -> dict[str, dict]:
    """Plain decoding, adaptive at each budget cap, fixed k at each k: one request at a time, in process."""
    engines: dict[str, SpeculativeEngine] = {"plain": assembly.engine(0)}
    engines |= {f"adaptive:{n}": assembly.engine(n, "adaptive") for n in caps}
    engines |= {f"fixed:{k}": assembly.engine(k, "fixed") for k in fixed}

    def runner(engine: SpeculativeEngine) -> Run:
        def run(prompt: Prompt, request: Request) -> tuple[list[int], int | None]:
            (result,) = engine.generate([request])
            return result.token_ids, result.stats.target_steps
        return run

    sweep = interleaved({n: runner(e) for n, e in engines.items()}, prompts, requests, warmup, "budget caps and fixed k")
    return _rows(sweep, "plain", len(prompts))


def margin_sweep(assembly: Assembly, requests: list[Request], warmup: Request, tree_nodes: int, margins: list[float],
                 batch: int) -> dict[str, dict]:
    """Adaptive at each margin, ``batch`` requests a pass (the margin applies only in a shared pass), and
    plain decoding: total tokens/s over the same batches, the engines interleaved batch by batch. A batch
    takes every ``len / batch``-th request, so a file in blocks by category gives batches that mix them."""
    engines = {"plain": assembly.engine(0)} | {f"margin:{m:g}": assembly.engine(tree_nodes, "adaptive", margin=m)
                                              for m in margins}
    count = -(-len(requests) // batch)
    batches = [requests[i::count] for i in range(count)]
    for engine in engines.values():
        engine.generate([Request(warmup.prompt_ids, warmup.params, kind=warmup.kind) for _ in range(batch)])
    tokens, seconds = dict.fromkeys(engines, 0), dict.fromkeys(engines, 0.0)
    speeds: dict[str, list[float]] = {name: [] for name in engines}  # per batch
    for index, chosen in enumerate(tqdm(batches, desc=f"margins, {batch} requests a pass", unit="batch")):
        for name in mode_order(list(engines), index):
            fresh = [Request(r.prompt_ids, r.params, kind=r.kind) for r in chosen]  # new ids for each engine
            started = time.perf_counter()
            results = engines[name].generate(fresh)
            elapsed, made = time.perf_counter() - started, sum(len(r.token_ids) for r in results)
            seconds[name] += elapsed
            tokens[name] += made
            speeds[name].append(made / elapsed)
    base = tokens["plain"] / seconds["plain"]
    return {name: {"tokens_per_s": round(tokens[name] / seconds[name], 2),
                   "vs_plain": round(tokens[name] / seconds[name] / base, 3),
                   **versus(speeds[name], speeds["plain"])} for name in engines}


def cluster_sweep(args: argparse.Namespace, drafters: tuple[str, ...], prompts: list[Prompt], warmup: Prompt,
                  rounds: int) -> dict[str, dict]:
    """One local cluster per setting of ``CLUSTER_SETTINGS``, adaptive at ``args.max_tree_nodes``, one request
    at a time; the settings in forward then mirrored order (``rounds`` passes), so drift hits all alike."""
    names = list(CLUSTER_SETTINGS)
    order = [n for r in range(rounds) for n in (names if r % 2 == 0 else names[::-1])]
    tokens, seconds = dict.fromkeys(names, 0), dict.fromkeys(names, 0.0)
    for name in tqdm(order, desc="cluster settings", unit="cluster"):
        spec = ClusterSpec(model=args.model, drafters=drafters, max_tree_nodes=args.max_tree_nodes, dtype=args.dtype,
                           precision=args.precision, offload=args.offload, **CLUSTER_SETTINGS[name])
        with LocalCluster(spec) as cluster, Client(cluster.router_address, api_key=cluster.client_key) as client:
            def ask(prompt: Prompt) -> list[int]:
                return client.generate(chat=[("user", prompt.text)], max_tokens=args.max_tokens,
                                       max_tree_nodes=args.max_tree_nodes).token_ids

            ask(warmup)
            for prompt in prompts:
                started = time.perf_counter()
                tokens[name] += len(ask(prompt))
                seconds[name] += time.perf_counter() - started
    base = tokens["shipped"] / seconds["shipped"]
    return {name: {"tokens_per_s": round(tokens[name] / seconds[name], 2),
                   "vs_shipped": round(tokens[name] / seconds[name] / base, 3)} for name in names}


def round_robin(prompts: list[Prompt]) -> list[Prompt]:
    """One prompt of each category in turn (file order within each), so that any first n mix the categories."""
    rank: dict[str, int] = defaultdict(int)
    keyed = []
    for index, prompt in enumerate(prompts):
        keyed.append((rank[prompt.category], index, prompt))
        rank[prompt.category] += 1
    return [prompt for _, _, prompt in sorted(keyed, key=lambda k: k[:2])]


def load_margin_sweep(args: argparse.Namespace, drafters: tuple[str, ...], prompts: list[Prompt], warmup: Prompt,
                      margins: list[float], levels: list[int], rounds: int) -> dict[str, dict]:
    """One local cluster per margin; in each, at every concurrency, adaptive (up to ``args.max_tree_nodes``) and
    no speculation over the same requests, ``rounds`` times in rotated order (bench/load_sweep.py).
    Each margin is judged by adaptive's paired relative difference to plain decoding in its own cluster."""
    rows: dict[str, dict] = {}
    for margin in tqdm(margins, desc="margins under load", unit="cluster"):
        spec = ClusterSpec(model=args.model, drafters=drafters, max_tree_nodes=args.max_tree_nodes, dtype=args.dtype,
                           precision=args.precision, offload=args.offload, speculation_margin=margin)
        with LocalCluster(spec) as cluster:
            with Client(cluster.router_address, api_key=cluster.client_key) as client:
                client.generate(chat=[("user", warmup.text)], max_tokens=args.max_tokens)
            runs = load_sweep(cluster, round_robin(prompts), args.max_tokens, levels, DEFAULT_FIXED_TREE_NODES,
                              args.max_tree_nodes, rounds, MARGIN_LOAD_POLICIES)
        row = {}
        for level in levels:
            speeds = {r["policy"]: r["tokens_per_s_runs"] for r in runs if r["concurrency"] == level}
            row[f"concurrency:{level}"] = {"tokens_per_s": round(statistics.fmean(speeds["adaptive"]), 2),
                                           "plain_tokens_per_s": round(statistics.fmean(speeds["none"]), 2),
                                           **versus(speeds["adaptive"], speeds["none"])}
        rows[f"margin:{margin:g}"] = row
    return rows


def _sweeps(text: str) -> list[str]:
    chosen = [x.strip() for x in text.split(",") if x.strip()]
    unknown = sorted(set(chosen) - set(SWEEPS))
    if not chosen or unknown:
        raise InvalidArgument("sweeps", f"choose from {', '.join(SWEEPS)}; got {text!r}")
    return chosen


def run_tune(args: argparse.Namespace) -> int:
    sweeps = _sweeps(args.sweeps)
    caps = number_list("tree_nodes", args.tree_nodes_candidates, 1, MAX_TREE_NODES)
    fixed = number_list("fixed_tree_nodes", args.fixed_tree_nodes_candidates, 1, MAX_TREE_NODES)
    margins = number_list("margins", args.margins, 0, kind=float)
    levels = number_list("load_concurrency", args.load_concurrency, 2, MAX_CONCURRENCY)  # the margin needs company
    if args.max_tokens < 1:
        raise InvalidArgument("max_tokens", f"must be >= 1, got {args.max_tokens}")
    if args.batch < 2:
        raise InvalidArgument("batch", f"the margin applies only in a shared pass: must be >= 2, got {args.batch}")
    for name in ("cluster_rounds", "load_rounds"):
        if getattr(args, name) < 1:
            raise InvalidArgument(name, f"must be >= 1, got {getattr(args, name)}")
    if not 1 <= args.max_tree_nodes <= MAX_TREE_NODES:
        raise InvalidArgument("max_tree_nodes", f"must be in 1..{MAX_TREE_NODES}, got {args.max_tree_nodes}")
    prompts, source = (named_or_file(args.prompts, "tune") if args.prompts
                       else (load_prompts(TUNING_PROMPTS), str(TUNING_PROMPTS)))
    prompts = held_out(prompts)
    configure_threads(args.threads)
    drafters = tuple(args.drafter or DEFAULT_DRAFTERS)
    warmup = Prompt(WARMUP_PROMPT, "warm-up")
    report: dict = {"provenance": provenance(args.argv), "target": args.model, "drafter_set": list(drafters),
                    "max_tokens": args.max_tokens,
                    "prompts": {"source": source, "count": len(prompts)},
                    "sweeps": sweeps, "best": {}}
    if "budget" in sweeps or "margin" in sweeps:
        assembly = assemble(args.model, drafters, device=args.device, dtype=args.dtype, precision=args.precision,
                            kv_cache_gb=getattr(args, "kv_cache_gb", None) or None,
                            batch_invariant=getattr(args, "batch_invariant", None), offload=args.offload)
        classifier, params = default_classifier(), SamplingParams(max_tokens=args.max_tokens)
        requests = [assembly.request(p.text, params, classifier) for p in prompts]
        warmup_request = assembly.request(warmup.text, params, classifier)
    if "budget" in sweeps:
        rows = engine_sweep(assembly, prompts, requests, (warmup, warmup_request), caps, fixed)
        report["budget_sweep"] = rows
        report["best"] |= {"tree_nodes": max(caps, key=lambda n: rows[f"adaptive:{n}"]["tokens_per_s"]),
                           "fixed_tree_nodes": max(fixed, key=lambda k: rows[f"fixed:{k}"]["tokens_per_s"])}
    if "margin" in sweeps:
        rows = margin_sweep(assembly, requests, warmup_request, args.max_tree_nodes, margins, args.batch)
        report["margin_sweep"] = {"batch": args.batch, "tree_nodes": args.max_tree_nodes, "rows": rows}
        report["best"]["margin"] = max(margins, key=lambda m: rows[f"margin:{m:g}"]["tokens_per_s"])
    if "cluster" in sweeps:
        rows = cluster_sweep(args, drafters, prompts, warmup, args.cluster_rounds)
        report["cluster_sweep"] = {"tree_nodes": args.max_tree_nodes, "rounds": args.cluster_rounds, "rows": rows}
        report["best"]["cluster_setting"] = max(rows, key=lambda n: rows[n]["tokens_per_s"])
    if "load" in sweeps:
        rows = load_margin_sweep(args, drafters, prompts, warmup, margins, levels, args.load_rounds)
        report["load_margin_sweep"] = {"tree_nodes": args.max_tree_nodes, "rounds": args.load_rounds, "rows": rows}
        report["best"] |= {f"margin_at_concurrency_{level}": max(
            margins, key=lambda m: rows[f"margin:{m:g}"][f"concurrency:{level}"]["paired_vs_plain"]) for level in levels}
    report["shipped"] = {"tree_nodes": DEFAULT_TREE_NODES, "fixed_tree_nodes": DEFAULT_FIXED_TREE_NODES,
                         "margin": SPECULATION_MARGIN,
                         "openmp_spin_count": int(OPENMP_SPIN_COUNT)}
    _print(report)
    if args.json_out:
        print(f"written to {write_json(report, args.json_out)}")
    return 0


def _print(report: dict) -> None:
    print(f"\n{report['prompts']['count']} held-out prompts x {report['max_tokens']} tokens ({report['prompts']['source']})")
    for name, row in report.get("budget_sweep", {}).items():
        accepted = f", accepted length {row['mean_accepted_length']:.2f}" if row["mean_accepted_length"] else ""
        print(f"  {name:14s} {row['tokens_per_s']:7.2f} tok/s = {row['vs_plain']:.3f}x plain{_interval(row)}{accepted}, "
              f"identical {row['identical_to_plain']}")
    margins = report.get("margin_sweep", {"rows": {}})
    for name, row in margins["rows"].items():
        print(f"  {name:14s} {row['tokens_per_s']:7.2f} tok/s = {row['vs_plain']:.3f}x plain{_interval(row)} "
              f"({margins['batch']} requests a pass, up to {margins['tree_nodes']} nodes)")
    for name, row in report.get("cluster_sweep", {}).get("rows", {}).items():
        print(f"  cluster {name:16s} {row['tokens_per_s']:7.2f} tok/s = {row['vs_shipped']:.3f}x the shipped settings")
    for name, levels in report.get("load_margin_sweep", {}).get("rows", {}).items():
        for level, row in levels.items():
            print(f"  load {name:11s} {level:15s} {row['tokens_per_s']:7.2f} tok/s vs plain "
                  f"{row['plain_tokens_per_s']:.2f}{_interval(row)}")
    print(f"  best: {report['best']}; shipped: {report['shipped']}")


def _interval(row: dict) -> str:
    interval = row["paired_vs_plain_ci95"]
    return f" (paired {row['paired_vs_plain']:+.1%}, 95 % CI [{interval[0]:+.1%}, {interval[1]:+.1%}])" if interval else ""
