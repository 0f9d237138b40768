"""`make soak`: the whole cluster on one machine (Redis behind a delaying proxy, two verifiers, every
shipped drafter, two routers; supervised as `specmesh up` does) under sustained mixed traffic from
locust, while faults arrive at random: kill -9 and SIGSTOP of verifiers and drafters, kill -9 of a
router, Redis restarted, the network to Redis slowed down. After each fault a probe measures when every
router serves again: a failure is excused only if its request was under way between the fault and that
recovery, and only by a fault that causes its status (a router's death: the HTTP requests sent to it;
SDK clients fail over and resume, so none of theirs). Writes a JSON report (default out/soak.json),
every excused failure listed with its fault, and exits 1 unless nothing hung, no output was wrong,
every failure is excused, memory grew < 10 %, the streams stayed short and, once the load is over, no
request, KV cache or drafter session is held any more.

    python tests/soak/run.py --duration 180          # what CI runs (make soak)
    python tests/soak/run.py --duration 1800         # the 30-minute run (docs/soak.md)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import psutil
import redis

sys.path.insert(0, str(Path(__file__).parent))
from proxy import DelayProxy  # noqa: E402
from report import (  # noqa: E402
    FINE, UNAVAILABLE, Fault, Sample, fit_test, overlaps, passes, sampling_passed, summarize,
)

from specmesh.bench.tune import TUNING_PROMPTS  # noqa: E402
from specmesh.client import AsyncClient, Client  # noqa: E402
from specmesh.cluster.drafter_sessions import DEFAULT_IDLE_S as DRAFTER_IDLE_S  # noqa: E402
from specmesh.cluster.launcher import DEFAULT_DRAFTERS, ClusterSpec, LocalCluster, ServiceProcess  # noqa: E402
from specmesh.cluster.redis_server import RedisServer  # noqa: E402
from specmesh.prompts import encode_chat, mtbench_prompts  # noqa: E402

JOB_TIMEOUT_S = 20.0  # the router's per-step limit
FAULT_KINDS = ("kill_verifier", "kill_drafter", "kill_router", "stop_verifier", "stop_drafter", "restart_redis",
               "delay_redis")
LENGTHS = (24, 64, 128, 256)  # the greedy answers' max_tokens, in turn over the prompts
ROUTER_DIED = ("HTTP_CONNECTION",)  # what a router's death does to the HTTP requests sent to it
SESSION_IDLE_S = DRAFTER_IDLE_S  # verifiers free a request's KV cache at its end (its router there or not)
FAULT_S = 20.0  # about how long a fault lasts, a restarted model process's loading included
QUIET_S = 20.0  # the load's last seconds are fault-free: the run ends on a calm cluster


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of load (default 180)")
    parser.add_argument("--users", type=int, default=6, help="concurrent clients (default 6)")
    parser.add_argument("--verifiers", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=256, help="the longest greedy answer (default 256)")
    parser.add_argument("--fault-every", type=float, default=None,
                        help="mean seconds between faults (default: every kind once in a 3-minute run, at most 30)")
    parser.add_argument("--seed", type=int, default=0, help="the faults' random order and timing")
    parser.add_argument("--sampling-draws", type=int, default=200,
                        help="speculative answers per prompt for the sampling check (default 200)")
    parser.add_argument("--out", default="out/soak.json")
    parser.add_argument("--log-dir", default="out/soak-logs")
    return parser


def soak_prompts(per_category: int = 2) -> list[tuple[str, str]]:
    """(category, prompt): ``per_category`` held-out prompts of each category of the tuning prompts (what
    the experts are for), and as many chat questions of MT-Bench."""
    lines = [json.loads(line) for line in TUNING_PROMPTS.read_text().splitlines() if line.strip()]
    chosen = [(c, [x["prompt"] for x in lines if x["category"] == c][:per_category])
              for c in sorted({x["category"] for x in lines})]
    every = mtbench_prompts()
    chosen.append(("chat", [q.text for q in every[3 :: len(every) // per_category][:per_category]]))
    return [(category, text) for category, texts in chosen for text in texts]


def references(max_tokens: int, temperature: float, draws: int, sampled_tokens: int = 24, answer_tokens: int = 4,
               min_count: int = 5) -> dict:
    """Computed in this process, never through the cluster. Greedy: plain decoding, each prompt with its own
    length (``LENGTHS`` in turn, at most ``max_tokens``). Seeded sampling without speculation: plain
    sampling with the same seed (each position's draw depends only on the seed and the position, so the
    cluster's answer must be this one whatever batch, verifier or fault it meets). Speculative sampling:
    the exact distribution of whole ``answer_tokens``-token answers, each answer expected ``min_count``
    times or more in ``draws``, for the two prompts where those answers cover the most probability."""
    from reference import answer_distributions

    from specmesh.runtime.loading import EMBEDDED_DEFAULT, load_hf_model
    from specmesh.runtime.target import target_runtime
    from specmesh.sampling import SamplingParams
    from specmesh.speculation.assembly import eos_token_ids
    from specmesh.speculation.engine import Request, SpeculativeEngine

    cases = soak_prompts()
    target = load_hf_model(EMBEDDED_DEFAULT, dtype="float32", device="cpu")
    runtime, eos = target_runtime(target), eos_token_ids(target)
    engine = SpeculativeEngine(runtime, [], max_tree_nodes=0, eos_token_ids=eos)
    prompts = [tuple(encode_chat(target.tokenizer, text)) for _, text in cases]
    greedy = []
    for i, ((category, text), prompt) in enumerate(zip(cases, prompts)):
        length = min(LENGTHS[i % len(LENGTHS)], max_tokens)
        (out,) = engine.generate([Request(prompt, SamplingParams(max_tokens=length))])
        greedy.append({"category": category, "prompt": text, "max_tokens": length, "tokens": out.token_ids,
                       "text": target.tokenizer.decode(out.token_ids, skip_special_tokens=True)})
    seeded = engine.generate([Request(prompt, SamplingParams(temperature=temperature, seed=1000 + i,
                                                             max_tokens=sampled_tokens))
                              for i, prompt in enumerate(prompts)])
    sampled = [{"prompt": text, "seed": 1000 + i, "tokens": out.token_ids}
               for i, ((_, text), out) in enumerate(zip(cases, seeded))]
    exact = answer_distributions(runtime, prompts, SamplingParams(temperature=temperature, max_tokens=answer_tokens),
                                 min_count / draws, eos)
    chosen = sorted(range(len(cases)), key=lambda i: -sum(exact[i].values()))[:2]
    return {"model": target.name, "sampled_max_tokens": sampled_tokens, "temperature": temperature,
            "greedy": greedy, "sampled": sampled,
            "distribution": {"prompts": [cases[i][1] for i in chosen], "max_tokens": answer_tokens,
                             "min_count": min_count,
                             "answers": [[[list(a), p] for a, p in exact[i].items()] for i in chosen]}}


CONFIRM_DRAWS = 3  # a failed test's fresh sample, in multiples of ``draws``


def sampling_check(cluster: LocalCluster, refs: dict, requests: list[dict], draws: int) -> dict:
    """Speculative sampling judged by whole answers: each distribution prompt's speculative answers (the
    load's, topped up to ``draws`` on the calm cluster, speculating every step) against the exact
    distribution computed in process (``references``), by Pearson's chi-square goodness of fit at 1 %
    overall (Bonferroni), each test's power stated as the shift it finds 80 % of the time. A test that
    fails is run again on ``CONFIRM_DRAWS`` times as many fresh answers, and the prompt fails only if that
    one fails too: a chance failure (1 run in 100) then comes 1 in 10,000, while a shift the first test
    finds 80 % of the time the larger second one finds nearly always. Speculation must have happened:
    drafted tokens were accepted."""
    spec = refs["distribution"]
    prompts, max_tokens, temperature = spec["prompts"], spec["max_tokens"], refs["temperature"]
    loaded = [r for r in requests if r["kind"] == "grpc_sampling" and r["status"] == "OK"]
    speculative = [[(r["tokens"], r["accepted"]) for r in loaded if r["prompt_index"] == i]
                   for i in range(len(prompts))]
    speculative = [answers + drawn for answers, drawn in
                   zip(speculative, calm_draws(cluster, prompts, max_tokens, temperature,
                                               [max(draws - len(a), 0) for a in speculative]))]
    alpha = 0.01 / len(prompts)
    tests = []
    for i, answers in enumerate(spec["answers"]):
        exact = {tuple(a): p for a, p in answers}
        test = fit_test(speculative[i], exact, alpha, spec["min_count"])
        if not passes(test, alpha):
            (fresh,) = calm_draws(cluster, [prompts[i]], max_tokens, temperature, [CONFIRM_DRAWS * draws])
            test["confirmation"] = fit_test(fresh, exact, alpha, spec["min_count"])
        tests.append({"prompt": i, **test})
    return {"alpha_each": alpha, "from_load": len(loaded), "tests": tests,
            "passed": sampling_passed(tests, alpha)}


def calm_draws(cluster: LocalCluster, prompts: list[str], max_tokens: int, temperature: float,
               counts: list[int]) -> list[list[tuple[list[int], int]]]:
    """``counts[i]`` speculative answers (tokens, drafted tokens accepted) to each prompt, 16 at a time."""

    async def draw(client, gate, prompt: str) -> tuple[list[int], int]:
        async with gate:
            answer = await client.generate(chat=[("user", prompt)], max_tokens=max_tokens, temperature=temperature,
                                           speculation="fixed")
            return list(answer.token_ids), answer.stats.accepted_tokens

    async def every():
        gate = asyncio.Semaphore(16)
        async with AsyncClient(cluster.router_addresses, api_key=cluster.client_key) as client:
            return [await asyncio.gather(*(draw(client, gate, p) for _ in range(n))) for p, n in zip(prompts, counts)]

    return asyncio.run(every())


def recovery(cluster: LocalCluster, timeout_s: float = 120.0) -> float:
    """When every router answers a short plain request again (unix time; the timeout's end if never)."""
    deadline = time.monotonic() + timeout_s
    for address in cluster.router_addresses:
        with Client(address, timeout_s=10.0, retries=0) as client:
            while time.monotonic() < deadline:
                try:
                    client.generate(prompt_ids=[5, 6, 7], max_tokens=2, speculation="off")
                    break
                except grpc.RpcError:
                    time.sleep(0.5)
    return time.time()


class Injector(threading.Thread):
    """Faults at random times (gaps of 0.5 to 1.5 ``every_s`` after the last one is over), every kind in
    turn in a shuffled order, none after ``until`` (the run ends on a calm cluster)."""

    def __init__(self, cluster: LocalCluster, redis_server: RedisServer, proxy: DelayProxy, rng: random.Random,
                 until: float, every_s: float) -> None:
        super().__init__(name="faults", daemon=True)
        self.cluster, self.redis_server, self.proxy, self.rng = cluster, redis_server, proxy, rng
        self.until, self.every_s = until, every_s
        self.faults: list[Fault] = []
        self.stop = threading.Event()

    def run(self) -> None:
        order: list[str] = []
        while True:
            if not order:
                order = self.rng.sample(FAULT_KINDS, len(FAULT_KINDS))
            # the round's faults must fit before ``until``: the gaps shrink when time is short
            room = self.until - time.time() - FAULT_S * len(order)
            if self.stop.wait(min(self.rng.uniform(0.5, 1.5) * self.every_s, max(room / len(order), 2.0))):
                return
            if time.time() >= self.until:
                return
            kind = order.pop()
            try:
                fault = getattr(self, kind)()
            except Exception as exc:  # the harness's own trouble: said, and the run goes on
                print(f"soak: fault {kind} could not be made: {exc}", flush=True)
                continue
            fault.recovered = recovery(self.cluster)
            self.faults.append(fault)
            print(f"soak: {fault.kind} {fault.target} ({fault.end - fault.start:.1f} s, served again after "
                  f"{fault.recovered - fault.start:.1f} s)", flush=True)

    def _victim(self, processes: list[ServiceProcess]) -> ServiceProcess:
        return self.rng.choice([p for p in processes if p.alive()])

    def _kill(self, kind: str, victim: ServiceProcess) -> Fault:
        started, killed = time.time(), victim.popen
        victim.signal(signal.SIGKILL)
        deadline = time.monotonic() + 300
        while victim.popen is killed and time.monotonic() < deadline:  # the supervisor starts it again
            time.sleep(0.1)
        victim.wait_ready(300)
        return Fault(kind, victim.name, started, time.time())

    def kill_verifier(self) -> Fault:
        return self._kill("kill_verifier", self._victim(self.cluster.verifiers))

    def kill_drafter(self) -> Fault:
        return self._kill("kill_drafter", self._victim(self.cluster.drafters))

    def kill_router(self) -> Fault:  # SDK clients fail over and resume; HTTP clients sent to it get an error
        victim = self._victim(self.cluster.routers)
        fault = self._kill("kill_router", victim)
        fault.explains, fault.via = ROUTER_DIED, http_base(self.cluster, victim)
        return fault

    def _pause(self, kind: str, victim: ServiceProcess, seconds: float) -> Fault:
        started = time.time()
        victim.signal(signal.SIGSTOP)
        time.sleep(seconds)
        victim.signal(signal.SIGCONT)
        return Fault(kind, victim.name, started, time.time())

    def stop_verifier(self) -> Fault:  # past the heartbeat's 3 s: the other verifier takes its jobs over
        return self._pause("stop_verifier", self._victim(self.cluster.verifiers), 5.0)

    def stop_drafter(self) -> Fault:  # past the drafter timeout: steps go on without it
        return self._pause("stop_drafter", self._victim(self.cluster.drafters), 4.0)

    def restart_redis(self) -> Fault:  # empty when back: what was queued is posted again by the routers
        started = time.time()
        self.redis_server.process.kill()
        self.redis_server.process.wait()
        time.sleep(2.0)
        self.redis_server.start()
        return Fault("restart_redis", "redis", started, time.time(), UNAVAILABLE)

    def delay_redis(self) -> Fault:
        started = time.time()
        self.proxy.delay_s = self.rng.choice((0.02, 0.05, 0.1))
        time.sleep(8.0)
        delay, self.proxy.delay_s = self.proxy.delay_s, 0.0
        return Fault("delay_redis", f"{delay * 1e3:.0f} ms", started, time.time())


class Sampler(threading.Thread):
    """Every few seconds: each process's RSS, Redis's memory, and the length of every stream."""

    def __init__(self, cluster: LocalCluster, redis_server: RedisServer, every_s: float = 3.0) -> None:
        super().__init__(name="sampler", daemon=True)
        self.cluster, self.redis_server, self.every_s = cluster, redis_server, every_s
        self.samples: list[Sample] = []
        self.stop = threading.Event()

    def run(self) -> None:
        client = redis.Redis(port=self.redis_server.port, socket_timeout=2)
        while not self.stop.wait(self.every_s):
            rss = {}
            for process in self.cluster.processes():
                try:
                    rss[process.name] = psutil.Process(process.popen.pid).memory_info().rss
                except (psutil.Error, AttributeError):
                    pass
            try:
                used = int(client.info("memory")["used_memory"])
                streams = {key.decode(): client.xlen(key) for key in client.scan_iter("specmesh:*", _type="stream")}
            except redis.RedisError:
                continue  # Redis is being restarted: no sample
            self.samples.append(Sample(time.time(), rss, used, streams))


HELD = {"specmesh_requests_in_flight": "requests_in_flight", "specmesh_kv_sessions": "kv_sessions",
        "specmesh_drafter_sessions": "drafter_sessions"}  # what must be back to 0 once the load is over


def counters(cluster: LocalCluster) -> dict[str, float]:
    """What the services counted (since each last started): the verifiers' requests' passes by outcome, worker
    errors; and what they hold now (``HELD``)."""
    totals: dict[str, float] = dict.fromkeys(HELD.values(), 0.0)
    for process in cluster.processes():
        try:
            families = process.metrics()
        except OSError:
            continue
        for family in families:
            for sample in family.samples:
                if sample.name == "specmesh_verify_jobs_total":
                    key = f"verifier_jobs_{sample.labels['outcome']}"
                elif sample.name == "specmesh_verifier_worker_errors_total":
                    key = "worker_errors"
                elif sample.name in HELD:
                    key = HELD[sample.name]
                else:
                    continue
                totals[key] = totals.get(key, 0) + sample.value
    return totals


def settled(cluster: LocalCluster, last_fault_end: float, timeout_s: float = 30.0) -> dict[str, float]:
    """``counters`` once nothing is held any more, or at the timeout: 30 s (closes are served within a second
    or so), and at least the drafter sessions' idle limit after the last fault (a killed verifier closes
    nothing: the drafter sessions it had opened are freed once idle that long)."""
    deadline = time.monotonic() + max(timeout_s, last_fault_end + SESSION_IDLE_S + timeout_s - time.time())
    while True:
        found = counters(cluster)
        if not any(found[key] for key in HELD.values()) or time.monotonic() >= deadline:
            return found
        time.sleep(1.0)


def http_base(cluster: LocalCluster, router: ServiceProcess) -> str:
    """A router's HTTP API, as the locustfile addresses it."""
    return cluster.http_urls[cluster.routers.index(router)].removesuffix("/v1")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    rng = random.Random(args.seed)
    log_dir, out = Path(args.log_dir), Path(args.out)
    log_dir.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    redis_server = RedisServer(log_path=log_dir / "redis.log").start()
    proxy = DelayProxy(redis_server.port).start()
    spec = ClusterSpec(drafters=DEFAULT_DRAFTERS, verifiers=args.verifiers, routers=2, job_timeout_s=JOB_TIMEOUT_S,
                       redis_url=f"redis://127.0.0.1:{proxy.port}/0", log_dir=log_dir)
    cluster = LocalCluster(spec)
    try:
        print("soak: starting the cluster ...", flush=True)
        cluster.start()
        print("soak: references (in process: plain greedy, seeded sampling, whole answers' distribution) ...", flush=True)
        refs = references(max_tokens=args.max_tokens, temperature=0.8, draws=args.sampling_draws)
        (log_dir / "references.json").write_text(json.dumps(refs))
        results = log_dir / "requests.jsonl"
        results.write_text("")
        env = {**os.environ, "SOAK_REFERENCES": str(log_dir / "references.json"), "SOAK_RESULTS": str(results),
               "SOAK_ROUTER": ",".join(cluster.router_addresses),
               "SOAK_HTTP": ",".join(http_base(cluster, r) for r in cluster.routers)}
        started = time.time()
        sampler = Sampler(cluster, redis_server)
        # the faults themselves take ~90 s a round (two restarts of a model process among them)
        every_s = args.fault_every or min(30.0, max(5.0, (args.duration - 90) / len(FAULT_KINDS)))
        injector = Injector(cluster, redis_server, proxy, rng, until=started + args.duration - QUIET_S, every_s=every_s)
        with open(log_dir / "locust.log", "w") as locust_log:
            locust = subprocess.Popen(
                [sys.executable, "-m", "locust", "-f", str(Path(__file__).parent / "locustfile.py"), "--headless",
                 "--users", str(args.users), "--spawn-rate", str(args.users), "--run-time", f"{args.duration:.0f}s",
                 "--stop-timeout", "150", "--only-summary", "--exit-code-on-error", "0", "--loglevel", "WARNING"],
                env=env, stdout=locust_log, stderr=subprocess.STDOUT)
            sampler.start()
            injector.start()
            print(f"soak: {args.users} clients for {args.duration:.0f} s, a fault every ~{every_s:.0f} s "
                  f"(logs: {log_dir})", flush=True)
            locust.wait(timeout=args.duration + 300)
        ended = time.time()
        injector.stop.set()
        injector.join()
        sampler.stop.set()
        sampler.join()
        requests = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
        report = summarize(requests, injector.faults, sampler.samples, started, ended)
        kills = [f for f in injector.faults if f.kind == "kill_router"]
        report["sdk_requests_lost_to_router_kills"] = sum(
            r["api"] == "grpc" and r["status"] not in FINE and any(overlaps(r, f) for f in kills) for r in requests)
        report["restarts"] = cluster.supervisor.restarts if cluster.supervisor else {}
        print("soak: speculative sampling's whole answers against the in-process reference ...", flush=True)
        report["sampling"] = sampling_check(cluster, refs, requests, args.sampling_draws)
        report["passed"] = report["passed"] and report["sampling"]["passed"]
        report["counters"] = settled(cluster, max((f.end for f in injector.faults), default=0.0))
        report["held_at_end"] = {key: report["counters"][key] for key in HELD.values()}
        report["passed"] = report["passed"] and not any(report["held_at_end"].values())
        out.write_text(json.dumps(report, indent=2))
    finally:
        cluster.stop()
        proxy.stop()
        redis_server.stop()
    print(json.dumps({k: report[k] for k in ("sent", "completed", "failed", "hung", "wrong_outputs", "checked_outputs",
                                              "unexplained_failures", "sdk_requests_lost_to_router_kills", "memory_growth_fraction", "longest_stream",
                                              "latency_s", "restarts", "counters", "held_at_end", "passed")}, indent=1))
    for test in report["sampling"]["tests"]:
        for label, run in (("", test), (", fresh answers", test.get("confirmation"))):
            if run is not None:
                print(f"soak: sampling, prompt {test['prompt']}{label}: p = {run['p_value']:.3f} ({run['answers']} "
                      f"whole answers in {run['bins']} bins, {run['accepted_drafted_tokens']} drafted tokens accepted; "
                      f"finds a shift of {run['detectable_shift'] or 0:.2f} 80 % of the time)", flush=True)
    print(f"soak: {'passed' if report['passed'] else 'FAILED'}; the report is {out}", flush=True)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
