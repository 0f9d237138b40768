"""Metrics, rules and dashboards, checked for real: the services (router, a drafter, a verifier worker,
over gRPC and the real Redis queue) serve their metrics over HTTP, a real Prometheus scrapes them on
loopback while traffic runs, and every dashboard panel's query, every recording rule and every alert's
quantity must return data through Prometheus's HTTP API. ``promtool`` checks and unit-tests the rules;
the dashboards must load as Grafana dashboards and match what ``deploy/grafana/generate.py`` builds."""

import asyncio
import importlib.util
import json
import math
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest
from cluster_parts import ServiceStack
from conftest import need, tiny_llama

from specmesh.client import AsyncClient
from specmesh.cluster.gateway import GatewayLimits
from specmesh.cluster.metrics import ALERTS, DERIVED, RouterMetrics, VerifierMetrics, serve_metrics
from specmesh.cluster.ports import free_port
from specmesh.drafters.ngram import HistoryDrafter
from specmesh.errors import InvalidArgument
from specmesh.speculation.batch_budget import POLICY, WINDOW_STEPS, BatchBudget
from specmesh.speculation.policy import StepOutcome, StepPlan, adaptive_policy
from specmesh.tree import TokenTree

ROOT = Path(__file__).resolve().parents[1]
GRAFANA = ROOT / "deploy" / "grafana"
RULES = GRAFANA / "rules" / "specmesh.rules.yml"
RULE_TESTS = GRAFANA / "rules" / "specmesh.rules.test.yml"
WINDOW = "1m"  # what the dashboards' $__rate_interval becomes here (scrapes every second)


def _generator():
    """deploy/grafana/generate.py, imported (it is a script, not a package)."""
    if "grafana_generate" not in sys.modules:
        spec = importlib.util.spec_from_file_location("grafana_generate", GRAFANA / "generate.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up while being defined
        spec.loader.exec_module(module)
    return sys.modules["grafana_generate"]


def _tool(name: str) -> str:
    path = shutil.which(name)
    need(path is not None, name, "apt-get install prometheus (.ci/run does)")
    return path


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as answer:
        return answer.read().decode()


# ---- pure: what one step counts ----


def test_a_step_counts_each_drafters_guesses_and_hits_by_depth():
    metrics = VerifierMetrics()
    right = TokenTree.chain([5, 6, 7])  # the target commits 5, 6, then 9: two hits, a miss at depth 3
    wrong = TokenTree.chain([8])
    outcome = StepOutcome(StepPlan(("expert", "ngram"), (1.0, 1.0), 4), (right, wrong), right, (5, 6, 9),
                          draft_ms=2.0, step_ms=30.0, pass_ms=18.0, fuse_ms=0.5, verify_ms=20.0, queue_ms=3.0)
    metrics.plan("code", outcome.plan)
    metrics.step(outcome)
    value = metrics.registry.get_sample_value
    assert value("specmesh_drafter_draft_tokens_total", {"drafter": "expert"}) == 3
    assert value("specmesh_drafter_accepted_tokens_total", {"drafter": "expert"}) == 2
    assert value("specmesh_drafter_accepted_tokens_total", {"drafter": "ngram"}) == 0
    assert [value("specmesh_drafter_position_attempts_total", {"drafter": "expert", "position": p}) for p in "123"] == [1, 1, 1]
    assert value("specmesh_drafter_position_hits_total", {"drafter": "expert", "position": "3"}) is None  # never hit there
    assert value("specmesh_committed_tokens_total") == 3 and value("specmesh_target_steps_total") == 1
    assert value("specmesh_routing_decisions_total", {"kind": "code", "drafter": "ngram"}) == 1
    # the timeline: drafting 1.5 + fusion 0.5, the verifier's queue 3 and its work 20 (the pass's 18 and a
    # prefill's 2), the rest transport; the stages add up to the step's 30 ms
    stages = {s: value("specmesh_step_stage_seconds_sum", {"stage": s}) * 1e3
              for s in ("draft", "fuse", "queue", "verify", "transport", "step")}
    assert stages == pytest.approx({"draft": 1.5, "fuse": 0.5, "queue": 3.0, "verify": 20.0, "transport": 5.0, "step": 30.0})
    assert sum(ms for s, ms in stages.items() if s != "step") == pytest.approx(stages["step"])


def test_a_plain_step_has_no_drafting_stages_and_an_unreported_pass_no_verifier_stages():
    metrics = VerifierMetrics()
    metrics.step(StepOutcome(StepPlan(), (), TokenTree(), (5,), step_ms=7.0, pass_ms=5.0, verify_ms=5.5, queue_ms=0.2))
    metrics.step(StepOutcome(StepPlan(), (), TokenTree(), (6,), step_ms=6.0))
    count = lambda stage: metrics.registry.get_sample_value("specmesh_step_stage_seconds_count", {"stage": stage})  # noqa: E731
    assert [count(s) for s in ("draft", "fuse", "queue", "verify", "transport", "step")] == [None, None, 1, 1, 1, 2]


def test_the_controllers_learned_state_is_exported_at_each_scrape():
    policy = adaptive_policy({"ngram": ["general"]})
    metrics = RouterMetrics()
    metrics.watch_policy(policy)
    value = metrics.registry.get_sample_value
    assert value("specmesh_controller_step_overhead_ms", {"load": "16"}) is None  # nothing learned yet
    for _ in range(20):  # read when scraped: what the controller learns later shows without a step counted here
        policy.controller.overhead.observe(20.0, requests=16)
        policy.controller.overhead.observe(52.0, requests=16, trees=16)
    assert value("specmesh_controller_step_overhead_ms", {"load": "16"}) == pytest.approx(20.0, abs=0.5)
    assert value("specmesh_controller_tree_overhead_ms", {"load": "16"}) == pytest.approx(2.0, abs=0.1)
    assert value("specmesh_controller_realism") == 1.0
    assert value("specmesh_controller_drafting_shares_cores") == 1.0  # no pass curve yet


def test_the_batch_arms_scores_are_exported_where_the_steps_run():
    now = [0.0]
    budget = BatchBudget((POLICY, 0), clock=lambda: now[0])
    metrics = VerifierMetrics()
    metrics.watch_policy(adaptive_policy({}), budget)
    value = metrics.registry.get_sample_value
    assert value("specmesh_controller_arm_tokens_per_second", {"load": "16", "kind": "mixed", "arm": "policy"}) is None
    for _ in range(WINDOW_STEPS + 1):  # one window of the policy's arm at 16 requests, 30 tokens a 10 ms step
        budget.arm(16)
        now[0] += 0.01
        budget.measured(30)
    assert value("specmesh_controller_arm_tokens_per_second", {"load": "16", "kind": "mixed", "arm": "policy"}) == pytest.approx(3000)
    assert value("specmesh_controller_arm_tokens_per_second", {"load": "16", "kind": "mixed", "arm": "0"}) is None


def test_an_answer_sent_whole_is_clocked_by_the_verifiers_times():
    """A unary answer reaches the router at its end: its first token came before that by the verifier's time
    from its first token to its last, and its tokens are spread over that time."""
    from specmesh.cluster.metrics import RequestClock

    metrics = RouterMetrics()
    value = metrics.registry.get_sample_value
    clock = RequestClock(metrics)
    clock.started -= 1.0  # admitted a second ago
    clock.answer_arrived(5, first_token_s=0.2, total_s=0.6)
    assert value("specmesh_generated_tokens_total") == 5
    assert value("specmesh_time_to_first_token_seconds_count") == 1
    assert value("specmesh_time_to_first_token_seconds_sum") == pytest.approx(0.6, abs=0.05)  # 1.0 - (0.6 - 0.2)
    assert value("specmesh_inter_token_seconds_count") == 4
    assert value("specmesh_inter_token_seconds_sum") == pytest.approx(0.4)


def test_metrics_are_served_over_http_and_a_bad_address_is_refused():
    metrics = RouterMetrics()
    metrics.generated.inc(7)
    endpoint = serve_metrics(metrics, "127.0.0.1:0")
    try:
        text = _scrape(endpoint.url)
    finally:
        endpoint.close()
    assert "specmesh_generated_tokens_total 7.0" in text and 'specmesh_build_info{service="router"' in text
    assert "process_cpu_seconds_total" in text
    assert serve_metrics(metrics, "") is None
    with pytest.raises(InvalidArgument, match="metrics_address"):
        serve_metrics(metrics, "localhost")


# ---- dashboards and rules as files ----


def test_dashboards_and_rules_are_what_the_generator_builds():
    generator = _generator()
    stale = [str(path) for path, text in generator.outputs().items() if not path.exists() or path.read_text() != text]
    assert not stale, f"run `python deploy/grafana/generate.py`: {stale} are out of date"


def test_each_dashboard_loads_as_a_grafana_dashboard():
    from grafana_foundation_sdk.models.dashboard import Dashboard

    files = sorted((GRAFANA / "dashboards").glob("*.json"))
    assert {f.stem for f in files} == {"overview", "speculation", "pipeline", "resources"}
    for file in files:
        data = json.loads(file.read_text())
        board = Dashboard.from_json(data)
        assert board.uid == f"specmesh-{file.stem}" and board.panels
        titles = [p["title"] for p in data["panels"]]
        assert len(titles) == len(set(titles)), f"{file.name}: two panels share a title"
        for panel in data["panels"]:
            assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
            assert panel["datasource"]["uid"] == "${datasource}"


def test_promtool_checks_and_unit_tests_the_rules():
    promtool = _tool("promtool")
    checked = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"{len(DERIVED) + len(ALERTS)} rules found" in checked.stdout
    tested = subprocess.run([promtool, "test", "rules", RULE_TESTS.name], capture_output=True, text=True, cwd=RULE_TESTS.parent)
    assert tested.returncode == 0, tested.stdout + tested.stderr


# ---- a real Prometheus scraping the real services ----


def _prometheus_config(tmp: Path, targets: dict[str, str]) -> Path:
    jobs = "\n".join(
        f"  - job_name: specmesh-{name}\n    metrics_path: /metrics\n    static_configs:\n"
        f"      - targets: ['{urllib.parse.urlsplit(url).netloc}']"
        for name, url in targets.items()
    )
    config = tmp / "prometheus.yml"
    config.write_text(f"global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {RULES}\n"
                      f"scrape_configs:\n{jobs}\n")
    return config


class Prometheus:
    def __init__(self, binary: str, config: Path, data: Path) -> None:
        self.port = free_port()
        self.log = open(data.parent / "prometheus.log", "wb")
        self.process = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={data}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        self.url = f"http://127.0.0.1:{self.port}"

    def api(self, path: str, **params) -> dict:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10) as answer:
            body = json.loads(answer.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list:
        return self.api("query", query=expr)["result"]

    def wait(self, what: str, check, timeout_s: float = 60.0):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                result = check()
                if result:
                    return result
            except (OSError, AssertionError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"Prometheus: {what} not seen within {timeout_s:.0f} s")
            time.sleep(0.5)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def _finite(result: list) -> list[float]:
    return [float(r["value"][1]) for r in result if math.isfinite(float(r["value"][1]))]


def _every_query_has_data(prometheus: Prometheus) -> None:
    generator = _generator()
    empty = []
    checked = 0
    for name in generator.DASHBOARDS:
        board = generator.dashboard(name)
        for title, expr in generator.panel_queries(board):
            checked += 1
            if not prometheus.query(expr.replace("$__rate_interval", WINDOW)):
                empty.append(f"{name} / {title}: {expr}")
    for record in DERIVED:
        if not prometheus.query(record):
            empty.append(f"recording rule {record}")
    for alert in ALERTS:
        if not prometheus.query(alert.quantity):
            empty.append(f"alert {alert.name}: {alert.quantity}")
    assert not empty, "no data for:\n" + "\n".join(empty)
    assert checked >= 30
    groups = prometheus.api("rules")["groups"]
    loaded = [rule for group in groups for rule in group["rules"]]
    assert len(loaded) == len(DERIVED) + len(ALERTS)
    assert all(rule["health"] == "ok" for rule in loaded), [r for r in loaded if r["health"] != "ok"]
    # the numbers mean something: tokens flowed, the history drafter got guesses accepted, errors counted
    assert _finite(prometheus.query(f"sum(increase(specmesh_generated_tokens_total[{WINDOW}]))"))[0] > 0
    assert max(_finite(prometheus.query("specmesh:drafter_acceptance:ratio"))) > 0
    assert _finite(prometheus.query("specmesh:mean_accepted_length:ratio"))[0] > 1.0
    assert _finite(prometheus.query('sum(specmesh_rpc_requests_total{code="INVALID_ARGUMENT"})'))[0] >= 1
    assert _finite(prometheus.query("max(specmesh_verifiers_alive)"))[0] == 1


@pytest.mark.slow  # a real Prometheus over a service stack, 8 s of traffic; the fast set keeps the rest of this file
def test_prometheus_scrapes_the_services_and_every_panel_and_rule_returns_data(redis_server, tokenizer, tmp_path):
    binary = _tool("prometheus")
    model = tiny_llama(vocab_size=len(tokenizer), layers=1, seed=5)
    chat = [("user", "Repeat after me: one two three one two three")]
    limits = GatewayLimits(max_tree_nodes=6, speculation="fixed")

    async def main():
        # the router's loop: on the verifiers' the per-drafter series come from their reports (issue 66, point 3)
        async with ServiceStack(redis_server.url, model, tokenizer, HistoryDrafter(min_n=1, max_n=3), limits,
                                metrics=True) as stack:
            prometheus = Prometheus(binary, _prometheus_config(tmp_path, stack.metrics_urls), tmp_path / "data")
            try:
                up = lambda: len([r for r in prometheus.query("up == 1")]) == len(stack.metrics_urls)  # noqa: E731
                await asyncio.to_thread(prometheus.wait, "every target up", up)
                before = "".join(_scrape(u) for u in stack.metrics_urls.values())  # the steps: the verifiers'
                async with AsyncClient(stack.address) as client:
                    started = time.monotonic()
                    while time.monotonic() - started < 8.0:  # long enough for rates over several scrapes
                        await client.generate(chat=chat, max_tokens=12)  # repeats: drafted from history
                        async for _ in client.stream(prompt="Count: 1 2 3 1 2 3", max_tokens=8):
                            pass
                        with pytest.raises(grpc.aio.AioRpcError) as refused:  # the error series get data too
                            await client.generate(chat=chat, max_tokens=1 << 20)
                        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                scrapes = {name: _scrape(u) for name, u in stack.metrics_urls.items()}
                after = "".join(scrapes.values())
                # the controller's state where the steps run, and nowhere else (a router's would never move)
                assert {n: "specmesh_controller_realism" in text for n, text in scrapes.items()} == \
                    {"router": False, "drafter": False, **{n: True for n in scrapes if n.startswith("verifier")}}
                await asyncio.to_thread(prometheus.wait, "recorded rules", lambda: prometheus.query(
                    "specmesh:drafter_acceptance:ratio"), 30.0)
                await asyncio.to_thread(_every_query_has_data, prometheus)  # while the services still answer
                return before, after
            finally:
                prometheus.stop()

    before, after = asyncio.run(main())

    # the speculation counters moved during the traffic
    def sample(text: str, name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))
    for name in ("specmesh_drafter_draft_tokens_total", "specmesh_drafter_accepted_tokens_total",
                 "specmesh_generated_tokens_total", "specmesh_target_steps_total"):
        assert sample(after, name) > sample(before, name), name
