"""First-proposal turn for 64 new requests: sessions opened in the call vs OpenSession first (real service, loopback)."""
import asyncio, statistics, sys, time
sys.path.insert(0, "tests")
from test_propose_many import drafter_service, prompt
from specmesh.cluster.remote_drafter import RemoteDrafter

async def turn(opens, n=64, rounds=30):
    times = []
    async with drafter_service(max_sessions=4096, opens_in_propose=opens) as (address, metrics):
        remote = RemoteDrafter(address, timeout_s=10)
        assert await remote.connect("h")
        for r in range(rounds):
            ids = [f"r{r}-{i}" for i in range(n)]
            for i, rid in enumerate(ids):
                await remote.start(rid, prompt(i % 8) * 20)
            t = time.perf_counter()
            await asyncio.gather(*(remote.propose(rid, 4) for rid in ids))
            times.append((time.perf_counter() - t) * 1e3)
            for rid in ids:
                await remote.end(rid)
        await remote.close()
    return statistics.median(times[3:])

for _ in range(2):
    for opens in (True, False):
        print("opens in the call" if opens else "OpenSession first", round(asyncio.run(turn(opens)), 2), "ms")
