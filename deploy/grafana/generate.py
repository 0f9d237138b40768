"""Builds specmesh's Grafana dashboards (with grafana-foundation-sdk) and Prometheus rules from the
PromQL in ``specmesh/cluster/metrics.py``, so that a panel, a recording rule and an alert that say the same
thing are the same expression.

    python deploy/grafana/generate.py           # (re)write dashboards/*.json and rules/specmesh.rules.yml
    python deploy/grafana/generate.py --check   # exit 1 if the files differ from what this builds

The Helm chart cannot read files outside its folder, so it gets copies (``files/`` of the chart).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml
from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import StackingMode
from grafana_foundation_sdk.models.dashboard import DataSourceRef

HERE = Path(__file__).resolve().parent
CHART_FILES = HERE.parent / "helm" / "specmesh" / "files"
sys.path.insert(0, str(HERE.parents[1]))
from specmesh.cluster.metrics import ALERTS, DERIVED  # noqa: E402

RATE = "$__rate_interval"  # Grafana's window for rate(): at least four scrape intervals
RULE_WINDOW = "5m"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class PanelSpec:
    title: str
    queries: tuple[Query, ...]
    unit: str = "short"
    description: str = ""
    kind: str = "timeseries"  # or "stat"
    width: int = 12
    stacked: bool = False  # series that add up (a timeseries' areas stacked)


def derived(record: str, legend: str = "") -> Query:
    return Query(DERIVED[record].at(RATE), legend)


def rate(expr: str, by: str = "", legend: str = "") -> Query:
    group = f" by ({by})" if by else ""
    return Query(f"sum{group} (rate({expr}[{RATE}]))", legend)


def quantile(q: float, histogram: str, by: str = "", legend: str = "") -> Query:
    extra = f", {by}" if by else ""
    return Query(f"histogram_quantile({q}, sum by (le{extra}) (rate({histogram}_bucket[{RATE}])))", legend)


GENERATE = 'method=~"Generate|GenerateStream"'

DASHBOARDS: dict[str, tuple[str, str, tuple[PanelSpec, ...]]] = {
    "overview": ("specmesh / overview", "Goodput, speculation, latency and errors of the whole cluster", (
        PanelSpec("Goodput", (derived("specmesh:goodput:tokens_per_second", "tokens/s"),), "short",
                  "Tokens delivered to clients per second", "stat", 6),
        PanelSpec("Mean accepted length", (derived("specmesh:mean_accepted_length:ratio", "tokens per pass"),), "none",
                  "Tokens committed per target pass; 1 is plain decoding", "stat", 6),
        PanelSpec("Requests in flight", (Query("sum(specmesh_requests_in_flight)", "in flight"),), "short", "", "stat", 6),
        PanelSpec("Verifiers alive", (Query("max(specmesh_verifiers_alive)", "verifiers"),), "short",
                  "Verifiers of the pool with a live heartbeat, as the routers see them", "stat", 6),
        PanelSpec("Generation calls by status", (rate(f"specmesh_rpc_requests_total{{{GENERATE}}}", "code", "{{code}}"),),
                  "reqps", "Generate and GenerateStream calls per second, by gRPC status code"),
        PanelSpec("Error ratio", (derived("specmesh:request_errors:ratio", "errors"),), "percentunit",
                  "Share of generation calls that did not end OK"),
        PanelSpec("Time to first token", (quantile(0.5, "specmesh_time_to_first_token_seconds", legend="p50"),
                                          derived("specmesh:time_to_first_token_seconds:p99", "p99")), "s"),
        PanelSpec("Inter-token latency", (derived("specmesh:inter_token_seconds:p50", "p50"),
                                          derived("specmesh:inter_token_seconds:p99", "p99")), "s"),
        PanelSpec("Goodput and committed tokens", (derived("specmesh:goodput:tokens_per_second", "delivered"),
                                                   rate("specmesh_committed_tokens_total", legend="committed")), "short"),
        PanelSpec("Requests finished", (rate("specmesh_requests_finished_total", "reason", "{{reason}}"),), "reqps",
                  "Requests that ended per second, by finish reason"),
    )),
    "speculation": ("specmesh / speculation quality", "How well each drafter guesses, per request kind and tree depth", (
        PanelSpec("Acceptance rate by drafter", (derived("specmesh:drafter_acceptance:ratio", "{{drafter}}"),), "percentunit",
                  "Share of each drafter's guesses the target kept"),
        PanelSpec("Acceptance by tree depth", (derived("specmesh:drafter_position_acceptance:ratio",
                                                       "{{drafter}} depth {{position}}"),), "percentunit",
                  "Acceptance at each depth given every level above was accepted"),
        PanelSpec("Draft tokens by drafter", (rate("specmesh_drafter_draft_tokens_total", "drafter", "{{drafter}}"),), "short",
                  "Nodes each drafter proposes per second"),
        PanelSpec("Accepted tokens by drafter", (rate("specmesh_drafter_accepted_tokens_total", "drafter", "{{drafter}}"),),
                  "short", "Nodes of each drafter's trees on the committed path, per second"),
        PanelSpec("Routing: steps drafted per kind and drafter", (derived("specmesh:routing_decisions:rate",
                                                                          "{{kind}} → {{drafter}}"),), "short"),
        PanelSpec("Requests by kind", (rate("specmesh_requests_by_kind_total", "kind", "{{kind}}"),), "reqps",
                  "Requests admitted per second, by the kind they were classified as"),
        PanelSpec("Speculation budget", (derived("specmesh:speculation_budget:mean", "mean budget"),
                                         quantile(0.9, "specmesh_speculation_budget", legend="p90")), "none",
                  "Tree nodes the policy chose per step; 0 is plain decoding (it speculates less under load)"),
        PanelSpec("Controller: what a step costs besides its pass", (
            Query("max by (load) (specmesh_controller_step_overhead_ms)", "no tree, {{load}}+ requests"),
            Query("max by (load) (specmesh_controller_tree_overhead_ms)", "each tree, {{load}}+ requests")), "ms",
                  "What the adaptive controller has learned: a step's overhead by load, and what each tree in "
                  "flight adds to it (why it drafts less under load)"),
        PanelSpec("Fused tree size", (quantile(0.5, "specmesh_tree_nodes", legend="p50"),
                                      quantile(0.9, "specmesh_tree_nodes", legend="p90")), "none"),
    )),
    "pipeline": ("specmesh / pipeline and queue", "Where a step's time goes, the queue and the verification batches", (
        PanelSpec("Where a step's time goes (mean per step)", (Query(
            f'sum by (stage) (rate(specmesh_step_stage_seconds_sum{{stage!="step"}}[{RATE}])) / scalar(sum '
            f'(rate(specmesh_step_stage_seconds_count{{stage="step"}}[{RATE}])))', "{{stage}}"),), "s",
                  "The stages add up to a step: draft (waiting for the drafters), fuse (merging their trees), queue "
                  "(waiting for the pass), verify (the verifier's pass), transport (the rest)", stacked=True, width=24),
        PanelSpec("Step time by stage (p99)", (derived("specmesh:step_stage_seconds:p99", "{{stage}}"),), "s",
                  "draft: waiting for drafters; fuse: merging their trees; queue: waiting for the pass; "
                  "verify: the verifier's pass; transport: the rest"),
        PanelSpec("Step time by stage (p50)", (quantile(0.5, "specmesh_step_stage_seconds", "stage", "{{stage}}"),), "s"),
        PanelSpec("Queue depth", (Query("max(specmesh_queue_depth)", "admissions waiting"),), "short",
                  "Admitted requests no verifier has taken yet"),
        PanelSpec("Adopted requests", (rate("specmesh_queue_reclaimed_jobs_total", "instance", "{{instance}}"),),
                  "short", "Requests per second taken over from verifiers whose heartbeat stopped"),
        PanelSpec("Requests' passes by outcome", (rate("specmesh_verify_jobs_total", "outcome", "{{outcome}}"),),
                  "short"),
        PanelSpec("Verification batch", (derived("specmesh:verify_batch_requests:mean", "requests {{instance}}"),
                                         quantile(0.5, "specmesh_verify_batch_tokens", legend="tokens p50")), "short"),
        PanelSpec("Verification pass", (quantile(0.5, "specmesh_verify_pass_seconds", legend="p50"),
                                        quantile(0.99, "specmesh_verify_pass_seconds", legend="p99")), "s"),
        PanelSpec("Drafter proposal time (p99)", (quantile(0.99, "specmesh_drafter_propose_seconds", "drafter",
                                                           "{{drafter}}"),), "s"),
        PanelSpec("Drafters reachable", (Query("specmesh_drafter_up", "{{drafter}} {{address}}"),), "none"),
    )),
    "resources": ("specmesh / nodes", "Per-process resources: CPU, memory, KV caches, busy time", (
        PanelSpec("CPU by process", (Query(f'sum by (instance, job) (rate(process_cpu_seconds_total[{RATE}]))',
                                           "{{job}} {{instance}}"),), "percentunit", "CPU seconds per second (1 = one core)"),
        PanelSpec("Resident memory", (Query("process_resident_memory_bytes", "{{job}} {{instance}}"),), "bytes"),
        PanelSpec("KV cache memory", (Query("specmesh_kv_cache_bytes", "{{instance}}"),), "bytes"),
        PanelSpec("KV sessions", (Query("specmesh_kv_sessions", "{{instance}}"),), "short"),
        PanelSpec("Drafter sessions", (Query("sum by (drafter, instance) (specmesh_drafter_sessions)",
                                             "{{drafter}} {{instance}}"),), "short"),
        PanelSpec("Verifier busy fraction", (derived("specmesh:verifier_busy:ratio", "{{instance}}"),), "percentunit",
                  "Share of time in target passes; the rest is idle or waiting for work"),
        PanelSpec("Weights streamed from host memory", (rate("specmesh_target_streamed_bytes_total", "instance",
                                                             "{{instance}}"),), "Bps",
                  "An offloaded target's (--offload) decoder layers copied to its device: all of them every pass; "
                  "0 where the weights are resident"),
        PanelSpec("gRPC latency by method (p99)", (quantile(0.99, "specmesh_rpc_duration_seconds", "method", "{{method}}"),),
                  "s"),
        PanelSpec("gRPC calls by method", (rate("specmesh_rpc_requests_total", "method, code", "{{method}} {{code}}"),),
                  "reqps"),
    )),
}


def _panel(spec: PanelSpec):
    builder = (stat.Panel() if spec.kind == "stat" else timeseries.Panel()).title(spec.title).unit(spec.unit)
    builder = builder.datasource(DATASOURCE).span(spec.width).height(4 if spec.kind == "stat" else 8)
    if spec.description:
        builder = builder.description(spec.description)
    if spec.stacked:
        builder = builder.stacking(common_builders.StackingConfig().mode(StackingMode.NORMAL)).fill_opacity(60)
    for index, query in enumerate(spec.queries):
        target = prometheus.Dataquery().expr(query.expr).ref_id(chr(ord("A") + index)).datasource(DATASOURCE)
        if query.legend:
            target = target.legend_format(query.legend)
        builder = builder.with_target(target)
    return builder


def dashboard(name: str) -> dict:
    title, description, panels = DASHBOARDS[name]
    builder = (db.Dashboard(title).uid(f"specmesh-{name}").description(description).tags(["specmesh"])
               .refresh("30s").time("now-1h", "now").timezone("browser")
               .with_variable(db.DatasourceVariable("datasource").label("Data source").type("prometheus")))
    for spec in panels:
        builder = builder.with_panel(_panel(spec))
    return _without_nulls(json.loads(json.dumps(builder.build(), cls=JSONEncoder)))


def _without_nulls(value):
    """Grafana fills in what is absent; an explicit null (e.g. a panel's options) it may not."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def panel_queries(board: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel of a dashboard's JSON."""
    return [(panel["title"], target["expr"]) for panel in board.get("panels", []) for target in panel.get("targets", [])]


def rules() -> dict:
    recording = [{"record": d.record, "expr": d.at(RULE_WINDOW)} for d in DERIVED.values()]
    alerting = [{"alert": a.name, "expr": a.expr, "for": a.for_, "labels": {"severity": a.severity},
                 "annotations": {"summary": a.summary}} for a in ALERTS]
    return {"groups": [{"name": "specmesh.recording", "rules": recording},  # at Prometheus's evaluation interval
                       {"name": "specmesh.alerts", "rules": alerting}]}


def outputs() -> dict[Path, str]:
    files = {HERE / "dashboards" / f"{name}.json": json.dumps(dashboard(name), indent=2, sort_keys=True) + "\n"
             for name in DASHBOARDS}
    header = "# Generated by deploy/grafana/generate.py from specmesh/cluster/metrics.py: edit those, not this file.\n"
    files[HERE / "rules" / "specmesh.rules.yml"] = header + yaml.safe_dump(rules(), sort_keys=False, width=160)
    for path, text in list(files.items()):
        files[CHART_FILES / path.parent.name / path.name] = text
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when a file is out of date")
    args = parser.parse_args(argv)
    stale = []
    for path, text in outputs().items():
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current != text:
            stale.append(path)
            if not args.check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text, encoding="utf-8")
    for path in stale:
        print(f"{'out of date' if args.check else 'wrote'}: {path.relative_to(HERE.parents[1])}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
