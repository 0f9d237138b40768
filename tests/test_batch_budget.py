"""The batch's measured budget arms (specmesh/speculation/batch_budget.py) on a hand-driven clock: every
arm measured once at a new load (the first a window, the others tries), the best one kept (the first unless
another leads it by LEAD), a losing one tried briefly now and then, loads apart, a neighbouring load's
standing carried over, steps that cached prompts not scored."""

from itertools import groupby

from specmesh.speculation.batch_budget import (
    DEFAULT_ARMS, LEAD, POLICY, TRY_EVERY, TRY_STEPS, WINDOW_STEPS, BatchBudget,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_steps(budget: BatchBudget, clock: Clock, steps: int, tokens_per_s: dict[int, float],
              running: int = 16) -> list[int]:
    """``steps`` steps of 12 ms, each committing at its arm's rate; the arm of each."""
    arms = []
    for _ in range(steps):
        arm = budget.arm(running)
        arms.append(arm)
        clock.now += 0.012
        budget.measured(round(tokens_per_s[arm] * 0.012))
    budget.arm(running)  # closes the last window
    return arms


def runs(arms: list[int]) -> list[tuple[int, int]]:
    """(arm, steps in a row)."""
    return [(arm, len(list(group))) for arm, group in groupby(arms)]


def test_every_arm_is_measured_then_the_best_runs_and_the_others_are_tried_briefly_now_and_then():
    clock = Clock()
    budget = BatchBudget(clock=clock)
    assert DEFAULT_ARMS == (0, POLICY, 4)  # plain decoding first: what the others must beat
    rates = {POLICY: 1900.0, 0: 2000.0, 4: 1000.0}  # plain decoding pays best
    arms = run_steps(budget, clock, 3000, rates)
    # the others' first measurements are tries; each change of arm adds a step, not scored (drafters catch
    # up on the context they missed)
    assert runs(arms)[:3] == [(0, WINDOW_STEPS), (POLICY, TRY_STEPS + 1), (4, TRY_STEPS + 1)]
    assert all(abs(budget.goodput(16)[arm] - rate) < 0.02 * rate for arm, rate in rates.items())
    later = arms[400:]
    tries = [n for arm, n in runs(later) if arm != 0]
    assert tries and all(n == TRY_STEPS + 1 for n in tries)  # a try is short
    # each loser once in TRY_EVERY windows
    assert len(tries) <= 2 * len(later) / (TRY_EVERY * WINDOW_STEPS) + 2
    assert later.count(0) >= 0.97 * len(later)


def test_an_arm_that_becomes_best_is_kept_and_loads_are_measured_apart():
    clock = Clock()
    budget = BatchBudget((POLICY, 0), clock=clock)
    assert run_steps(budget, clock, 100, {POLICY: 1500.0, 0: 2000.0})[-1] == 0
    arms = run_steps(budget, clock, 1000, {POLICY: 3000.0, 0: 1000.0})  # the drafts got better: tried, then kept
    assert arms[-200:].count(POLICY) >= 190
    assert budget.goodput(1) == {POLICY: None, 0: None}  # a lone request's load was never measured


def test_a_new_load_starts_from_a_measured_neighbour_rescaled_by_its_first_window():
    clock = Clock()
    budget = BatchBudget((POLICY, 0, 4), clock=clock)
    run_steps(budget, clock, 200, {POLICY: 1000.0, 0: 2000.0, 4: 4000.0}, running=16)
    # eight requests: the best arm at sixteen first, the others standing as they stood there
    arms = run_steps(budget, clock, WINDOW_STEPS, {POLICY: 500.0, 0: 1000.0, 4: 2000.0}, running=8)
    assert arms == [4] * WINDOW_STEPS
    assert all(abs(budget.goodput(8)[arm] - rate) < 0.02 * rate for arm, rate in {POLICY: 500, 0: 1000, 4: 2000}.items())
    arms = run_steps(budget, clock, 400, {POLICY: 500.0, 0: 1000.0, 4: 2000.0}, running=8)
    assert {POLICY, 0} <= set(arms)  # tried here too, as often as there
    assert arms[200:].count(4) >= 0.97 * 200
    # a load farther off starts blank: at 1 request what pays at 16 rarely does
    arms = run_steps(budget, clock, 3 * WINDOW_STEPS, {POLICY: 1.0, 0: 1.0, 4: 1.0}, running=1)
    assert [arm for arm, _ in runs(arms)][:3] == [POLICY, 0, 4]


def test_another_arm_runs_instead_of_the_first_only_when_it_leads_by_a_margin():
    for lead, kept in ((LEAD / 2, 0), (2 * LEAD, 4)):
        clock = Clock()
        budget = BatchBudget((0, 4), clock=clock)
        arms = run_steps(budget, clock, 400, {0: 1000.0, 4: 1000.0 * (1 + lead)})
        assert arms[100:].count(kept) >= 0.95 * 300, lead  # a window's noise is no reason to speculate


def test_a_window_spans_enough_time_and_a_load_change_ends_it():
    clock = Clock()
    budget = BatchBudget((POLICY, 0), clock=clock)
    assert budget.arm(1) == POLICY
    for _ in range(3 * WINDOW_STEPS):  # steps far shorter than the window's least time: still one window
        clock.now += 1e-5
        budget.measured(1)
        assert budget.arm(1) == POLICY
    assert budget.arm(64) == POLICY  # another load: its own first window; the last one scored where it began
    assert round(budget.goodput(1)[POLICY]) == 1e5 and budget.goodput(64) == {POLICY: None, 0: None}
    # loads are powers of two at the middle of their class: 16 requests give or take two are one load
    assert {BatchBudget.load_class(n) for n in (14, 15, 16, 17, 18)} == {4}
    assert [BatchBudget.load_class(n) for n in (1, 2, 3, 62, 64, 66)] == [0, 1, 2, 6, 6, 6]


def test_a_step_that_cached_prompts_scores_nothing():
    clock = Clock()
    budget = BatchBudget((POLICY, 0), clock=clock)
    budget.arm(16)
    clock.now += 1.0  # a burst's prompts: a long step that commits nothing
    budget.measured(0, clean=False)
    for _ in range(WINDOW_STEPS):
        assert budget.arm(16) == POLICY
        clock.now += 0.01
        budget.measured(10)
    assert budget.arm(16) == 0
    assert round(budget.goodput(16)[POLICY]) == 1000  # the window began after the burst's step


def test_a_window_ends_when_no_request_is_left_running():
    clock = Clock()
    budget = BatchBudget((POLICY, 0), clock=clock)
    budget.arm(1)
    clock.now += 0.05
    budget.measured(50)
    budget.idle()
    clock.now += 10.0  # waiting for the next request: nobody's arm's
    assert budget.arm(1) == 0
    assert round(budget.goodput(1)[POLICY]) == 1000


def test_the_first_step_after_a_change_of_arm_is_not_scored():
    clock = Clock()
    budget = BatchBudget((POLICY, 0), clock=clock)
    run_steps(budget, clock, WINDOW_STEPS, {POLICY: 1000.0, 0: 1000.0})
    assert budget.arm(16) == 0
    clock.now += 1.0  # the switch's step: drafters catching up, say
    budget.measured(1)
    run_steps(budget, clock, WINDOW_STEPS, {POLICY: 1000.0, 0: 1000.0})
    assert abs(budget.goodput(16)[0] - 1000.0) < 20


def test_request_kinds_are_measured_apart():
    clock = Clock()
    budget = BatchBudget((POLICY, 0), clock=clock)

    def steps(kind: str, rates: dict[int, float], count: int) -> list[int]:
        arms = []
        for _ in range(count):
            arms.append(budget.arm(1, kind))
            clock.now += 0.012
            budget.measured(round(rates[arms[-1]] * 0.012))
        return arms

    steps("chat", {POLICY: 500.0, 0: 1000.0}, 100)  # open questions: plain decoding pays
    assert steps("chat", {POLICY: 500.0, 0: 1000.0}, 20).count(0) >= 18
    # a request that rewrites its prompt starts blank, its own arms measured from the policy's
    arms = steps("writing", {POLICY: 2000.0, 0: 1000.0}, 100)
    assert arms[0] == POLICY and arms[-20:].count(POLICY) >= 18
    assert budget.goodput(1, "chat")[0] > budget.goodput(1, "chat")[POLICY]
