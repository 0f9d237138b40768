"""``specmesh bench``'s report: the summary (keys as shared/BENCH.md; docs/bench.md says what each figure
means), the rows per mode and per category, the headline lines and the printout, the JSON file."""

from __future__ import annotations

import json
from pathlib import Path

from specmesh.bench.modes import ModeRecord, best_setting


def write_json(report: dict, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return out


# What the ratios measure: the headline is speculation's own gain, on specmesh's own runtime; a ratio to
# Hugging Face also holds the runtime's own speed-up (own_plain_speedup_vs_plain), so it is not speculation's
FIGURE_LABELS = {
    "speedup_vs_own_plain": "speculation: cluster / specmesh's own plain decoding (the headline)",
    "engine_speedup_vs_own_plain": "speculation: in process / specmesh's own plain decoding",
    "own_plain_speedup_vs_plain": "runtime: specmesh's own plain decoding / Hugging Face plain greedy",
    "speedup_vs_plain": "runtime + speculation: cluster / Hugging Face plain greedy",
    "speedup_vs_hf_assisted": "runtime + speculation: cluster / Hugging Face assisted at its best setting",
    "engine_speedup_vs_plain": "runtime + speculation: in process / Hugging Face plain greedy",
    "engine_speedup_vs_hf_assisted": "runtime + speculation: in process / Hugging Face assisted at its best setting",
}


# --tree-nodes, --fixed-tree-nodes and the policy's margin are chosen on held-out prompts, never on the
# prompts a bench judges (docs/bench.md)
DEFAULTS_TUNED_ON = "specmesh tune on specmesh/bench/tuning_prompts.jsonl: held out of MT-Bench and of training"


def mode_summary(records: dict[str, ModeRecord], count: int, identical: int, reference: str, one_step_ms: float,
             busy_s: float, union: dict, drafting_s: float = 0.0, drafters: int = 0) -> dict:
    """The summary of shared/BENCH.md from every mode's record over ``count`` prompts, ``identical`` of which
    every specmesh mode answered exactly as ``reference`` did."""
    speed = {m: r.speed() for m, r in records.items()}
    accepted = {m: r.accepted_length() for m, r in records.items() if r.steps}
    singles = {m: accepted[m] for m in records if m.startswith("single:")}
    best_single = max(singles, key=singles.get) if singles else None
    headline = "cluster" if "cluster" in records else "engine"
    summary = {
        # the headline first: speculation's own gain, both sides on specmesh's runtime
        "speedup_vs_own_plain": round(speed[headline] / speed["own_plain"], 3),
        "headline_mode": headline,
        "greedy_identical_fraction": round(identical / count, 4),
        "greedy_reference": GREEDY_REFERENCES[reference],
        "own_plain_tokens_per_s": round(speed["own_plain"], 2),
        "verify_one_step_ms": round(one_step_ms, 2),
        "engine_tokens_per_s": round(speed["engine"], 2),
        "engine_fixed_tokens_per_s": round(speed["router_fixed"], 2),
        "engine_speedup_vs_own_plain": round(speed["engine"] / speed["own_plain"], 3),
        "mean_accepted_length": round(accepted["engine"], 3),
        "fixed_mean_accepted_length": round(accepted["router_fixed"], 3),
        "drafter_union_agreement": union.get("all", 0.0),
    }
    if "own_plain_fp32" in records:  # computing on the shipped blocks against the de-quantized weights
        summary |= {"own_plain_fp32_tokens_per_s": round(speed["own_plain_fp32"], 2),
                    "own_plain_speedup_vs_fp32": round(speed["own_plain"] / speed["own_plain_fp32"], 3)}
    if "llama_cpp_plain" in records:
        summary |= {"llama_cpp_plain_tokens_per_s": round(speed["llama_cpp_plain"], 2),
                    "own_plain_vs_llama_cpp": round(speed["own_plain"] / speed["llama_cpp_plain"], 3),
                    f"{headline}_vs_llama_cpp": round(speed[headline] / speed["llama_cpp_plain"], 3),
                    "llama_cpp_identical_to_own_plain": round(records["llama_cpp_plain"].identical / count, 4)}
    if best_single:
        summary |= {
            "best_single_drafter": best_single.split(":", 1)[1],
            "best_single_drafter_mean_accepted_length": round(singles[best_single], 3),
            "best_single_drafter_tokens_per_s": round(speed[best_single], 2),
            "accepted_length_vs_best_single": round(accepted["engine"] / singles[best_single], 3),
            "fixed_accepted_length_vs_best_single": round(accepted["router_fixed"] / singles[best_single], 3),
        }
        if "cluster_fixed" in accepted:
            summary["cluster_fixed_accepted_length_vs_best_single"] = round(
                accepted["cluster_fixed"] / singles[best_single], 3)
    assisted = best_setting(speed)
    if "hf_plain" in records and assisted:
        setting, assisted_speed = assisted
        summary |= {
            "plain_tokens_per_s": round(speed["hf_plain"], 2),
            "hf_assisted_tokens_per_s": round(assisted_speed, 2),
            "hf_assisted_setting": setting,
            "hf_assisted_greedy_identical_fraction": round(records[f"hf_assisted:{setting}"].identical / count, 4),
            "own_plain_speedup_vs_plain": round(speed["own_plain"] / speed["hf_plain"], 3),
            "engine_speedup_vs_plain": round(speed["engine"] / speed["hf_plain"], 3),
            "engine_speedup_vs_hf_assisted": round(speed["engine"] / assisted_speed, 3),
        }
    if "cluster" in records:
        summary |= _cluster_figures(records, speed, accepted, one_step_ms, busy_s, drafting_s, drafters,
                                    assisted if "hf_plain" in records else None)
    return summary


def _cluster_figures(records: dict[str, ModeRecord], speed: dict[str, float], accepted: dict[str, float],
                     one_step_ms: float, busy_s: float, drafting_s: float, drafters: int,
                     assisted: tuple[str, float] | None) -> dict:
    """The summary's figures of the cluster modes: speed, accepted length, what the cluster adds to a step
    against the same loop in process, idle fractions, TLS's cost, and against Hugging Face (``assisted``: its
    best assisted setting and speed, where its baselines ran); ``speed`` and ``accepted``: each mode's, as
    ``mode_summary`` has them."""
    cluster, engine = records["cluster"], records["engine"]
    cluster_steps, engine_steps = max(sum(cluster.steps.values()), 1), max(sum(engine.steps.values()), 1)
    # per target step, what the cluster adds to the same loop in process: the drafters' gRPC round trips
    # (their wait beyond the in-process drafters'), the queue (the wait for verification beyond the
    # verifier's own work); and, wall clock, everything: those hops, the client's call, the processes
    drafter_hops_ms = max(cluster.draft_s / cluster_steps - engine.draft_s / engine_steps, 0.0) * 1e3
    queue_ms = cluster.transport_s / cluster_steps * 1e3
    added_ms = cluster.step_ms() - engine.step_ms()
    summary = {
        "cluster_tokens_per_s": round(speed["cluster"], 2),
        "cluster_mean_accepted_length": round(accepted["cluster"], 3),
        "cluster_overhead_fraction": round((drafter_hops_ms + queue_ms) / one_step_ms, 3),
        "cluster_drafter_hops_ms_per_step": round(drafter_hops_ms, 2),
        "cluster_queue_ms_per_step": round(queue_ms, 2),
        "cluster_queue_overhead_fraction": round(queue_ms / one_step_ms, 3),
        "cluster_added_ms_per_step": round(added_ms, 2),
        "cluster_added_fraction": round(added_ms / one_step_ms, 3),
        "verifier_idle_fraction": round(max(0.0, 1.0 - busy_s / max(sum(cluster.seconds.values()), 1e-9)), 3),
    }
    if "cluster_fixed" in accepted:  # both sides draft every step: the same step mix, unlike adaptive's
        fixed_added_ms = records["cluster_fixed"].step_ms() - records["router_fixed"].step_ms()
        summary |= {"cluster_fixed_tokens_per_s": round(speed["cluster_fixed"], 2),
                    "cluster_fixed_mean_accepted_length": round(accepted["cluster_fixed"], 3),
                    "cluster_fixed_added_ms_per_step": round(fixed_added_ms, 2)}
    if drafters:  # the drafter processes' share of the cluster's time spent idle (proposing is their work)
        summary["drafters_idle_fraction"] = round(
            max(0.0, 1.0 - drafting_s / max(drafters * sum(cluster.seconds.values()), 1e-9)), 3)
    if "cluster_secure" in records:  # what TLS, mutual TLS and API keys cost a step
        summary |= {"cluster_secure_tokens_per_s": round(speed["cluster_secure"], 2),
                    "cluster_secure_vs_cluster": round(speed["cluster_secure"] / speed["cluster"], 3),
                    "cluster_secure_added_ms_per_step":
                        round(records["cluster_secure"].step_ms() - cluster.step_ms(), 2)}
    if assisted:
        summary |= {
            "speedup_vs_plain": round(speed["cluster"] / speed["hf_plain"], 3),
            "speedup_vs_hf_assisted": round(speed["cluster"] / assisted[1], 3),
        }
    return summary


GREEDY_REFERENCES = {
    "hf_plain": "hf_plain: Hugging Face generate, greedy, the same model in the same dtype",
    "own_plain": "own_plain: specmesh's runtime with speculation off, on the same weights (the fp32 runtime: "
                 "against Hugging Face when it ran)",
    "own_plain_fp32": "own_plain_fp32: specmesh's runtime with speculation off (Hugging Face baselines skipped)",
}


def per_category(records: dict[str, ModeRecord]) -> dict[str, dict]:
    """Per category: the headline mode's speedups (the cluster when it ran, else the engine) and every
    specmesh mode's ratios and accepted length."""
    plain = "hf_plain" if "hf_plain" in records else "own_plain"
    headline = "cluster" if "cluster" in records else "engine"
    table = {}
    for category in records["own_plain"].tokens:
        base, own = records[plain].speed(category), records["own_plain"].speed(category)
        row = {"speedup_vs_plain": round(records[headline].speed(category) / base, 3),
               "speedup_vs_own_plain": round(records[headline].speed(category) / own, 3),
               "mean_accepted_length": round(records[headline].accepted_length(category), 3)}
        for mode, record in records.items():
            if not mode.startswith("hf_") and mode != "own_plain":
                row[mode] = {"speedup_vs_plain": round(record.speed(category) / base, 3),
                             "speedup_vs_own_plain": round(record.speed(category) / own, 3),
                             "mean_accepted_length": round(record.accepted_length(category), 3)}
        table[category] = row
    return table


def mode_rows(records: dict[str, ModeRecord], count: int) -> dict[str, dict]:
    """Each mode's speed, share of answers identical to its reference, accepted length and latencies."""
    return {m: {"tokens_per_s": round(r.speed(), 2), "greedy_identical_fraction": round(r.identical / count, 4)}
            | ({"mean_accepted_length": round(r.accepted_length(), 3)} if r.steps else {})
            | (r.latency() if r.first_token_ms else {}) for m, r in records.items()}


def headline_lines(summary: dict) -> list[str]:
    """The figures a reader should take away, in order: speculation's own gain first, then what specmesh's
    runtime and speculation together do against Hugging Face (labelled so), then exactness."""
    where = "through the cluster" if summary["headline_mode"] == "cluster" else "in process"
    lines = [f"  HEADLINE speedup_vs_own_plain {summary['speedup_vs_own_plain']:.3f}x: speculation {where} against "
             f"specmesh's own plain decoding ({summary['own_plain_tokens_per_s']:.2f} tok/s)"]
    if "plain_tokens_per_s" in summary:
        versus = "speedup_vs_plain" if "speedup_vs_plain" in summary else "engine_speedup_vs_plain"
        assisted = "speedup_vs_hf_assisted" if versus == "speedup_vs_plain" else "engine_speedup_vs_hf_assisted"
        lines += [f"  runtime + speculation: {summary[versus]:.3f}x Hugging Face plain greedy "
                  f"({summary['plain_tokens_per_s']:.2f} tok/s), {summary[assisted]:.3f}x Hugging Face assisted at its "
                  f"best setting, {summary['hf_assisted_setting']} ({summary['hf_assisted_tokens_per_s']:.2f} tok/s)",
                  f"  runtime alone: own plain {summary['own_plain_speedup_vs_plain']:.3f}x Hugging Face plain"]
    if "own_plain_speedup_vs_fp32" in summary:
        lines.append(f"  shipped precision: own plain {summary['own_plain_speedup_vs_fp32']:.3f}x the same runtime on "
                     f"the de-quantized fp32 weights ({summary['own_plain_fp32_tokens_per_s']:.2f} tok/s)")
    if "own_plain_vs_llama_cpp" in summary:
        headline = summary["headline_mode"]
        lines.append(f"  llama.cpp plain ({summary['llama_cpp_plain_tokens_per_s']:.2f} tok/s, same GGUF and threads): "
                     f"own plain {summary['own_plain_vs_llama_cpp']:.3f}x, {headline} "
                     f"{summary[f'{headline}_vs_llama_cpp']:.3f}x")
    lines.append(f"  greedy identical {summary['greedy_identical_fraction']:.0%} of prompts, against "
                 f"{summary['greedy_reference']}")
    return lines


def print_report(report: dict) -> None:
    summary, curve = report["summary"], report["verify_cost_curve"]
    print(f"\n{report['target']} on {report['machine']['cpu']} ({report['machine']['threads']} threads), "
          f"{report['prompts']['count']} prompts x {report['max_tokens']} tokens")
    for line in headline_lines(summary):
        print(line)
    for key, value in summary.items():
        print(f"  {key:40s} {value}")
    print("  verify cost (k+1 tokens / 1 token): "
          + " ".join(f"k={k}:{v}" for k, v in curve.items()))
    for row in report["drafters"]:
        agreement = " ".join(f"{c}:{v:.2f}" for c, v in row["agreement"].items())
        print(f"  drafter {row['name']:10s} cost {row['cost_fraction']:.3f} of a step; agreement {agreement}; "
              f"tokens/step k=1..8: {list(row['expected_tokens_per_step'].values())}")
    for mode, row in report["modes"].items():
        latency = (f"; first token p50 {row['ttft_p50_ms']:.0f} ms, per token p50 {row['per_token_p50_ms']:.1f} / "
                   f"p99 {row['per_token_p99_ms']:.1f} ms" if "ttft_p50_ms" in row else "")
        accepted = f", accepted length {row['mean_accepted_length']:.2f}" if "mean_accepted_length" in row else ""
        print(f"  mode {mode:40s} {row['tokens_per_s']:7.2f} tok/s, identical {row['greedy_identical_fraction']:.0%}"
              f"{accepted}{latency}")
    for category, row in report["per_category"].items():
        print(f"  {category:12s} {row['speedup_vs_own_plain']:.2f}x own plain, {row['speedup_vs_plain']:.2f}x plain "
              f"(runtime + speculation), accepted length {row['mean_accepted_length']:.2f}")
    for where, key in (("in process", "engine_load_sweep"), ("cluster", "load_sweep")):
        _print_load(where, report.get(key, []), report.get(f"{key}_verdicts", []))


def _print_load(where: str, rows: list[dict], verdicts: list[dict]) -> None:
    for row in rows:
        print(f"  load ({where}): concurrency {row['concurrency']:3d} {row['policy']:8s} {row['tokens_per_s']:7.2f} "
              f"± {row['tokens_per_s_spread']:.2f} tok/s over {row['rounds']} rounds {row['tokens_per_s_runs']}, "
              f"per token p50 {row['p50_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms")
    for verdict in verdicts:
        parts = []
        for other in ("none", "fixed"):
            interval = verdict[f"vs_{other}_ci95"]
            shown = f"95 % CI [{interval[0]:+.1%}, {interval[1]:+.1%}]" if interval else "no interval (one round)"
            parts.append(f"vs {other} {verdict[f'vs_{other}_relative']:+.1%} ({shown}): "
                         f"{'not worse' if verdict[f'not_worse_than_{other}'] else 'not worse: not shown'}")
        print(f"  load ({where}): concurrency {verdict['concurrency']:3d} adaptive {'; '.join(parts)} "
              f"(margin {verdict['margin']:.0%}, {verdict['rounds']} paired rounds)")
