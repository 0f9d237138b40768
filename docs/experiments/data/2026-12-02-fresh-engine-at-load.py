"""Fresh adaptive engines (learning included) vs plain, in process, embedded target, MT-Bench first 16 of 2/category."""
import statistics, sys, time
from dataclasses import replace
from specmesh.bench.run import first_of_each_category
from specmesh.cluster.launcher import DEFAULT_DRAFTERS
from specmesh.prompts import mtbench_prompts
from specmesh.sampling import SamplingParams
from specmesh.speculation.assembly import assemble
from specmesh.speculation.classifier import default_classifier
from specmesh.runtime.loading import configure_threads
configure_threads(2)
a = assemble("smollm2-135m-instruct", DEFAULT_DRAFTERS)
cl = default_classifier()
reqs = [a.request(p.text, SamplingParams(max_tokens=64), cl) for p in first_of_each_category(mtbench_prompts(), 2)]
plain = a.engine(0)
def run(e, tag, level):
    batch = [replace(r, request_id=f"{tag}-{i}") for i, r in enumerate(reqs)]
    t = time.perf_counter(); done = e.generate(batch, concurrency=level); s = time.perf_counter() - t
    return sum(len(c.token_ids) for c in done) / s
run(plain, "w", 4); run(a.engine(16, "adaptive"), "w2", 4)
for level in (4, 16):
    ratios = []
    for r in range(4):
        fresh = a.engine(16, "adaptive")
        if r % 2: ad = run(fresh, f"a{r}", level); pl = run(plain, f"p{r}", level)
        else: pl = run(plain, f"p{r}", level); ad = run(fresh, f"a{r}", level)
        ratios.append(ad / pl)
    print(level, [round(x, 3) for x in ratios], "mean", round(statistics.fmean(ratios), 3))
