import asyncio, os, random, sys, time
from specmesh.cluster.launcher import ClusterSpec, LocalCluster
from specmesh.client import AsyncClient
loop = sys.argv[1]
TICK = os.sysconf("SC_CLK_TCK")
def cpu(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / TICK
spec = ClusterSpec(model="random:tiny", drafters=(), step_loop=loop, http_port=None)
rng = random.Random(0)
prompts = [tuple(rng.randrange(1000) for _ in range(rng.randrange(48, 144))) for _ in range(512)]
async def run(cluster, n):
    gate = asyncio.Semaphore(64)
    async with AsyncClient(cluster.router_address, max_in_flight=128) as client:
        async def one(p):
            async with gate:
                return await client.generate(prompt_ids=p, max_tokens=64, speculation="off")
        return await asyncio.gather(*(one(p) for p in prompts[:n]))
with LocalCluster(spec) as cluster:
    asyncio.run(run(cluster, 128))
    pids = {"verifier": cluster.verifiers[0].popen.pid, "router": cluster.router.popen.pid, "client": os.getpid(),
            "redis": cluster.redis.process.pid if hasattr(cluster.redis, "process") else None}
    pids = {k: v for k, v in pids.items() if v}
    before = {k: cpu(p) for k, p in pids.items()}
    t = time.perf_counter()
    out = asyncio.run(run(cluster, 512))
    wall = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in out)
    print(loop, "tok/s", round(tokens / wall, 1), "wall", round(wall, 2))
    for k, p in pids.items():
        used = cpu(p) - before[k]
        print(f"  {k}: {used:.2f} s CPU = {used / wall:.2f} cores, {used * 1e3 / tokens:.3f} ms/token")
