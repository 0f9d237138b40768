"""`specmesh bench` end to end on the embedded model, scaled down: every mode runs (the baselines, each
drafter alone, the router in process and through a local cluster, the load sweep), the summary has
the keys shared/BENCH.md promises, every greedy output is identical, and the plots are PNG files."""

import json

import pytest

from specmesh.cli import main

pytestmark = pytest.mark.slow

SUMMARY_KEYS = {
    "greedy_identical_fraction", "plain_tokens_per_s", "hf_assisted_tokens_per_s", "own_plain_tokens_per_s",
    "engine_tokens_per_s", "cluster_tokens_per_s", "speedup_vs_plain", "speedup_vs_hf_assisted",
    "speedup_vs_own_plain", "mean_accepted_length", "best_single_drafter_mean_accepted_length",
    "cluster_overhead_fraction", "verifier_idle_fraction",
}


def test_bench_writes_the_summary_and_plots(tmp_path):
    out = tmp_path / "bench.json"
    code = main(["bench", "--limit", "2", "--max-tokens", "12", "--skip-drafter-report", "--concurrency", "1,2",
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
    for name in ("speedup_per_category.png", "latency_vs_load.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
