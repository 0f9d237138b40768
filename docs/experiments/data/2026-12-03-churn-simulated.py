"""Offline: the real BatchBudget (at HEAD, and with data/2026-12-03-time-excluded-steps.patch applied) on a simulated
step loop with request churn: a step where a request joins (it caches a prompt: not clean) or ends takes longer, and
churn follows the arm's tokens a step. Prints adaptive's tokens/s over the best arm's alone, per rule.
Usage: git show HEAD:specmesh/speculation/batch_budget.py > /tmp/sim/bb_old.py; apply the patch to a copy as
/tmp/sim/bb_new.py; python 2026-12-03-churn-simulated.py"""
import random, statistics, sys, importlib.util
def load(path):
    name = path.split("/")[-1][:-3]; spec = importlib.util.spec_from_file_location(name, path); m = importlib.util.module_from_spec(spec); sys.modules[name] = m; spec.loader.exec_module(m); return m
class Clock:
    now = 0.0
    def __call__(self): return self.now
def simulate(bb, rates, steps=20000, seed=0, sigma=0.08, outlier=0.03, running=16, step_ms=5.0, regime=0.004,
             join=0.25, end_slow=2.0, join_slow=1.8, arms=None, mark_end=False):
    rng = random.Random(seed); clock = Clock(); b = bb.BatchBudget(arms, clock=clock) if arms else bb.BatchBudget(clock=clock)
    slow = 0; tokens = 0; last = None; count = {}
    base = max(rates.values())
    for _ in range(steps):
        arm = b.arm(running); count[arm] = count.get(arm, 0) + 1
        dt = step_ms / 1e3 * (1 + sigma * rng.gauss(0, 1)) * (1.6 if rng.random() < outlier else 1.0)
        if last is not None and arm != last: dt *= 1.5
        if slow: slow -= 1; dt *= 1.3
        elif rng.random() < regime: slow = rng.randrange(10, 60)
        # churn: requests end at a rate that grows with the arm's tokens a step (each request 64 tokens)
        t = rates[arm] * step_ms / 1e3
        ended = rng.random() < join * rates[arm] / 3000
        joined = rng.random() < join * rates[arm] / 3000
        if ended: dt *= end_slow
        if joined: dt *= join_slow
        last = arm
        clock.now += dt; tokens += t
        b.measured(round(t), clean=not joined and not (mark_end and ended))
    return tokens / clock.now / base, {a: round(c / steps, 3) for a, c in count.items()}
old, new = load("/tmp/sim/bb_old.py"), load("/tmp/sim/bb_new.py")
P = old.POLICY
cases = {"plain best by 10%": {0: 3000, P: 2750, 4: 2500},
         "plain ~ policy": {0: 3000, P: 2950, 4: 2500},
         "fixed best 1.3x": {0: 3000, P: 3300, 4: 3900},
         "fixed best 1.08x": {0: 3000, P: 2900, 4: 3250}}
for join in (0.0, 0.25, 0.5):
  for name, rates in cases.items():
    best = max(rates, key=rates.get)
    out = []
    for label, bb, mark in (("old", old, False), ("new", new, False), ("new+end", new, True)):
        res = [simulate(bb, rates, seed=s, join=join, mark_end=mark) for s in range(6)]
        ref = [simulate(bb, rates, seed=s, join=join, arms=(best,)) for s in range(6)]
        out.append(f"{label} {statistics.mean(r[0] / q[0] for r, q in zip(res, ref)):.3f}")
    print(f"join {join} {name:20s}", "  ".join(out))
