"""Short requests beside a ~1,400-token prefill vs alone: one run of the procedure of
tests/test_cluster.py::test_a_long_prompt_is_prefilled_between_short_requests_steps, recorded (2026-11-29).

The test's own pieces are imported from tests/ (its questions fixture, per_token_latency, metric_total,
MAX_TOKENS, its plain_outputs fixture for plain greedy decoding); nothing is asserted, everything the test
asserts on is written down: per request the per-token latency alone and beside the prefill, the test's
median ratio (sorted(beside)[2] / sorted(alone)[2] of the 4), the fraction of the short requests' time the
long prompt was still running, the router's re-sent jobs, and whether the outputs equal plain greedy's
(computed after the cluster is stopped, so that it does not run beside it).

Before it starts it reads /proc/loadavg and, while the 1-minute load is above --max-load, waits 60 s (at
most --max-wait-s), writing each reading down. The run is appended to --out's "runs".

    .venv/bin/python docs/experiments/data/2026-11-29-newcomers-beside-a-long-prefill.py \
        --out docs/experiments/data/2026-11-29-newcomers-beside-a-long-prefill.json   # once per run
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))

import conftest  # noqa: E402,F401  (the tests' environment: TRITON_INTERPRET, HF_HUB_OFFLINE, torch threads)
import test_cluster as tc  # noqa: E402

from specmesh.client import Client  # noqa: E402
from specmesh.cluster.launcher import ClusterSpec, LocalCluster  # noqa: E402

PACKAGES = ("specmesh", "torch", "numpy", "transformers", "redis", "grpcio", "protobuf", "gguf", "pytest")


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


def wait_for_load(max_load: float, max_wait_s: float) -> list[dict]:
    readings, deadline = [], time.monotonic() + max_wait_s
    while True:
        now = loadavg()
        readings.append({"at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                         "loadavg": now})
        if float(now.split()[0]) <= max_load or time.monotonic() >= deadline:
            return readings
        time.sleep(60)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def package_versions() -> dict:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def median(values: list[float]) -> float:
    """The test's median: the upper middle one of an even count."""
    return sorted(values)[len(values) // 2]


def one_run() -> dict:
    """The test's procedure, step for step (tests/test_cluster.py)."""
    questions = tc.questions.__wrapped__()
    long_text = " ".join(questions)  # ~1,400 tokens
    chosen = list(range(4))
    with tempfile.TemporaryDirectory(prefix="newcomers-") as logs:
        spec = ClusterSpec(drafters=("ngram",), verifiers=1, job_timeout_s=120, log_dir=Path(logs))
        with LocalCluster(spec) as cluster, Client(cluster.router_address) as client:
            client.generate(chat=[("user", questions[5])], max_tokens=8)  # warm-up
            with ThreadPoolExecutor(len(chosen)) as pool:
                alone = list(pool.map(lambda i: tc.per_token_latency(client, questions[i]), chosen))
            with ThreadPoolExecutor(len(chosen) + 1) as pool:
                long_started = time.monotonic()
                long = pool.submit(lambda: (client.generate(prompt=long_text, max_tokens=4), time.monotonic()))
                time.sleep(1.0)  # its prefill is under way (it takes several seconds)
                started = time.monotonic()
                beside = list(pool.map(lambda i: tc.per_token_latency(client, questions[i]), chosen))
                ended = time.monotonic()
                answer, answered = long.result(timeout=300)
            resent = tc.metric_total(cluster.router, "specmesh_resent_jobs_total")
            outputs = [client.generate(chat=[("user", questions[i])], max_tokens=tc.MAX_TOKENS).token_ids
                       for i in chosen]
    plain = tc.plain_outputs.__wrapped__([questions[i] for i in chosen])  # after the cluster: not beside it
    return {
        "requests": [{"question": i, "alone_s_per_token": round(a, 5), "beside_s_per_token": round(b, 5),
                      "ratio": round(b / a, 3), "output_tokens": len(out), "equals_plain_greedy": out == p}
                     for i, a, b, out, p in zip(chosen, alone, beside, outputs, plain)],
        "median_ratio": round(median(beside) / median(alone), 3),  # the test's figure (bound: < 2)
        "median_ratio_of_means_of_middle_two": round(statistics.median(beside) / statistics.median(alone), 3),
        "short_requests_s": round(ended - started, 3),
        "long_prompt_tokens": answer.usage.prompt_tokens,
        "long_answer_tokens": len(answer.token_ids),
        "long_answered_after_start_s": round(answered - long_started, 3),
        "long_ended_after_short_requests": answered > ended,
        "fraction_overlapped": round((min(answered, ended) - started) / (ended - started), 3),  # test: > 0.5
        "resent_jobs": resent,  # test: 0
        "outputs_equal_plain_greedy": outputs == plain,  # test: True
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file; this run is appended to its runs")
    parser.add_argument("--max-load", type=float, default=1.5, help="1-minute load to wait below")
    parser.add_argument("--max-wait-s", type=float, default=600)
    args = parser.parse_args()

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git("rev-parse", "HEAD"),
        "uncommitted_in_specmesh_or_tests": git("status", "--porcelain", "--", "specmesh", "tests").splitlines(),
        "nproc": os.cpu_count(),
        "machine": platform.machine(),
        "cpu": next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name")), None),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "packages": package_versions(),
        "redis_server": subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.strip(),
    }
    meta["load_checks"] = wait_for_load(args.max_load, args.max_wait_s)
    meta["loadavg_start"] = loadavg()
    meta["waited_out_the_load"] = float(meta["loadavg_start"].split()[0]) <= args.max_load
    wall = time.monotonic()
    result = one_run()
    meta["wall_s"] = round(time.monotonic() - wall, 1)
    meta["loadavg_end"] = loadavg()
    run = {**meta, **result}
    print(json.dumps({k: run[k] for k in ("median_ratio", "fraction_overlapped", "resent_jobs",
                                          "outputs_equal_plain_greedy", "loadavg_start", "loadavg_end")}))

    data = json.loads(args.out.read_text()) if args.out.exists() else {"method": __doc__, "runs": []}
    data["runs"].append(run)
    args.out.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
