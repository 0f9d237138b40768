"""A long prompt cached beside 4 decoding requests, in process, on the embedded target (2026-12-02).

1. What a chunk of t tokens after L cached positions adds to a pass of 4 decoding requests (300 cached each).
2. A 1,400- and a 2,800-token prompt cached with the verifier's budget (half a decode pass) beside the 4:
   the decode passes' median time before and after, the mean and longest pass while the prompt is cached,
   how long it takes. Prints JSON. Run alone on the machine: `.venv/bin/python docs/experiments/data/2026-12-02-prefill-beside-decoding.py`
"""

import json
import time

import torch

from specmesh.runtime.llama import TreeBatch
from specmesh.runtime.loading import EMBEDDED_DEFAULT, configure_threads
from specmesh.runtime.target import load_target, prefill_sessions
from specmesh.runtime.tree_verifier import TreeVerifier, VerifyJob
from specmesh.sampling import SamplingParams
from specmesh.tree import TokenTree, chained, compile_tree

configure_threads(2)
_, runtime = load_target(EMBEDDED_DEFAULT)
tokens = lambda n, k=0: [3 + (i * 7 + k) % 9000 for i in range(n)]  # noqa: E731


def chunk_table() -> dict:
    def session(n):
        s = runtime.new_session()
        prefill_sessions(runtime, [s], [tokens(n)])
        return s

    def median_ms(sessions, trees, rows):
        times = []
        for _ in range(7):
            batch = TreeBatch.build(sessions, trees)
            started = time.perf_counter()
            runtime.forward(batch, rows)
            times.append((time.perf_counter() - started) * 1e3)
        return sorted(times)[3]

    shorts = [session(300) for _ in range(4)]
    decode = [compile_tree(9, TokenTree()) for _ in shorts]
    base = median_ms(shorts, decode, None)
    table = {"decode_4_ms": round(base, 1), "added_ms": {}}
    for cached in (0, 700, 1400, 2100):
        long = session(cached) if cached else runtime.new_session()
        table["added_ms"][cached] = {
            t: round(median_ms(shorts + [long], decode + [chained(tokens(t, 5))], torch.arange(4)) - base, 1)
            for t in (1, 4, 8, 16, 32)}
    return table


def beside(prompt_tokens: int) -> dict:
    verifier = TreeVerifier(runtime)
    shorts = [tuple(tokens(60, k)) for k in range(4)]
    position = [len(s) for s in shorts]
    step = 0

    def decode_jobs():
        return [VerifyJob(f"s{k}", step, position[k], 9, TokenTree(), SamplingParams(), shorts[k] if step == 0 else None)
                for k in range(4)]

    def advance():
        nonlocal step
        step += 1
        position[:] = [p + 1 for p in position]

    def decode_pass_ms():
        times = []
        for _ in range(30):
            started = time.perf_counter()
            verifier.verify(decode_jobs())
            times.append((time.perf_counter() - started) * 1e3)
            advance()
        return sorted(times)[15]

    verifier.verify(decode_jobs())
    advance()
    before = decode_pass_ms()
    history = tuple(tokens(prompt_tokens, 11))
    passes, started_all = [], time.perf_counter()
    while True:
        job = VerifyJob("long", 0, len(history), 5, TokenTree(), SamplingParams(), history)
        started = time.perf_counter()
        result = verifier.verify([job] + decode_jobs(), 0.5 * verifier.decode_cost.ms(4), 200.0)[0]
        passes.append((time.perf_counter() - started) * 1e3)
        advance()
        if not result.prefilling:
            break
    seconds = time.perf_counter() - started_all
    after = decode_pass_ms()  # the decoding requests' caches grew meanwhile: their passes cost more
    mean = sum(passes) / len(passes)
    return {"prompt_tokens": prompt_tokens, "decode_pass_ms_before": round(before, 1),
            "decode_pass_ms_after": round(after, 1), "pass_ms_while_cached": round(mean, 1),
            "ratio_to_decode_passes": round(mean / ((before + after) / 2), 2), "longest_pass_ms": round(max(passes), 1),
            "passes": len(passes), "seconds": round(seconds, 1)}


print(json.dumps({"chunks": chunk_table(), "beside": [beside(1400), beside(2800)]}, indent=1))
