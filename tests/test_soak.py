"""The soak's verdict (tests/soak/report.py) on hand-made records: which failures a fault explains, what
counts as hung or wrong, how memory growth and the streams are judged; its in-process reference for
sampled answers (tests/soak/reference.py) on a tiny model, and that the judgement it makes of them fails
a wrong acceptance rule. The soak itself is `make soak`."""

import random
from dataclasses import replace

import pytest
from soak.reference import answer_distributions
from soak.report import (
    UNAVAILABLE, Fault, Sample, detectable_shift, fit_bins, fit_test, goodness_of_fit, memory_growth, passes,
    sampling_passed, summarize,
)

from specmesh.sampling import SamplingParams
from specmesh.speculation.engine import Request, SpeculativeEngine


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


def test_the_sampling_check_tells_the_reference_from_a_shifted_distribution_and_states_its_power():
    rng = random.Random(0)
    answers = [(1, 2), (1, 3), (4,), (5, 6), (5, 7), (8, 9)]  # (4,): an answer that ended early
    exact = dict(zip(answers, [0.45, 0.2, 0.15, 0.1, 0.05, 0.01]))  # 0.04 left: answers too rare to list
    shifted = [0.33, 0.26, 0.19, 0.13, 0.06, 0.01]  # 0.12 moved off the likeliest answer

    def draw(n, p):
        rest = [(99, k) for k in range(n)]  # every unlisted answer is another one
        return [answers[i] if i < len(answers) else rest[k] for k, i in
                enumerate(rng.choices(range(len(answers) + 1), p + [1 - sum(p)], k=n))]

    calm = [goodness_of_fit(draw(300, list(exact.values())), exact)[0] for _ in range(20)]
    assert sum(p < 0.01 for p in calm) <= 1  # ~1 % false alarms
    assert goodness_of_fit(draw(1000, shifted), exact)[0] < 1e-4
    assert goodness_of_fit([(8, 9)] * 50, {(8, 9): 1.0}) == (1.0, 0)  # one bin: nothing to test
    # bins: the answers expected 5 times or more at 300 (not (8, 9)), the rest pooled into one
    observed, probs = fit_bins(draw(300, list(exact.values())), exact)
    assert len(observed) == 6 and sum(observed) == 300 and abs(probs[-1] - 0.05) < 1e-9
    # the power: more answers find smaller shifts; 1,000 find the 0.12 shift above
    small, large = (detectable_shift(draw(n, list(exact.values())), exact, 0.01) for n in (300, 1000))
    assert 0 < large < 0.12 < small < 0.5


def test_a_sampling_test_passes_on_its_numbers_and_a_failed_one_is_judged_by_its_confirmation():
    exact = {(1, 2): 0.5, (3,): 0.3}
    calm = [((1, 2), 1)] * 50 + [((3,), 0)] * 30 + [((7, 7), 0)] * 20  # the reference's own frequencies
    test = fit_test(calm, exact, 0.005)
    assert test["answers"] == 100 and test["bins"] == 3 and test["accepted_drafted_tokens"] == 50
    assert passes(test, 0.005)
    assert not passes({**test, "accepted_drafted_tokens": 0}, 0.005)  # nothing speculative was judged
    shifted = fit_test([((1, 2), 1)] * 80 + [((3,), 0)] * 10 + [((7, 7), 0)] * 10, exact, 0.005)
    assert not passes(shifted, 0.005)
    assert sampling_passed([test, {**shifted, "confirmation": test}], 0.005)  # a chance failure, not repeated
    assert not sampling_passed([test, {**shifted, "confirmation": shifted}], 0.005)
    assert not sampling_passed([shifted], 0.005)  # failed, and no confirmation was drawn


@pytest.fixture(scope="module")
def runtime():
    from conftest import tiny_llama

    from specmesh.runtime.llama import LlamaRuntime

    return LlamaRuntime(tiny_llama())


PROMPT, PARAMS = (2, 9, 4, 2, 9), SamplingParams(temperature=0.8, top_k=3, max_tokens=3)


def generate(engine, answers: int) -> list:
    """``answers`` seeded answers to ``PROMPT``, 100 requests a batch."""
    return [out for first in range(0, answers, 100) for out in engine.generate(
        [Request(PROMPT, replace(PARAMS, seed=seed)) for seed in range(first, first + 100)])]


def test_the_in_process_reference_is_plain_samplings_distribution_of_whole_answers(runtime):
    (exact,) = answer_distributions(runtime, [PROMPT], PARAMS, floor=0.0)
    assert len(exact) == 27 and abs(sum(exact.values()) - 1) < 1e-6  # top-3, 3 tokens: every answer, listed
    (likely,) = answer_distributions(runtime, [PROMPT], PARAMS, floor=0.05)
    assert likely.keys() == {a for a, p in exact.items() if p >= 0.05}  # the floor drops only rarer answers
    assert all(abs(likely[a] - exact[a]) < 1e-6 for a in likely)
    eos = max(exact, key=exact.get)[0]
    (stopped,) = answer_distributions(runtime, [PROMPT], PARAMS, floor=0.0, eos_token_ids=[eos])
    assert sum(len(a) == 1 for a in stopped) == 1 and abs(sum(stopped.values()) - 1) < 1e-6  # it ends that answer
    answers = [tuple(out.token_ids) for out in generate(SpeculativeEngine(runtime, [], max_tree_nodes=0), 600)]
    assert goodness_of_fit(answers, exact)[0] > 1e-3


@pytest.mark.parametrize("rule", ["exact", "lying"])
def test_the_sampling_check_fails_speculative_sampling_with_a_wrong_acceptance_rule(runtime, rule, monkeypatch):
    from drafting import OracleTreeDrafter
    from sampled_distribution import lying_rule

    (exact,) = answer_distributions(runtime, [PROMPT], PARAMS, floor=5 / 600)
    if rule == "lying":
        monkeypatch.setattr("specmesh.runtime.tree_verifier.verify_mss", lying_rule)
    drafter = OracleTreeDrafter({PROMPT: list(max(exact, key=exact.get))}, 96, seed=1)
    engine = SpeculativeEngine(runtime, [drafter], max_tree_nodes=6)
    outs = generate(engine, 600)
    assert sum(out.stats.accepted_tokens for out in outs) > 0  # it speculated
    p_value, _ = goodness_of_fit([tuple(out.token_ids) for out in outs], exact)
    assert p_value > 1e-3 if rule == "exact" else p_value < 1e-6
