"""The soak's verdict from what was recorded: each request's outcome (the locustfile's lines), the faults
injected (when, and which failure statuses each explains), and the resource samples.

Pure functions: tests/test_soak.py checks them on hand-made records.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from statistics import median
from typing import Sequence

from scipy.stats import chi2, chisquare, ncx2

FINE = ("OK", "EXPECTED", "CANCELLED_BY_CLIENT")  # answered, refused as it should be, or left by its client
UNAVAILABLE = ("UNAVAILABLE", "HTTP_503", "STREAM_service_unavailable")
MAX_MEMORY_GROWTH = 0.10  # between the first and the last fifth of the run
MAX_STREAM_ENTRIES = 1_000  # the jobs stream and every results stream stay below this throughout


@dataclass
class Fault:
    kind: str  # kill_verifier, kill_drafter, kill_router, stop_verifier, stop_drafter, restart_redis, delay_redis
    target: str
    start: float  # unix time
    end: float  # when it was over: the process back and ready, resumed, Redis back, the delay lifted
    explains: tuple[str, ...] = ()  # failure statuses it may cause (with 2 verifiers a verifier's death causes none)
    recovered: float | None = None  # when every router served a request again after it (None: at ``end``)
    via: str = ""  # a killed router's HTTP address: only requests sent there are its to explain

    def explains_request(self, request: dict) -> bool:
        """Whether this fault accounts for the request's failure: a status it causes, on its path, and the
        request under way between the fault's start and the cluster's measured recovery."""
        until = self.recovered if self.recovered is not None else self.end
        return (request["status"] in self.explains and request["start"] <= until and request["end"] >= self.start
                and (not self.via or request.get("via") == self.via))


@dataclass
class Sample:
    at: float
    rss: dict[str, int]  # process name -> resident bytes
    redis_bytes: int
    streams: dict[str, int] = field(default_factory=dict)  # stream key -> entries


def overlaps(request: dict, fault: Fault) -> bool:
    return request["start"] <= fault.end and request["end"] >= fault.start


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


def fit_bins(answers: Sequence[tuple], exact: dict[tuple, float], min_count: int = 5) -> tuple[list[int], list[float]]:
    """(observed counts, probabilities) per bin: each answer of ``exact`` expected at least ``min_count``
    times among these, and one bin of every other answer (what is left of the probability), pooled into
    the least likely bin when it is expected fewer times (a chi-square test needs expected counts of ~5)."""
    n = len(answers)
    kept = sorted((a for a, p in exact.items() if n * p >= min_count), key=exact.__getitem__, reverse=True)
    seen = Counter(answers)
    observed, probs = [seen[a] for a in kept], [exact[a] for a in kept]
    rest_count, rest_p = n - sum(observed), max(1.0 - sum(probs), 0.0)
    if observed and n * rest_p < min_count:
        observed[-1], probs[-1] = observed[-1] + rest_count, probs[-1] + rest_p
    else:
        observed, probs = observed + [rest_count], probs + [rest_p]
    return observed, probs


def goodness_of_fit(answers: Sequence[tuple], exact: dict[tuple, float], min_count: int = 5) -> tuple[float, int]:
    """Pearson's chi-square test that whole answers were drawn from ``exact`` (answer -> probability, the
    likeliest answers of the reference), over ``fit_bins``: (p-value, degrees of freedom); (1.0, 0) when
    there is one bin."""
    observed, probs = fit_bins(answers, exact, min_count)
    if len(observed) < 2:
        return 1.0, 0
    n = sum(observed)
    expected = [n * p / sum(probs) for p in probs]
    return float(chisquare(observed, expected).pvalue), len(observed) - 1


def detectable_shift(answers: Sequence[tuple], exact: dict[tuple, float], alpha: float, power: float = 0.8,
                     min_count: int = 5) -> float | None:
    """The test's power, stated as the smallest probability mass moved off the likeliest bin (onto the
    others in proportion: a total-variation distance) that ``goodness_of_fit`` finds at level ``alpha``
    with probability ``power`` at this many answers (noncentral chi-square). None: one bin, or no shift found."""
    observed, probs = fit_bins(answers, exact, min_count)
    if len(observed) < 2:
        return None
    n, total = sum(observed), sum(probs)
    probs = [p / total for p in probs]
    top = max(range(len(probs)), key=probs.__getitem__)
    dof = len(probs) - 1
    critical = chi2.ppf(1 - alpha, dof)

    def found(shift: float) -> float:
        moved = [p * (1 + shift / (1 - probs[top])) for p in probs]
        moved[top] = probs[top] - shift
        noncentrality = n * sum((q - p) ** 2 / p for p, q in zip(probs, moved) if p > 0)
        return 1 - ncx2.cdf(critical, dof, noncentrality)

    low, high = 0.0, probs[top]
    if found(high) < power:
        return None
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if found(middle) < power else (low, middle)
    return high


def summarize(requests: Sequence[dict], faults: Sequence[Fault], samples: Sequence[Sample], started: float,
              ended: float) -> dict:
    """The report: ``sent``, ``completed``, ``failed`` by status, ``hung``, ``wrong_outputs``,
    ``explained`` (each failure a fault accounts for, with the fault), ``unexplained_failures`` (the rest),
    ``memory_growth_fraction``, latency percentiles with and without faults, streams and memory, and
    ``passed``."""
    failed = [r for r in requests if r["status"] not in FINE]
    explained, unexplained = [], []
    for r in failed:
        if r["status"] == "HUNG":  # counted apart: nothing excuses it
            continue
        fault = next((f for f in faults if f.explains_request(r)), None)
        if fault is None:
            unexplained.append(r)
        else:
            explained.append({**{k: r[k] for k in ("kind", "status", "start", "end")}, "fault": fault.kind,
                              "fault_target": fault.target, "fault_start": fault.start,
                              "fault_recovered": fault.recovered if fault.recovered is not None else fault.end})
    answered = [r for r in requests if r["status"] == "OK"]
    during = [r["end"] - r["start"] for r in answered if any(overlaps(r, f) for f in faults)]
    calm = [r["end"] - r["start"] for r in answered if not any(overlaps(r, f) for f in faults)]
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
        "explained": explained,
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


def fit_test(answers: Sequence[tuple[list[int], int]], exact: dict[tuple, float], alpha: float, min_count: int = 5) -> dict:
    """One goodness-of-fit test of speculative answers, (tokens, drafted tokens accepted) each, as the report
    states it."""
    whole = [tuple(tokens) for tokens, _ in answers]
    p_value, dof = goodness_of_fit(whole, exact, min_count)
    return {"answers": len(whole), "bins": dof + 1, "p_value": p_value,
            "accepted_drafted_tokens": sum(accepted for _, accepted in answers),
            "likeliest_answers_mass": sum(p for a, p in exact.items() if len(whole) * p >= min_count),
            "detectable_shift": detectable_shift(whole, exact, alpha, min_count=min_count)}


def passes(test: dict | None, alpha: float) -> bool:
    """Whether a test found nothing at ``alpha``, over two bins or more, and judged speculative answers."""
    return test is not None and test["p_value"] >= alpha and test["bins"] >= 2 and test["accepted_drafted_tokens"] > 0


def sampling_passed(tests: Sequence[dict], alpha: float) -> bool:
    """Every prompt's test passed, or failed and its confirmation on fresh answers passed."""
    return all(passes(t, alpha) or passes(t.get("confirmation"), alpha) for t in tests)
