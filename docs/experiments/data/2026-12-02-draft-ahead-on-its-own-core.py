"""Drafting ahead with the drafter on a core of its own: a local cluster (embedded target, the code expert
as a drafter service, fixed speculation up to 6 nodes; ``cores=1``: the verifier on one torch thread) with
the verifier pinned to core 0 and the drafter, router and Redis to core 1 (``taskset``), --draft-ahead off
and on in alternating rounds, a fresh cluster each; one request at a time (chat, 96 tokens), the four code
prompts of the tuning set (not judged by the bench).

    .venv/bin/python docs/experiments/data/2026-12-02-draft-ahead-on-its-own-core.py OUT.json
"""

import json
import subprocess
import sys
import time
from importlib.resources import files
from pathlib import Path

from specmesh.client import Client
from specmesh.cluster.launcher import ClusterSpec, LocalCluster

ROUNDS = 3
PROMPTS = [json.loads(line)["prompt"] for line in (files("specmesh.bench") / "tuning_prompts.jsonl").read_text().splitlines()
           if json.loads(line)["category"] == "code"]


def pin(pid: int, core: int) -> None:
    subprocess.run(["taskset", "-a", "-p", "-c", str(core), str(pid)], check=True, capture_output=True)


def measure(ahead: str) -> dict:
    spec = ClusterSpec(drafters=("code",), speculation="fixed", max_tree_nodes=6, http_port=None, cores=1,
                       extra_env={"SPECMESH_DRAFT_AHEAD": ahead}, log_dir=Path(f"/tmp/ahead-{ahead}"))
    with LocalCluster(spec).start() as cluster:
        pin(cluster.verifiers[0].popen.pid, 0)  # one torch thread (cores=1), core 0 alone
        for part in (*cluster.drafters, *cluster.routers):
            pin(part.popen.pid, 1)
        pin(cluster.redis.process.pid, 1)
        client = Client(cluster.router_address)
        client.generate(chat=[("user", "Say hello.")], max_tokens=16)  # warm
        tokens, seconds, ahead_steps, steps, accepted, draft_s, verify_s = 0, 0.0, 0, 0, 0, 0.0, 0.0
        for prompt in PROMPTS:
            started = time.perf_counter()
            answer = client.generate(chat=[("user", prompt)], max_tokens=96)
            seconds += time.perf_counter() - started
            tokens += len(answer.token_ids)
            ahead_steps += answer.stats.drafted_ahead
            steps += answer.stats.target_steps
            accepted += answer.stats.accepted_tokens
            draft_s += answer.stats.draft_ms / 1e3
            verify_s += answer.stats.verify_ms / 1e3
        return {"draft_ahead": ahead, "tokens_per_s": tokens / seconds, "tokens": tokens, "steps": steps,
                "drafted_ahead_steps": ahead_steps, "accepted_tokens": accepted,
                "draft_ms_per_step": draft_s * 1e3 / steps, "verify_ms_per_step": verify_s * 1e3 / steps}


def main() -> None:
    rounds = []
    for i in range(ROUNDS):
        for ahead in (("off", "on") if i % 2 == 0 else ("on", "off")):
            rounds.append(measure(ahead))
            print(rounds[-1], flush=True)
    json.dump({"rounds": rounds}, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
