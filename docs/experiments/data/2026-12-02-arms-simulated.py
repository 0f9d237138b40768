"""Offline: the real BatchBudget on a simulated noisy step loop; tokens/s of adaptive vs the best arm alone."""
import random, sys, statistics
from specmesh.speculation.batch_budget import BatchBudget, POLICY

class Clock:
    now = 0.0
    def __call__(self): return self.now

def simulate(rates, steps=20000, seed=0, sigma=0.08, outlier=0.03, running=16, step_ms=5.0, regime=0.004, arms=None):
    rng = random.Random(seed); clock = Clock(); b = BatchBudget(arms, clock=clock) if arms else BatchBudget(clock=clock)
    slow = 0
    tokens = 0; count = {}
    base = max(rates.values())
    last = None
    for _ in range(steps):
        arm = b.arm(running); count[arm] = count.get(arm, 0) + 1
        # a step of the arm: tokens at its rate, time noisy; a switch costs an extra half step
        dt = step_ms / 1e3 * (1 + sigma * rng.gauss(0, 1)) * (1.6 if rng.random() < outlier else 1.0)
        if last is not None and arm != last: dt *= 1.5
        if slow: slow -= 1; dt *= 1.3
        elif rng.random() < regime: slow = rng.randrange(10, 60)
        last = arm
        t = rates[arm] * step_ms / 1e3
        clock.now += dt; tokens += t
        b.measured(round(t))
    return tokens / clock.now / base, {a: round(c / steps, 3) for a, c in count.items()}

cases = {"plain best by 10%": {0: 3000, POLICY: 2750, 4: 2500},
         "plain ~ policy": {0: 3000, POLICY: 2950, 4: 2500},
         "fixed best 1.3x": {0: 3000, POLICY: 3300, 4: 3900},
         "fixed best 1.08x": {0: 3000, POLICY: 2900, 4: 3250}}
import specmesh.speculation.batch_budget as bb

for name, rates in cases.items():
    best = max(rates, key=rates.get)
    res = [simulate(rates, seed=s) for s in range(8)]
    ref = [simulate(rates, seed=s, arms=(best,)) for s in range(8)]
    print(f"{name:20s} vs best alone {statistics.mean(r[0] / q[0] for r, q in zip(res, ref)):.3f}  shares {res[0][1]}")
