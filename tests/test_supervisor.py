"""The supervisor on real processes: what dies is started again after a growing wait; a crash loop is
reported and left down, and ends the cluster only when the part is one it cannot serve without."""

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

    def start(self) -> None:
        self.popen = subprocess.Popen([sys.executable, "-c", self.code])
        self.starts.append(time.monotonic())

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

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
