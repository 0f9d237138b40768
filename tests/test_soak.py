"""The soak's verdict (tests/soak/report.py) on hand-made records: which failures a fault explains, what
counts as hung or wrong, how memory growth and the streams are judged. The soak itself is `make soak`."""

from soak.report import UNAVAILABLE, Fault, Sample, memory_growth, summarize


def request(kind="grpc_unary_greedy", start=0.0, end=1.0, status="OK", check="ok"):
    return {"kind": kind, "api": "grpc", "start": start, "end": end, "status": status, "check": check}


def samples(totals, streams=None):
    return [Sample(float(i), {"router": t}, 0, streams or {"specmesh:default:jobs": 0}) for i, t in enumerate(totals)]


def test_a_failure_is_explained_only_by_an_overlapping_fault_that_causes_it():
    redis = Fault("restart_redis", "redis", 10.0, 13.0, UNAVAILABLE)
    kill = Fault("kill_verifier", "verifier-0", 30.0, 40.0)
    requests = [
        request(start=9.0, end=12.0, status="UNAVAILABLE", check="none"),  # during the Redis restart
        request(start=14.0, end=20.0, status="HTTP_503", check="none"),  # within the grace after it
        request(start=31.0, end=33.0, status="UNAVAILABLE", check="none"),  # a verifier's death explains none
        request(start=50.0, end=51.0, status="RESOURCE_EXHAUSTED", check="none"),  # no fault then
        request(start=60.0, end=61.0, status="EXPECTED", check="none"),  # an invalid request, refused
        request(start=62.0, end=63.0, status="CANCELLED_BY_CLIENT", check="none"),
        request(start=64.0, end=65.0),
        request(start=66.0, end=67.0, check="wrong"),
        request(start=70.0, end=190.0, status="HUNG", check="none"),
    ]
    report = summarize(requests, [redis, kill], samples([100] * 20), 0.0, 200.0, grace_s=10.0)
    assert report["sent"] == 9 and report["completed"] == 2
    assert report["failed"] == {"UNAVAILABLE": 2, "HTTP_503": 1, "RESOURCE_EXHAUSTED": 1, "HUNG": 1}
    assert report["unexplained_failures"] == 2  # the one beside the verifier's death, the 429 with no fault
    assert report["hung"] == 1 and report["wrong_outputs"] == 1 and report["checked_outputs"] == 1
    assert report["passed"] is False


def test_a_calm_run_passes_and_latency_is_split_by_faults():
    fault = Fault("stop_drafter", "drafter-code", 10.0, 14.0)
    requests = [request(start=s, end=s + 2.0) for s in (0.0, 5.0, 9.0, 20.0, 30.0)]
    report = summarize(requests, [fault], samples([100] * 20), 0.0, 40.0, grace_s=10.0)
    assert report["passed"] is True
    assert report["latency_s"]["with_faults"]["requests"] == 1  # 9..11 overlaps 10..14
    assert report["latency_s"]["without_faults"]["requests"] == 4


def test_memory_growth_compares_the_first_and_last_fifth_and_long_streams_fail():
    assert memory_growth(samples([100] * 5)) is None  # too few to judge
    assert abs(memory_growth(samples([100] * 10 + [120] * 10)) - 0.2) < 1e-9
    growing = summarize([request()], [], samples([100] * 10 + [120] * 10), 0.0, 1.0, grace_s=0.0)
    assert growing["passed"] is False
    long = summarize([request()], [], samples([100] * 20, {"specmesh:results:r": 5_000}), 0.0, 1.0, grace_s=0.0)
    assert long["longest_stream"] == 5_000 and long["passed"] is False
