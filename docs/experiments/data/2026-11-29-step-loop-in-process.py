import asyncio, random, time, torch
from specmesh.runtime.target import load_target
from specmesh.runtime.tree_verifier import TreeVerifier
from specmesh.speculation.engine import InProcessVerifier
from specmesh.speculation.engine_core import EngineCore
from specmesh.speculation.policy import FixedPolicy
from specmesh.speculation.requests import Request
from specmesh.sampling import SamplingParams
from specmesh.runtime.loading import configure_threads
configure_threads(2)
target, runtime = load_target("random:tiny", None, "cpu", "shipped", None, None, False)
rng = random.Random(0)
prompts = [tuple(rng.randrange(1000) for _ in range(rng.randrange(48, 144))) for _ in range(512)]
async def run(n, level):
    core = EngineCore(InProcessVerifier(TreeVerifier(runtime)), max_running=level)
    for i, p in enumerate(prompts[:n]):
        core.add(Request(p, SamplingParams(max_tokens=64), request_id=str(i)), FixedPolicy().begin("", 0))
    tokens = 0
    t = time.perf_counter()
    while core.num_requests:
        for o in await core.step():
            tokens += len(o.token_ids)
    return tokens / (time.perf_counter() - t)
asyncio.run(run(128, 64))
for level in (1, 16, 64):
    n = 512 if level > 1 else 16
    print("in process, concurrency", level, "tok/s", round(asyncio.run(run(n, level)), 1))
