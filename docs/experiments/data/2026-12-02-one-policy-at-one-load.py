"""One policy (or several, alternating: "none,adaptive") at one load through the oracle cluster for SECS seconds,
rounds paired; py-spy (pip install --target /tmp/pyspy py-spy) on verifier, drafter and router unless --nospy.
Usage: python 2026-12-02-one-policy-at-one-load.py POLICIES LEVEL ACCEPTANCE SECS OUTDIR [--nospy]"""
import asyncio, subprocess, sys, tempfile, time
from pathlib import Path
from specmesh.bench.oracle_cluster import random_prompts, plain_answers, ids_input
from specmesh.bench.load_sweep import load_sweep
from specmesh.cluster.launcher import ClusterSpec, LocalCluster
from specmesh.drafters.oracle import PREFIX, OracleEntry, write_oracle_file

policy, level, p, secs = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
out = Path(sys.argv[5]); out.mkdir(exist_ok=True)

with tempfile.TemporaryDirectory() as folder:
    oracle = Path(folder) / "oracle.jsonl"
    spec = ClusterSpec(model="random:tiny", drafters=(f"{PREFIX}{oracle}",), max_tree_nodes=16, job_timeout_s=300)
    with LocalCluster(spec) as cluster:
        from specmesh.runtime.random_models import random_config
        prompts = random_prompts(random_config("random:tiny").vocab_size, 2 * level, seed=0)
        answers = asyncio.run(plain_answers(cluster, prompts, 64, level))
        write_oracle_file(oracle, [OracleEntry(q, tuple(a), p) for q, a in zip(prompts, answers)])
        policies = policy.split(",")
        load_sweep(cluster, prompts, 16, [level], 4, 16, rounds=1, policies=tuple(policies), inputs=ids_input)
        pids = {"verifier": cluster.verifiers[0].popen.pid, "drafter": cluster.drafters[0].popen.pid,
                "router": cluster.routers[0].popen.pid}
        spies = [] if "--nospy" in sys.argv else [subprocess.Popen(["/tmp/pyspy/bin/py-spy", "record", "-p", str(pid), "--format", "raw", "-r", "200",
                                   "-d", str(secs), "-o", str(out / f"{name}.txt"), "--nonblocking"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for name, pid in pids.items()]
        t = time.time(); rows = []
        while time.time() - t < secs:
            for pol in policies:
                rows += load_sweep(cluster, prompts, 64, [level], 4, 16, rounds=1, policies=(pol,), inputs=ids_input,
                                   expected=answers)
        for s in spies: s.wait()
        import statistics
        for pol in policies:
            v = [r["tokens_per_s"] for r in rows if r["policy"] == pol]
            print(pol, level, p, "mean", round(statistics.mean(v)), "n", len(v), "sd", round(statistics.stdev(v)), "unlike", sum(r["answers_unlike_plain"] for r in rows if r["policy"] == pol))
        none = [r["tokens_per_s"] for r in rows if r["policy"] == "none"]
        for pol in policies[1:]:
            v = [r["tokens_per_s"] for r in rows if r["policy"] == pol]
            ratios = [a / b for a, b in zip(v, none)]
            print(pol, "paired ratio vs none: mean", round(statistics.mean(ratios), 3), "sd", round(statistics.stdev(ratios), 3), "n", len(ratios))
