"""A hostile probe: a burst of OpenAI streams against a `specmesh up` cluster, every one cancelled before
its first chunk (a long prompt each, so that they are still waiting when their clients leave). Prints,
as JSON, what the cluster held a second in, how long until nothing was held (requests in flight, KV
sessions, drafter sessions), whether generated tokens kept rising, and a request's latency before and
right after. Exits 1 unless everything was freed within ``--within`` seconds and nothing was generated
for nobody (issue 48's must-show: 64 streams, 2 s).

    python tests/soak/cancel_burst.py --streams 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from specmesh.cluster.launcher import ClusterSpec, LocalCluster, ServiceProcess  # noqa: E402


def total(process: ServiceProcess, sample: str) -> float:
    """The sum of the process's samples named ``sample`` (every label set), as it serves them now."""
    return sum(s.value for family in process.metrics() for s in family.samples if s.name == sample)


def held(cluster: LocalCluster) -> dict[str, float]:
    return {"in_flight": total(cluster.router, "specmesh_requests_in_flight"),
            "kv_sessions": sum(total(v, "specmesh_kv_sessions") for v in cluster.verifiers),
            "drafter_sessions": sum(total(d, "specmesh_drafter_sessions") for d in cluster.drafters),
            "generated": total(cluster.router, "specmesh_generated_tokens_total")}


async def probe(cluster: LocalCluster, streams: int, words: int, leave_after_s: float) -> dict:
    report: dict = {"streams": streams, "prompt_words": words, "left_after_s": leave_after_s}
    limits = httpx.Limits(max_connections=streams + 8)
    async with httpx.AsyncClient(base_url=cluster.http_url.removesuffix("/v1"), timeout=120, limits=limits) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        short = {"model": model, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8}

        async def latency() -> float:
            started = time.perf_counter()
            (await http.post("/v1/chat/completions", json=short)).raise_for_status()
            return round(time.perf_counter() - started, 3)

        report["latency_before_s"] = await latency()
        prompt = "Write code for: " + " ".join(f"word{i}" for i in range(words))
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 200, "stream": True}
        asking = [asyncio.ensure_future(http.post("/v1/chat/completions", json=body)) for _ in range(streams)]
        await asyncio.sleep(leave_after_s)
        report["answered_before_leaving"] = sum(a.done() for a in asking)
        report["held_when_leaving"] = held(cluster)
        for request in asking:
            request.cancel()
        await asyncio.gather(*asking, return_exceptions=True)
        left = time.perf_counter()
        kinds = ("in_flight", "kv_sessions", "drafter_sessions")
        freed: dict[str, float] = {}  # when each kind was last seen reaching 0
        while True:
            now = held(cluster)
            since = round(time.perf_counter() - left, 2)
            freed = {k: freed.get(k, since) for k in kinds if not now[k]}
            if len(freed) == len(kinds) or since > 60:
                break
            await asyncio.sleep(0.05)
        report["freed_after_s"] = round(time.perf_counter() - left, 2)
        report["each_freed_after_s"] = freed
        report["held_after"] = now
        await asyncio.sleep(3.0)
        report["generated_in_the_3_s_after"] = held(cluster)["generated"] - now["generated"]
        report["latency_after_s"] = await latency()
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=1500)
    parser.add_argument("--leave-after", type=float, default=1.0, help="seconds before the clients leave")
    parser.add_argument("--within", type=float, default=2.0, help="seconds everything must be freed in")
    args = parser.parse_args(argv)
    with LocalCluster(ClusterSpec()) as cluster:
        report = asyncio.run(probe(cluster, args.streams, args.prompt_words, args.leave_after))
    report["ok"] = report["freed_after_s"] <= args.within and report["generated_in_the_3_s_after"] == 0
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
