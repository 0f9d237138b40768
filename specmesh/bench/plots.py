"""The benchmark's PNG plots, drawn from its JSON report: speculation's own speedup per category (over
specmesh's own plain decoding, the headline), and latency and throughput against load for each policy."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def write_plots(report: dict, directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = [_speedup_per_category(report, directory / "speedup_per_category.png")]
    if report.get("load_sweep"):
        written.append(_latency_vs_load(report, directory / "latency_vs_load.png"))
    return written


def _speedup_per_category(report: dict, path: Path) -> Path:
    categories = list(report["per_category"])
    best = report["summary"].get("best_single_drafter")
    series = [("engine", "router, adaptive (in process)"), ("router_fixed", "router, fixed k (in process)")]
    if best:
        series.append((f"single:{best}", f"best single drafter ({best}, fixed k)"))
    if "cluster" in report["modes"]:
        series.append(("cluster", "router, adaptive (cluster)"))
    width = 0.8 / len(series)
    figure, axes = plt.subplots(figsize=(max(6.0, 1.2 * len(categories) + 2), 4.5))
    for i, (mode, label) in enumerate(series):
        values = [report["per_category"][c].get(mode, {}).get("speedup_vs_own_plain", 0.0) for c in categories]
        axes.bar([x + (i - (len(series) - 1) / 2) * width for x in range(len(categories))], values, width, label=label)
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xticks(range(len(categories)), categories, rotation=30, ha="right")
    axes.set_ylabel("speedup over specmesh's own plain decoding")
    axes.set_title(f"{report['target']}: speculation's speedup per category ({report['prompts']['count']} prompts, "
                   f"{report['max_tokens']} tokens)")
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _latency_vs_load(report: dict, path: Path) -> Path:
    rows = report["load_sweep"]
    figure, (latency, throughput) = plt.subplots(1, 2, figsize=(11, 4.5))
    for policy in dict.fromkeys(r["policy"] for r in rows):
        mine = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["concurrency"])
        levels = [r["concurrency"] for r in mine]
        line, = latency.plot(levels, [r["p50_ms"] for r in mine], marker="o", label=f"{policy} p50")
        latency.plot(levels, [r["p99_ms"] for r in mine], marker="x", linestyle="--", color=line.get_color(),
                     label=f"{policy} p99")
        throughput.errorbar(levels, [r["tokens_per_s"] for r in mine], yerr=[r.get("tokens_per_s_spread", 0) for r in mine],
                            marker="o", capsize=3, label=policy)
    for axes in (latency, throughput):
        axes.set_xscale("log", base=2)
        axes.set_xlabel("concurrent requests")
        axes.legend(fontsize="small")
    latency.set_ylabel("latency per output token (ms)")
    throughput.set_ylabel("tokens/s (all requests; mean ± s.e. over rounds)")
    figure.suptitle(f"{report['target']} through the local cluster: no speculation, fixed k, adaptive")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
