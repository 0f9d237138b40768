"""The one back-off policy of the cluster's retries."""

import pytest

from specmesh.cluster.backoff import Backoff, redis_reconnect, unreachable_node


def test_delays_grow_by_the_multiplier_up_to_the_cap_and_reset_after_a_success():
    backoff = Backoff(initial_s=0.5, max_s=3.0, multiplier=2.0)
    assert [backoff.next() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    backoff.reset()
    assert backoff.delay_s == 0.5 and backoff.next() == 0.5 and backoff.delay_s == 1.0


def test_the_presets_keep_the_cluster_constants():
    redis = redis_reconnect()
    assert [redis.next() for _ in range(7)] == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    node = unreachable_node()
    assert [node.next() for _ in range(7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    capped = unreachable_node(max_s=0.2)  # a drafter's max_backoff_s below the usual first wait
    assert [capped.next() for _ in range(2)] == [0.2, 0.2]


@pytest.mark.parametrize("initial_s,max_s,multiplier", [(0.0, 1.0, 2.0), (2.0, 1.0, 2.0), (0.1, 1.0, 0.5)])
def test_a_policy_that_would_not_back_off_is_refused(initial_s, max_s, multiplier):
    with pytest.raises(ValueError, match="back-off"):
        Backoff(initial_s, max_s, multiplier)
