"""The soak's verdict from what was recorded: each request's outcome (the locustfile's lines), the faults
injected (when, and which failure statuses each explains), and the resource samples.

Pure functions: tests/test_soak.py checks them on hand-made records.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from statistics import median
from typing import Sequence

FINE = ("OK", "EXPECTED", "CANCELLED_BY_CLIENT")  # answered, refused as it should be, or left by its client
UNAVAILABLE = ("UNAVAILABLE", "HTTP_503", "STREAM_service_unavailable")
MAX_MEMORY_GROWTH = 0.10  # between the first and the last fifth of the run
MAX_STREAM_ENTRIES = 1_000  # the jobs stream and every results stream stay below this throughout


@dataclass
class Fault:
    kind: str  # kill_verifier, kill_drafter, stop_verifier, stop_drafter, restart_redis, delay_redis
    target: str
    start: float  # unix time
    end: float  # when it was over: the process back and ready, resumed, Redis back, the delay lifted
    explains: tuple[str, ...] = ()  # failure statuses it may cause (with 2 verifiers a verifier's death causes none)


@dataclass
class Sample:
    at: float
    rss: dict[str, int]  # process name -> resident bytes
    redis_bytes: int
    streams: dict[str, int] = field(default_factory=dict)  # stream key -> entries


def overlaps(request: dict, fault: Fault, grace_s: float) -> bool:
    return request["start"] <= fault.end + grace_s and request["end"] >= fault.start


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def memory_growth(samples: Sequence[Sample]) -> float | None:
    """Growth of the cluster's memory (every process's RSS plus Redis's) from the first fifth of the samples
    to the last fifth, as a fraction (None: too few samples)."""
    if len(samples) < 10:
        return None
    totals = [sum(s.rss.values()) + s.redis_bytes for s in samples]
    fifth = len(totals) // 5
    first, last = median(totals[:fifth]), median(totals[-fifth:])
    return last / first - 1


def summarize(requests: Sequence[dict], faults: Sequence[Fault], samples: Sequence[Sample], started: float,
              ended: float, grace_s: float) -> dict:
    """The report: ``sent``, ``completed``, ``failed`` by status, ``hung``, ``wrong_outputs``,
    ``unexplained_failures`` (failures no overlapping fault explains), ``memory_growth_fraction``, latency
    percentiles with and without faults, streams and memory, and ``passed``."""
    failed = [r for r in requests if r["status"] not in FINE]
    unexplained = [r for r in failed if r["status"] != "HUNG" and not any(
        r["status"] in f.explains and overlaps(r, f, grace_s) for f in faults)]
    answered = [r for r in requests if r["status"] == "OK"]
    during = [r["end"] - r["start"] for r in answered if any(overlaps(r, f, 0.0) for f in faults)]
    calm = [r["end"] - r["start"] for r in answered if not any(overlaps(r, f, 0.0) for f in faults)]
    growth = memory_growth(samples)
    longest = max((n for s in samples for n in s.streams.values()), default=0)
    report = {
        "duration_s": round(ended - started, 1),
        "sent": len(requests),
        "completed": len(answered),
        "failed": dict(Counter(r["status"] for r in failed)),
        "hung": sum(r["status"] == "HUNG" for r in requests),
        "wrong_outputs": sum(r["check"] == "wrong" for r in requests),
        "checked_outputs": sum(r["check"] == "ok" for r in requests),
        "unexplained_failures": len(unexplained),
        "unexplained": [{k: r[k] for k in ("kind", "status", "start", "end")} for r in unexplained[:20]],
        "outcomes_by_kind": {kind: dict(Counter(r["status"] for r in requests if r["kind"] == kind))
                             for kind in sorted({r["kind"] for r in requests})},
        "latency_s": {
            "without_faults": {"p50": percentile(calm, 0.5), "p99": percentile(calm, 0.99), "requests": len(calm)},
            "with_faults": {"p50": percentile(during, 0.5), "p99": percentile(during, 0.99), "requests": len(during)},
        },
        "faults": [asdict(f) for f in faults],
        "memory_growth_fraction": growth,
        "memory": {"start": asdict(samples[0]) if samples else None, "end": asdict(samples[-1]) if samples else None},
        "longest_stream": longest,
        "streams_at_end": samples[-1].streams if samples else {},
    }
    report["passed"] = bool(
        requests and report["hung"] == 0 and report["wrong_outputs"] == 0 and report["unexplained_failures"] == 0
        and growth is not None and growth < MAX_MEMORY_GROWTH and longest < MAX_STREAM_ENTRIES)
    return report
