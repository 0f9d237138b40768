"""Prometheus metrics of the services: counters and histograms, never precomputed rates.

Every service keeps its metrics in its own registry (tests host several services in one process) and
serves them over HTTP (``serve_metrics``). Derived quantities are PromQL over these series; the
recording rules (``deploy/grafana/rules/specmesh.rules.yml``) and the dashboards use exactly these
expressions, so a number on a dashboard means what is written here:

- acceptance rate of a drafter (its guesses the target kept, per guess made)::

    sum by (drafter) (rate(specmesh_drafter_accepted_tokens_total[5m]))
      / sum by (drafter) (rate(specmesh_drafter_draft_tokens_total[5m]))

- acceptance at tree depth d given every level above was accepted::

    sum by (drafter, position) (rate(specmesh_drafter_position_hits_total[5m]))
      / sum by (drafter, position) (rate(specmesh_drafter_position_attempts_total[5m]))

- mean accepted length (tokens committed per target pass; 1 = plain decoding)::

    sum(rate(specmesh_committed_tokens_total[5m])) / sum(rate(specmesh_target_steps_total[5m]))

- goodput (tokens per second delivered to clients)::  sum(rate(specmesh_generated_tokens_total[5m]))
- verifier busy fraction::  sum by (instance) (rate(specmesh_verify_pass_seconds_sum[5m]))
- host-to-device bytes per second of an offloaded target::  sum by (instance) (rate(specmesh_target_streamed_bytes_total[5m]))
- latency quantiles::  histogram_quantile(0.99, sum by (le) (rate(specmesh_time_to_first_token_seconds_bucket[5m])))
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from specmesh import __version__
from specmesh.errors import InvalidArgument
from specmesh.speculation.batch_budget import POLICY, BatchBudget
from specmesh.speculation.expertise import level_hits
from specmesh.speculation.policy import AdaptivePolicy, RequestPolicy, StepOutcome, StepPlan

MAX_POSITION_LABEL = 16  # deeper tree levels share the last label: bounded label sets
# seconds: from a fraction of a millisecond (a model-free draft) to a minute (a long request)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
COUNT_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def position_label(depth: int) -> str:
    return str(min(depth, MAX_POSITION_LABEL))


class ServiceMetrics:
    """What every service exports: its identity and its gRPC calls by method and status code."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # CPU seconds, resident memory, open files: the per-node dashboard
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        Gauge("specmesh_build_info", "Always 1: the service and its version", ["service", "version"],
              registry=r).labels(service, __version__).set(1)
        self.rpc_requests = Counter("specmesh_rpc_requests", "gRPC calls handled, by method and status code",
                                    ["method", "code"], registry=r)
        self.rpc_seconds = Histogram("specmesh_rpc_duration_seconds",
                                     "gRPC call duration (a server stream: until its last message; a held request "
                                     "stream: each message until its reply)",
                                     ["method"], buckets=LATENCY_BUCKETS, registry=r)

    def watch_policy(self, policy: AdaptivePolicy, budget: BatchBudget | None = None) -> None:
        """Export what ``policy``'s controller has learned, and ``budget``'s arms where the steps run
        (``ControllerCollector``)."""
        self.registry.register(ControllerCollector(policy, budget))

    def rpc_done(self, method: str, code: str, seconds: float) -> None:
        short = method.rsplit("/", 1)[-1]
        self.rpc_requests.labels(short, code).inc()
        self.rpc_seconds.labels(short).observe(seconds)


class _Histogram:
    """A histogram's buckets, sum and count as plain numbers, for ``StepMetrics``'s collector."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, int]]:
        cumulative, total = [], 0
        for bound, count in zip([*map(floatToGoString, self.bounds), "+Inf"], list(self.counts)):
            total += count
            cumulative.append((bound, total))
        return cumulative


class StepMetrics(Collector):
    """The speculation steps, counted where the step loop runs (the verifiers): budgets,
    routing, what each drafter guessed and got accepted, and where a step's time went. Every request of a
    step is metered, so the counts are plain numbers read at each scrape: prometheus_client's per-call
    locks and label lookups cost ~40 µs a request-step, at 64 requests about a pass of a small target."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.counts = {"target_steps": 0, "committed": 0, "tree_accepted": 0}
        self.tree_nodes, self.budget = _Histogram(COUNT_BUCKETS[:8]), _Histogram(COUNT_BUCKETS[:8])
        self.by_drafter: dict[str, dict[tuple[str, ...], int]] = {
            "routing": {}, "drafts": {}, "draft_tokens": {}, "accepted": {}, "position_attempts": {},
            "position_hits": {}}
        self.stages: dict[str, _Histogram] = {}
        registry.register(self)

    def plan(self, kind: str, plan: StepPlan) -> None:
        self.budget.observe(plan.budget)
        routing = self.by_drafter["routing"]
        for name in plan.drafters:
            key = (kind or "general", name)
            routing[key] = routing.get(key, 0) + 1

    def step(self, outcome: StepOutcome) -> None:
        """One step of a request: what each drafter guessed and got accepted, and where the time went."""
        counts, by = self.counts, self.by_drafter
        counts["target_steps"] += 1
        counts["committed"] += len(outcome.committed)
        self.tree_nodes.observe(len(outcome.fused))
        counts["tree_accepted"] += max(len(outcome.committed) - 1, 0) if len(outcome.fused) else 0
        for name, tree in zip(outcome.plan.drafters, outcome.trees):
            hits, attempts = level_hits(tree, outcome.committed)
            for metric, amount in (("drafts", 1), ("draft_tokens", len(tree)), ("accepted", hits)):
                by[metric][name,] = by[metric].get((name,), 0) + amount
            for depth in range(1, attempts + 1):
                key = (name, position_label(depth))
                by["position_attempts"][key] = by["position_attempts"].get(key, 0) + 1
                if depth <= hits:
                    by["position_hits"][key] = by["position_hits"].get(key, 0) + 1
        for stage, ms in step_timeline(outcome).items():
            histogram = self.stages.get(stage)
            if histogram is None:
                histogram = self.stages[stage] = _Histogram(LATENCY_BUCKETS)
            histogram.observe(ms / 1e3)

    def collect(self):
        for name, help_text in (("target_steps", "Verification passes that committed tokens"),
                                ("committed", "Tokens committed (accepted guesses + the target's own token)"),
                                ("tree_accepted", "Fused-tree nodes the target accepted")):
            yield CounterMetricFamily(f"specmesh_{_STEP_NAMES.get(name, name)}", help_text, value=self.counts[name])
        for name, histogram, help_text in (
                ("specmesh_tree_nodes", self.tree_nodes, "Nodes of each fused tree sent to verification"),
                ("specmesh_speculation_budget", self.budget, "Tree budget the policy chose for a step (0 = plain "
                                                             "decoding)")):
            family = HistogramMetricFamily(name, help_text)
            family.add_metric([], histogram.buckets(), histogram.sum)
            yield family
        for metric, (name, labels, help_text) in _BY_DRAFTER.items():
            family = CounterMetricFamily(name, help_text, labels=labels)
            for key, value in list(self.by_drafter[metric].items()):
                family.add_metric(list(key), value)
            yield family
        family = HistogramMetricFamily("specmesh_step_stage_seconds", STAGE_HELP, labels=["stage"])
        for stage, histogram in list(self.stages.items()):
            family.add_metric([stage], histogram.buckets(), histogram.sum)
        yield family


_STEP_NAMES = {"committed": "committed_tokens", "tree_accepted": "tree_accepted_tokens"}
_BY_DRAFTER = {
    "routing": ("specmesh_routing_decisions", ["kind", "drafter"], "Steps each drafter was asked to draft, by "
                "request kind"),
    "drafts": ("specmesh_drafter_drafts", ["drafter"], "Trees asked of each drafter"),
    "draft_tokens": ("specmesh_drafter_draft_tokens", ["drafter"], "Nodes of each drafter's own trees"),
    "accepted": ("specmesh_drafter_accepted_tokens", ["drafter"], "Nodes of each drafter's own tree on the "
                 "committed path"),
    "position_attempts": ("specmesh_drafter_position_attempts", ["drafter", "position"], "Tree levels where a "
                          "drafter guessed, every level above accepted"),
    "position_hits": ("specmesh_drafter_position_hits", ["drafter", "position"], "Tree levels where one of a "
                      "drafter's guesses was accepted"),
}
STAGE_HELP = ("A step's timeline, stage by stage (all but step add up to step): draft (waiting for the drafters), "
              "fuse (merging their trees), queue (waiting for the pass), verify (the pass, any prefill included), "
              "transport (the rest), step (all of it)")


class RouterMetrics(ServiceMetrics):
    """The requests as the router sees them: tokens, latency, kinds, the pool; and the routing policy it learns
    from the verifiers' reports (their steps are counted where they run, ``VerifierMetrics``)."""

    def __init__(self) -> None:
        super().__init__("router")
        r = self.registry
        self.in_flight = Gauge("specmesh_requests_in_flight", "Requests being generated", registry=r)
        self.finished = Counter("specmesh_requests_finished", "Requests that ended, by finish reason (stop, length; aborted: an error or the client left)",
                                ["reason"], registry=r)
        self.generated = Counter("specmesh_generated_tokens", "Tokens delivered to clients", registry=r)
        self.requests_by_kind = Counter("specmesh_requests_by_kind", "Requests admitted, by the kind they were classified as",
                                        ["kind"], registry=r)
        self.ttft = Histogram("specmesh_time_to_first_token_seconds", "Time from admission to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("specmesh_inter_token_seconds", "Time between successive tokens of a request",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("specmesh_queue_depth", "Admitted requests no verifier has taken yet", registry=r)
        self.verifiers_alive = Gauge("specmesh_verifiers_alive", "Verifiers of the pool with a live heartbeat", registry=r)
        self.forged_results = Counter("specmesh_forged_results", "Outputs dropped for want of a valid queue tag "
                                      "(written to Redis by something other than a verifier)", registry=r)
        self.drafter_up = Gauge("specmesh_drafter_up", "1 while the router can reach a drafter, else 0",
                                ["drafter", "address"], registry=r)
        # the routing policy learnt here from the verifiers' reports (policy_sync.py)
        self.routing_reports = Counter("specmesh_routing_reports", "Reports of per-level hit counts received from "
                                       "verifiers and learnt from", registry=r)
        self.routing_published = Gauge("specmesh_routing_snapshot_published_version", "Version of the routing "
                                       "snapshot this router last published (0: none yet)", registry=r)


class ControllerCollector(Collector):
    """What the adaptive policy has learned, read at each scrape (no work per step): the step overhead
    and each tree's share of it by load, the realism ratio, and the load it weighs. It tells an operator
    why the controller drafts or not."""

    def __init__(self, policy: AdaptivePolicy, budget: BatchBudget | None = None) -> None:
        self.policy = policy
        self.budget = budget

    def collect(self):
        controller, state = self.policy.controller, self.policy.state
        base = GaugeMetricFamily("specmesh_controller_step_overhead_ms", "Learnt time a step takes besides its pass "
                                 "and drafting, with no tree in flight, by load (requests in flight, in powers of two)", labels=["load"])
        per_tree = GaugeMetricFamily("specmesh_controller_tree_overhead_ms", "Learnt time each tree in flight adds to "
                                     "every step, by load", labels=["load"])
        for requests, base_ms, per_tree_ms in controller.overhead.learned():
            base.add_metric([str(requests)], base_ms)
            per_tree.add_metric([str(requests)], per_tree_ms)
        yield base
        yield per_tree
        yield GaugeMetricFamily("specmesh_controller_realism", "Accepted tokens steps kept over those the controller "
                                "predicted (scales its predictions)", value=state.realism.ratio)
        yield GaugeMetricFamily("specmesh_controller_batch_requests", "Requests a verification pass carries, as the "
                                "controller averages it", value=state.batch_size)
        yield GaugeMetricFamily("specmesh_controller_drafting_share", "Share of request steps with a tree, as the "
                                "controller averages it", value=state.trees_per_request_step)
        if self.budget is not None:
            arms = GaugeMetricFamily("specmesh_controller_arm_tokens_per_second", "Tokens a second the adaptive "
                                     "requests' steps committed under each arm (policy: the controller's choice; "
                                     "a number: that many nodes each), by load (requests running, in powers of "
                                     "two) and request kind (mixed: several)", labels=["load", "kind", "arm"])
            for requests, kind, arm, goodput in self.budget.learned():
                arms.add_metric([str(requests), kind, "policy" if arm == POLICY else str(arm)], goodput)
            yield arms
        yield GaugeMetricFamily("specmesh_controller_drafting_shares_cores", "1 while the controller counts drafting "
                                "in every request's cycle (a CPU verifier, or no pass curve yet)",
                                value=float(controller.drafting_shares_cores))


def step_timeline(outcome: StepOutcome) -> dict[str, float]:
    """Where a step's time went, in ms: stages that add up to ``step`` (drafting ones only for a step that
    drafted; the verifier's only where it reported them)."""
    stages: dict[str, float] = {}
    if outcome.trees:
        stages["draft"] = max(outcome.draft_ms - outcome.fuse_ms, 0.0)
        stages["fuse"] = outcome.fuse_ms
    verify_ms = outcome.verify_ms or outcome.pass_ms
    if verify_ms > 0:
        stages["queue"] = outcome.queue_ms
        stages["verify"] = verify_ms
        stages["transport"] = max(outcome.step_ms - outcome.draft_ms - outcome.queue_ms - verify_ms, 0.0)
    stages["step"] = outcome.step_ms
    return stages


class MeteredRequest:
    """A request's policy, with every plan and outcome also counted (the policy itself stays pure)."""

    def __init__(self, inner: RequestPolicy, metrics: StepMetrics) -> None:
        self.inner = inner
        self.metrics = metrics

    @property
    def kind(self) -> str:
        return self.inner.kind

    @property
    def adapts(self) -> bool:
        return self.inner.adapts

    def plan(self, room: int, available: Sequence[str], position: int, budget: int | None = None) -> StepPlan:
        plan = self.inner.plan(room, available, position, budget)
        self.metrics.plan(self.kind, plan)
        return plan

    def observe(self, outcome: StepOutcome) -> None:
        self.inner.observe(outcome)
        self.metrics.step(outcome)

    def end(self) -> None:
        self.inner.end()


class RequestClock:
    """TTFT and inter-token latency of one request, fed as its tokens arrive (``tokens_arrived``) or, for an
    answer sent whole, at its end from the verifier's own clock (``answer_arrived``)."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics
        self.started = self.last = time.perf_counter()
        self.tokens = 0

    def tokens_arrived(self, count: int) -> None:
        if count <= 0:
            return
        now = time.perf_counter()
        self.metrics.generated.inc(count)
        if self.tokens == 0:
            self.metrics.ttft.observe(now - self.started)
        else:
            gap = (now - self.last) / count  # a step's tokens arrive together: its time is spread over them
            for _ in range(count):
                self.metrics.inter_token.observe(gap)
        self.tokens += count
        self.last = now

    def answer_arrived(self, count: int, first_token_s: float, total_s: float) -> None:
        """A whole answer of ``count`` tokens, which the verifier ran for ``total_s``, its first token at
        ``first_token_s``: the first token came that much before the end reached here."""
        if count <= 0:
            return
        now = time.perf_counter()
        self.metrics.generated.inc(count)
        decoding = max(total_s - first_token_s, 0.0)
        self.metrics.ttft.observe(max(now - self.started - decoding, 0.0))
        for _ in range(count - 1):
            self.metrics.inter_token.observe(decoding / (count - 1))
        self.tokens += count
        self.last = now


class VerifierMetrics(ServiceMetrics, StepMetrics):
    """Passes, the queue, the KV cache, and the steps of the requests it runs."""

    def __init__(self) -> None:
        ServiceMetrics.__init__(self, "verifier")
        StepMetrics.__init__(self, self.registry)
        r = self.registry
        self.jobs = Counter("specmesh_verify_jobs", "Requests' parts of a pass, and admissions refused, by outcome "
                            "(ok, resync, refused, failed: its request alone failed in the pass, prefilling: its "
                            "prompt is cached over several passes; forged: an admission without a valid queue tag, "
                            "error: an admission that could not be run)", ["outcome"], registry=r)
        self.batch_requests = Histogram("specmesh_verify_batch_requests", "Requests per verification pass",
                                        buckets=COUNT_BUCKETS[:10], registry=r)
        self.batch_rows = Histogram("specmesh_verify_batch_tokens", "Rows (tokens: roots, tree nodes, prefill) per verification pass",
                                    buckets=COUNT_BUCKETS, registry=r)
        self.pass_seconds = Histogram("specmesh_verify_pass_seconds", "Duration of a verification pass",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.reclaimed = Counter("specmesh_queue_reclaimed_jobs", "Requests adopted from verifiers whose heartbeat "
                                 "stopped", registry=r)
        self.kv_sessions = Gauge("specmesh_kv_sessions", "Requests whose KV cache this verifier holds", registry=r)
        self.kv_bytes = Gauge("specmesh_kv_cache_bytes", "Memory held by the KV caches", registry=r)
        self.worker_errors = Counter("specmesh_verifier_worker_errors", "Unexpected errors the worker survived "
                                     "(logged with their traceback)", registry=r)
        # the routers' routing snapshots (policy_sync.py)
        self.routing_applied = Gauge("specmesh_routing_snapshot_applied_version", "Version of the routing snapshot "
                                     "this verifier routes by (0: none yet, its own learning alone)", registry=r)
        self.routing_refused = Counter("specmesh_routing_snapshots_refused", "Routing snapshots refused, by reason "
                                       "(forged: no valid queue tag; unreadable: not a sound snapshot)", ["reason"],
                                       registry=r)

    def watch(self, runtime: object) -> None:
        """Export what ``runtime`` streams (``StreamingCollector``)."""
        self.registry.register(StreamingCollector(runtime))


class StreamingCollector(Collector):
    """The target's decoder-layer weights copied from host memory to its device (``--offload``), read from
    the runtime at each scrape: every pass of an offloaded target adds all its layers; a resident one, nothing."""

    def __init__(self, runtime: object) -> None:
        self.runtime = runtime

    def collect(self):
        yield CounterMetricFamily("specmesh_target_streamed_bytes", "Bytes of the target's weights copied from host "
                                  "memory to the device (--offload; 0 when resident)",
                                  value=getattr(self.runtime, "streamed_bytes", 0))  # only offloading runtimes count


class DrafterMetrics(ServiceMetrics):
    def __init__(self) -> None:
        super().__init__("drafter")
        r = self.registry
        self.proposals = Counter("specmesh_drafter_proposals", "Trees proposed, by drafter", ["drafter"], registry=r)
        self.proposed_nodes = Counter("specmesh_drafter_proposed_nodes", "Nodes of the trees proposed", ["drafter"], registry=r)
        self.propose_seconds = Histogram("specmesh_drafter_propose_seconds", "Time to propose a tree (catch-up included)",
                                         ["drafter"], buckets=LATENCY_BUCKETS, registry=r)
        self.propose_batch_items = Histogram("specmesh_drafter_propose_batch_items",
                                             "Proposals asked for in each ProposeMany call (one a request in a step)",
                                             ["drafter"], buckets=COUNT_BUCKETS[:10], registry=r)
        self.sessions = Gauge("specmesh_drafter_sessions", "Requests whose drafting state this service holds", ["drafter"], registry=r)


@dataclass
class MetricsEndpoint:
    host: str
    port: int
    _server: object

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve_metrics(metrics: ServiceMetrics, address: str) -> MetricsEndpoint | None:
    """Serve ``metrics`` at ``http://address/metrics`` (``host:port``; port 0 picks a free one; an empty
    address serves nothing)."""
    if not address:
        return None
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise InvalidArgument("metrics_address", f"is {address!r}; use host:port (port 0: any free port)")
    try:
        server, _ = start_http_server(int(port), addr=host or "0.0.0.0", registry=metrics.registry)
    except OSError as exc:
        raise InvalidArgument("metrics_address", f"cannot listen on {address}: {exc}") from None
    return MetricsEndpoint(host or "0.0.0.0", server.server_port, server)


# ---- derived quantities: the PromQL the recording rules, alerts and dashboards are built from ----


@dataclass(frozen=True)
class Derived:
    """A quantity computed from the counters: ``expr`` has ``{w}`` where the rate window goes (``5m`` in
    the recording rules, ``$__rate_interval`` on the dashboards)."""

    record: str  # the recording rule's series name
    expr: str
    help: str
    unit: str = "none"  # Grafana unit of the dashboards' panels

    def at(self, window: str) -> str:
        return self.expr.replace("{w}", window)


def _ratio(numerator: str, denominator: str, by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({numerator}[{{w}}])) / sum{group} (rate({denominator}[{{w}}]))"


def _quantile(q: float, histogram: str, by: str = "") -> str:
    extra = f", {by}" if by else ""
    return f"histogram_quantile({q}, sum by (le{extra}) (rate({histogram}_bucket[{{w}}])))"


GENERATE_METHODS = 'method=~"Generate|GenerateStream"'
DERIVED = {d.record: d for d in (
    Derived("specmesh:drafter_acceptance:ratio",
            _ratio("specmesh_drafter_accepted_tokens_total", "specmesh_drafter_draft_tokens_total", "drafter"),
            "Share of each drafter's guesses that the target kept", "percentunit"),
    Derived("specmesh:drafter_position_acceptance:ratio",
            _ratio("specmesh_drafter_position_hits_total", "specmesh_drafter_position_attempts_total", "drafter, position"),
            "Acceptance at each tree depth, given every level above was accepted", "percentunit"),
    Derived("specmesh:mean_accepted_length:ratio",
            _ratio("specmesh_committed_tokens_total", "specmesh_target_steps_total"),
            "Tokens committed per target pass (1 = plain decoding)"),
    Derived("specmesh:goodput:tokens_per_second", "sum(rate(specmesh_generated_tokens_total[{w}]))",
            "Tokens delivered to clients per second", "short"),
    Derived("specmesh:request_errors:ratio",
            f'sum(rate(specmesh_rpc_requests_total{{{GENERATE_METHODS}, code!="OK"}}[{{w}}])) '
            f'/ sum(rate(specmesh_rpc_requests_total{{{GENERATE_METHODS}}}[{{w}}]))',
            "Share of generation calls that did not end OK", "percentunit"),
    Derived("specmesh:time_to_first_token_seconds:p99", _quantile(0.99, "specmesh_time_to_first_token_seconds"),
            "99th percentile of the time to the first token", "s"),
    Derived("specmesh:inter_token_seconds:p50", _quantile(0.5, "specmesh_inter_token_seconds"),
            "Median time between tokens", "s"),
    Derived("specmesh:inter_token_seconds:p99", _quantile(0.99, "specmesh_inter_token_seconds"),
            "99th percentile of the time between tokens", "s"),
    Derived("specmesh:step_stage_seconds:p99", _quantile(0.99, "specmesh_step_stage_seconds", "stage"),
            "99th percentile of each step stage", "s"),
    Derived("specmesh:speculation_budget:mean", _ratio("specmesh_speculation_budget_sum", "specmesh_speculation_budget_count"),
            "Mean tree budget the policy chose per step (0 = plain decoding)"),
    Derived("specmesh:verify_batch_requests:mean",
            _ratio("specmesh_verify_batch_requests_sum", "specmesh_verify_batch_requests_count", "instance"),
            "Mean requests per verification pass, per verifier"),
    Derived("specmesh:verifier_busy:ratio", "sum by (instance) (rate(specmesh_verify_pass_seconds_sum[{w}]))",
            "Share of time each verifier spends in target passes", "percentunit"),
    Derived("specmesh:routing_decisions:rate", "sum by (kind, drafter) (rate(specmesh_routing_decisions_total[{w}]))",
            "Steps per second each drafter drafts for each request kind", "short"),
)}


@dataclass(frozen=True)
class Alert:
    """An alert is a quantity and a condition on it (the quantity alone is what tests query for data)."""

    name: str
    quantity: str
    condition: str
    for_: str
    severity: str
    summary: str

    @property
    def expr(self) -> str:
        return f"({self.quantity}) {self.condition}"


ALERTS = (
    Alert("SpecmeshAcceptanceCollapse", DERIVED["specmesh:drafter_acceptance:ratio"].at("10m"),
          "< 0.05 and on (drafter) sum by (drafter) (rate(specmesh_drafter_drafts_total[10m])) > 0.1", "15m", "warning",
          "Drafter {{ $labels.drafter }} gets under 5 % of its guesses accepted: it costs time and earns nothing"),
    Alert("SpecmeshQueueBacklog", "max(specmesh_queue_depth)", "> 200", "5m", "warning",
          "{{ $value }} admitted requests wait for a verifier: the verifiers cannot keep up"),
    Alert("SpecmeshNoVerifier", "max(specmesh_verifiers_alive)", "< 1", "1m", "critical",
          "No verifier of the pool has a live heartbeat: every request is failing"),
    Alert("SpecmeshDrafterUnreachable", "max by (drafter, address) (specmesh_drafter_up)", "< 1", "5m", "warning",
          "Drafter {{ $labels.drafter }} at {{ $labels.address }} is unreachable: its requests lose speculation"),
    Alert("SpecmeshRequestErrors", DERIVED["specmesh:request_errors:ratio"].at("5m"), "> 0.05", "10m", "warning",
          "{{ $value | humanizePercentage }} of generation calls fail"),
    Alert("SpecmeshSlowFirstToken", DERIVED["specmesh:time_to_first_token_seconds:p99"].at("5m"), "> 10", "10m", "warning",
          "p99 time to the first token is {{ $value | humanizeDuration }}"),
)
