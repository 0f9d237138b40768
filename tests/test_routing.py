"""The router's pure algorithms: per-level hits, trust-weighted fusion, expertise routing as a bandit,
the request classifier, the cost model and the goodput controller."""

import random
from dataclasses import replace

import pytest

from specmesh.distill.templates import domain_prompts
from specmesh.errors import InvalidArgument
from specmesh.fusion import fuse_trees
from specmesh.speculation.classifier import RequestClassifier, default_classifier
from specmesh.speculation.expertise import GENERAL, Expertise, LevelRecord, RoutingConfig, level_hits
from specmesh.speculation.goodput import CostModel, DraftCost, GoodputController, Load, Realism, expected_tokens
from specmesh.runtime.calibration import PassSample
from specmesh.speculation.policy import SPECULATION_MARGIN, AdaptivePolicy, StepOutcome, StepPlan
from specmesh.tree import TokenTree

# ---- per-level hits ----


def test_level_hits_walk_the_tree_along_the_committed_tokens():
    tree = TokenTree.from_paths([[5, 6, 7], [5, 8], [9]])
    assert level_hits(tree, [5, 6, 7, 1]) == (3, 3)  # the leaf ends the walk: a 4th level is unobserved
    assert level_hits(tree, [5, 8, 2]) == (2, 2)
    assert level_hits(tree, [5, 3, 3]) == (1, 2)  # wrong at level 2
    assert level_hits(tree, [4]) == (0, 1)
    assert level_hits(tree, [5]) == (1, 1)  # the committed tokens end first: deeper levels unobserved
    assert level_hits(TokenTree(), [5, 6]) == (0, 0)  # nothing drafted, nothing attempted


# ---- fusion ----


def test_fusion_prefers_the_trusted_drafter_and_agreement():
    a = TokenTree.chain([1, 2, 3], [0.9, 0.9, 0.9])
    b = TokenTree.chain([4, 5, 6], [0.9, 0.9, 0.9])
    # equal confidence: trust decides which path fills a small budget
    assert fuse_trees([a, b], budget=3, weights=[1.0, 0.1]).tokens == (1, 2, 3)
    assert fuse_trees([a, b], budget=3, weights=[0.1, 1.0]).tokens == (4, 5, 6)
    # two drafters agreeing on a first token outvote one more confident drafter
    c = TokenTree.chain([4, 7], [0.5, 0.5])
    fused = fuse_trees([a, b, c], budget=2, weights=[1.0, 1.0, 1.0])
    assert fused.tokens == (4, 1)  # 4 scored 0.9 + 0.5 > 1 scored 0.9 > 5 scored 0.9 * 0.9
    assert fused.parents == (-1, -1)
    # unless the agreeing drafters are the distrusted ones
    assert fuse_trees([a, b, c], budget=1, weights=[1.0, 0.4, 0.4]).tokens == (1,)
    # the whole set within a big budget: one trie, ancestors before children
    everything = fuse_trees([a, b, c], budget=10, weights=[1.0, 1.0, 1.0])
    assert sorted(everything.tokens) == [1, 2, 3, 4, 5, 6, 7]
    assert all(p < i for i, p in enumerate(everything.parents))
    # merged nodes keep the best single drafter's confidence (the verifier treats them as one-hot)
    assert everything.draft_probs[everything.tokens.index(4)] == 0.9


# ---- routing ----


class Simulated:
    """A drafter that guesses the committed token with probability ``skill``, a 4-deep chain."""

    def __init__(self, skill: float, rng: random.Random) -> None:
        self.skill = skill
        self.rng = rng

    def tree(self, truth: list[int]) -> TokenTree:
        tokens = [t if self.rng.random() < self.skill else 999 for t in truth[:4]]
        return TokenTree.chain(tokens, [0.8] * len(tokens))


def run_steps(expertise, route, drafters, steps, rng):
    chosen_counts = {name: 0 for name in drafters}
    for _ in range(steps):
        truth = [rng.randrange(100) for _ in range(5)]
        for name in expertise.select(route, list(drafters)):
            chosen_counts[name] += 1
            expertise.observe(route, name, *level_hits(drafters[name].tree(truth), truth))
    return chosen_counts


def test_an_always_wrong_drafter_loses_its_traffic_and_regains_it_when_it_improves():
    rng = random.Random(0)
    config = RoutingConfig(max_drafters=1, explore=0.1)
    # the wrong one even claims the request's domain: the prior favours it at first
    expertise = Expertise({"expert": ["code"], "lookup": ["general"]}, config, seed=1)
    drafters = {"expert": Simulated(0.0, rng), "lookup": Simulated(0.7, rng)}
    route = expertise.open("code")
    assert expertise.select(route, list(drafters))[0] == "expert"
    first = run_steps(expertise, route, drafters, 5, rng)
    assert first["lookup"] >= 3, first  # a couple of misses of the favoured one move the traffic over
    later = run_steps(expertise, route, drafters, 100, rng)
    assert later["lookup"] == 100 and later["expert"] <= 20, later  # the wrong one only when explored
    # the expert improves (a retrained node): exploration finds it, and it wins the traffic back
    drafters["expert"].skill, drafters["lookup"].skill = 0.95, 0.3
    run_steps(expertise, route, drafters, 60, rng)
    again = run_steps(expertise, route, drafters, 50, rng)
    assert again["expert"] >= 45, again
    # and it is learned for the kind too: a new request of the same kind starts with the expert
    assert expertise.select(expertise.open("code"), list(drafters))[0] == "expert"


def test_routing_by_kind_prior_and_trust_weights():
    expertise = Expertise({"code": ["code"], "math": ["math"], "ngram": ["general"]},
                          RoutingConfig(max_drafters=2, explore=0.0))
    code, math_route = expertise.open("code"), expertise.open("math")
    assert expertise.select(code, ["code", "math", "ngram"]) == ["code", "ngram"]
    assert expertise.select(math_route, ["code", "math", "ngram"]) == ["math", "ngram"]
    assert expertise.select(code, ["math", "ngram"]) == ["ngram", "math"]  # a dead expert is routed around
    # trust follows the request's own evidence: a wrong drafter's weight shrinks
    before = expertise.weights(code, ["code"])[0]
    for _ in range(5):
        expertise.observe(code, "code", 0, 1)
    assert expertise.weights(code, ["code"])[0] < before / 2
    assert expertise.table()["code"]["code"] < expertise.config.domain_prior


def test_model_free_drafters_ride_along_with_the_best_expert():
    expertise = Expertise({"code": ["code"], "math": ["math"], "ngram": ["general"], "history": ["general"]},
                          RoutingConfig(max_drafters=1, explore=0.0), free=["ngram", "history"])
    route = expertise.open("code")
    assert expertise.select(route, ["code", "math", "ngram", "history"]) == ["code", "history", "ngram"]
    for _ in range(30):  # history never helps this request: it stops being asked, ngram stays
        expertise.observe(route, "history", 0, 2)
    assert expertise.select(route, ["code", "math", "ngram", "history"]) == ["code", "ngram"]


def test_a_budget_given_is_drafted_without_the_experts_a_model_free_drafter_out_guesses():
    """Under the batch's fixed arm the budget is given: an expert that prompt lookup out-guesses on this
    request (an edit of text the prompt holds) only adds its cost, and is left out; one that guesses better
    stays."""
    policy = AdaptivePolicy(Expertise({"code": ["code"], "ngram": ["general"]}, RoutingConfig(explore=0.0),
                                         free=["ngram"]), GoodputController(CostModel(), probe_every=0))
    expertise = policy.expertise
    copying, open_question = policy.begin("code", 8), policy.begin("code", 8)
    assert copying.plan(room=100, available=["code", "ngram"], position=10, budget=4).drafters == ("code", "ngram")
    for _ in range(20):
        expertise.observe(copying.route, "ngram", 4, 4)
        expertise.observe(copying.route, "code", 0, 1)
        expertise.observe(open_question.route, "ngram", 0, 1)
        expertise.observe(open_question.route, "code", 2, 3)
    plan = copying.plan(room=100, available=["code", "ngram"], position=10, budget=4)
    assert plan.drafters == ("ngram",) and plan.budget == 4
    assert open_question.plan(room=100, available=["code", "ngram"], position=10, budget=4).drafters == ("code", "ngram")
    assert expertise.outguessed(copying.route, ["code"]) == ["code"]  # no model-free drafter asked: nothing to compare


def test_a_team_is_expected_to_be_right_as_often_as_its_fused_trees_were():
    expertise = Expertise({"a": ["code"], "b": ["code"]}, RoutingConfig(explore=0.0))
    route = expertise.open("code")
    for step in range(60):  # each right half the time, on the same tokens: together no better than one
        hit = step % 2
        expertise.observe(route, "a", hit, 1)
        expertise.observe(route, "b", hit, 1)
        expertise.observe_team(route, ["a", "b"], hit, 1)
    alone = expertise.levels(route, "a", 1)[0]
    independent = 1 - (1 - alone) * (1 - expertise.levels(route, "b", 1)[0])
    together = expertise.team_levels(route, ["b", "a"], 1)[0]  # the order of the names does not matter
    assert alone == pytest.approx(0.5, abs=0.1) and independent > 0.7
    assert together == pytest.approx(0.5, abs=0.1)
    assert expertise.team_levels(expertise.open("code"), ["a", "b"], 1)[0] < 0.65  # the next request of the kind knows it too
    assert set(expertise.table()["code"]) == {"a", "b"}  # teams are not drafters


def test_drafters_register_by_what_they_advertise():
    from types import SimpleNamespace

    from specmesh.drafters.ngram import NgramDrafter
    from specmesh.speculation.drafting import LocalDrafter

    expertise = Expertise({})
    expertise.register(SimpleNamespace(name="code", kind="expert", domains=("code",)))  # an in-process expert
    expertise.register(SimpleNamespace(name="remote-math", kind="expert", domains=("math", "reasoning")))  # a card
    expertise.register(LocalDrafter(NgramDrafter()))  # no domain of its own
    assert expertise.domains == {"code": ("code",), "remote-math": ("math", "reasoning"), "ngram": (GENERAL,)}
    assert expertise.free == {"ngram"}


def test_a_hopeless_drafter_is_not_asked_unless_exploring():
    expertise = Expertise({"bad": ["code"]}, RoutingConfig(max_drafters=2, explore=0.0, kind_decay=1.0))
    route = expertise.open("code")
    for _ in range(40):
        expertise.observe(route, "bad", 0, 3)
    assert expertise.select(route, ["bad"]) == []
    assert expertise.select(route, ["bad"], at_least_one=True) == ["bad"]  # a probe asks the best there is


# ---- the request classifier ----


def test_classifier_learns_kinds_from_examples_and_says_general_when_unsure():
    classifier = RequestClassifier([("write a python function", "code"), ("solve for x", "math"),
                                    ("implement a sort in java", "code"), ("what is 3 plus 4", "math")])
    assert classifier.classify("Write a Rust function that sorts") == "code"
    assert classifier.classify("Solve for y: 2y = 4") == "math"
    assert classifier.classify("Tell me about lighthouses") == GENERAL  # no known words: no evidence


def test_default_classifier_sorts_held_out_templated_prompts():
    classifier = default_classifier()
    right = total = 0
    for domain in ("code", "math", "writing"):
        for prompt in domain_prompts(domain, 60, seed=99):  # another seed than the training prompts
            right += classifier.classify(prompt.text) == domain
            total += 1
    assert right / total > 0.9
    assert classifier.classify("Develop a Python program that reads all the text files under a directory.") == "code"
    assert classifier.classify("Compose an engaging travel blog post about a recent trip to Hawaii.") == "writing"


# ---- cost model and goodput controller ----


# passes measured on 2 CPU cores with SmolLM2-135M: (requests, nodes per request) -> ms
MEASURED_PASSES = {(1, 0): 19.5, (1, 1): 20.3, (1, 2): 25.2, (1, 4): 21.5, (1, 8): 23.8,
                   (4, 0): 25.4, (4, 1): 31.8, (4, 2): 31.8, (4, 4): 37.7, (4, 8): 49.4,
                   (16, 0): 48.4, (16, 1): 70.7, (16, 2): 95.5, (16, 4): 122.5, (16, 8): 184.8}


def measured_cost() -> CostModel:
    cost = CostModel()
    for _ in range(20):
        for (requests, nodes), ms in MEASURED_PASSES.items():
            cost.observe(requests, requests if nodes else 0, requests * (1 + nodes), ms)
    return cost


def test_cost_model_learns_what_requests_trees_and_rows_cost():
    cost = CostModel()
    assert cost.pass_ms(1, 0, 1) == pytest.approx(25.0)  # the prior before any pass
    cost = measured_cost()
    errors = [abs(cost.pass_ms(r, r if n else 0, r * (1 + n)) - ms) / ms for (r, n), ms in MEASURED_PASSES.items()]
    assert max(errors) < 0.2, errors
    # a node costs little alone, and more in a busy pass, where the matrix products are no longer flat
    alone = cost.pass_ms(1, 1, 2) - cost.pass_ms(1, 0, 1)
    busy = cost.pass_ms(16, 1, 17) - cost.pass_ms(16, 0, 16)
    assert alone < 1.5 < busy
    flat = CostModel()
    for _ in range(50):
        flat.observe(1, 1, 3, 20.0)
        flat.observe(1, 1, 9, 19.0)  # noise: more rows measured faster
    assert flat.pass_ms(1, 1, 9) >= flat.pass_ms(1, 1, 3)  # never cheaper with more work


def test_expected_tokens_multiplies_the_conditional_acceptance_of_each_level():
    assert expected_tokens(0.0, 8) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)  # one rate: the geometric sum
    assert expected_tokens(1.0, 4) == pytest.approx(5.0)
    assert expected_tokens([0.5, 1.0], 3) == pytest.approx(2.5)  # past the list: its last rate


def test_level_record_keeps_the_acceptance_of_each_level_given_the_ones_above():
    record = LevelRecord()
    for _ in range(50):
        record.add(3, 3, decay=1.0)  # on track: all three levels right
        record.add(0, 1, decay=1.0)  # off track: the first level wrong, nothing deeper attempted
    first, second, third, fourth = record.means(4, prior=0.3, strength=1e-6)
    assert first == pytest.approx(0.5) and second == pytest.approx(1.0) and third == pytest.approx(1.0)
    assert fourth == pytest.approx(third)  # no evidence: the level above's estimate
    # a request's own record, on the kind's estimates as its priors
    own = LevelRecord()
    own.add(0, 1, decay=1.0)
    assert own.means(2, prior=[0.5, 0.9], strength=1.0) == pytest.approx([0.25, 0.9])


def test_controller_speculates_when_it_pays_and_not_when_it_does_not():
    controller = GoodputController(measured_cost(), probe_every=0)
    cheap = lambda n: 0.1 + 0.1 * n  # noqa: E731
    costly = lambda n: 2.0 + 3.0 * n  # noqa: E731
    # good acceptance, cheap drafting, no load: a deep tree
    assert controller.choose(8, 0.8, cheap)[0] == 8
    # poor acceptance and costly drafting: plain decoding
    assert controller.choose(8, 0.05, costly)[0] == 0
    # deeper levels accepted more often once the first is: it pays to go deeper than one rate would say
    assert controller.choose(8, [0.4, 0.9], costly)[0] > controller.choose(8, 0.4, costly)[0]
    # under load (15 other requests in each pass, plain decoding) rows are no longer free: prompt lookup's
    # guesses, free to draft, pay alone and not in a busy pass
    assert controller.choose(8, 0.4, cheap)[0] > 0
    assert controller.choose(8, 0.4, cheap, Load(other_requests=15, other_rows=15, other_tokens=15))[0] == 0
    # never more than the request's own cap; the goodput comes with the budget
    budget, goodput = controller.choose(3, 0.9, cheap)
    assert budget == 3 and goodput == pytest.approx(controller.goodput(3, 0.9, cheap(3)))


def test_draft_cost_separates_round_trip_levels_and_catch_up():
    drafting = DraftCost(fixed_ms=1.0, per_node_ms=0.5, per_token_ms=0.05)
    assert drafting.ms(0) == 0.0 and drafting.ms(4, catch_up=20) == 4.0  # the prior
    for _ in range(200):
        for nodes, catch_up in ((1, 2), (4, 3), (8, 1), (4, 120)):
            drafting.observe(nodes, catch_up, 3.0 + 1.5 * nodes + 0.1 * catch_up)  # 3 ms round trip, 1.5 ms a level
    assert drafting.fixed_ms == pytest.approx(3.0, rel=0.05) and drafting.per_node_ms == pytest.approx(1.5, rel=0.05)
    assert drafting.per_token_ms == pytest.approx(0.1, rel=0.05)
    stuck = DraftCost(fixed_ms=1.0, per_node_ms=0.5)
    for _ in range(200):
        stuck.observe(2, 0, 6.0)  # always the same budget: the split stays near the prior's slope
    assert stuck.ms(2) == pytest.approx(6.0, rel=0.05) and stuck.per_node_ms < 1.5


def test_a_first_proposal_that_took_in_the_whole_prompt_does_not_make_the_drafter_look_dear():
    drafting = DraftCost(fixed_ms=1.0, per_node_ms=0.5, per_token_ms=0.05)
    drafting.observe(8, 65, 80.0)  # session opened, 65 prompt tokens taken in, 8 levels drafted (through the cluster)
    assert drafting.ms(8, catch_up=65) > 40.0  # the same again is expected to cost most of that
    assert drafting.ms(8, catch_up=2) < 15.0  # but a step that only catches up on the last tokens is cheap
    assert drafting.fixed_ms < 2.0


def test_a_step_that_prefilled_does_not_teach_the_step_overhead():
    policy = AdaptivePolicy(Expertise({"ngram": ["general"]}, free=["ngram"]), GoodputController(CostModel()))
    request = policy.begin("general", 4)
    plan = request.plan(16, ["ngram"], 60)
    first = StepOutcome(plan, (TokenTree(),), TokenTree(), (3,), step_ms=260.0, pass_ms=50.0, batch_rows=1,
                        batch_size=1, prefilled=60)  # 200 ms of it were the prompt's prefill
    request.observe(first)
    assert policy.controller.overhead.by_load == {}
    request.observe(replace(first, step_ms=53.5, pass_ms=50.5, prefilled=0))  # the next pass
    assert policy.controller.overhead.ms() == pytest.approx(3.0)


def test_the_step_overhead_is_learnt_once_a_pass_for_the_whole_cycle():
    policy = AdaptivePolicy(Expertise({"ngram": ["general"]}, free=["ngram"]), GoodputController(CostModel()))
    requests = [policy.begin("general", 4) for _ in range(8)]
    learnt = []
    observe = policy.controller.overhead.observe
    policy.controller.overhead.observe = lambda *a, **k: learnt.append(k.get("weight")) or observe(*a, **k)
    for step in range(3):  # eight requests in each pass: each pass's overhead is the same for all of them
        for request in requests:
            plan = request.plan(16, ["ngram"], 60 + step)
            request.observe(StepOutcome(plan, (TokenTree(),), TokenTree(), (3,), step_ms=12.0 + step, pass_ms=10.0 + step,
                                        batch_rows=8, batch_size=8))
    assert learnt == [1.0, 1.0, 1.0]
    assert policy.controller.overhead.ms(8) == pytest.approx(2.0)


def test_overhead_charges_each_tree_of_a_pass_its_share():
    controller = GoodputController(CostModel())
    assert controller.overhead.ms() == controller.overhead.ms(1, 1) == 0.0
    controller.overhead.observe(2.0)
    assert controller.overhead.ms(1, 1) == 2.0  # no tree seen yet: nothing charged for one
    for _ in range(20):  # 16 requests: plain steps, and steps where every request drafted
        controller.overhead.observe(20.0, requests=16)
        controller.overhead.observe(52.0, requests=16, trees=16)
    assert controller.overhead.per_tree_ms(16) == pytest.approx(2.0, abs=0.1)  # not 32 for one tree
    assert controller.overhead.ms(16, 1) == pytest.approx(22.0, abs=0.5)
    assert controller.overhead.ms(1) == 2.0  # another load's steps teach this one nothing
    assert controller.goodput(2, 0.0, 0.0) < controller.goodput(0, 0.0, 0.0)  # a tree nobody gets right only costs


def test_overhead_is_learned_by_load():
    controller = GoodputController(CostModel())
    controller.overhead.observe(2.0)  # alone: queue and transport
    controller.overhead.observe(50.0, requests=64)  # 64 a pass: the router's turn
    assert controller.overhead.ms(1) == 2.0 and controller.overhead.ms(70) == 50.0
    assert controller.overhead.ms(48) == 50.0  # the nearest load seen
    assert controller.overhead.ms(3) == 2.0


# An 8B step on an H100 (milliseconds by requests and tree nodes): rows nearly free up to hundreds
GPU_PASSES = {(1, 0): 7.5, (1, 4): 7.6, (1, 16): 8.2, (4, 0): 7.7, (4, 4): 7.9, (4, 16): 9.0,
              (16, 0): 8.0, (16, 4): 9.5, (16, 16): 12.4, (64, 0): 9.8, (64, 4): 20.2, (64, 16): 45.0}


def curve(passes: dict) -> list[PassSample]:
    return [PassSample(r, r if n else 0, r * (1 + n), ms) for (r, n), ms in passes.items()]


def test_a_calibrated_cost_model_starts_from_the_measured_curve():
    gpu = CostModel()
    gpu.calibrate(curve(GPU_PASSES))
    errors = [abs(gpu.pass_ms(r, r if n else 0, r * (1 + n)) - ms) / ms for (r, n), ms in GPU_PASSES.items()]
    assert max(errors) < 0.3, errors
    assert gpu.pass_ms(1, 1, 5) < 8.5  # a lone tree costs next to nothing, unlike the 2-core prior's
    cpu = CostModel()
    cpu.calibrate(curve(MEASURED_PASSES))
    assert cpu.pass_ms(16, 1, 20) - cpu.pass_ms(16, 0, 16) > 2.0
    for _ in range(30):  # and it keeps learning from the passes it is told of
        gpu.observe(1, 0, 1, 15.0)
    assert gpu.pass_ms(1, 0, 1) > 11.0
    unchanged = CostModel()
    unchanged.calibrate([PassSample(1, 0, 1, 10.0)])  # one point is no curve
    assert unchanged.pass_ms(1, 0, 1) == pytest.approx(25.0)


def test_a_pass_curve_says_how_many_rows_fit_a_time():
    from specmesh.runtime.calibration import PassCurve

    cpu = PassCurve("cpu", tuple(curve(MEASURED_PASSES)))  # ~1.1 ms a row on 2 cores
    assert 180 <= cpu.rows_within(250.0) <= 260
    gpu = PassCurve("cuda", tuple(curve(GPU_PASSES)))
    assert gpu.rows_within(250.0) > 3000  # rows nearly free: far past any batch cap
    assert PassCurve("cpu", tuple(curve({(1, 0): 10.0}))).rows_within(250.0) is None  # one point is no line
    assert PassCurve("cuda", tuple(curve({(1, 0): 9.0, (4, 0): 8.0}))).rows_within(250.0) is None  # flat


def test_in_a_busy_batch_a_tree_pays_where_rows_are_nearly_free_and_not_where_they_are_dear():
    gpu, cpu = CostModel(), CostModel()
    gpu.calibrate(curve(GPU_PASSES))
    cpu.calibrate(curve(MEASURED_PASSES))
    round_trip = lambda n: 2.2 + 0.05 * n  # noqa: E731  # a drafter service's hop
    busy = Load(other_requests=15, other_rows=15, other_tokens=15)
    gpu_controller, cpu_controller = GoodputController(gpu, probe_every=0), GoodputController(cpu, probe_every=0)
    gpu_controller.drafting_shares_cores = False  # the drafter's cores are not the GPU's
    for controller in (gpu_controller, cpu_controller):
        controller.overhead.observe(15.0, requests=16)  # the router's turn at this load
    assert gpu_controller.choose(8, 0.8, round_trip, busy)[0] >= 4
    assert cpu_controller.choose(8, 0.4, round_trip, busy)[0] == 0
    # steps measured 18 ms slower when every request drafted (one router and one drafter serving them
    # all): each tree's share of that is in every step, and a tree right 80 % of the time still pays
    for _ in range(10):
        gpu_controller.overhead.observe(33.0, requests=16, trees=16)
    assert gpu_controller.overhead.per_tree_ms(16) > 0.5
    assert gpu_controller.choose(8, 0.8, round_trip, busy)[0] >= 4
    everyone = replace(busy, other_trees=15, other_rows=15 * 5, other_tokens=15 * 3.4)
    assert gpu_controller.choose(8, 0.8, round_trip, everyone)[0] >= 4  # and when every other request drafts too
    # the hop delays this request only: alone, where it delays everything, a tree still pays at 0.8
    assert gpu_controller.choose(8, 0.8, round_trip)[0] >= 4
    # an expert on the verifier's own cores slows every request's pass: in a busy batch its tree loses
    expert = lambda n: 6.0 + 1.5 * n  # noqa: E731
    cpu_controller.drafting_shares_cores = False
    assert cpu_controller.choose(8, 0.6, expert, busy)[0] > 0
    cpu_controller.drafting_shares_cores = True
    assert cpu_controller.choose(8, 0.6, expert, busy)[0] == 0


def test_realism_scales_predictions_to_what_came_true():
    realism = Realism(prior_steps=4.0)
    assert realism.ratio == 1.0
    for _ in range(60):
        realism.observe(3.0, 1)  # three accepted tokens predicted, one kept
    assert realism.ratio == pytest.approx(1 / 3, rel=0.1)
    controller = GoodputController(measured_cost(), probe_every=0)
    drafting = lambda n: 6.0 + 1.5 * n  # noqa: E731  # an expert on one core
    assert controller.choose(8, 0.7, drafting)[0] > 0
    assert controller.choose(8, 0.7, drafting, realism=realism.ratio)[0] == 0


def test_a_policy_whose_trees_keep_fewer_tokens_than_it_predicts_stops_drafting_them():
    policy = AdaptivePolicy(Expertise({"expert": ["code"]}, RoutingConfig(explore=0.0)),
                            GoodputController(measured_cost(), probe_every=0))
    policy.draft_cost("expert").fit.observe([1.0, 4.0, 0.0], 8.0)
    request = policy.begin("code", 8)
    plan = request.plan(room=100, available=["expert"], position=100)
    assert plan.budget > 0 and plan.predicted_accepted > 0.5  # the domain prior: worth a tree
    for step in range(40):
        if not plan.budget:
            break
        # the guesses are wrong, whatever the prior says (a record that has not caught up with it)
        tree = TokenTree.chain([9] * plan.budget)
        request.observe(StepOutcome(plan, (tree,), tree, (6,), draft_ms=8.0, drafter_ms=(8.0,), step_ms=30.0,
                                    pass_ms=20.0, batch_rows=1 + plan.budget, batch_size=1))
        request.route.records.clear()  # the record keeps saying what the prior says: only realism can learn
        policy.expertise._kinds.clear()
        plan = request.plan(room=100, available=["expert"], position=100 + step)
    assert plan.budget == 0 and policy.state.realism.ratio < 0.5


def test_controller_probes_after_a_run_of_plain_steps_and_less_often_in_a_busy_batch():
    controller = GoodputController(CostModel(), probe_every=4)
    assert not controller.should_probe(3) and controller.should_probe(4)
    busy = Load(other_requests=3, other_rows=3)  # four requests a pass: the batch probes once per 4 passes
    assert not controller.should_probe(15, busy) and controller.should_probe(16, busy)


def test_a_busy_batch_of_short_requests_still_probes_once_in_a_while():
    # 16 requests of 8 steps each never reach a busy batch's probe interval (64 steps) on their own
    policy = AdaptivePolicy(Expertise({"ngram": ["general"]}, free=["ngram"]), GoodputController(CostModel(), probe_every=4))
    for _ in range(30):  # every step learnt dear: plain decoding pays best
        policy.controller.overhead.observe(10.0, requests=16)
        policy.controller.overhead.observe(500.0, requests=16, trees=16)
    requests = [policy.begin("general", 8) for _ in range(16)]
    probes = 0
    for generation in range(8):
        for step in range(8):
            for request in requests:
                plan = request.plan(room=100, available=["ngram"], position=50 + step)
                probes += plan.budget > 0
                kept = (1, 2) if plan.budget else (1,)  # probes keep a token: the interval does not stretch
                request.observe(StepOutcome(plan, (TokenTree(),) * len(plan.drafters), TokenTree(), kept,
                                            step_ms=30.0, pass_ms=20.0, batch_rows=16, batch_size=16))
        for request in requests:  # they end; new ones take their place
            request.end()
        requests = [policy.begin("general", 8) for _ in range(16)]
    assert 8 * 8 * 16 // (4 * 16 * 2) <= probes <= 8 * 8 * 16 // (4 * 16) + 1  # about one per 64 request steps


def test_probes_that_keep_nothing_come_less_often_until_one_keeps_something():
    from specmesh.speculation.policy import PROBE_BACKOFF_MOST

    policy = AdaptivePolicy(Expertise({"ngram": ["general"]}, RoutingConfig(explore=0.0), free=["ngram"]),
                            GoodputController(CostModel(), probe_every=4))
    policy.draft_cost("ngram").fit.observe([1.0, 4.0, 0.0], 400.0)  # drafting looks hopeless: only probes
    request = policy.begin("general", 4)
    probe_steps, keep = [], False
    for step in range(400):
        plan = request.plan(room=1000, available=["ngram"], position=50 + step)
        if plan.budget:
            assert plan.probe
            probe_steps.append(step)
        committed = (1, 2) if plan.budget and keep else (1,)
        request.observe(StepOutcome(plan, (TokenTree(),) * len(plan.drafters), TokenTree(), committed,
                                    step_ms=6.0, pass_ms=5.0, batch_rows=1, batch_size=1))
        if step == 300:
            keep = True  # from here on probes keep a token
    gaps = [b - a for a, b in zip(probe_steps, probe_steps[1:])]
    # after each failed probe twice the wait (8, 16, 32 plain steps), at most PROBE_BACKOFF_MOST x 4; back to
    # 4 once one keeps a token
    assert gaps[:4] == [9, 17, 33, 33] and max(gaps) == 4 * PROBE_BACKOFF_MOST + 1
    assert gaps[-1] == 5 and policy.state.probe_backoff == 1


def test_the_policy_leaves_out_an_expert_whose_guesses_do_not_pay_for_its_time():
    policy = AdaptivePolicy(Expertise({"expert": ["code"], "ngram": ["general"]}, RoutingConfig(explore=0.0),
                                         free=["ngram"]), GoodputController(CostModel(), probe_every=0))
    request = policy.begin("code", 8)
    plan = request.plan(room=100, available=["expert", "ngram"], position=100)
    assert set(plan.drafters) == {"expert", "ngram"}  # the expert's domain prior: it is tried first
    for _ in range(40):
        truth = (5, 6, 7, 8)
        trees = {"expert": TokenTree.chain([9] * plan.budget), "ngram": TokenTree.chain(truth[: plan.budget])}
        ms = {"expert": 2.0 + 2.0 * plan.budget, "ngram": 0.1}
        asked = plan.drafters
        request.observe(StepOutcome(plan, tuple(trees[n] for n in asked), trees["ngram"], truth[: plan.budget + 1],
                                    draft_ms=sum(ms[n] for n in asked), drafter_ms=tuple(ms[n] for n in asked),
                                    step_ms=25.0, pass_ms=20.0, batch_rows=1 + plan.budget, batch_size=1))
        plan = request.plan(room=100, available=["expert", "ngram"], position=100)
    assert plan.drafters == ("ngram",) and plan.budget >= 4


def test_in_a_shared_pass_a_predicted_gain_within_the_margin_is_not_worth_a_tree():
    class Predicting(GoodputController):  # the goodput model, with its prediction for a tree set by the test
        gain = 1.0

        def choose(self, max_budget, acceptance, draft_ms, load=Load(), realism=1.0, shares=()):
            return 4, self.goodput(0, [], 0.0, load) * self.gain

    controller = Predicting(CostModel(), probe_every=0)
    policy = AdaptivePolicy(Expertise({"ngram": ["general"]}, RoutingConfig(explore=0.0), free=["ngram"]), controller)
    request = policy.begin("general", 8)
    controller.gain = 1.0 + SPECULATION_MARGIN / 2
    assert request.plan(room=100, available=["ngram"], position=100).budget == 4  # alone: the model holds
    others = [policy.begin("general", 8) for _ in range(3)]  # four requests a pass: a share is a quarter
    for gain, budget in ((1.0 + SPECULATION_MARGIN / 8, 0), (1.0 + SPECULATION_MARGIN / 2, 4)):
        controller.gain = gain
        assert request.plan(room=100, available=["ngram"], position=100).budget == budget, gain
    assert len(others) == 3
    # `specmesh tune` compares margins: with none, any predicted gain is worth a tree
    policy.margin = 0.0
    controller.gain = 1.0 + SPECULATION_MARGIN / 8
    assert request.plan(room=100, available=["ngram"], position=100).budget == 4


def test_a_negative_margin_is_refused():
    with pytest.raises(InvalidArgument, match="margin"):
        AdaptivePolicy(Expertise({"ngram": ["general"]}), GoodputController(CostModel()), margin=-0.1)


def test_an_expert_joining_late_pays_its_catch_up_over_the_steps_it_will_draft():
    policy = AdaptivePolicy(Expertise({"expert": ["code"]}, RoutingConfig(explore=0.0)),
                            GoodputController(CostModel(), probe_every=0))
    policy.draft_cost("expert").fit.observe([1.0, 8.0, 100.0], 2.0 + 4.0 * 8 + 0.35 * 100)  # 0.35 ms a context token
    policy.state.tokens_per_request_step = 2.0
    request = policy.begin("code", 8)
    # the expert never drafted for this request: 100 tokens to take in first, then it drafts for the rest
    assert request.plan(room=200, available=["expert"], position=100).budget > 0
    # the same catch-up for a step or two of room left is not worth it
    assert request.plan(room=3, available=["expert"], position=100).budget == 0


@pytest.mark.parametrize("in_flight", [0, 7])  # alone, and in a busy batch
def test_a_request_without_speculation_weighs_it_again_every_few_steps(in_flight):
    policy = AdaptivePolicy(Expertise({"ngram": ["general"]}, RoutingConfig(explore=0.0), free=["ngram"]),
                            GoodputController(CostModel(), probe_every=0), margin=0.0)  # the margin: its own test
    others = [policy.begin("general", 4) for _ in range(in_flight)]
    request = policy.begin("general", 4)
    policy.draft_cost("ngram").fit.observe([1.0, 4.0, 0.0], 400.0)  # drafting looks hopeless
    plans = []
    for step in range(8):
        plan = request.plan(room=50, available=["ngram"], position=50 + step)
        plans.append(plan.budget)
        request.observe(StepOutcome(plan, (), TokenTree(), (3,), step_ms=60.0, pass_ms=50.0, batch_rows=8, batch_size=8))
        if step == 1:  # from here on drafting looks cheap and right: noticed at the next weighing
            policy.state.drafting.clear()
            for _ in range(30):
                policy.expertise.observe(request.route, "ngram", 4, 4)
    assert plans[:4] == [0, 0, 0, 0] and plans[4] > 0
    assert len(others) == in_flight


def test_a_request_at_zero_weighs_again_only_once_something_was_learned(monkeypatch):
    from specmesh.speculation.policy import RECHECK_EVERY, RECHECK_UNCHANGED_EVERY

    policy = AdaptivePolicy(Expertise({"ngram": ["general"]}, RoutingConfig(explore=0.0), free=["ngram"]),
                            GoodputController(CostModel(), probe_every=0))
    request = policy.begin("general", 4)
    policy.draft_cost("ngram").fit.observe([1.0, 4.0, 0.0], 400.0)  # drafting looks hopeless
    weighings = []
    choose = policy.controller.choose
    monkeypatch.setattr(policy.controller, "choose", lambda *a, **k: weighings.append(request.steps_without) or choose(*a, **k))
    for step in range(2 * RECHECK_UNCHANGED_EVERY):
        plan = request.plan(room=500, available=["ngram"], position=50 + step)
        assert plan.budget == 0
        request.observe(StepOutcome(plan, (), TokenTree(), (3,), step_ms=6.0, pass_ms=5.0, batch_rows=1, batch_size=1))
    # the first weighing, then one each RECHECK_UNCHANGED_EVERY steps: nothing was learned in between
    assert weighings == [0, RECHECK_UNCHANGED_EVERY]
    policy.expertise.observe(request.route, "ngram", 4, 4)  # something learned: weighed at the next recheck
    for step in range(RECHECK_EVERY):
        plan = request.plan(room=500, available=["ngram"], position=200 + step)
        request.observe(StepOutcome(plan, (), TokenTree(), (3,), step_ms=6.0, pass_ms=5.0, batch_rows=1, batch_size=1))
    assert len(weighings) == 3


def test_adaptive_policy_learns_costs_and_load_from_the_verifiers_reports():
    policy = AdaptivePolicy(Expertise({"a": ["general"]}), GoodputController(CostModel(), probe_every=0))
    request = policy.begin("general", 8)
    plan = request.plan(room=50, available=["a"], position=50)
    assert plan.drafters == ("a",) and plan.budget > 0
    for _ in range(30):  # a drafter that is never right, slow to draft, in big passes
        outcome = StepOutcome(plan, (TokenTree.chain([7] * plan.budget),), TokenTree.chain([7] * plan.budget), (3,),
                              draft_ms=20.0, drafter_ms=(20.0,), step_ms=52.0 + plan.budget, pass_ms=30.0 + plan.budget,
                              batch_rows=1 + plan.budget, batch_size=1)
        request.observe(outcome)
        plan = request.plan(room=50, available=["a"], position=50)
        if plan.budget == 0:
            break
    assert plan == StepPlan()  # speculation stopped paying
    assert policy.controller.overhead.ms(1, 1) > 0 and policy.draft_cost("a").ms(4) > 5.0
    assert request.plan(room=1, available=["a"], position=99) == StepPlan()  # one token left: nothing to draft for
    assert policy.state.active == 1
    request.end()
    request.end()  # the loop and its caller may both end it
    assert policy.state.active == 0
