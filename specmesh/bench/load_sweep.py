"""The load sweep: each speculation policy (none, fixed, adaptive) at each concurrency, through a cluster
(``load_sweep``) or in process (``engine_load_sweep``), in rotated and mirrored orders over paired rounds,
and whether adaptive is shown not worse than the others within a margin (``adaptive_verdicts``)."""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Sequence

from scipy import stats
from tqdm.auto import tqdm

from specmesh.bench.cluster_meter import ClusterMeter, Reading, per_token
from specmesh.bench.modes import percentile
from specmesh.cluster.launcher import LocalCluster
from specmesh.prompts import Prompt
from specmesh.speculation.engine import SpeculativeEngine
from specmesh.speculation.requests import Request


MAX_CONCURRENCY = 256  # the load sweep's most concurrent requests
LOAD_POLICIES = ("none", "fixed", "adaptive")
LOAD_ROUNDS = 3  # runs of each policy at each concurrency, in rotated/mirrored orders
_SPECULATION_OF = {"none": "off", "fixed": "fixed", "adaptive": "adaptive"}


def chat_input(prompt: Prompt) -> dict:
    """A bench prompt as the client's request: the user's turn, rendered with the model's chat template."""
    return {"chat": [("user", prompt.text)]}


def load_sweep(cluster: LocalCluster, prompts: Sequence, max_tokens: int, levels: list[int],
               fixed_tree_nodes: int, tree_nodes: int, rounds: int = LOAD_ROUNDS,
               policies: tuple[str, ...] = LOAD_POLICIES, inputs: Callable[[Any], dict] = chat_input,
               expected: Sequence[list[int]] | None = None, meter: ClusterMeter | None = None) -> list[dict]:
    """At each concurrency, the same requests through the cluster with each of ``policies`` (none: no
    speculation, fixed: k = ``fixed_tree_nodes`` every step, adaptive: up to ``tree_nodes``), ``rounds``
    times in rotated (then mirrored) orders, so that drift and warm-up hit every policy alike. Per (level,
    policy): mean tokens/s over the rounds and its spread, per-token latency percentiles over every
    request of every round, tokens per target step and tree nodes per step. ``inputs`` turns a prompt into
    the request's input; with ``expected`` (each prompt's greedy output), the answers that differ from it
    are counted; with ``meter``, where the time went (``cluster_meter.per_token``, over the rounds)."""
    import asyncio

    from specmesh.client import AsyncClient

    async def one_run(level: int, policy: str, chosen: list[int]) -> tuple[float, list[float], Counter]:
        gate = asyncio.Semaphore(level)
        latencies: list[float] = []
        counts: Counter = Counter()  # tokens, steps (target passes), nodes (drafted), unlike (``expected``), busy_us, wall_us

        async def send(client: AsyncClient, index: int) -> None:
            async with gate:
                started = time.perf_counter()
                answer = await client.generate(**inputs(prompts[index]), max_tokens=max_tokens,
                                               speculation=_SPECULATION_OF[policy],
                                               max_tree_nodes=fixed_tree_nodes if policy == "fixed" else tree_nodes)
                latencies.append((time.perf_counter() - started) * 1e3 / max(len(answer.token_ids), 1))
                counts["busy_us"] += round((time.perf_counter() - started) * 1e6)
                counts["tokens"] += len(answer.token_ids)
                counts["steps"] += answer.stats.target_steps
                counts["nodes"] += answer.stats.drafted_nodes
                counts["unlike"] += expected is not None and answer.token_ids != expected[index]

        async with AsyncClient(cluster.router_address, max_in_flight=max(64, level), api_key=cluster.client_key) as client:
            started = time.perf_counter()
            await asyncio.gather(*(send(client, i) for i in chosen))
            wall = time.perf_counter() - started
        counts["wall_us"] += round(wall * 1e6)
        return counts["tokens"] / wall, latencies, counts

    rows = []
    for index, level in enumerate(tqdm(levels, desc="load sweep", unit="level")):
        count = max(2 * level, min(len(prompts), 8))
        chosen = [i % len(prompts) for i in range(count)]
        costs: dict[str, list] = {p: [] for p in policies}  # (reading before, after, tokens, wall s) of each run

        def run(policy: str, level: int = level, chosen: list[int] = chosen) -> tuple[float, list[float], Counter]:
            before = meter.reading() if meter is not None else None
            speed, latency, counts = asyncio.run(one_run(level, policy, chosen))
            if meter is not None:
                costs[policy].append((before, meter.reading(), counts["tokens"], counts["tokens"] / speed))
            return speed, latency, counts

        speeds, latencies, totals = _rotated_rounds(policies, index, rounds, run)
        for policy in policies:
            rows.append(_sweep_row(level, policy, count, speeds[policy], latencies[policy], totals[policy],
                                   expected is not None)
                        # requests a client waited on, on average (Little's law): what a pass could hold
                        | {"in_flight": round(totals[policy]["busy_us"] / max(totals[policy]["wall_us"], 1), 2)}
                        | (_where_the_time_went(costs[policy]) if meter is not None else {}))
    return rows


def _sweep_row(level: int, policy: str, count: int, speeds: list[float], latencies: list[float], totals: Counter,
               checked: bool) -> dict:
    """One (level, policy) of a load sweep: tokens/s over its runs, per-token latency percentiles, tokens and
    tree nodes a step; ``checked``: the answers unlike plain decoding, counted."""
    tokens, steps, nodes = (totals[k] for k in ("tokens", "steps", "nodes"))
    return {"concurrency": level, "policy": policy, "requests": count, "rounds": len(speeds),
            "tokens_per_s": round(statistics.fmean(speeds), 2),
            "tokens_per_s_runs": [round(s, 2) for s in speeds],
            "tokens_per_s_spread": round(_spread(speeds), 2),
            "p50_ms": percentile(latencies, 50), "p99_ms": percentile(latencies, 99),
            "tokens_per_step": round(tokens / max(steps, 1), 3),
            "tree_nodes_per_step": round(nodes / max(steps, 1), 2),
            **({"answers_unlike_plain": totals["unlike"]} if checked else {})}


def engine_load_sweep(engines: dict[str, SpeculativeEngine], requests: Sequence[Request], levels: list[int],
                      rounds: int = LOAD_ROUNDS, expected: Sequence[list[int]] | None = None) -> list[dict]:
    """``load_sweep`` in process: at each concurrency, the same requests through each policy's engine (its
    drafters, policy and batch budget), at most ``level`` at a time, the next joining at the step one ends;
    ``rounds`` times in rotated (then mirrored) orders. Rows as ``load_sweep``'s; with ``expected``, the
    answers unlike it are counted."""
    policies = tuple(engines)
    rows = []
    for index, level in enumerate(tqdm(levels, desc="load sweep in process", unit="level")):
        count = max(2 * level, min(len(requests), 8))
        chosen = [i % len(requests) for i in range(count)]
        batch = [replace(requests[i], request_id=f"load-{n}") for n, i in enumerate(chosen)]  # one id each

        def run(policy: str, level: int = level, chosen: list[int] = chosen,
                batch: list[Request] = batch) -> tuple[float, list[float], Counter]:
            started = time.perf_counter()
            done = engines[policy].generate(batch, concurrency=level)
            wall = time.perf_counter() - started
            tokens = sum(len(c.token_ids) for c in done)
            counts = Counter(tokens=tokens, steps=sum(c.stats.target_steps for c in done),
                             nodes=sum(c.stats.drafted_nodes for c in done),
                             unlike=sum(expected is not None and c.token_ids != expected[i]
                                        for c, i in zip(done, chosen)))
            return tokens / wall, [c.stats.total_s * 1e3 / max(len(c.token_ids), 1) for c in done], counts

        speeds, latencies, totals = _rotated_rounds(policies, index, rounds, run)
        rows += [_sweep_row(level, p, count, speeds[p], latencies[p], totals[p], expected is not None)
                 for p in policies]
    return rows


def _rotated_rounds(policies: tuple[str, ...], rotation: int, rounds: int,
                    run: Callable[[str], tuple[float, list[float], Counter]]) -> tuple[dict, dict, dict]:
    """``run(policy)`` (tokens/s, per-token latencies, counts) ``rounds`` times for each policy, in orders
    rotated from ``rotation`` (then mirrored, ``sweep_order``): each policy's speeds, latencies and summed
    counts."""
    speeds: dict[str, list[float]] = {p: [] for p in policies}
    latencies: dict[str, list[float]] = {p: [] for p in policies}
    totals: dict[str, Counter] = {p: Counter() for p in policies}
    for round_ in range(rounds):
        for policy in sweep_order(rotation + round_, (round_ // len(policies)) % 2 == 1, policies):
            speed, latency, counts = run(policy)
            speeds[policy].append(speed)
            latencies[policy].extend(latency)
            totals[policy].update(counts)
    return speeds, latencies, totals


def _where_the_time_went(runs: list) -> dict[str, float]:
    """The runs' costs per token (``cluster_meter.per_token``) over their sum: each run's counters from its
    own readings, other policies' runs between them left out."""
    if not runs:
        return {}
    names = [f.name for f in fields(Reading)]
    spent = Reading(*(sum(getattr(after, n) - getattr(before, n) for before, after, _, _ in runs) for n in names))
    return per_token(Reading(*(0 for _ in names)), spent, sum(r[2] for r in runs), sum(r[3] for r in runs))


def sweep_order(rotation: int, mirrored: bool, policies: tuple[str, ...] = LOAD_POLICIES) -> tuple[str, ...]:
    """``policies`` rotated by ``rotation``, reversed when ``mirrored``: n rotations in a row put each
    policy in each slot once (a Latin square); the next n, mirrored, balance who runs after whom."""
    shift = rotation % len(policies)
    order = policies[shift:] + policies[:shift]
    return order[::-1] if mirrored else order


def _spread(values: list[float]) -> float:
    """Standard error of the mean (0 for a single run): the noise a comparison of means must beat."""
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0


NON_INFERIORITY_MARGIN = -0.05  # adaptive may be at most 5 % slower than another policy to count as not worse


@dataclass(frozen=True)
class NonInferiority:
    """Paired rounds of a treatment against a control: the mean of the per-round relative differences
    (treatment - control) / control, its two-sided ``confidence`` interval (Student's t on those
    differences; None with one round, where their noise is unknown), and the verdict."""

    mean: float
    low: float | None
    high: float | None
    margin: float

    @property
    def not_worse(self) -> bool:
        """The interval's lower bound is above the margin: with one round nothing is shown."""
        return self.low is not None and self.low > self.margin


def non_inferiority(treatment: list[float], control: list[float], margin: float = NON_INFERIORITY_MARGIN,
                    confidence: float = 0.95) -> NonInferiority:
    """Is ``treatment`` not worse than ``control`` by more than ``margin`` (relative), pairing round by round?
    In each round the policies ran back to back, so the machine's slow drift (this VM's speed wanders 10-20 %
    over minutes) cancels in each round's ratio."""
    differences = [(t - c) / c for t, c in zip(treatment, control, strict=True)]
    mean = statistics.fmean(differences)
    if len(differences) < 2:
        return NonInferiority(mean, None, None, margin)
    half = float(stats.t.ppf(0.5 + confidence / 2, len(differences) - 1)) * _spread(differences)
    return NonInferiority(mean, mean - half, mean + half, margin)


def adaptive_verdicts(rows: list[dict]) -> list[dict]:
    """Per concurrency: is adaptive not worse than no speculation, and than fixed k (a non-inferiority
    test per pair: the lower 95 % bound of adaptive's relative difference, paired by round, is above
    ``NON_INFERIORITY_MARGIN``)?"""
    verdicts = []
    for level in sorted({r["concurrency"] for r in rows}):
        by_policy = {r["policy"]: r for r in rows if r["concurrency"] == level}
        adaptive = by_policy["adaptive"]["tokens_per_s_runs"]
        verdict = {"concurrency": level, "margin": NON_INFERIORITY_MARGIN, "rounds": len(adaptive)}
        for other in ("none", "fixed"):
            control = by_policy[other]["tokens_per_s_runs"]
            test = non_inferiority(adaptive, control)
            verdict[f"vs_{other}_tokens_per_s"] = round(statistics.fmean(a - o for a, o in zip(adaptive, control)), 2)
            verdict[f"vs_{other}_relative"] = round(test.mean, 4)
            verdict[f"vs_{other}_ci95"] = None if test.low is None else [round(test.low, 4), round(test.high, 4)]
            verdict[f"not_worse_than_{other}"] = test.not_worse
        verdicts.append(verdict)
    return verdicts
