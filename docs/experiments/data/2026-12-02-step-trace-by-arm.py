import json, sys, collections, math
recs = [json.loads(l) for f in sys.argv[1:] for l in open(f)]
steps = []; last_a = None; pinfo = None
for r in recs:
    if r[0] == "a":
        if steps and steps[-1].get("end") is None: steps[-1]["end"] = r[1]
        last_a = r
    elif r[0] == "p": pinfo = r
    elif r[0] == "m" and last_a is not None:
        steps.append({"start": last_a[1], "running": last_a[2], "tokens": r[2], "clean": r[3], "arm": r[4], "switched": r[5], "pass": pinfo[1], "nodes": pinfo[2]})
steps = [s for s in steps if s.get("end") and s["end"] - s["start"] < 0.5]
tot = collections.defaultdict(lambda: [0.0, 0])
for s in steps:
    lc = round(math.log2(max(s["running"], 1)))
    t = tot[(lc, s["arm"])]; t[0] += s["end"] - s["start"]; t[1] += s["tokens"]
T = sum(v[0] for v in tot.values())
print("total time", round(T, 2), "s, tokens", sum(v[1] for v in tot.values()))
for k in sorted(tot): print(k, f"{tot[k][0] / T:6.1%} of time", round(tot[k][1] / tot[k][0]), "tok/s")
