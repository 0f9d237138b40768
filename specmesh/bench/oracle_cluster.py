"""``specmesh bench --model random:<arch> --oracle-acceptance 0.6,0.8``: what speculation gives through the
whole cluster on a device, at an acceptance the bench sets.

Random weights leave real drafters nothing to agree with; the oracle drafter (``specmesh.drafters.oracle``)
proposes the target's own greedy continuation, each token right with probability p. The bench starts the
cluster (Redis, a verifier on the device, the oracle's drafter service, the router), decodes every prompt
plainly through it to learn the continuations, hands them to the oracle, then runs the load sweep: per
acceptance and concurrency, plain decoding (``none``), fixed-k and adaptive speculation through the same
cluster in rotated rounds. Reported: tokens/s and their ratio to plain, tokens per step, tree nodes per
step (the controller's budgets), where the time went (requests a verifier pass, the gap between passes,
Redis commands and router CPU a token), answers unlike plain (must be none), adaptive's non-inferiority
verdicts, and one streamed request's per-step timeline at each acceptance.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

import torch

from specmesh.bench.cluster_meter import ClusterMeter
from specmesh.bench.engine_at_load import engine_at_load
from specmesh.bench.provenance import provenance
from specmesh.bench.arguments import number_list
from specmesh.bench.load_sweep import MAX_CONCURRENCY, adaptive_verdicts, load_sweep
from specmesh.bench.report import write_json
from specmesh.client import AsyncClient
from specmesh.cluster.launcher import ClusterSpec, LocalCluster
from specmesh.drafters.oracle import MAX_WIDTH, PREFIX, OracleEntry, write_oracle_file
from specmesh.errors import InvalidArgument
from specmesh.runtime.random_models import random_config
from specmesh.tree import MAX_TREE_NODES

PROMPT_TOKENS = (48, 144)  # random prompts of 48-143 tokens: trees straddle the KV cache's 64-key blocks
JOB_TIMEOUT_S = 300.0  # a verifier's first pass at a new batch shape compiles its kernels
OFFLOAD_PROMPTS = 2  # a round's requests where every pass streams the layers (~0.26 s for an 8B over PCIe)


def random_prompts(vocab_size: int, count: int, seed: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(vocab_size) for _ in range(rng.randrange(*PROMPT_TOKENS))) for _ in range(count)]


def ids_input(prompt: tuple[int, ...]) -> dict:
    return {"prompt_ids": prompt}


async def plain_answers(cluster: LocalCluster, prompts: list[tuple[int, ...]], max_tokens: int,
                        concurrency: int) -> list[list[int]]:
    """Each prompt's greedy answer through the cluster without speculation: what the oracle will know."""
    gate = asyncio.Semaphore(concurrency)
    async with AsyncClient(cluster.router_address, max_in_flight=max(64, concurrency), api_key=cluster.client_key) as client:
        async def one(prompt):
            async with gate:
                return (await client.generate(prompt_ids=prompt, max_tokens=max_tokens, speculation="off")).token_ids

        return list(await asyncio.gather(*(one(p) for p in prompts)))


async def timeline(cluster: LocalCluster, prompt: tuple[int, ...], max_tokens: int, tree_nodes: int) -> dict:
    """One adaptive request streamed alone: each step's arrival, tokens, budget, tree and timings."""
    steps = []
    async with AsyncClient(cluster.router_address, api_key=cluster.client_key) as client:
        started = time.perf_counter()
        async for chunk in client.stream(prompt_ids=prompt, max_tokens=max_tokens, speculation="adaptive",
                                         max_tree_nodes=tree_nodes):
            row = {"at_ms": round((time.perf_counter() - started) * 1e3, 2), "tokens": len(chunk.token_ids)}
            if chunk.step is not None:
                s = chunk.step
                row |= {"budget": s.budget, "tree_nodes": s.tree_nodes, "draft_ms": round(s.draft_ms, 2),
                        "pass_ms": round(s.pass_ms, 2), "step_ms": round(s.step_ms, 2), "batch_size": s.batch_size}
            steps.append(row)
    return {"steps": steps, "tokens": sum(r["tokens"] for r in steps),
            "tokens_per_s": round(sum(r["tokens"] for r in steps) / max(steps[-1]["at_ms"], 1e-9) * 1e3, 2)}


def pass_curves(cluster: LocalCluster) -> dict[str, dict]:
    """Each verifier's pass curve as it measured it at start-up and tells the router (its heartbeat)."""
    import redis

    from specmesh.cluster.pipeline.messages import QueueKeys, decode_pass_curve

    client = redis.Redis.from_url(cluster.redis_url)
    try:
        curves = {v.name: decode_pass_curve(client.get(QueueKeys().alive(v.name))) for v in cluster.verifiers}
        return {name: {"device": c.device, "passes": [vars(s) for s in c.samples]} for name, c in curves.items() if c}
    finally:
        client.close()


def streamed(cluster: LocalCluster) -> dict[str, dict]:
    """Each verifier's passes and the target weights it copied from host memory to its device, as it exports
    them: an offloaded verifier streams every decoder layer each pass, a resident one nothing."""
    def total(process, name: str) -> int:
        return int(sum(s.value for family in process.metrics() for s in family.samples if s.name == name))

    return {v.name: {"passes": total(v, "specmesh_verify_pass_seconds_count"),
                     "bytes": total(v, "specmesh_target_streamed_bytes_total")} for v in cluster.verifiers}


def summarize(rows: list[dict]) -> list[dict]:
    """Per concurrency: each speculative policy's tokens/s over plain's (``none``)."""
    out = []
    for level in sorted({r["concurrency"] for r in rows}):
        by = {r["policy"]: r for r in rows if r["concurrency"] == level}
        plain = by["none"]["tokens_per_s"]
        out.append({"concurrency": level, "plain_tokens_per_s": plain,
                    **{f"{p}_vs_plain": round(r["tokens_per_s"] / plain, 3) for p, r in by.items() if p != "none"},
                    **{f"{p}_tokens_per_step": r["tokens_per_step"] for p, r in by.items()},
                    **{f"{p}_tree_nodes_per_step": r["tree_nodes_per_step"] for p, r in by.items() if p != "none"}})
    return out


def controller_state(cluster: LocalCluster) -> dict[str, float]:
    """What the first verifier's controller has learned, as it exports it (``specmesh_controller_*``; by load
    kind and arm: ``name/load/kind/arm``): why adaptive drafted as much as it did."""
    state = {}
    for family in cluster.verifiers[0].metrics():
        if family.name.startswith("specmesh_controller_"):
            for sample in family.samples:
                labels = "".join(f"/{sample.labels[k]}" for k in ("load", "kind", "arm") if k in sample.labels)
                state[family.name.removeprefix("specmesh_controller_") + labels] = round(sample.value, 3)
    return state


def _check_args(args: argparse.Namespace) -> tuple[list[float], list[int]]:
    """Refuse what cannot be measured, naming the argument; the acceptances and the concurrency levels."""
    acceptances = number_list("oracle_acceptance", args.oracle_acceptance, 0.0, 1.0, kind=float)
    levels = number_list("concurrency", args.concurrency or "1", 1, MAX_CONCURRENCY)
    if args.max_tokens < 1:
        raise InvalidArgument("max_tokens", f"must be >= 1, got {args.max_tokens}")
    if not 1 <= args.oracle_width <= MAX_WIDTH:
        raise InvalidArgument("oracle_width", f"must be in 1..{MAX_WIDTH}, got {args.oracle_width}")
    if args.sweep_rounds < 1:
        raise InvalidArgument("sweep_rounds", f"must be >= 1, got {args.sweep_rounds}")
    if not 1 <= args.max_tree_nodes <= MAX_TREE_NODES or not 1 <= args.fixed_tree_nodes <= MAX_TREE_NODES:
        raise InvalidArgument("max_tree_nodes", f"--max-tree-nodes and --fixed-tree-nodes must be in 1..{MAX_TREE_NODES}")
    return acceptances, levels


def run_oracle_bench(args: argparse.Namespace) -> int:
    acceptances, levels = _check_args(args)
    vocab = random_config(args.model).vocab_size
    per_set = OFFLOAD_PROMPTS if args.offload else max(2 * max(levels), 8)  # the sweep's most requests a round
    prompt_sets = {p: random_prompts(vocab, per_set, seed=i) for i, p in enumerate(acceptances)}
    report: dict = {"provenance": provenance(args.argv), "model": args.model,
                    "device": args.device or ("cuda" if torch.cuda.is_available() else "cpu"),
                    "max_tokens": args.max_tokens, "tree_nodes": args.max_tree_nodes,
                    "fixed_tree_nodes": args.fixed_tree_nodes, "rounds": args.sweep_rounds,
                    "oracle_width": args.oracle_width, "offload": args.offload,
                    "acceptance": {}, "cluster_at_load": {}}
    with tempfile.TemporaryDirectory(prefix="specmesh-oracle-") as folder:
        oracle_file = Path(folder) / "oracle.jsonl"
        spec = ClusterSpec(model=args.model, drafters=(f"{PREFIX}{oracle_file}",), device=args.device, dtype=args.dtype,
                           max_tree_nodes=max(args.max_tree_nodes, args.fixed_tree_nodes), job_timeout_s=JOB_TIMEOUT_S,
                           batch_invariant=args.batch_invariant, offload=args.offload)
        print(f"starting the cluster: {args.model} (random weights), oracle drafter ...", flush=True)
        with LocalCluster(spec) as cluster:
            started = time.perf_counter()
            at_once = per_set if args.offload else max(levels)  # offloaded: in as few passes as can be
            answers = {p: asyncio.run(plain_answers(cluster, prompts, args.max_tokens, at_once))
                       for p, prompts in prompt_sets.items()}
            report["plain_reference_s"] = round(time.perf_counter() - started, 1)
            report["pass_curves"] = pass_curves(cluster)
            write_oracle_file(oracle_file, [OracleEntry(prompt, tuple(answer), p, width=args.oracle_width)
                                            for p, prompts in prompt_sets.items()
                                            for prompt, answer in zip(prompts, answers[p])])
            meter = ClusterMeter(cluster)
            # offloaded, a second target in this process would double the host memory and the passes
            yardstick = None if args.offload else InProcessYardstick(args, cluster.spec)
            first = acceptances[0]  # untimed: every batch shape's kernels compiled before anything is timed
            load_sweep(cluster, prompt_sets[first], min(args.max_tokens, 16), levels, args.fixed_tree_nodes,
                       args.max_tree_nodes, rounds=1, policies=("fixed", "adaptive"), inputs=ids_input)
            for p in acceptances:
                _sweep_acceptance(args, cluster, meter, yardstick if p == first else None, p, prompt_sets[p],
                                  answers[p], levels, report)
            report["streamed"] = streamed(cluster)
            meter.close()
    report["answers_unlike_plain"] = sum(r["answers_unlike_plain"] for a in report["acceptance"].values()
                                         for r in a["load_sweep"])
    _print(report)
    if args.json_out:
        print(f"wrote {write_json(report, args.json_out)}")
    if report["answers_unlike_plain"]:
        print("FAILED: a speculative answer differs from plain decoding through the same cluster")
    return 1 if report["answers_unlike_plain"] else 0


def _sweep_acceptance(args: argparse.Namespace, cluster: LocalCluster, meter: ClusterMeter,
                      yardstick: InProcessYardstick | None, p: float, prompts: list, answers: list, levels: list[int],
                      report: dict) -> None:
    """The sweep with the oracle at acceptance ``p``, one level at a time, each written to the report (and its
    file) when done, so that a run stopped midway keeps them; with ``yardstick``, each level's plain run beside
    the same stepper in process; then one request's timeline."""
    print(f"oracle acceptance {p} ...", flush=True)
    rows: list[dict] = []
    controller: dict[str, dict] = {}
    for level in levels:
        rows += load_sweep(cluster, prompts, args.max_tokens, [level], args.fixed_tree_nodes, args.max_tree_nodes,
                           rounds=args.sweep_rounds, inputs=ids_input, expected=answers, meter=meter)
        controller[str(level)] = controller_state(cluster)  # after the level's last round
        if yardstick is not None:
            report["cluster_at_load"][str(level)] = yardstick.compare(
                [r for r in rows if r["concurrency"] == level], prompts, args.max_tokens, args.sweep_rounds)
        report["acceptance"][str(p)] = {"load_sweep": rows, "vs_plain": summarize(rows),
                                        "verdicts": adaptive_verdicts(rows), "controller": controller}
        if args.json_out:
            write_json(report, args.json_out)
    report["acceptance"][str(p)]["timeline"] = asyncio.run(timeline(cluster, prompts[0], args.max_tokens,
                                                                    args.max_tree_nodes))


class InProcessYardstick:
    """The verifier's stepper in this process, on the same target and threads: plain decoding of the sweep's
    requests at the sweep's concurrency, for ``cluster_at_load`` (docs/bench.md)."""

    def __init__(self, args: argparse.Namespace, spec: ClusterSpec) -> None:
        from specmesh.runtime.loading import configure_threads, parts_of
        from specmesh.runtime.target import load_target
        from specmesh.runtime.tree_verifier import TreeVerifier

        configure_threads(max(1, spec.cores // max(1, spec.verifiers)))  # the verifier's share
        target, runtime = load_target(args.model, args.dtype, args.device, "shipped", None, args.batch_invariant,
                                      args.offload)
        self.verifier = TreeVerifier(runtime, max_sessions=MAX_CONCURRENCY, max_tree_nodes=MAX_TREE_NODES)
        self.eos_token_ids = frozenset(parts_of(target).eos_token_ids)

    def compare(self, rows: list[dict], prompts: list[tuple[int, ...]], max_tokens: int, rounds: int) -> dict:
        """``rows``: one level's sweep rows; its plain run's figures beside the same requests in process."""
        plain = next(r for r in rows if r["policy"] == "none")
        level = plain["concurrency"]
        chosen = [prompts[i % len(prompts)] for i in range(plain["requests"])]
        engine_at_load(self.verifier, chosen[:level], 16, level, self.eos_token_ids)  # untimed: shapes compiled
        runs = [engine_at_load(self.verifier, chosen, max_tokens, level, self.eos_token_ids) for _ in range(rounds)]
        engine = sum(r.tokens_per_s for r in runs) / len(runs)
        full_ms = sum(r.full_pass_ms for r in runs) / len(runs)
        return {"cluster_tokens_per_s": plain["tokens_per_s"], "engine_tokens_per_s": round(engine, 2),
                "cluster_vs_engine": round(plain["tokens_per_s"] / engine, 3),
                "requests_per_pass": plain.get("requests_per_pass", 0.0), "in_flight": plain["in_flight"],
                "redis_commands_per_token": plain.get("redis_commands_per_token", 0.0),
                "router_cpu_ms_per_token": plain.get("router_cpu_ms_per_token", 0.0),
                "pass_gap_ms": plain.get("pass_gap_ms", 0.0), "pass_ms": plain.get("pass_ms", 0.0),
                "engine_pass_ms": round(full_ms, 3),
                "verifier_capacity_tokens_per_s": round(level / full_ms * 1e3, 1) if full_ms else 0.0}


def _print(report: dict) -> None:
    offloaded = ""
    if report["offload"]:
        gb, passes = (sum(v[k] for v in report["streamed"].values()) for k in ("bytes", "passes"))
        offloaded = f", offloaded ({gb / 1e9:.2f} GB streamed in {passes} passes)"
    print(f"\n{report['model']} through the cluster on {report['device']}{offloaded}, {report['max_tokens']} tokens "
          f"a request, "
          f"adaptive up to {report['tree_nodes']} nodes, fixed k={report['fixed_tree_nodes']}, "
          f"{report['rounds']} rounds, oracle width {report['oracle_width']}; answers unlike plain: "
          f"{report['answers_unlike_plain']}")
    for p, part in report["acceptance"].items():
        print(f"  oracle acceptance {p}:")
        for row in part["vs_plain"]:
            print(f"    concurrency {row['concurrency']:3d}: plain {row['plain_tokens_per_s']:8.1f} tok/s; "
                  f"fixed {row['fixed_vs_plain']:.2f}x ({row['fixed_tokens_per_step']} tokens/step), "
                  f"adaptive {row['adaptive_vs_plain']:.2f}x ({row['adaptive_tokens_per_step']} tokens/step, "
                  f"{row['adaptive_tree_nodes_per_step']} nodes/step)")
        for row in part["load_sweep"]:
            if "requests_per_pass" in row:
                print(f"    concurrency {row['concurrency']:3d} {row['policy']:8s}: {row['requests_per_pass']} requests a "
                      f"pass, {row['pass_gap_ms']} ms between passes, {row['redis_commands_per_token']} Redis "
                      f"commands and {row['router_cpu_ms_per_token']} ms of router CPU a token")
        for v in part["verdicts"]:
            interval = v["vs_none_ci95"]
            shown = f"[{interval[0]:+.1%}, {interval[1]:+.1%}]" if interval else "no interval"
            print(f"    concurrency {v['concurrency']:3d}: adaptive vs plain {v['vs_none_relative']:+.1%} (95 % CI "
                  f"{shown}): {'not worse' if v['not_worse_than_none'] else 'not worse: not shown'}")
        steps = part["timeline"]["steps"]
        print(f"    one request streamed: {part['timeline']['tokens_per_s']} tok/s; budgets "
              f"{[s.get('budget') for s in steps][:24]}; tokens {[s['tokens'] for s in steps][:24]}")
    for level, row in report["cluster_at_load"].items():
        print(f"  plain at {level:>3} in flight: cluster {row['cluster_tokens_per_s']:.1f} tok/s = "
              f"{row['cluster_vs_engine']:.2f}x the same stepper in process ({row['engine_tokens_per_s']:.1f}); "
              f"{row['requests_per_pass']} requests a pass of {row['in_flight']} in flight; a pass {row['pass_ms']} ms "
              f"(in process {row['engine_pass_ms']}), {row['pass_gap_ms']} ms between; verifier capacity "
              f"{row['verifier_capacity_tokens_per_s']} tok/s")
