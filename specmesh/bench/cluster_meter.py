"""Where a cluster's time goes during a run: Redis commands, the routers' CPU, the verifiers' passes.

``ClusterMeter.reading()`` snapshots cumulative counters of the running cluster (Redis's commands
processed, each router process's CPU seconds, the verifiers' pass count, requests and busy seconds);
``per_token(before, after, tokens)`` turns two snapshots around a run into the run's costs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import redis

from specmesh.cluster.launcher import LocalCluster

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Reading:
    redis_commands: int
    router_cpu_s: float
    passes: float
    pass_requests: float
    pass_s: float


class ClusterMeter:
    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.redis = redis.Redis.from_url(cluster.redis_url)

    def reading(self) -> Reading:
        passes = requests = seconds = 0.0
        for verifier in self.cluster.verifiers:
            for family in verifier.metrics():
                for sample in family.samples:
                    if sample.name == "specmesh_verify_batch_requests_count":
                        passes += sample.value
                    elif sample.name == "specmesh_verify_batch_requests_sum":
                        requests += sample.value
                    elif sample.name == "specmesh_verify_pass_seconds_sum":
                        seconds += sample.value
        return Reading(int(self.redis.info("stats")["total_commands_processed"]),
                       sum(_cpu_s(router.popen.pid) for router in self.cluster.routers), passes, requests, seconds)

    def close(self) -> None:
        self.redis.close()


def per_token(before: Reading, after: Reading, tokens: int, wall_s: float) -> dict[str, float]:
    """The run's Redis commands and router CPU per token, requests per verifier pass, the mean pass and the
    time between passes (wall time not spent in one, per pass)."""
    passes = after.passes - before.passes
    tokens = max(tokens, 1)
    return {
        "redis_commands_per_token": round((after.redis_commands - before.redis_commands) / tokens, 3),
        "router_cpu_ms_per_token": round((after.router_cpu_s - before.router_cpu_s) * 1e3 / tokens, 3),
        "requests_per_pass": round((after.pass_requests - before.pass_requests) / passes, 2) if passes else 0.0,
        "pass_gap_ms": round(max(wall_s - (after.pass_s - before.pass_s), 0.0) * 1e3 / passes, 3)
        if passes else 0.0,
        "pass_ms": round((after.pass_s - before.pass_s) * 1e3 / passes, 3) if passes else 0.0,
    }


def _cpu_s(pid: int) -> float:
    """User and system CPU seconds of a process (0 where it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
