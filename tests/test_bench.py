"""`specmesh bench` end to end on the embedded model, scaled down: every mode runs (the baselines, each
drafter alone, the router in process and through a local cluster, the load sweep), the summary has
the keys shared/BENCH.md promises, every greedy output is identical, and the plots are PNG files."""

import json

import pytest

from specmesh.bench.run import LOAD_POLICIES, adaptive_verdicts, sweep_order, t95
from specmesh.cli import main

SUMMARY_KEYS = {
    "greedy_identical_fraction", "plain_tokens_per_s", "hf_assisted_tokens_per_s", "own_plain_tokens_per_s",
    "engine_tokens_per_s", "cluster_tokens_per_s", "speedup_vs_plain", "speedup_vs_hf_assisted",
    "speedup_vs_own_plain", "mean_accepted_length", "best_single_drafter_mean_accepted_length",
    "cluster_overhead_fraction", "verifier_idle_fraction",
}


@pytest.mark.slow
def test_bench_writes_the_summary_and_plots(tmp_path):
    out = tmp_path / "bench.json"
    code = main(["bench", "--limit", "2", "--max-tokens", "12", "--skip-drafter-report", "--concurrency", "1,2", "--sweep-rounds", "2",
                 "--drafter", "ngram", "--drafter", "code", "--json", str(out), "--plots", str(tmp_path / "plots")])
    assert code == 0
    report = json.loads(out.read_text())
    assert SUMMARY_KEYS <= set(report["summary"])
    assert report["summary"]["greedy_identical_fraction"] == 1.0
    assert report["summary"]["best_single_drafter"] in ("ngram", "code")
    assert {"single:ngram", "single:code", "router_fixed", "engine", "cluster"} <= set(report["modes"])
    assert report["modes"]["engine"]["per_token_p99_ms"] >= report["modes"]["engine"]["per_token_p50_ms"] > 0
    assert set(report["verify_cost_curve"]) == {str(k) for k in range(17)}
    assert {(r["concurrency"], r["policy"]) for r in report["load_sweep"]} == {
        (c, p) for c in (1, 2) for p in ("none", "fixed", "adaptive")}
    assert all(r["tokens_per_s"] > 0 and r["p99_ms"] >= r["p50_ms"] > 0 for r in report["load_sweep"])
    assert all(r["rounds"] == 2 and len(r["tokens_per_s_runs"]) == 2 and r["tokens_per_s_spread"] >= 0
               for r in report["load_sweep"])
    assert [v["concurrency"] for v in report["load_sweep_verdicts"]] == [1, 2]
    for name in ("speedup_per_category.png", "latency_vs_load.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_orders_put_every_policy_in_every_slot():
    for mirrored in (False, True):
        orders = [sweep_order(rotation, mirrored) for rotation in range(3)]
        assert all(sorted(order) == sorted(LOAD_POLICIES) for order in orders)
        for slot in range(3):
            assert {order[slot] for order in orders} == set(LOAD_POLICIES)
    six = [sweep_order(rotation, mirrored=rotation >= 3) for rotation in range(6)]
    follows = [(order[i], order[i + 1]) for order in six for i in range(2)]
    assert all(follows.count((a, b)) == 2 for a in LOAD_POLICIES for b in LOAD_POLICIES if a != b)


def _row(level, policy, runs):
    return {"concurrency": level, "policy": policy, "tokens_per_s": sum(runs) / len(runs), "tokens_per_s_runs": runs}


def test_adaptive_verdict_compares_round_by_round_within_students_t():
    # at 4: the machine drifts 20 tok/s between rounds, which pairing cancels; adaptive's differences to
    # none (+1, -6, -1) average -2, inside 4.303 (t, 2 degrees of freedom) * their standard error 2.08
    rows = [_row(4, "none", [80.0, 100.0, 60.0]), _row(4, "fixed", [60.0, 75.0, 45.0]),
            _row(4, "adaptive", [81.0, 94.0, 59.0]),
            # at 16: a loss of ~20 in every round is real however much the rounds differ (noise 4.303 * 0.58)
            _row(16, "none", [160.0, 120.0, 140.0]), _row(16, "fixed", [80.0, 70.0, 75.0]),
            _row(16, "adaptive", [139.0, 101.0, 120.0])]
    at4, at16 = adaptive_verdicts(rows)
    assert at4["vs_none_tokens_per_s"] == -2.0 and at4["vs_none_noise"] == 8.96
    assert at4["not_worse_than_none"] and at4["not_worse_than_fixed"]
    assert at16["vs_none_tokens_per_s"] == -20.0 and at16["vs_none_noise"] == 2.48
    assert not at16["not_worse_than_none"] and at16["not_worse_than_fixed"]
    single = adaptive_verdicts([_row(1, "none", [20.0]), _row(1, "fixed", [25.0]), _row(1, "adaptive", [24.0])])[0]
    assert single["vs_fixed_noise"] == 0.0 and not single["not_worse_than_fixed"] and single["not_worse_than_none"]


def test_students_t_quantiles():
    assert t95(1) == 12.706 and t95(2) == 4.303 and t95(11) == t95(10) and t95(1000) == 1.96
    with pytest.raises(ValueError):
        t95(0)
