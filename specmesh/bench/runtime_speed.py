"""`specmesh bench --model random:<architecture>`: the target runtime against the hardware's limit.

A verification step cannot be faster than reading every weight once: its weight-streaming limit is the
bytes of the weights over the device's measured copy bandwidth (bytes read plus written by a large
device-to-device copy). The report gives, at a fixed context: the one-token step next to that limit,
the cost of scoring a tree of k nodes over the one-token step (the verify cost curve), batched passes of
many requests, Hugging Face's own eager step, and a losslessness check (speculative steps give exactly
the tokens of plain steps). Weights are random: a step's time depends only on the shapes.

With ``--offload`` the decoder layers stay in host memory and stream to the device every pass: the limit
is then their bytes over the measured host-to-device bandwidth, and the report adds trees of 256 and
1,024 nodes, the sizes that regime pays for. Such a pass takes ~0.26 s for an 8B over PCIe, so an offloaded
report counts its passes: a shorter curve, no batched passes or invariance check (the same products as
the device-resident report's), a lossless check of two requests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from specmesh.bench.provenance import provenance
from specmesh.errors import InvalidArgument
from specmesh.runtime.llama import TreeBatch
from specmesh.runtime.loading import configure_threads, pick_device, pick_dtype
from specmesh.runtime.paged_llama import PagedLlamaRuntime
from specmesh.runtime.random_models import random_model, weight_bytes
from specmesh.runtime.target import prefill_sessions
from specmesh.tree import TokenTree, compile_tree

CONTEXT = 512  # committed tokens of every request while steps are timed
CURVE_NODES = (0, 1, 3, 7, 15, 31, 63)  # tree nodes below the root
BATCHES = ((16, 0), (16, 8), (64, 4))  # timed batched passes: (requests, tree nodes each)
LOSSLESS_STEPS = 24
LOSSLESS_GUESSES = (1, 4, 16, 31)  # true tokens guessed a step, in turn: trees of 2 to 62 nodes with the siblings
MIXED_NODES = (0, 1, 3, 7, 15, 31, 48, 63)  # tree sizes mixed in one batch by the invariance check
OFFLOAD_TREES = (256, 1024)  # the trees an offloaded pass pays for, timed against its one-token step
OFFLOAD_CURVE_NODES = (0, 7, 63)
OFFLOAD_REQUESTS = 2  # lossless-checked together and alone
OFFLOAD_LOSSLESS_STEPS = 8

def batch_name(requests: int, nodes: int) -> str:
    """The report's key of a batched pass: ``batch16_plain``, ``batch64_tree4``."""
    return f"batch{requests}_" + (f"tree{nodes}" if nodes else "plain")


def copy_bandwidth(device: torch.device, megabytes: int) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read and written (median of 10)."""
    source = torch.randn(megabytes * 2**20 // 4, device=device)
    target = torch.empty_like(source)
    times = timed(lambda: target.copy_(source), device, repeats=10, warmup=2)
    return 2 * source.numel() * 4 / (statistics.median(times) / 1e3)


def host_to_device_bandwidth(device: torch.device, megabytes: int) -> float:
    """Bytes per second of a copy from host memory (pinned on a GPU machine) to ``device``: the link an
    offloaded target's layers cross every pass (median of 10)."""
    source = torch.randn(megabytes * 2**20 // 4)
    if device.type == "cuda":
        source = source.pin_memory()
    target = torch.empty_like(source, device=device)
    times = timed(lambda: target.copy_(source, non_blocking=True), device, repeats=10, warmup=2)
    return source.numel() * 4 / (statistics.median(times) / 1e3)


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


def guessed_tree(truth: list[int], vocab: int) -> TokenTree:
    """The true continuation ``truth`` with a wrong sibling at every depth, each followed by one more token:
    a tree of 3 x len(truth) - 1 nodes whose greedy walk must accept exactly ``truth``."""
    paths = [truth] + [truth[:d] + [(truth[d] + 1) % vocab, truth[d]] for d in range(len(truth))]
    return TokenTree.from_paths(paths)


def greedy_walk(tree: TokenTree, logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """(tokens the target speaks, tree rows kept) for one scored tree (row 0: the root)."""
    node, kept, spoken = -1, [0], []
    while True:  # follow the child whose token is the target's argmax
        best = int(logits[0 if node == -1 else node + 1].argmax())
        spoken.append(best)
        child = next((c for c in range(len(tree)) if tree.parents[c] == node and tree.tokens[c] == best), None)
        if child is None:
            return spoken, kept
        node = child
        kept.append(child + 1)


def lossless_check(runtime: PagedLlamaRuntime, prompts: list[list[int]], batch_sizes: Sequence[int],
                   steps: int = LOSSLESS_STEPS) -> dict:
    """``steps`` plain greedy steps of each prompt alone, then the same tokens verified as trees (the true
    continuation, ``LOSSLESS_GUESSES`` tokens long in turn, with wrong siblings) for the first ``b`` prompts
    together in one batch, for each ``b`` in ``batch_sizes``: every request must speak exactly what plain
    decoding produced. Trees of 2 to 62 nodes in batches of 1 to 64 cross every row bucket up to 512."""
    plains = [[p[-1]] + plain_greedy(runtime, p, steps) for p in prompts[: max(batch_sizes)]]
    report = {"tokens": steps, "identical": True}
    for size in batch_sizes:
        sessions = [runtime.new_session() for _ in range(size)]
        prefill_sessions(runtime, sessions, [p[:-1] for p in prompts[:size]])
        spoken = [[p[-1]] for p in prompts[:size]]
        passes = 0
        while any(len(s) < len(plain) for s, plain in zip(spoken, plains)):
            trees = []
            for b, (said, plain) in enumerate(zip(spoken, plains)):
                guess = LOSSLESS_GUESSES[(passes + b) % len(LOSSLESS_GUESSES)]
                trees.append(guessed_tree(plain[len(said) : len(said) + guess] or [0], runtime.vocab_size))
            compiled = [compile_tree(said[-1], tree) for said, tree in zip(spoken, trees)]
            batch = TreeBatch.build(sessions, compiled)
            logits = runtime.forward(batch)
            for b, (session, tree, said) in enumerate(zip(sessions, trees, spoken)):
                tokens, kept = greedy_walk(tree, logits[batch.cu_rows[b] : batch.cu_rows[b + 1]])
                said.extend(tokens)
                session.keep_rows(kept)
            passes += 1
        same = sum(said[: len(plain)] == plain for said, plain in zip(spoken, plains))
        report[f"batch{size}"] = {"identical_requests": same, "requests": size, "speculative_steps": passes}
        report["identical"] &= same == size
        for session in sessions:
            session.free()
    return report


def batch_invariance(runtime: PagedLlamaRuntime, sessions: list, lasts: list[int], drafted: list[list[int]]) -> dict:
    """Each request's rows scored in a batch against its tree scored alone, for the timed batches and one
    batch mixing every tree size: rows with the same logits bit for bit, and the same argmax."""
    mixes = {batch_name(r, n): [n] * r for r, n in BATCHES if n}
    mixes["batch16_mixed"] = [MIXED_NODES[i % len(MIXED_NODES)] for i in range(16)]
    report = {"rows": 0, "bitwise_equal": 0, "same_argmax": 0}
    alone_logits: dict[tuple[int, int], torch.Tensor] = {}
    for name, nodes in mixes.items():
        trees = [compile_tree(last, binary_tree(d[:n])) for last, d, n in zip(lasts, drafted, nodes)]
        together = runtime.forward(TreeBatch.build(sessions[: len(trees)], trees))
        alone = torch.cat([alone_logits.setdefault((i, n), runtime.forward(TreeBatch.build([sessions[i]], [t])))
                           for i, (t, n) in enumerate(zip(trees, nodes))])
        equal = int((together == alone).all(dim=1).sum())
        report[name] = f"{equal}/{together.shape[0]}"
        report["rows"] += together.shape[0]
        report["bitwise_equal"] += equal
        report["same_argmax"] += int((together.argmax(1) == alone.argmax(1)).sum())
    return report


def measure(runtime: PagedLlamaRuntime, contexts: list[torch.Tensor], device: torch.device, repeats: int,
            limit_ms: float, curve: bool = True, lossless: bool = True, offloaded: bool = False) -> dict:
    """Every timed pass of the report on ``runtime``, then its batch invariance and (``lossless``) lossless
    checks; ``offloaded``: the offloaded report's passes (the module's docstring)."""
    curve_nodes, big_trees, batches = (OFFLOAD_CURVE_NODES, OFFLOAD_TREES, ()) if offloaded else (
        CURVE_NODES, (), BATCHES)
    warmup = 1 if offloaded else 3  # a streamed pass is as slow the tenth time; one pass compiles its shapes
    report: dict = {}
    context_len = contexts[0].shape[0]
    sessions = [runtime.new_session() for _ in contexts]
    started = time.perf_counter()
    prefill_sessions(runtime, sessions, [c.tolist()[:-1] for c in contexts])
    if device.type == "cuda":
        torch.cuda.synchronize()
    report["prefill_tokens_per_s"] = round(len(contexts) * (context_len - 1) / (time.perf_counter() - started))
    lasts = [int(c[-1]) for c in contexts]
    longest = max((63, *big_trees))
    drafted = [(c.tolist() * (1 + longest // len(c)))[:longest] for c in contexts]  # a big tree's tokens repeat

    def one(nodes: int, shape: Callable[[list[int]], TokenTree] = TokenTree.chain) -> Callable[[], object]:
        batch = TreeBatch.build([sessions[0]], [compile_tree(lasts[0], shape(drafted[0][:nodes]))])
        return lambda: runtime.forward(batch)

    print("one-token step and verify cost curve ...", flush=True)
    step_ms = statistics.median(timed(one(0), device, repeats, warmup))
    report["step_ms"] = round(step_ms, 3)
    report["step_vs_limit"] = round(step_ms / limit_ms, 2)
    print(f"  one-token step {report['step_ms']} ms = {report['step_vs_limit']}x the limit", flush=True)  # at once
    if curve:
        report["cost_curve"] = {str(n): round(statistics.median(timed(one(n), device, repeats, warmup)) / step_ms, 3)
                                for n in curve_nodes[1:]}
    for nodes in (16, *big_trees):
        tree_ms = statistics.median(timed(one(nodes, binary_tree), device, repeats, warmup))
        report[f"tree{nodes}_vs_step"] = round(tree_ms / step_ms, 3)
    prepare = TreeBatch.build([sessions[0]], [compile_tree(lasts[0], TokenTree())])
    report["host_prepare_ms"] = round(statistics.median(timed(lambda: runtime.prepare(prepare), device, repeats)), 3)

    if batches:
        print(f"batched passes {batches} (requests, tree nodes) ...", flush=True)
    for requests, nodes in batches:
        trees = [compile_tree(last, binary_tree(d[:nodes])) for last, d in zip(lasts[:requests], drafted)]
        batch = TreeBatch.build(sessions[:requests], trees)
        ms = statistics.median(timed(lambda: runtime.forward(batch), device, repeats, warmup))
        name = batch_name(requests, nodes)
        report[f"{name}_ms"] = round(ms, 3)
        report[f"{name}_vs_step"] = round(ms / step_ms, 3)
    if not offloaded:
        print("batch invariance ...", flush=True)
        report["batch_invariance"] = batch_invariance(runtime, sessions, lasts, drafted)
    for session in sessions:
        session.free()

    if lossless:
        print("lossless check ...", flush=True)
        # 48 to 143 tokens: trees straddle key blocks that plain decoding reads whole, at 64 and at 128
        prompts = [c.tolist()[: 48 + (i * 13) % 96] for i, c in enumerate(contexts)]
        report["lossless"] = lossless_check(runtime, prompts, sorted({1, min(16, len(prompts)), len(prompts)}),
                                            OFFLOAD_LOSSLESS_STEPS if offloaded else LOSSLESS_STEPS)
    report["kv_pool_free_after"] = runtime.pool.free_pages == runtime.pool.capacity_pages
    return report


def run_runtime_bench(args: argparse.Namespace) -> int:
    configure_threads(args.threads)
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    context_len = args.context
    if context_len < 2:
        raise InvalidArgument("context", f"must be >= 2, got {context_len}")
    where = "host memory, streamed to " if args.offload else ""
    print(f"{args.model}: random weights in {where}{device}, {str(dtype).removeprefix('torch.')} ...", flush=True)
    hf_model = random_model(args.model, dtype, torch.device("cpu") if args.offload else device)
    nbytes = weight_bytes(hf_model)
    report: dict = {
        "provenance": provenance(args.argv),
        "model": args.model, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."), "context": context_len, "weight_bytes": nbytes,
    }
    generator = torch.Generator().manual_seed(0)
    vocab = hf_model.config.vocab_size
    requests = OFFLOAD_REQUESTS if args.offload else max(r for r, _ in BATCHES)
    contexts = [torch.randint(0, vocab, (context_len,), generator=generator) for _ in range(requests)]
    repeats = args.repeats
    if args.offload:  # the layers cross the host-to-device link every pass; the head and embeddings stay
        runtime = PagedLlamaRuntime(hf_model, kv_cache_gb=args.kv_cache_gb or None, offload=device)
        streamed = runtime.layers.layer_bytes * len(runtime.layers)
        bandwidth = host_to_device_bandwidth(device, 1024 if device.type == "cuda" else 256)
        limit_ms = streamed / bandwidth * 1e3
        report |= {"offload": True, "streamed_bytes": streamed, "host_to_device_gbps": round(bandwidth / 1e9, 1),
                   "streaming_limit_ms": round(limit_ms, 3)}
    else:
        bandwidth = copy_bandwidth(device, 1024 if device.type == "cuda" else 256)
        limit_ms = nbytes / bandwidth * 1e3
        report |= {"copy_bandwidth_gbps": round(bandwidth / 1e9, 1), "streaming_limit_ms": round(limit_ms, 3)}
        if not args.skip_baselines:
            print("hf eager step ...", flush=True)
            report["hf_step_ms"] = round(hf_step_ms(hf_model, contexts[0], device, repeats), 3)
        graphs = None if device.type == "cuda" else False
        runtime = PagedLlamaRuntime(hf_model, kv_cache_gb=args.kv_cache_gb or None, graphs=graphs)
    report["batch_invariant_products"] = runtime.batch_invariant
    report["kv_pool_pages"] = runtime.pool.capacity_pages
    report.update(measure(runtime, contexts, device, repeats, limit_ms, offloaded=args.offload))
    exact = runtime.batch_invariant and runtime.attention == "triton"  # what promises rows exact in any batch
    if device.type == "cuda" and not args.offload:  # the same passes with the opt-out: cuBLAS under the products
        del runtime
        torch.cuda.empty_cache()
        print("cuBLAS matrix products (--no-batch-invariant) ...", flush=True)
        cublas = PagedLlamaRuntime(hf_model, kv_cache_gb=args.kv_cache_gb or None, batch_invariant=False)
        report["cublas"] = measure(cublas, contexts, device, repeats, limit_ms, curve=False, lossless=False)
    _print(report)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    invariance = report.get("batch_invariance", {"rows": 0, "bitwise_equal": 0})
    failed = not report["lossless"]["identical"] or (exact and invariance["bitwise_equal"] < invariance["rows"])
    if failed:
        print("FAILED: speculative != plain, or a row's logits depend on its batch")
    return 1 if failed else 0


def _batches(report: dict) -> str:
    return ", ".join(f"{r} x {n}-node trees {report[batch_name(r, n) + '_ms']} ms "
                     f"({report[batch_name(r, n) + '_vs_step']}x)" for r, n in BATCHES
                     if batch_name(r, n) + "_ms" in report)


def _print(report: dict) -> None:
    library = "PyTorch" if report["device"] == "cpu" else "cuBLAS"
    products = "batch-invariant Triton" if report["batch_invariant_products"] else library
    print(f"\n{report['model']} on {report['device']} ({report['dtype']}), context {report['context']}, "
          f"matrix products: {products}")
    if report.get("offload"):
        print(f"  offloaded: {report['streamed_bytes'] / 1e9:.2f} GB of layers a pass over "
              f"{report['host_to_device_gbps']} GB/s host to device: streaming limit {report['streaming_limit_ms']} ms")
    else:
        print(f"  weights {report['weight_bytes'] / 1e9:.2f} GB, copy bandwidth {report['copy_bandwidth_gbps']} GB/s: "
              f"streaming limit {report['streaming_limit_ms']} ms")
    hf = f" (Hugging Face eager {report['hf_step_ms']} ms)" if "hf_step_ms" in report else ""
    print(f"  one-token step {report['step_ms']} ms = {report['step_vs_limit']}x the limit{hf}; "
          f"host work {report['host_prepare_ms']} ms")
    print("  verify cost over a one-token step, by tree nodes: "
          + ", ".join(f"{k}: {v}" for k, v in report["cost_curve"].items())
          + "; " + ", ".join(f"a {k.removeprefix('tree').removesuffix('_vs_step')}-node tree {v}"
                             for k, v in report.items() if k.startswith("tree") and k.endswith("_vs_step")))
    if _batches(report):
        print(f"  batched passes (requests x tree): {_batches(report)}")
    for name, part in (("", report), ("cuBLAS: ", report.get("cublas"))):
        if part is None:
            continue
        if name:
            print(f"  {name}step {part['step_ms']} ms ({part['step_vs_limit']}x the limit), 16-node tree "
                  f"{part['tree16_vs_step']}x; {_batches(part)}")
        if rows := part.get("batch_invariance"):
            print(f"  {name}batch invariance: of {rows['rows']} rows scored in batches and alone, "
                  f"{rows['bitwise_equal']} bitwise equal, {rows['same_argmax']} with the same argmax")
        if (lossless := part.get("lossless")) is None:
            continue
        print(f"  {name}lossless: speculative == plain over {lossless['tokens']} tokens: {lossless['identical']} "
              + ", ".join(f"{k}: {v['identical_requests']}/{v['requests']}" for k, v in lossless.items()
                          if k.startswith("batch"))
              + f"; KV pool empty after: {part['kv_pool_free_after']}")
