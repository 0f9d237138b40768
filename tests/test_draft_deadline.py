"""How long a step waits for a drafter: learnt from its answers (the late ones too), never under a floor;
and which drafters run on another machine than their caller."""

from specmesh.speculation import draft_deadline as dd
from specmesh.speculation.draft_deadline import DraftDeadlines
from specmesh.speculation.drafting import IN_PROCESS, runs_apart


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


def test_late_answers_teach_the_pace_too():
    deadlines = DraftDeadlines()
    deadlines.answered("a", 10.0)
    first = deadlines.wait_s(["a"])
    deadlines.answered("a", 100.0)  # arrived long after its step stopped waiting
    assert deadlines.wait_s(["a"]) > first
    assert deadlines.usual_ms("a") == 10.0 + dd.ALPHA * 90.0 and deadlines.usual_ms("b") is None


def test_a_drafter_runs_apart_unless_it_is_in_process_or_on_a_loopback_address():
    assert runs_apart("drafter-code.specmesh.svc:50061")
    assert runs_apart("10.0.3.7:50061")
    assert runs_apart("[2001:db8::5]:50061")
    for here in (IN_PROCESS, "127.0.0.1:50061", "localhost:50061", "[::1]:50061", "unix:/tmp/drafter.sock"):
        assert not runs_apart(here), here
