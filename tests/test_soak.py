"""The soak's verdict (tests/soak/report.py) on hand-made records: which failures a fault explains, what
counts as hung or wrong, how memory growth and the streams are judged. The soak itself is `make soak`."""

import random

from soak.report import UNAVAILABLE, Fault, Sample, detectable_shift, homogeneity, memory_growth, summarize


def request(kind="grpc_unary_greedy", start=0.0, end=1.0, status="OK", check="ok", via=""):
    return {"kind": kind, "api": "grpc", "start": start, "end": end, "status": status, "check": check, "via": via}


def samples(totals, streams=None):
    return [Sample(float(i), {"router": t}, 0, streams or {"specmesh:default:jobs": 0}) for i, t in enumerate(totals)]


def test_a_failure_is_explained_only_by_an_overlapping_fault_that_causes_it():
    redis = Fault("restart_redis", "redis", 10.0, 13.0, UNAVAILABLE, recovered=16.0)
    kill = Fault("kill_verifier", "verifier-0", 30.0, 40.0)
    router = Fault("kill_router", "router-1", 80.0, 85.0, ("HTTP_CONNECTION",), recovered=85.0, via="http://b")
    requests = [
        request(start=9.0, end=12.0, status="UNAVAILABLE", check="none"),  # during the Redis restart
        request(start=15.0, end=20.0, status="HTTP_503", check="none"),  # before the cluster served again
        request(start=17.0, end=20.0, status="HTTP_503", check="none"),  # after: nothing excuses it
        request(start=31.0, end=33.0, status="UNAVAILABLE", check="none"),  # a verifier's death explains none
        request(start=50.0, end=51.0, status="RESOURCE_EXHAUSTED", check="none"),  # no fault then
        request(start=60.0, end=61.0, status="EXPECTED", check="none"),  # an invalid request, refused
        request(start=62.0, end=63.0, status="CANCELLED_BY_CLIENT", check="none"),
        request(start=64.0, end=65.0),
        request(start=66.0, end=67.0, check="wrong"),
        request(start=70.0, end=190.0, status="HUNG", check="none"),
        request(start=81.0, end=81.5, status="HTTP_CONNECTION", check="none", via="http://b"),  # the killed router's
        request(start=81.0, end=81.5, status="HTTP_CONNECTION", check="none", via="http://a"),  # the other's: not
    ]
    report = summarize(requests, [redis, kill, router], samples([100] * 20), 0.0, 200.0)
    assert report["sent"] == 12 and report["completed"] == 2
    assert report["failed"] == {"UNAVAILABLE": 2, "HTTP_503": 2, "RESOURCE_EXHAUSTED": 1, "HUNG": 1,
                                "HTTP_CONNECTION": 2}
    # explained: the two under the Redis restart until it served again, the killed router's own request
    assert [(e["status"], e["fault"], e["start"]) for e in report["explained"]] == [
        ("UNAVAILABLE", "restart_redis", 9.0), ("HTTP_503", "restart_redis", 15.0),
        ("HTTP_CONNECTION", "kill_router", 81.0)]
    assert report["explained"][1]["fault_recovered"] == 16.0
    assert report["unexplained_failures"] == 4  # the late 503, beside the verifier's death, the 429, the other router's
    assert report["hung"] == 1 and report["wrong_outputs"] == 1 and report["checked_outputs"] == 1
    assert report["passed"] is False


def test_a_calm_run_passes_and_latency_is_split_by_faults():
    fault = Fault("stop_drafter", "drafter-code", 10.0, 14.0)
    requests = [request(start=s, end=s + 2.0) for s in (0.0, 5.0, 9.0, 20.0, 30.0)]
    report = summarize(requests, [fault], samples([100] * 20), 0.0, 40.0)
    assert report["passed"] is True
    assert report["latency_s"]["with_faults"]["requests"] == 1  # 9..11 overlaps 10..14
    assert report["latency_s"]["without_faults"]["requests"] == 4


def test_memory_growth_compares_the_first_and_last_fifth_and_long_streams_fail():
    assert memory_growth(samples([100] * 5)) is None  # too few to judge
    assert abs(memory_growth(samples([100] * 10 + [120] * 10)) - 0.2) < 1e-9
    growing = summarize([request()], [], samples([100] * 10 + [120] * 10), 0.0, 1.0)
    assert growing["passed"] is False
    long = summarize([request()], [], samples([100] * 20, {"specmesh:results:r": 5_000}), 0.0, 1.0)
    assert long["longest_stream"] == 5_000 and long["passed"] is False


def test_the_sampling_check_tells_one_distribution_from_a_shifted_one_and_states_its_power():
    rng = random.Random(0)
    same, shifted = [0.5, 0.2, 0.15, 0.1, 0.05], [0.38, 0.25, 0.19, 0.12, 0.06]  # 0.12 moved off the top token
    draw = lambda n, p: rng.choices(range(len(p)), p, k=n)  # noqa: E731
    calm = [homogeneity(draw(300, same), draw(300, same))[0] for _ in range(20)]
    assert sum(p < 0.01 for p in calm) <= 1  # ~1 % false alarms
    assert homogeneity(draw(1000, same), draw(1000, shifted))[0] < 1e-4
    assert homogeneity([7] * 50, [7] * 50) == (1.0, 0)  # one token: nothing to test
    # the power: more draws find smaller shifts; 1,000 a side find the 0.12 shift above
    small, large = detectable_shift(draw(300, same), draw(300, same), 0.01), detectable_shift(
        draw(1000, same), draw(1000, same), 0.01)
    assert 0 < large < 0.12 < small < 0.5
