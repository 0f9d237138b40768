"""`specmesh bench --model random:<architecture>`: the target runtime against the hardware's limit.

A verification step cannot be faster than reading every weight once: its weight-streaming limit is the
bytes of the weights over the device's measured copy bandwidth (bytes read plus written by a large
device-to-device copy). The report gives, at a fixed context: the one-token step next to that limit,
the cost of scoring a tree of k nodes over the one-token step (the verify cost curve), batched passes of
many requests, Hugging Face's own eager step, and a losslessness check (speculative steps give exactly
the tokens of plain steps). Weights are random: a step's time depends only on the shapes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from specmesh.errors import InvalidArgument
from specmesh.runtime.llama import TreeBatch
from specmesh.runtime.loading import configure_threads, pick_device, pick_dtype
from specmesh.runtime.paged_llama import PagedLlamaRuntime
from specmesh.runtime.random_models import random_model, weight_bytes
from specmesh.runtime.target import prefill_sessions
from specmesh.tree import TokenTree, compile_tree

CONTEXT = 512  # committed tokens of every request while steps are timed
CURVE_NODES = (0, 1, 3, 7, 15, 31, 63)  # tree nodes below the root
BATCH = 16
BATCH_TREE_NODES = 8
LOSSLESS_STEPS = 24


def copy_bandwidth(device: torch.device, megabytes: int) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read and written (median of 10)."""
    source = torch.randn(megabytes * 2**20 // 4, device=device)
    target = torch.empty_like(source)
    times = timed(lambda: target.copy_(source), device, repeats=10, warmup=2)
    return 2 * source.numel() * 4 / (statistics.median(times) / 1e3)


def timed(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 3) -> list[float]:
    """Milliseconds of each of ``repeats`` calls, the device synchronised around each (wall clock: what a
    verifier waits, host work included)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - started) * 1e3)
    return times


def binary_tree(tokens: list[int]) -> TokenTree:
    """A tree where node i hangs under node (i - 1) // 2: wide and deep, as fused drafts are."""
    parents = tuple(-1 if i == 0 else (i - 1) // 2 for i in range(len(tokens)))
    return TokenTree(tuple(tokens), parents, (1.0,) * len(tokens))


def hf_step_ms(hf_model: torch.nn.Module, context: torch.Tensor, device: torch.device, repeats: int) -> float:
    """Hugging Face's eager one-token step after ``context`` (its own KV cache)."""
    from transformers import DynamicCache

    with torch.no_grad():
        try:
            cache = DynamicCache(config=hf_model.config)
        except TypeError:  # older transformers
            cache = DynamicCache()
        hf_model(context[None, :-1].to(device), past_key_values=cache, use_cache=True)
        last = context[None, -1:].to(device)

        def step():
            hf_model(last, past_key_values=cache, use_cache=True)
            cache.crop(-1)  # forget the step: negative counts from the end in every version

        return statistics.median(timed(step, device, repeats))


def plain_greedy(runtime, prompt: list[int], steps: int) -> list[int]:
    """The ``steps`` tokens plain greedy decoding gives after ``prompt``, one target pass a token."""
    session = runtime.new_session()
    prefill_sessions(runtime, [session], [prompt[:-1]])
    tokens = [prompt[-1]]
    for _ in range(steps):
        logits = runtime.forward(TreeBatch.build([session], [compile_tree(tokens[-1], TokenTree())]))
        session.keep_rows([0])
        tokens.append(int(logits[0].argmax()))
    session.free()
    return tokens[1:]


def lossless_check(runtime: PagedLlamaRuntime, prompt: list[int]) -> dict:
    """Plain greedy steps, then the same tokens verified as trees (the true continuation with a wrong
    sibling at every depth): every step must accept exactly what plain decoding produced."""
    plain = [prompt[-1]] + plain_greedy(runtime, prompt, LOSSLESS_STEPS)

    session = runtime.new_session()
    prefill_sessions(runtime, [session], [prompt[:-1]])
    spoken, steps = [prompt[-1]], 0
    while len(spoken) < len(plain):
        guess = plain[len(spoken) : len(spoken) + 4]
        paths = [guess] + [guess[:d] + [(guess[d] + 1) % runtime.vocab_size] for d in range(len(guess))]
        tree = TokenTree.from_paths(paths)
        compiled = compile_tree(spoken[-1], tree)
        logits = runtime.forward(TreeBatch.build([session], [compiled]))
        node, kept = -1, [0]
        while True:  # greedy walk: follow the child whose token is the target's argmax
            row = 0 if node == -1 else node + 1
            best = int(logits[row].argmax())
            spoken.append(best)
            child = next((c for c in range(len(tree)) if tree.parents[c] == node and tree.tokens[c] == best), None)
            if child is None:
                break
            node = child
            kept.append(child + 1)
        session.keep_rows(kept)
        steps += 1
    session.free()
    return {"identical": spoken[: len(plain)] == plain, "tokens": len(plain) - 1, "speculative_steps": steps}


def batch_invariance(runtime: PagedLlamaRuntime, sessions: list, trees: list) -> dict:
    """Each request's rows scored in one batch against the same tree scored alone: how many rows have
    the same logits bit for bit, and the same argmax (a batch's row bucket may use other matrix kernels)."""
    together = runtime.forward(TreeBatch.build(sessions, trees))
    alone = torch.cat([runtime.forward(TreeBatch.build([s], [t])) for s, t in zip(sessions, trees)])
    rows = together.shape[0]
    return {"rows": rows, "bitwise_equal": int((together == alone).all(dim=1).sum()),
            "same_argmax": int((together.argmax(1) == alone.argmax(1)).sum())}


def measure(runtime: PagedLlamaRuntime, contexts: list[torch.Tensor], device: torch.device, repeats: int,
            limit_ms: float, curve: bool = True) -> dict:
    """Every timed pass of the report on ``runtime``, then its batch invariance and lossless checks."""
    report: dict = {}
    context_len = contexts[0].shape[0]
    sessions = [runtime.new_session() for _ in range(BATCH)]
    started = time.perf_counter()
    prefill_sessions(runtime, sessions, [c.tolist()[:-1] for c in contexts])
    if device.type == "cuda":
        torch.cuda.synchronize()
    report["prefill_tokens_per_s"] = round(BATCH * (context_len - 1) / (time.perf_counter() - started))
    lasts = [int(c[-1]) for c in contexts]
    drafted = [c.tolist()[:63] for c in contexts]

    def one(nodes: int, shape: Callable[[list[int]], TokenTree] = TokenTree.chain) -> Callable[[], object]:
        batch = TreeBatch.build([sessions[0]], [compile_tree(lasts[0], shape(drafted[0][:nodes]))])
        return lambda: runtime.forward(batch)

    print("one-token step and verify cost curve ...", flush=True)
    step_ms = statistics.median(timed(one(0), device, repeats))
    report["step_ms"] = round(step_ms, 3)
    report["step_vs_limit"] = round(step_ms / limit_ms, 2)
    if curve:
        report["cost_curve"] = {str(n): round(statistics.median(timed(one(n), device, repeats)) / step_ms, 3)
                                for n in CURVE_NODES[1:]}
    report["tree16_vs_step"] = round(statistics.median(timed(one(16, binary_tree), device, repeats)) / step_ms, 3)
    prepare = TreeBatch.build([sessions[0]], [compile_tree(lasts[0], TokenTree())])
    report["host_prepare_ms"] = round(statistics.median(timed(lambda: runtime.prepare(prepare), device, repeats)), 3)

    print(f"batched passes ({BATCH} requests) ...", flush=True)
    for name, nodes in (("batch16_plain", 0), (f"batch16_tree{BATCH_TREE_NODES}", BATCH_TREE_NODES)):
        trees = [compile_tree(last, binary_tree(d[:nodes])) for last, d in zip(lasts, drafted)]
        batch = TreeBatch.build(sessions, trees)
        ms = statistics.median(timed(lambda: runtime.forward(batch), device, repeats))
        report[f"{name}_ms"] = round(ms, 3)
        report[f"{name}_vs_step"] = round(ms / step_ms, 3)
    report["batch_invariance"] = batch_invariance(runtime, sessions, trees)
    for session in sessions:
        session.free()

    print("lossless check ...", flush=True)
    report["lossless"] = lossless_check(runtime, contexts[0].tolist()[:64])
    report["kv_pool_free_after"] = runtime.pool.free_pages == runtime.pool.capacity_pages
    return report


def run_runtime_bench(args: argparse.Namespace) -> int:
    configure_threads(args.threads)
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    context_len = args.context
    if context_len < 2:
        raise InvalidArgument("context", f"must be >= 2, got {context_len}")
    print(f"{args.model}: random weights on {device} in {str(dtype).removeprefix('torch.')} ...", flush=True)
    hf_model = random_model(args.model, dtype, device)
    nbytes = weight_bytes(hf_model)
    bandwidth = copy_bandwidth(device, 1024 if device.type == "cuda" else 256)
    limit_ms = nbytes / bandwidth * 1e3
    report: dict = {
        "model": args.model, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."), "context": context_len, "weight_bytes": nbytes,
        "copy_bandwidth_gbps": round(bandwidth / 1e9, 1), "streaming_limit_ms": round(limit_ms, 3),
    }
    generator = torch.Generator().manual_seed(0)
    vocab = hf_model.config.vocab_size
    contexts = [torch.randint(0, vocab, (context_len,), generator=generator) for _ in range(BATCH)]
    repeats = args.repeats
    if not args.skip_baselines:
        print("hf eager step ...", flush=True)
        report["hf_step_ms"] = round(hf_step_ms(hf_model, contexts[0], device, repeats), 3)

    runtime = PagedLlamaRuntime(hf_model, kv_cache_gb=args.kv_cache_gb, graphs=None if device.type == "cuda" else False)
    report["kv_pool_pages"] = runtime.pool.capacity_pages
    report.update(measure(runtime, contexts, device, repeats, limit_ms))
    if device.type == "cuda":  # the same passes with batch-invariant matrix products (Triton, not cuBLAS)
        del runtime
        torch.cuda.empty_cache()
        print("batch-invariant matrix products ...", flush=True)
        invariant = PagedLlamaRuntime(hf_model, kv_cache_gb=args.kv_cache_gb, batch_invariant=True)
        report["batch_invariant"] = measure(invariant, contexts, device, repeats, limit_ms, curve=False)
    _print(report)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    return 0


def _print(report: dict) -> None:
    print(f"\n{report['model']} on {report['device']} ({report['dtype']}), context {report['context']}")
    print(f"  weights {report['weight_bytes'] / 1e9:.2f} GB, copy bandwidth {report['copy_bandwidth_gbps']} GB/s: "
          f"streaming limit {report['streaming_limit_ms']} ms")
    hf = f" (Hugging Face eager {report['hf_step_ms']} ms)" if "hf_step_ms" in report else ""
    print(f"  one-token step {report['step_ms']} ms = {report['step_vs_limit']}x the limit{hf}; "
          f"host work {report['host_prepare_ms']} ms")
    print("  verify cost over a one-token step, by tree nodes: "
          + ", ".join(f"{k}: {v}" for k, v in report["cost_curve"].items())
          + f"; a 16-node tree {report['tree16_vs_step']}")
    print(f"  {BATCH} requests, one row each: {report['batch16_plain_ms']} ms ({report['batch16_plain_vs_step']}x a step); "
          f"{BATCH_TREE_NODES}-node trees: {report[f'batch16_tree{BATCH_TREE_NODES}_ms']} ms "
          f"({report[f'batch16_tree{BATCH_TREE_NODES}_vs_step']}x)")
    invariance = report["batch_invariance"]
    print(f"  batch invariance: of {invariance['rows']} rows scored in one batch and alone, "
          f"{invariance['bitwise_equal']} bitwise equal, {invariance['same_argmax']} with the same argmax")
    lossless = report["lossless"]
    print(f"  lossless: speculative == plain over {lossless['tokens']} tokens: {lossless['identical']} "
          f"({lossless['speculative_steps']} speculative steps); KV pool empty after: {report['kv_pool_free_after']}")
    invariant = report.get("batch_invariant")
    if invariant:
        rows = invariant["batch_invariance"]
        print(f"  batch-invariant matrix products: step {invariant['step_ms']} ms ({invariant['step_vs_limit']}x the "
              f"limit), 16-node tree {invariant['tree16_vs_step']}x, {BATCH} requests x {BATCH_TREE_NODES}-node trees "
              f"{invariant[f'batch16_tree{BATCH_TREE_NODES}_ms']} ms; rows equal in a batch and alone: "
              f"{rows['bitwise_equal']}/{rows['rows']}; lossless {invariant['lossless']['identical']}")
