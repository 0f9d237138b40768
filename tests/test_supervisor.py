"""The supervisor on real processes: what dies is started again after a growing wait; a crash loop is
reported and left down, and ends the cluster only when the part is one it cannot serve without; a
process that has stopped serving is killed and started again, one still starting is left alone."""

import subprocess
import sys
import time

from conftest import wait_until

from specmesh.cluster.supervisor import Supervisor


class Part:
    """A real process, started by ``start()`` like the launcher's services."""

    def __init__(self, name: str, code: str) -> None:
        self.name = name
        self.code = code
        self.popen = None
        self.starts: list[float] = []
        self.answers = True  # what its health check says (None: no answer)

    def start(self) -> None:
        self.popen = subprocess.Popen([sys.executable, "-c", self.code])
        self.starts.append(time.monotonic())

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def serving(self) -> bool | None:
        return self.answers

    def kill(self) -> None:
        self.popen.kill()
        self.popen.wait()


def test_a_dead_process_is_restarted_and_a_crash_loop_is_left_down():
    steady = Part("steady", "import time; time.sleep(60)")
    crashing = Part("crashing", "raise SystemExit(3)")
    for part in (steady, crashing):
        part.start()
    said = []
    supervisor = Supervisor(lambda: [steady, crashing], essential=lambda p: p is crashing, report=said.append,
                            max_restarts=3, window_s=30, first_delay_s=0.1, max_delay_s=0.4, every_s=0.02).start()
    try:
        steady.kill()
        wait_until(lambda: len(steady.starts) == 2 and steady.alive(), what="the killed process runs again")
        assert supervisor.failed.wait(30)  # crashing: 3 restarts, then a crash loop
        time.sleep(0.5)
        assert len(crashing.starts) == 4 and not crashing.alive()  # left down
        waits = [b - a for a, b in zip(crashing.starts, crashing.starts[1:])]
        assert waits[0] >= 0.1 and waits[1] >= 0.2 and waits[2] >= 0.4  # doubling back-off, capped
        assert supervisor.restarts == {"steady": 1, "crashing": 3}
        assert any("steady stopped; restarting it" in line for line in said)
        assert any("crashing crashed 4 times" in line and "cannot serve without it" in line for line in said)
    finally:
        supervisor.stop()
        for part in (steady, crashing):
            if part.alive():
                part.kill()


def test_a_stopped_supervisor_restarts_nothing():
    part = Part("p", "import time; time.sleep(60)")
    part.start()
    supervisor = Supervisor(lambda: [part], essential=lambda p: True, report=lambda line: None,
                            first_delay_s=0.05, every_s=0.02).start()
    supervisor.stop()
    part.kill()
    time.sleep(0.3)
    assert len(part.starts) == 1 and not supervisor.failed.is_set()


def test_a_process_that_stops_serving_is_killed_and_started_again():
    stuck, starting = Part("stuck", "import time; time.sleep(60)"), Part("starting", "import time; time.sleep(60)")
    starting.answers = None  # silent, never served since its start: still starting, not judged
    for part in (stuck, starting):
        part.start()
    said = []
    supervisor = Supervisor(lambda: [stuck, starting], essential=lambda p: False, report=said.append,
                            first_delay_s=0.05, every_s=0.02, unresponsive_s=0.5, probe_every_s=0.05).start()
    try:
        time.sleep(0.3)  # it serves: left alone
        assert len(stuck.starts) == 1
        first, stuck.answers = stuck.popen, None  # it hangs
        went = time.monotonic()
        wait_until(lambda: len(stuck.starts) == 2, what="the process that hangs is started again")
        assert stuck.starts[1] - went >= 0.5 and first.returncode == -9
        second, stuck.answers = stuck.popen, False  # it answers that it does not serve (drained), at once
        went = time.monotonic()
        wait_until(lambda: len(stuck.starts) == 3, what="the process that says it does not serve is started again")
        assert stuck.starts[2] - went >= 0.5 and second.returncode == -9
        assert sum("stuck has not been serving for" in line for line in said) == 2
        assert len(starting.starts) == 1 and starting.alive()
        assert supervisor.restarts == {"stuck": 2, "starting": 0}
    finally:
        supervisor.stop()
        for part in (stuck, starting):
            if part.alive():
                part.kill()


def test_a_process_that_never_serves_again_is_a_crash_loop():
    """Killed for not serving after every start (a verifier whose worker dies at once): after
    ``max_restarts`` such kills in a row it is left down, and the cluster fails if it needs it."""
    dead_on_arrival = Part("doa", "import time; time.sleep(60)")
    dead_on_arrival.answers = False  # it answers, always NOT_SERVING
    dead_on_arrival.start()
    said = []
    supervisor = Supervisor(lambda: [dead_on_arrival], essential=lambda p: True, report=said.append, max_restarts=2,
                            window_s=0.1, first_delay_s=0.01, every_s=0.01, unresponsive_s=0.1,
                            probe_every_s=0.01).start()  # a window too short to see the kills as a crash loop
    try:
        assert supervisor.failed.wait(30)
        assert len(dead_on_arrival.starts) == 3 and not dead_on_arrival.alive()  # two restarts, three kills
        assert any("doa stopped serving after each of 3 starts: a crash loop" in line for line in said)
    finally:
        supervisor.stop()
        if dead_on_arrival.alive():
            dead_on_arrival.kill()
