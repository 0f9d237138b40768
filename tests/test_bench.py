"""`specmesh bench` end to end on the embedded model, scaled down: every mode runs (the baselines, each
drafter alone, the router in process and through a local cluster, the load sweep), the summary has
the keys shared/BENCH.md promises, every greedy output is identical, and the plots are PNG files.
The fast tests check the bench's own logic with small pure functions: the rotated order of the modes,
the choice of Hugging Face's best assisted setting, and the non-inferiority verdict of the load sweep."""

import importlib.util
import json

import pytest
from conftest import need, tiny_llama

from specmesh.bench.load_sweep import (
    LOAD_POLICIES, NON_INFERIORITY_MARGIN, adaptive_verdicts, non_inferiority, sweep_order,
)
from specmesh.bench.modes import (
    HF_PROMPT_LOOKUP_TOKENS, ModeRecord, best_setting, hf_modes, llama_cpp_baseline, mode_order, mode_references,
)
from specmesh.bench.report import headline_lines, mode_summary
from specmesh.cli import main
from specmesh.drafters.model import ModelDrafter
from specmesh.drafters.ngram import NgramDrafter

SUMMARY_KEYS = {
    "greedy_identical_fraction", "greedy_reference", "plain_tokens_per_s", "hf_assisted_tokens_per_s",
    "hf_assisted_setting", "own_plain_tokens_per_s", "engine_tokens_per_s", "cluster_tokens_per_s",
    "speedup_vs_plain", "speedup_vs_hf_assisted", "speedup_vs_own_plain", "mean_accepted_length",
    "best_single_drafter_mean_accepted_length", "cluster_mean_accepted_length", "cluster_overhead_fraction",
    "cluster_added_ms_per_step", "verifier_idle_fraction",
}


@pytest.mark.slow
def test_bench_writes_the_summary_and_plots(tmp_path):
    out = tmp_path / "bench.json"
    code = main(["bench", "--limit", "2", "--max-tokens", "12", "--skip-drafter-report", "--concurrency", "1,2", "--sweep-rounds", "2",
                 "--drafter", "ngram", "--drafter", "code", "--json", str(out), "--plots", str(tmp_path / "plots")])
    assert code == 0
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert SUMMARY_KEYS <= set(summary)
    assert next(iter(summary)) == "speedup_vs_own_plain"  # the headline leads
    # shipped precision (the default): specmesh's modes reproduce its plain decoding on the GGUF's blocks, and
    # the same runtime on the de-quantized weights reproduces Hugging Face's
    assert report["precision"] == "Q4_1+Q8_0"
    assert report["provenance"]["command"].startswith("specmesh bench --limit 2") and report["provenance"]["commit"]
    llama_cpp = report["llama_cpp"]  # what ran, or why nothing did: never silent
    assert ("llama_cpp_plain" in report["modes"] and llama_cpp["version"]) if isinstance(llama_cpp, dict) else (
        llama_cpp.startswith("not run: ") and "llama_cpp_plain" not in report["modes"])
    assert summary["greedy_identical_fraction"] == 1.0 and summary["greedy_reference"].startswith("own_plain")
    assert report["modes"]["own_plain_fp32"]["greedy_identical_fraction"] == 1.0
    assert summary["own_plain_speedup_vs_fp32"] > 1.0
    assert summary["best_single_drafter"] in ("ngram", "code")
    settings = {f"hf_assisted:prompt_lookup_num_tokens={n}" for n in HF_PROMPT_LOOKUP_TOKENS}
    assert settings | {"hf_plain", "single:ngram", "single:code", "router_fixed", "engine", "cluster",
                       "cluster_fixed", "cluster_secure"} <= set(report["modes"])
    # the fixed budget through the cluster, fused where the drafts meet, against the best drafter alone (12
    # tokens of two prompts: too few to show what drafting keeps; docs/experiments has the full run)
    assert summary["cluster_fixed_mean_accepted_length"] >= 1.0
    assert summary["cluster_fixed_accepted_length_vs_best_single"] > 0
    assert report["modes"]["cluster_fixed"]["greedy_identical_fraction"] == 1.0
    # the secured cluster (TLS, mutual TLS, an API key) gives the same outputs; what it costs is a ratio
    assert report["modes"]["cluster_secure"]["greedy_identical_fraction"] == 1.0
    assert summary["cluster_secure_vs_cluster"] > 0
    # the overlap: how much of the cluster's time the verifier and the drafter process (the code expert) idled
    assert 0.0 <= summary["verifier_idle_fraction"] < 1.0 and 0.0 <= summary["drafters_idle_fraction"] <= 1.0
    assert f"hf_assisted:{summary['hf_assisted_setting']}" in settings
    assert summary["hf_assisted_tokens_per_s"] == max(report["modes"][m]["tokens_per_s"] for m in settings)
    assert report["modes"]["engine"]["per_token_p99_ms"] >= report["modes"]["engine"]["per_token_p50_ms"] > 0
    assert set(report["verify_cost_curve"]) == {str(k) for k in range(17)}
    assert {(r["concurrency"], r["policy"]) for r in report["load_sweep"]} == {
        (c, p) for c in (1, 2) for p in ("none", "fixed", "adaptive")}
    assert all(r["tokens_per_s"] > 0 and r["p99_ms"] >= r["p50_ms"] > 0 for r in report["load_sweep"])
    assert all(r["rounds"] == 2 and len(r["tokens_per_s_runs"]) == 2 and r["tokens_per_s_spread"] >= 0
               for r in report["load_sweep"])
    assert [v["concurrency"] for v in report["load_sweep_verdicts"]] == [1, 2]
    assert all(len(v["vs_none_ci95"]) == 2 for v in report["load_sweep_verdicts"])
    # the same sweep in process: each policy's engine at each concurrency, every answer its own plain one
    assert [(r["concurrency"], r["policy"]) for r in report["engine_load_sweep"]] == [
        (c, p) for c in (1, 2) for p in ("none", "fixed", "adaptive")]
    assert all(r["tokens_per_s"] > 0 and r["answers_unlike_plain"] == 0 and len(r["tokens_per_s_runs"]) == 2
               for r in report["engine_load_sweep"])
    assert next(r for r in report["engine_load_sweep"] if r["policy"] == "fixed")["tree_nodes_per_step"] > 0
    assert [v["concurrency"] for v in report["engine_load_sweep_verdicts"]] == [1, 2]
    for name in ("speedup_per_category.png", "latency_vs_load.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_modes_rotate_prompt_by_prompt():
    modes = ["hf_plain", "own_plain", "engine", "cluster"]
    orders = [mode_order(modes, index) for index in range(len(modes))]
    assert all(sorted(order) == sorted(modes) for order in orders)  # every mode once a prompt
    for slot in range(len(modes)):  # every mode in every slot, once, over len(modes) prompts
        assert {order[slot] for order in orders} == set(modes)
    assert orders[1] == ["own_plain", "engine", "cluster", "hf_plain"]
    assert mode_order(modes, len(modes) + 1) == orders[1]  # the cycle repeats
    assert mode_order(modes, 0) == modes and modes == ["hf_plain", "own_plain", "engine", "cluster"]  # not mutated


def test_sweep_orders_put_every_policy_in_every_slot():
    for mirrored in (False, True):
        orders = [sweep_order(rotation, mirrored) for rotation in range(3)]
        assert all(sorted(order) == sorted(LOAD_POLICIES) for order in orders)
        for slot in range(3):
            assert {order[slot] for order in orders} == set(LOAD_POLICIES)
    six = [sweep_order(rotation, mirrored=rotation >= 3) for rotation in range(6)]
    follows = [(order[i], order[i + 1]) for order in six for i in range(2)]
    assert all(follows.count((a, b)) == 2 for a in LOAD_POLICIES for b in LOAD_POLICIES if a != b)


def test_hugging_face_assisted_settings_and_the_best_one():
    lookups = {f"hf_assisted:prompt_lookup_num_tokens={n}": {"prompt_lookup_num_tokens": n} for n in (2, 3, 5, 10)}
    assert hf_modes([NgramDrafter()]) == {"hf_plain": {}} | lookups  # no model among the drafters: no assistant
    small = tiny_llama()
    with_model = hf_modes([NgramDrafter(), ModelDrafter(small, vocab_size=96, name="tiny")])
    assert with_model["hf_assisted:assistant_model=tiny"] == {"assistant_model": small}
    speeds = {"hf_plain": 30.0, "own_plain": 50.0, "hf_assisted:prompt_lookup_num_tokens=2": 24.0,
              "hf_assisted:prompt_lookup_num_tokens=3": 27.5, "hf_assisted:prompt_lookup_num_tokens=10": 22.0}
    # the fastest assisted setting, even where plain decoding (not a setting of assisted decoding) is faster
    assert best_setting(speeds) == ("prompt_lookup_num_tokens=3", 27.5)
    assert best_setting(speeds | {"hf_assisted:assistant_model=tiny": 28.0}) == ("assistant_model=tiny", 28.0)
    assert best_setting({"hf_plain": 30.0, "engine": 40.0}) is None


def test_non_inferiority_passes_within_the_margin_and_pairs_rounds():
    # the machine drifts from 100 to 60 tok/s across rounds; adaptive is 1 % slower in each: pairing by
    # round cancels the drift, the interval is tight, and -1 % is inside the -5 % margin
    test = non_inferiority([99.0, 79.2, 59.4], [100.0, 80.0, 60.0])
    assert test.mean == pytest.approx(-0.01) and test.low == pytest.approx(-0.01) and test.high == pytest.approx(-0.01)
    assert test.not_worse
    # differences -1 %, +1 %, 0: standard error 0.01 / sqrt(3), t(0.975, 2 df) = 4.3027
    test = non_inferiority([99.0, 101.0, 100.0], [100.0, 100.0, 100.0])
    assert test.mean == pytest.approx(0.0, abs=1e-12)
    assert test.low == pytest.approx(-4.302653 * 0.01 / 3 ** 0.5, rel=1e-5) and test.high == pytest.approx(-test.low)
    assert test.margin == NON_INFERIORITY_MARGIN == -0.05 and test.not_worse


def test_non_inferiority_fails_when_the_interval_reaches_past_the_margin():
    # 2 % slower on average, but the rounds disagree (-6 %, +2 %, -2 %): the lower bound is -11.9 %
    noisy = non_inferiority([94.0, 102.0, 98.0], [100.0, 100.0, 100.0])
    assert noisy.mean == pytest.approx(-0.02)
    assert noisy.low == pytest.approx(-0.02 - 4.302653 * 0.04 / 3 ** 0.5, rel=1e-5) and not noisy.not_worse
    # steadily 10 % slower: a tight interval, wholly past the margin
    slower = non_inferiority([90.0, 72.0, 54.0], [100.0, 80.0, 60.0])
    assert slower.high == pytest.approx(-0.10) and not slower.not_worse
    # one round: its noise is unknown, so even a gain shows nothing
    single = non_inferiority([120.0], [100.0])
    assert single.mean == pytest.approx(0.2) and single.low is None and not single.not_worse


def _row(level, policy, runs):
    return {"concurrency": level, "policy": policy, "tokens_per_s": sum(runs) / len(runs), "tokens_per_s_runs": runs}


def test_adaptive_verdicts_store_each_interval():
    rows = [_row(4, "none", [80.0, 100.0, 60.0]), _row(4, "fixed", [60.0, 75.0, 45.0]),
            _row(4, "adaptive", [79.2, 99.0, 59.4]),  # -1 % against none every round; +32 % against fixed
            _row(16, "none", [160.0, 120.0, 140.0]), _row(16, "fixed", [100.0, 130.0, 90.0]),
            _row(16, "adaptive", [144.0, 108.0, 126.0])]  # -10 % against none every round
    at4, at16 = adaptive_verdicts(rows)
    assert at4["margin"] == -0.05 and at4["rounds"] == 3
    assert at4["vs_none_relative"] == -0.01 and at4["vs_none_ci95"] == [-0.01, -0.01] and at4["not_worse_than_none"]
    assert at4["vs_none_tokens_per_s"] == pytest.approx(-0.8) and at4["not_worse_than_fixed"]
    assert at16["vs_none_ci95"] == [-0.1, -0.1] and not at16["not_worse_than_none"]
    low, high = at16["vs_fixed_ci95"]
    assert low < at16["vs_fixed_relative"] < high and at16["not_worse_than_fixed"] == (low > -0.05)
    single = adaptive_verdicts([_row(1, "none", [20.0]), _row(1, "fixed", [25.0]), _row(1, "adaptive", [24.0])])[0]
    assert single["vs_none_ci95"] is None and not single["not_worse_than_none"]


def test_the_headline_is_speculations_own_gain_and_hugging_face_ratios_are_labelled():
    summary = {"speedup_vs_own_plain": 1.4, "headline_mode": "cluster", "own_plain_tokens_per_s": 30.0,
               "plain_tokens_per_s": 12.0, "speedup_vs_plain": 3.5, "speedup_vs_hf_assisted": 3.2,
               "hf_assisted_setting": "prompt_lookup_num_tokens=3", "hf_assisted_tokens_per_s": 13.1,
               "own_plain_speedup_vs_plain": 2.5, "greedy_identical_fraction": 1.0, "greedy_reference": "hf_plain: ..."}
    first, versus_hf, runtime, identical = headline_lines(summary)
    assert "HEADLINE speedup_vs_own_plain 1.400x" in first and "through the cluster" in first
    assert versus_hf.startswith("  runtime + speculation: 3.500x") and "3.200x" in versus_hf
    assert "prompt_lookup_num_tokens=3" in versus_hf and "2.500x" in runtime and "hf_plain" in identical
    skipped = headline_lines({k: summary[k] for k in ("speedup_vs_own_plain", "own_plain_tokens_per_s",
                                                      "greedy_identical_fraction", "greedy_reference")}
                             | {"headline_mode": "engine"})
    assert len(skipped) == 2 and "in process" in skipped[0]


def _record(tokens, seconds, steps, draft_s=0.0, transport_s=0.0, identical=2):
    record = ModeRecord(draft_s=draft_s, transport_s=transport_s, identical=identical)
    record.add("writing", list(range(tokens)), seconds, steps, None)
    return record


def test_the_cluster_overhead_counts_the_drafter_hops_and_the_queue():
    # 100 steps each; per step the cluster waits 3 ms more for its drafters than in process (gRPC) and
    # 2 ms for the queue; its wall clock is 10 ms a step slower (the hops, the client's call, the router)
    records = {"hf_plain": _record(200, 10.0, 200), "hf_assisted:prompt_lookup_num_tokens=3": _record(200, 8.0, None),
               "hf_assisted:prompt_lookup_num_tokens=10": _record(200, 9.0, None, identical=1),
               "own_plain": _record(200, 5.0, 200), "single:ngram": _record(200, 4.0, 100),
               "router_fixed": _record(200, 4.5, 100), "engine": _record(200, 4.0, 100, draft_s=0.5),
               "cluster": _record(200, 5.0, 100, draft_s=0.8, transport_s=0.2)}
    summary = mode_summary(records, count=2, identical=2, reference="hf_plain", one_step_ms=25.0, busy_s=4.0, union={},
                       drafting_s=3.0, drafters=3)
    assert summary["verifier_idle_fraction"] == 0.2 and summary["drafters_idle_fraction"] == 0.8  # 3 s of 3 x 5 s
    assert summary["cluster_drafter_hops_ms_per_step"] == 3.0 and summary["cluster_queue_ms_per_step"] == 2.0
    assert summary["cluster_overhead_fraction"] == 0.2 and summary["cluster_queue_overhead_fraction"] == 0.08
    assert summary["cluster_added_ms_per_step"] == 10.0 and summary["cluster_added_fraction"] == 0.4
    assert summary["speedup_vs_own_plain"] == 1.0 and summary["speedup_vs_plain"] == 2.0  # 40 / 40, 40 / 20 tok/s
    assert summary["hf_assisted_setting"] == "prompt_lookup_num_tokens=3" and summary["hf_assisted_tokens_per_s"] == 25.0
    assert summary["speedup_vs_hf_assisted"] == 1.6 and summary["hf_assisted_greedy_identical_fraction"] == 1.0
    assert summary["greedy_reference"].startswith("hf_plain") and summary["verifier_idle_fraction"] == 0.2


@pytest.mark.slow
def test_tune_measures_every_candidate_on_held_out_prompts_losslessly(tmp_path):
    # scaled down: one held-out prompt, a few tokens, two candidates of each constant, no cluster
    from specmesh.bench.tune import TUNING_PROMPTS

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(TUNING_PROMPTS.read_text(encoding="utf-8").splitlines()[0] + "\n")
    out = tmp_path / "tune.json"
    assert main(["tune", "--prompts", str(prompts), "--max-tokens", "6", "--tree-nodes-candidates", "4,8",
                 "--fixed-tree-nodes-candidates", "2,4", "--margins", "0,0.2", "--batch", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    sweep = report["budget_sweep"]
    assert list(sweep) == ["plain", "adaptive:4", "adaptive:8", "fixed:2", "fixed:4"]
    assert all(row["identical_to_plain"] == "1/1" and row["tokens_per_s"] > 0 for row in sweep.values())
    assert sweep["plain"]["vs_plain"] == 1.0 and sweep["fixed:4"]["mean_accepted_length"] >= 1.0
    assert list(report["margin_sweep"]["rows"]) == ["plain", "margin:0", "margin:0.2"]
    assert report["best"]["tree_nodes"] in (4, 8) and report["best"]["fixed_tree_nodes"] in (2, 4)
    assert report["best"]["margin"] in (0.0, 0.2) and "cluster_sweep" not in report
    assert report["sweeps"] == ["budget", "margin"] and "load_margin_sweep" not in report


@pytest.mark.slow
def test_tune_weighs_each_margin_under_load_in_a_cluster_of_its_own(tmp_path):
    # scaled down: prompt lookup only (no drafter services), 2 concurrent requests, 1 round per margin
    from specmesh.bench.tune import TUNING_PROMPTS

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(TUNING_PROMPTS.read_text(encoding="utf-8").splitlines(keepends=True)[:2]))
    out = tmp_path / "tune.json"
    assert main(["tune", "--prompts", str(prompts), "--max-tokens", "6", "--sweeps", "load", "--drafter", "ngram",
                 "--margins", "0,1.5", "--load-concurrency", "2", "--load-rounds", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["sweeps"] == ["load"] and "budget_sweep" not in report and "margin_sweep" not in report
    rows = report["load_margin_sweep"]["rows"]
    assert list(rows) == ["margin:0", "margin:1.5"]
    for row in rows.values():
        level = row["concurrency:2"]
        assert level["tokens_per_s"] > 0 and level["plain_tokens_per_s"] > 0
        assert level["paired_vs_plain_ci95"] is None  # one round: no interval
    assert report["best"]["margin_at_concurrency_2"] in (0.0, 1.5)


def test_round_robin_mixes_the_categories_in_file_order():
    from specmesh.bench.tune import round_robin
    from specmesh.prompts import Prompt

    prompts = [Prompt(f"{c}{i}", c) for c in "abc" for i in range(3 if c == "a" else 1)]  # a0 a1 a2 b0 c0
    assert [p.text for p in round_robin(prompts)] == ["a0", "b0", "c0", "a1", "a2"]


def test_each_mode_is_held_to_its_own_reference():
    modes = ["hf_plain", "hf_assisted:prompt_lookup_num_tokens=3", "llama_cpp_plain", "own_plain_fp32", "own_plain",
             "engine", "cluster"]
    shipped = mode_references(modes, quantized=True)
    assert {m: shipped[m] for m in ("engine", "cluster", "own_plain", "llama_cpp_plain")} == dict.fromkeys(
        ("engine", "cluster", "own_plain", "llama_cpp_plain"), "own_plain")  # speculation: lossless on the blocks
    assert shipped["own_plain_fp32"] == shipped["hf_assisted:prompt_lookup_num_tokens=3"] == "hf_plain"
    fp32 = mode_references(["hf_plain", "own_plain", "engine"], quantized=False)
    assert fp32 == dict.fromkeys(["hf_plain", "own_plain", "engine"], "hf_plain")
    assert mode_references(["own_plain", "engine"], quantized=False)["engine"] == "own_plain"  # baselines skipped


@pytest.mark.slow
@pytest.mark.extra
def test_the_llama_cpp_baseline_decodes_the_shipped_gguf_and_says_how_it_was_built():
    """With the optional llama-cpp extra (`pip install -e '.[llama-cpp]'`, then `pytest --extras`)."""
    need(importlib.util.find_spec("llama_cpp") is not None, "the llama-cpp extra", "pip install -e '.[llama-cpp]'")
    from specmesh.sampling import SamplingParams
    from specmesh.speculation.assembly import assemble, eos_token_ids
    from specmesh.speculation.requests import Request

    assembly = assemble("smollm2-135m-instruct", [])
    generate, build = llama_cpp_baseline(assembly)
    assert build["version"] and build["system_info"]  # e.g. "CPU : SSE3 = 1 | AVX = 1 | ..."
    prompt = tuple(assembly.target.tokenizer.encode("The capital of France is"))
    eos = eos_token_ids(assembly.target)
    first, again = generate(prompt, 8, eos), generate(prompt, 8, eos)
    assert first == again and 0 < len(first) <= 8  # greedy, and no state carried between prompts
    assert all(0 <= t < assembly.runtime.vocab_size for t in first)
    (own,) = assembly.engine(0).generate([Request(prompt, SamplingParams(max_tokens=8))])
    assert first[0] == own.token_ids[0]  # the same GGUF, plain greedy: the same first token


def test_without_llama_cpp_the_bench_says_why(monkeypatch):
    import sys
    from types import SimpleNamespace

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if not installed
    gguf = SimpleNamespace(target=SimpleNamespace(gguf="model.gguf"))
    assert llama_cpp_baseline(gguf) == (None, "not run: llama-cpp-python is not installed")
    assert llama_cpp_baseline(SimpleNamespace(target=SimpleNamespace(gguf=None)))[1].startswith("not run: ")


def test_a_baseline_runs_in_a_process_of_its_own_whose_crash_is_an_error():
    from crashing_baseline import crashing_decoder

    from specmesh.bench.isolated import BaselineFailed, IsolatedBaseline

    with pytest.raises(BaselineFailed, match="process was killed by SIGILL while starting"):
        IsolatedBaseline("crashing", crashing_decoder, 0)
    baseline = IsolatedBaseline("crashing", crashing_decoder, 1)
    assert baseline.info == {"version": "crashing"} and baseline((5, 6, 7), 2, []) == [5, 6]
    with pytest.raises(BaselineFailed, match="process was killed by SIGILL during a call"):
        baseline((5, 6, 7), 2, [])
    with pytest.raises(BaselineFailed):  # and stays gone
        baseline((5,), 1, [])
    baseline.close()
