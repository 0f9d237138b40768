"""How long a step waits for a drafter: learnt from its answers, longer once it is slower for good, and a
drafter late step after step sits out a back-off that doubles while it stays late."""

from specmesh.speculation import draft_deadline as dd
from specmesh.speculation.draft_deadline import DraftDeadlines
from specmesh.speculation.drafting import IN_PROCESS, runs_apart


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_drafter_not_yet_heard_from_is_waited_for_until_its_call_deadline():
    deadlines = DraftDeadlines()
    assert deadlines.wait_s([]) is None
    deadlines.answered("a", 10.0)
    assert deadlines.wait_s(["a", "b"]) is None, "b has not answered yet"
    assert deadlines.wait_s(["a"]) == dd.LATE_FACTOR * 10.0 / 1e3


def test_the_wait_follows_the_slowest_asked_and_never_drops_under_the_floor():
    deadlines = DraftDeadlines()
    deadlines.answered("fast", 0.5)
    deadlines.answered("slow", 40.0)
    assert deadlines.wait_s(["fast"]) == dd.MIN_WAIT_MS / 1e3
    assert deadlines.wait_s(["fast", "slow"]) == dd.LATE_FACTOR * 40.0 / 1e3
    for _ in range(50):
        deadlines.answered("slow", 80.0)
    assert abs(deadlines.wait_s(["slow"]) - dd.LATE_FACTOR * 80.0 / 1e3) < 1e-3, "it learns the new pace"


def test_a_drafter_that_became_slower_for_good_is_soon_waited_for_longer():
    deadlines = DraftDeadlines(Clock())
    deadlines.answered("a", 10.0)
    first = deadlines.wait_s(["a"])
    deadlines.late("a", first * 1e3)
    second = deadlines.wait_s(["a"])
    assert second > first, "the wait a late answer cost stands in for its time"
    deadlines.answered("a", 25.0)  # within the longer wait: on time again
    assert not deadlines.benched("a")


def test_a_drafter_late_step_after_step_is_benched_for_a_back_off_that_doubles():
    clock = Clock()
    deadlines = DraftDeadlines(clock)
    deadlines.answered("a", 10.0)

    def late_steps(count: int) -> None:
        for _ in range(count):
            deadlines.late("a", deadlines.wait_s(["a"]) * 1e3)

    late_steps(dd.STRIKES - 1)
    assert not deadlines.benched("a")
    late_steps(1)
    assert deadlines.benched("a")
    clock.now += dd.BENCH_S
    assert not deadlines.benched("a"), "back after the first back-off"
    late_steps(dd.STRIKES)
    clock.now += dd.BENCH_S
    assert deadlines.benched("a"), "late again at once: the back-off doubled"
    clock.now += dd.BENCH_S
    assert not deadlines.benched("a")
    deadlines.answered("a", 10.0)
    late_steps(dd.STRIKES)
    clock.now += dd.BENCH_S
    assert not deadlines.benched("a"), "an answer in time starts the back-off over"
    assert deadlines.benched("a") is False and not deadlines.benched("never-asked")


def test_a_drafter_runs_apart_unless_it_is_in_process_or_on_a_loopback_address():
    assert runs_apart("drafter-code.specmesh.svc:50061")
    assert runs_apart("10.0.3.7:50061")
    assert runs_apart("[2001:db8::5]:50061")
    for here in (IN_PROCESS, "127.0.0.1:50061", "localhost:50061", "[::1]:50061", "unix:/tmp/drafter.sock"):
        assert not runs_apart(here), here
