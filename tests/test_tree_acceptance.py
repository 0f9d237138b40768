"""Tree acceptance: what a tree of n nodes commits when its nodes may be siblings, what a drafter's
runners-up are learned to catch, and the controller growing trees to hundreds of nodes where rows are
nearly free (an offloaded target) and not where they are dear."""

import random

import pytest

from specmesh.drafters.oracle import OracleEntry, best_first_tree
from specmesh.runtime.calibration import PassSample
from specmesh.speculation.expertise import Expertise, RoutingConfig, level_hits
from specmesh.speculation.goodput import CostModel, GoodputController, expected_tokens_upto
from specmesh.speculation.policy import AdaptivePolicy, StepOutcome
from specmesh.speculation.tree_acceptance import RankRecord, tree_tokens_upto, walk_ranks
from specmesh.tree import TokenTree


def test_the_walk_gives_the_rank_of_each_accepted_token_among_its_siblings():
    tree = TokenTree.from_paths([[5, 6, 7], [5, 8], [9], [4, 1]])
    assert walk_ranks(tree, [5, 8, 2]) == [(3, 0), (2, 1)]  # 5 is the root's first child, 8 its second; 8 is a leaf
    assert walk_ranks(tree, [4, 1, 3]) == [(3, 2), (1, 0)]
    assert walk_ranks(tree, [2]) == [(3, None)]
    assert walk_ranks(TokenTree(), [5]) == []


def test_a_chain_commits_what_the_levels_say_and_a_wide_tree_what_its_best_nodes_are_worth():
    levels = [0.9, 0.7, 0.8]
    assert tree_tokens_upto(levels, [], 12) == pytest.approx(expected_tokens_upto(levels, 12))
    p = 0.8  # the oracle's calibrated guesses: rank r holds with p (1 - p)^(r - 1)
    shares = [p * (1 - p) ** r for r in range(7)]  # of the first guess's misses
    curve = tree_tokens_upto(p, shares, 1024)
    entry = OracleEntry((1,), tuple(random.Random(0).randrange(1000) for _ in range(2000)), p, width=8)
    for n in (4, 16, 64, 256, 1024):  # the oracle's own best-first tree is worth what the model says
        tree = best_first_tree(entry, 0, n, 1000)
        along = []
        for parent, q in zip(tree.parents, tree.draft_probs):
            along.append(q * (along[parent] if parent >= 0 else 1.0))
        assert curve[n] == pytest.approx(1 + sum(along), rel=1e-9)
    assert curve[16] > 1 / (1 - p) > curve[8]  # past what any chain at p can commit
    assert curve[256] > 9.5
    assert all(b >= a for a, b in zip(curve, curve[1:]))
    assert tree_tokens_upto(0.0, [], 3) == [1.0] * 4


def test_runners_up_are_learned_from_the_ranks_the_trees_had_and_no_others():
    record = RankRecord()
    assert record.shares() == [0.0] * 7  # no tree yet: a chain
    for _ in range(100):  # chains: nothing is credited to runners-up they never drafted
        record.add([(1, 0), (1, None)])
    assert record.shares() == [0.0] * 7
    record = RankRecord()
    for _ in range(100):  # three guesses a node; of the first's misses, rank 2 catches 60 %, rank 3 half the rest
        record.add([(3, 1)] * 6 + [(3, 2)] * 2 + [(3, None)] * 2)
    shares = record.shares()
    assert shares[0] == pytest.approx(0.6, abs=0.02) and shares[1] == pytest.approx(0.2, abs=0.02)
    assert shares[2:] == [0.0] * 5  # ranks 4 and on: never offered
    assert RankRecord().first_share() == 1.0  # before a tree: chains
    mixed = RankRecord()
    for _ in range(100):  # of the levels hit, two in three by the first guess
        mixed.add([(2, 0), (2, 0), (2, 1), (2, None)])
    assert mixed.first_share() == pytest.approx(2 / 3, abs=0.02)
    half = RankRecord()
    for _ in range(100):  # the same catches where the trees offer the runners-up, at half of the nodes
        half.add([(3, 1)] * 3 + [(1, None)] * 3 + [(3, 2)] + [(1, None)] + [(3, None)] + [(1, None)])
    assert half.shares()[0] == pytest.approx(0.3, abs=0.02)


# an offloaded target: the pass streams the whole model, so a thousand rows cost about what one does
FLAT = [PassSample(r, t, r * (1 + n), 300.0 + 0.02 * r * n + 2.0 * r) for r in (1, 4, 16)
        for t, n in ((0, 0), (r, 16), (r, 256), (r, 1024)) if t or not n]
STEEP = [PassSample(r, t, r * (1 + n), 10.0 + 1.1 * r * n + 2.0 * r) for r in (1, 4, 16)  # 2 CPU cores
         for t, n in ((0, 0), (r, 4), (r, 16), (r, 64)) if t or not n]


@pytest.mark.parametrize("samples, wide", [(FLAT, True), (STEEP, False)])
def test_trees_grow_to_hundreds_of_nodes_where_rows_are_nearly_free(samples, wide):
    cost = CostModel()
    cost.calibrate(samples)
    controller = GoodputController(cost, probe_every=0)
    controller.drafting_shares_cores = False
    p, shares = 0.8, [0.8 * 0.2 ** r for r in range(7)]
    free = lambda nodes: 0.5  # noqa: E731 (a model-free drafter: its cost does not grow with the tree)
    chain, _ = controller.choose(1024, p, free)
    tree, _ = controller.choose(1024, p, free, shares=shares)
    if wide:
        assert chain <= 96  # a chain's deep nodes are worth nothing
        assert tree >= 256
    else:
        assert chain <= 16 and tree <= 16


def _oracle_outcome(policy, request, entry, at, vocab=1000):
    plan = request.plan(room=10_000, available=["oracle"], position=40 + at)
    tree = best_first_tree(entry, at, plan.budget, vocab) if plan.budget else TokenTree()
    hits, _ = level_hits(tree, entry.continuation[at:])
    committed = entry.continuation[at : at + hits + 1]
    request.observe(StepOutcome(plan, (tree,) if plan.budget else (), tree, committed, draft_ms=0.5,
                                drafter_ms=(0.5,) if plan.budget else (), step_ms=305.5, pass_ms=300.0,
                                batch_rows=1 + len(tree), batch_size=1, batch_trees=1 if len(tree) else 0))
    return plan.budget, len(committed)


def _policy_over_the_oracle(width: int, steps: int) -> tuple[AdaptivePolicy, list[int], list[int]]:
    """An adaptive policy on a flat pass curve, fed ``steps`` of the oracle at p = 0.8: it, and each step's
    budget and tokens committed."""
    policy = AdaptivePolicy(Expertise({"oracle": ["general"]}, RoutingConfig(explore=0.0), free=["oracle"]),
                            GoodputController(CostModel()))
    policy.controller.cost.calibrate(FLAT)
    policy.controller.drafting_shares_cores = False
    entry = OracleEntry((1,), tuple(random.Random(1).randrange(1000) for _ in range(20_000)), 0.8, width=width)
    request = policy.begin("general", 1024)
    at, budgets, kept = 0, [], []
    while at < 15_000 and len(budgets) < steps:
        budget, committed = _oracle_outcome(policy, request, entry, at)
        at += committed
        budgets.append(budget)
        kept.append(committed)
    return policy, budgets, kept


def test_the_policy_learns_that_the_oracles_runners_up_pay_and_grows_its_trees():
    policy, budgets, kept = _policy_over_the_oracle(width=4, steps=400)
    late = slice(len(budgets) // 2, None)
    assert min(budgets[late]) >= 256, budgets[-20:]
    assert sum(kept[late]) / len(kept[late]) > 8.0  # a chain at 0.8 commits 5 at most
    levels, shares = policy.tree_model(["oracle"], [1.0])
    assert levels[0] == pytest.approx(policy.state.ranks["oracle"].first_share())
    assert 0.4 < shares[0] < 0.8  # 0.8 of the misses where its trees offer a runner-up, as most accepted nodes do
    assert 0.7 < policy.state.realism.ratio < 1.4  # the model predicted about what the trees kept


def test_a_drafter_of_chains_is_not_credited_with_runners_up():
    policy, budgets, _ = _policy_over_the_oracle(width=1, steps=200)
    assert max(budgets[100:]) <= 96  # the chain's tail buys nothing, even where rows are nearly free
    assert policy.tree_model(["oracle"], [0.8]) == ([0.8], [0.0] * 7)  # weighed exactly as a chain
