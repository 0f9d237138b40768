"""Issue 66's fault must-shows with 16 streams in flight, on the embedded target (2 CPU cores).

Each fault strikes once all 16 streams have their first tokens; every answer is checked against plain
greedy decoding computed here. Scenarios:

- calm: 16 streams on a cluster of two verifiers, two routers, the code expert and prompt lookup;
- kill_verifier: kill -9 of the verifier holding more requests;
- kill_drafter: kill -9 of the code expert's drafter service;
- kill_router: kill -9 of the first router, the SDK given both;
- restart_redis: Redis killed (the supervisor starts it again, empty): each answer complete and right,
  or UNAVAILABLE;
- only_verifier_back_after_60s: a cluster of one verifier, unsupervised; kill -9, started again 60 s
  later (past the router's 12 s timeout);
- busy_start: a verifier started while 4 processes spin on the 2 cores, run once they have stopped:
  requests a pass against a verifier started on a quiet machine (the previous scenario's calm round).

Usage: python 2026-12-01-faults-16-streams.py OUT.json
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from specmesh.client import Client
from specmesh.cluster.control import call_verifier
from specmesh.cluster.launcher import ClusterSpec, LocalCluster
from specmesh.cluster.pipeline.messages import QueueSigner
from specmesh.prompts import encode_chat, mtbench_prompts
from specmesh.runtime.loading import EMBEDDED_DEFAULT, load_hf_model
from specmesh.runtime.target import target_runtime
from specmesh.sampling import SamplingParams
from specmesh.speculation.assembly import eos_token_ids
from specmesh.speculation.engine import Request, SpeculativeEngine

STREAMS = 16
MAX_TOKENS = 128
JOB_TIMEOUT_S = 12.0


def questions() -> list[str]:
    every = mtbench_prompts()
    return [q.text for q in every[:: len(every) // STREAMS][:STREAMS]]


def plain(texts: list[str]) -> list[list[int]]:
    target = load_hf_model(EMBEDDED_DEFAULT, dtype="float32", device="cpu")
    engine = SpeculativeEngine(target_runtime(target), [], max_tree_nodes=0, eos_token_ids=eos_token_ids(target))
    return [engine.generate([Request(tuple(encode_chat(target.tokenizer, t)), SamplingParams(max_tokens=MAX_TOKENS))])[0].token_ids
            for t in texts]


def batch_histogram(cluster: LocalCluster) -> dict[str, float]:
    """Passes by requests a pass (cumulative buckets), summed over the verifiers, with sum and count."""
    out: dict[str, float] = {}
    for v in cluster.verifiers:
        for family in v.metrics():
            for s in family.samples:
                if s.name.startswith("specmesh_verify_batch_requests"):
                    key = s.name.rsplit("_", 1)[-1] + (f"_le_{s.labels['le']}" if "le" in s.labels else "")
                    out[key] = out.get(key, 0.0) + s.value
    return out


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def run_streams(cluster: LocalCluster, texts, expected, strike=None, retries: int = 4) -> dict:
    """16 streams; ``strike()`` once each has its first tokens. The outcome of each, and whether right."""
    started = threading.Barrier(len(texts) + 1)

    def one(text):
        tokens, waited = [], False
        try:
            for chunk in client.stream(chat=[("user", text)], max_tokens=MAX_TOKENS):
                tokens += chunk.token_ids
                if not waited and tokens:
                    waited = True
                    started.wait(timeout=300)
            return "ok", tokens
        except grpc.RpcError as exc:
            if not waited:
                started.abort()
            return exc.code().name, exc.details()

    before = batch_histogram(cluster) if strike is None else {}  # a fault's victim takes its counts with it
    t0 = time.monotonic()
    with Client(cluster.router_addresses, retries=retries) as client, ThreadPoolExecutor(len(texts)) as pool:
        futures = [pool.submit(one, t) for t in texts]
        started.wait(timeout=300)
        struck_at = time.monotonic() - t0
        if strike is not None:
            strike()
        results = [f.result(timeout=600) for f in futures]
    took = time.monotonic() - t0
    outcomes = {}
    for (status, payload), want in zip(results, expected):
        key = "identical" if status == "ok" and payload == want else ("WRONG" if status == "ok" else status)
        outcomes[key] = outcomes.get(key, 0) + 1
    hist = delta(batch_histogram(cluster), before) if strike is None else {}
    return {"outcomes": outcomes, "seconds": round(took, 1), "struck_at_s": round(struck_at, 1),
            "passes": hist.get("count", 0), "requests_a_pass": round(hist["sum"] / hist["count"], 2) if hist.get("count") else None,
            "passes_with_more_than_8": hist.get("count", 0) - hist.get("bucket_le_8.0", 0),
            "passes_with_more_than_4": hist.get("count", 0) - hist.get("bucket_le_4.0", 0)}


def main(out_path: str) -> None:
    texts = questions()
    expected = plain(texts)
    report: dict = {"streams": STREAMS, "max_tokens": MAX_TOKENS}

    def save():
        with open(out_path, "w") as out:
            json.dump(report, out, indent=2)

    spec = ClusterSpec(drafters=("ngram", "code"), verifiers=2, routers=2, job_timeout_s=JOB_TIMEOUT_S, unresponsive_s=10.0)
    with LocalCluster(spec) as cluster:
        report["calm"] = run_streams(cluster, texts, expected)
        save()

        def kill_busier():
            signer = QueueSigner(cluster.queue_key)
            held = {v.name: call_verifier(v.address, "info", signer).get("active_sessions", 0) for v in cluster.verifiers}
            busiest = max(cluster.verifiers, key=lambda v: held[v.name])
            report["kill_verifier_held"] = held
            busiest.signal(signal.SIGKILL)

        scenarios = [("kill_verifier", kill_busier),
                     ("kill_drafter", lambda: next(d for d in cluster.drafters if d.name == "drafter-code").signal(signal.SIGKILL)),
                     ("kill_router", lambda: cluster.routers[0].signal(signal.SIGKILL)),
                     ("restart_redis", cluster.redis.stop)]
        for name, strike in scenarios:
            for p in [*cluster.processes(), cluster.redis]:  # the last fault's part is back
                deadline = time.monotonic() + 300
                while not p.alive() and time.monotonic() < deadline:
                    time.sleep(0.5)
            for p in cluster.processes():
                p.wait_ready(300)
            time.sleep(3)
            report[name] = run_streams(cluster, texts, expected, strike, retries=0 if name == "restart_redis" else 4)
            save()
        report["supervisor_events"] = list(cluster.events)

    spec = ClusterSpec(drafters=("ngram", "code"), verifiers=1, job_timeout_s=JOB_TIMEOUT_S, supervise=False)
    with LocalCluster(spec) as cluster:
        report["calm_one_verifier"] = run_streams(cluster, texts, expected)
        save()
        verifier = cluster.verifiers[0]

        def kill_and_back_later():
            verifier.signal(signal.SIGKILL)
            verifier.wait(10)

            def back():
                time.sleep(60)
                verifier.start()
            threading.Thread(target=back, daemon=True).start()

        report["only_verifier_back_after_60s"] = run_streams(cluster, texts, expected, kill_and_back_later)
        save()

    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(4)]
    try:
        cluster = LocalCluster(ClusterSpec(drafters=("ngram", "code"), verifiers=1, job_timeout_s=JOB_TIMEOUT_S)).start()
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    try:
        time.sleep(3)
        report["busy_start"] = run_streams(cluster, texts, expected)
        report["busy_start_second_round"] = run_streams(cluster, texts, expected)
    finally:
        cluster.stop()
    save()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main(sys.argv[1])
