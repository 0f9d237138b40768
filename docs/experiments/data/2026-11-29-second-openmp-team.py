"""A second OpenMP team, made by one parallel op on another thread, slows the first team's passes (2 cores).

Run from the repository root: .venv/bin/python docs/experiments/data/2026-11-29-second-openmp-team.py
"""
import random, sys
from concurrent.futures import ThreadPoolExecutor
from specmesh.runtime.loading import configure_threads
from specmesh.runtime.target import load_target
from specmesh.runtime.tree_verifier import TreeVerifier
from specmesh.bench.engine_at_load import engine_at_load
import torch
rng = random.Random(0)
prompts = [tuple(rng.randrange(1000) for _ in range(rng.randrange(48, 144))) for _ in range(64)]
ex = ThreadPoolExecutor(1)
configure_threads(2)
target, runtime = load_target("random:tiny", "float32", "cpu", "shipped", None, None, False)
v = TreeVerifier(runtime, max_sessions=256, max_tree_nodes=64)
engine_at_load(v, prompts[:16], 16, 16)
for r in range(4):
    if r == 2:
        ex.submit(lambda: torch.ones(4_000_000).add_(1)).result()
        print("second team made")
    a = engine_at_load(v, prompts, 64, 16)
    print(f"main {a.tokens_per_s:.0f} tok/s pass {a.full_pass_ms:.2f}")
