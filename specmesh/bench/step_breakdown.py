"""Where a one-token step's time goes, on the shipped blocks and on the de-quantized fp32 weights, so that
the two things that make the shipped runtime fast are credited apart: computing the matrix products on
the GGUF's own blocks (the products), and running each decoder layer as one C++ call instead of PyTorch
op by op (the rest: norms, RoPE, attention, K/V writes, activations, and the calls between them).

    python -m specmesh.bench.step_breakdown --json OUT

A step's products are timed alone: each layer's fused projections, then the head, called in order on
one row, as the step calls them; the rest is the step less its products.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from specmesh.bench.provenance import provenance
from specmesh.runtime.llama import LlamaRuntime, TreeBatch
from specmesh.runtime.loading import EMBEDDED_DEFAULT, configure_threads
from specmesh.runtime.target import make_runtime, prefilled_session
from specmesh.speculation.assembly import assemble
from specmesh.tree import TokenTree, compile_tree


def _median_ms(call: Callable[[], object], repeats: int) -> float:
    call()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


@torch.no_grad()
def breakdown(runtime: LlamaRuntime, context: Sequence[int], repeats: int) -> dict:
    """One-token step, its products alone and the rest, in ms (medians; steps and products interleaved in
    rounds so that drift biases neither)."""
    session = prefilled_session(runtime, context)
    tree = compile_tree(context[-1], TokenTree.chain([]))
    row = torch.randn(1, runtime.config.hidden_size, dtype=runtime.dtype)
    inner = runtime.config.intermediate_size

    def step():
        runtime.forward(TreeBatch.build([session], [tree]))

    def products():
        for layer in runtime.layers:
            layer.qkv(row)
            layer.out(row)
            layer.down(layer.gate_up(row)[:, :inner].contiguous())
        runtime.lm_head(row)

    rounds = {"step": [], "products": []}
    for _ in range(5):
        rounds["step"].append(_median_ms(step, repeats))
        rounds["products"].append(_median_ms(products, repeats))
    session.free()
    step_ms, products_ms = statistics.median(rounds["step"]), statistics.median(rounds["products"])
    return {"precision": runtime.precision, "fused_layers": runtime.fused_layers, "step_ms": round(step_ms, 3),
            "products_ms": round(products_ms, 3), "rest_ms": round(step_ms - products_ms, 3)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specmesh.bench.step_breakdown", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=EMBEDDED_DEFAULT, help="a GGUF target (default: the embedded one)")
    parser.add_argument("--context", type=int, default=150, help="committed tokens while steps are timed")
    parser.add_argument("--repeats", type=int, default=40, help="timed calls of each, per round (5 rounds)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", dest="json_out")
    args = parser.parse_args(argv)
    configure_threads(args.threads)
    assembly = assemble(args.model, [])
    context = list(range(100, 100 + args.context))
    shipped = breakdown(assembly.runtime, context, args.repeats)
    fp32 = breakdown(make_runtime(assembly.target.model), context, args.repeats)
    report = {
        "provenance": provenance(sys.argv[1:] if argv is None else argv, parser.prog),
        "model": args.model, "threads": torch.get_num_threads(), "context": args.context,
        "shipped": shipped, "fp32": fp32,
        # the step's gain, split: products on the blocks vs on fp32 weights; the rest fused vs op by op
        "step_speedup": round(fp32["step_ms"] / shipped["step_ms"], 2),
        "products_speedup": round(fp32["products_ms"] / shipped["products_ms"], 2),
        "rest_speedup": round(fp32["rest_ms"] / shipped["rest_ms"], 2),
        "of_the_saving_products": round((fp32["products_ms"] - shipped["products_ms"])
                                        / (fp32["step_ms"] - shipped["step_ms"]), 3),
    }
    print(json.dumps(report, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
