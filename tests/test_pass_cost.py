"""The decode pass cost model: a fixed part a pass pays whatever its size, and a part per row."""

import random

from specmesh.runtime.pass_cost import PassCost


def test_one_size_of_pass_counts_all_its_time_per_row():
    cost = PassCost()
    assert cost.ms(10) == 0.0  # nothing known
    for _ in range(5):
        cost.observe(64, 8.0)
    assert cost.fixed_ms == 0.0 and cost.row_ms == 8.0 / 64
    assert cost.ms(16) == 2.0


def test_passes_of_several_sizes_fit_the_fixed_part_and_the_part_per_row():
    """Measured on 2 cores with random:tiny, a pass cost ~3 ms whatever its size."""
    cost = PassCost()
    rng = random.Random(0)
    for _ in range(200):
        rows = rng.choice([1, 2, 4, 64, 80, 130])
        cost.observe(rows, 3.0 + 0.02 * rows)
    assert abs(cost.fixed_ms - 3.0) < 1e-6 and abs(cost.row_ms - 0.02) < 1e-9
    assert abs(cost.ms(250) - 8.0) < 1e-6


def test_noise_never_gives_a_negative_or_free_row():
    cost = PassCost()
    rng = random.Random(1)
    for _ in range(500):
        rows = rng.randrange(1, 200)
        cost.observe(rows, max(0.01, 3.0 + 0.02 * rows + rng.gauss(0, 2.0)))
        assert cost.fixed_ms >= 0 and cost.row_ms > 0


def test_a_line_through_the_origin_is_all_per_row():
    cost = PassCost()
    for rows in (10, 100, 10, 100, 50):
        cost.observe(rows, 0.1 * rows)
    assert cost.fixed_ms == 0.0 and abs(cost.row_ms - 0.1) < 1e-9
    cost.observe(0, 5.0)  # an empty pass tells nothing
    assert abs(cost.row_ms - 0.1) < 1e-9


def test_noisy_passes_of_nearly_one_size_keep_the_line_near_the_truth():
    """Decode passes are nearly one size, their times noisy (other processes on the cores); now and then a
    larger one gives the spread. The line stays near the truth."""
    for seed in range(5):
        cost, rng = PassCost(), random.Random(seed)
        for i in range(300):
            rows = 64 if i % 30 == 0 else rng.choice([6, 7, 8])
            cost.observe(rows, 5.0 + 1.7 * rows + rng.gauss(0, 3.0))
            if i > 30:
                assert abs(cost.ms(7) - 16.9) < 5.0, (seed, i, cost)
        assert abs(cost.row_ms - 1.7) < 0.3, cost
