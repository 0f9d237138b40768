"""`python -m specmesh.bench.invariant_tiles`: the measurements behind ``kernels/matmul_triton.TILES``.

For every matrix product of one step of an architecture (random weights, bf16, on CUDA): the time of each
candidate tile at each row count (Triton's ``do_bench``, L2 flushed between calls, so the weights stream
as in a real step), cuBLAS's beside them, and whether each tile gives every row the same bits as the
reference tile does. A tile may join the ladder only if it does; the ladder takes, for each row
count, the fastest such tile (written out as ``ladder``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specmesh.kernels.matmul_triton import TILES, Tile, device_programs, invariant_linear, plan
from specmesh.runtime.random_models import random_config

ROWS = (1, 16, 32, 64, 128, 160, 256, 320, 512)
REFERENCE = Tile(64, 128, 64, 4, 3)  # the tile every other must match bit for bit
CANDIDATES = (
    Tile(16, 16, 256, 4, 4), Tile(16, 32, 128, 4, 4), Tile(16, 32, 256, 4, 3), Tile(16, 64, 128, 4, 4),
    Tile(16, 64, 64, 4, 5), Tile(32, 64, 128, 4, 4), Tile(64, 32, 128, 4, 4), Tile(64, 64, 64, 4, 4),
    Tile(64, 64, 128, 4, 3), Tile(64, 128, 64, 4, 4), Tile(128, 64, 64, 4, 4), Tile(128, 128, 64, 4, 3),
    Tile(128, 128, 64, 8, 3), Tile(128, 256, 64, 8, 3), Tile(256, 128, 64, 8, 3),
)


def step_products(model: str) -> list[tuple[int, int, int]]:
    """(out_features, in_features, times a step) of each distinct product of one step."""
    c = random_config(model)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * head_dim
    layers = c.num_hidden_layers
    return [(qkv, c.hidden_size, layers), (c.hidden_size, c.num_attention_heads * head_dim, layers),
            (2 * c.intermediate_size, c.hidden_size, layers), (c.hidden_size, c.intermediate_size, layers),
            (c.vocab_size, c.hidden_size, 1)]


def main() -> int:
    import triton.testing

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--json", dest="json_out")
    args = parser.parse_args()
    device = torch.device("cuda")
    generator = torch.Generator(device).manual_seed(0)
    shapes = step_products(args.model)
    weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=generator) * 0.02 for n, k, _ in shapes]
    xs = [torch.randn(max(ROWS), k, device=device, dtype=torch.bfloat16, generator=generator) for _, k, _ in shapes]
    expected = [invariant_linear(x, w, tile=REFERENCE) for x, w in zip(xs, weights)]

    def step_ms(fn) -> dict[str, float]:
        times = {}
        for rows in ROWS:
            total = 0.0
            for (_, _, count), x, w in zip(shapes, xs, weights):
                part = x[:rows].contiguous()
                total += count * triton.testing.do_bench(lambda: fn(part, w), warmup=5, rep=20)
            times[str(rows)] = round(total, 3)
        return times

    report: dict = {"model": args.model, "device": torch.cuda.get_device_name(device), "rows": ROWS,
                    "reference_tile": str(REFERENCE), "shipped_ladder": [[most, str(t)] for most, t in TILES], "cublas_ms": step_ms(torch.nn.functional.linear)}
    report["splits"] = {f"{n}x{k}": plan(n, k, device_programs(device)) for n, k, _ in shapes}
    print(f"products of one {args.model} step (ms) at rows {ROWS}, splits of K {report['splits']}\n"
          f"cuBLAS {report['cublas_ms']}", flush=True)
    tiles = {}
    for tile in CANDIDATES:
        try:
            same = all(torch.equal(invariant_linear(x[:rows].contiguous(), w, tile=tile), e[:rows])
                       for x, w, e in zip(xs, weights, expected) for rows in ROWS)
            tiles[str(tile)] = {"same_bits": same, "ms": step_ms(lambda x, w: invariant_linear(x, w, tile=tile))}
        except Exception as exc:  # a tile this device cannot compile (shared memory, registers)
            tiles[str(tile)] = {"error": str(exc).splitlines()[0][:200]}
        print(tile, tiles[str(tile)], flush=True)
    report["tiles"] = tiles
    report["shipped_ladder_ms"] = step_ms(invariant_linear)  # TILES as committed
    print("shipped ladder", report["shipped_ladder_ms"], flush=True)
    exact = [name for name, t in tiles.items() if t.get("same_bits")]
    report["ladder"] = {str(rows): min(exact, key=lambda name: tiles[name]["ms"][str(rows)], default=None)
                        for rows in ROWS}
    print("fastest tile giving the reference's bits, by rows:", report["ladder"], flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
