"""The prefill cost model that sizes chunked prefill: a fixed part a call pays whatever its size, and a part
per token."""

import random

from specmesh.runtime.prefill_cost import PrefillCost


def test_one_size_of_call_counts_all_its_time_per_token():
    cost = PrefillCost()
    assert cost.tokens_within(10.0) == 1  # nothing known: the least
    for _ in range(5):
        cost.observe(64, 8.0)
    assert cost.fixed_ms == 0.0 and cost.marginal_ms == 8.0 / 64
    assert cost.tokens_within(2.0) == 16


def test_calls_of_several_sizes_fit_the_fixed_part_and_the_part_per_token():
    """Measured on 2 cores with random:tiny, a call cost ~3 ms whatever its size: sized on the mean time per
    token, chunks after a 64-token first one shrank to 1–4 tokens; on the fitted line they stay large."""
    cost = PrefillCost()
    rng = random.Random(0)
    for _ in range(200):
        tokens = rng.choice([1, 2, 4, 64, 80, 130])
        cost.observe(tokens, 3.0 + 0.02 * tokens)
    assert abs(cost.fixed_ms - 3.0) < 1e-6 and abs(cost.marginal_ms - 0.02) < 1e-9
    assert 249 <= cost.tokens_within(8.0) <= 250  # the budget past the fixed part, per token
    assert 99 <= cost.tokens_within(2.0) <= 100  # the fixed part alone is over budget: the budget caches tokens


def test_noise_never_gives_a_negative_or_free_token():
    cost = PrefillCost()
    rng = random.Random(1)
    for _ in range(500):
        tokens = rng.randrange(1, 200)
        cost.observe(tokens, max(0.01, 3.0 + 0.02 * tokens + rng.gauss(0, 2.0)))
        assert cost.fixed_ms >= 0 and cost.marginal_ms > 0
        assert cost.tokens_within(5.0) >= 1


def test_a_line_through_the_origin_is_all_per_token():
    cost = PrefillCost()
    for tokens in (10, 100, 10, 100, 50):
        cost.observe(tokens, 0.1 * tokens)
    assert cost.fixed_ms == 0.0 and abs(cost.marginal_ms - 0.1) < 1e-9
    cost.observe(0, 5.0)  # an empty call tells nothing
    assert abs(cost.marginal_ms - 0.1) < 1e-9


def test_noisy_chunks_of_nearly_one_size_keep_the_line_near_the_truth():
    """A long prompt's chunks are nearly one size, their times noisy (other processes on the cores); newcomers'
    first chunks now and then give the spread. The line stays near the truth, the chunks near the budget's."""
    for seed in range(5):
        cost, rng = PrefillCost(), random.Random(seed)
        for i in range(300):
            tokens = 64 if i % 30 == 0 else rng.choice([6, 7, 8])
            cost.observe(tokens, 5.0 + 1.7 * tokens + rng.gauss(0, 3.0))
            if i > 30:
                assert cost.tokens_within(17.0) <= 9, (seed, i, cost)
        assert abs(cost.marginal_ms - 1.7) < 0.3, cost
