"""Supervision of a one-machine cluster's processes: what dies is started again, with back-off.

A process that crashes is restarted after a wait that doubles with each crash in the last ``window_s``
(0.5 s, 1 s, 2 s ... at most ``max_delay_s``); more than ``max_restarts`` crashes in the window is a
crash loop: it is reported and left down. If that process is one the cluster cannot serve without
(``essential``), ``failed`` is set and the launcher shuts the cluster down.

A process that is alive but does not serve (it says NOT_SERVING, as a drained verifier does; or, having
served since its start, it no longer answers) for ``unresponsive_s`` is killed, then restarted as a crash:
a liveness probe. A part killed so more than ``max_restarts`` times in a row, without serving for
``unresponsive_s`` in between, is left down as a crash loop is. In Kubernetes the kubelet does this
job (restartPolicy, CrashLoopBackOff, the chart's liveness probes).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence


class Supervised(Protocol):
    name: str

    def alive(self) -> bool: ...

    def start(self) -> object: ...

    def serving(self) -> bool | None:
        """A short probe: True if it answers that it serves, False if it answers that it does not, None if
        it does not answer (still starting, or hung)."""

    def kill(self) -> None: ...


@dataclass
class RestartRecord:
    crashes: deque = field(default_factory=deque)  # monotonic times of the crashes in the window
    restart_at: float | None = None  # when the next start is due (None: running, or given up)
    restarts: int = 0
    given_up: bool = False
    served: bool = False  # it has answered as serving since its last start
    unserving_since: float | None = None  # since when it has not served
    serving_since: float | None = None  # since when it has served without a break
    liveness_kills: int = 0  # killed for not serving, in a row (reset once it serves for unresponsive_s)
    probed_at: float = float("-inf")


UNRESPONSIVE_S = 30.0  # a part that has not served this long is killed and started again


class Supervisor:
    def __init__(self, parts: Callable[[], Sequence[Supervised]], essential: Callable[[Supervised], bool],
                 report: Callable[[str], None] = print, max_restarts: int = 5, window_s: float = 60.0,
                 first_delay_s: float = 0.5, max_delay_s: float = 10.0, every_s: float = 0.2,
                 unresponsive_s: float = UNRESPONSIVE_S, probe_every_s: float = 2.0) -> None:
        """``parts()``: the processes to watch (asked each round: the cluster may change); ``essential(p)``:
        whether the cluster can serve without ``p``; ``report``: where restarts and crash loops are said."""
        self.parts = parts
        self.essential = essential
        self.report = report
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.first_delay_s = first_delay_s
        self.max_delay_s = max_delay_s
        self.every_s = every_s
        self.unresponsive_s = unresponsive_s
        self.probe_every_s = probe_every_s
        self.records: dict[str, RestartRecord] = {}
        self.failed = threading.Event()  # an essential process crash-loops: the cluster cannot serve
        self._hold = threading.Event()  # restart nothing more
        self._stop = threading.Event()  # and end the thread
        self._thread: threading.Thread | None = None

    def given_up(self, name: str) -> bool:
        """Whether ``name`` crash-looped and is left down."""
        record = self.records.get(name)
        return record is not None and record.given_up

    @property
    def restarts(self) -> dict[str, int]:
        return {name: r.restarts for name, r in self.records.items()}

    def start(self) -> Supervisor:
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self._thread.start()
        return self

    def hold(self) -> None:
        """Restart nothing more (before the cluster is shut down). The thread lives on until ``stop``: a
        process it started gets SIGTERM when it ends (PR_SET_PDEATHSIG is per thread: ``specmesh.cluster.lifetime``)."""
        self._hold.set()

    def stop(self) -> None:
        self._hold.set()
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            if not self._hold.is_set():
                self.check(time.monotonic())

    def check(self, now: float) -> None:
        """One round: note the crashes, start what is due."""
        for part in self.parts():
            record = self.records.setdefault(part.name, RestartRecord())
            if record.given_up or self._hold.is_set():
                continue
            if record.restart_at is None:
                if part.alive():
                    if not self._unresponsive(part, record, now):
                        continue
                    self.report(f"{part.name} has not been serving for {now - record.unserving_since:.0f} s: "
                                f"killing it")
                    part.kill()
                    if part.alive():  # not gone yet: no second one on its port; tried again next round
                        continue
                    record.liveness_kills += 1
                    if record.liveness_kills > self.max_restarts:
                        self._give_up(part, record, f"stopped serving after each of {record.liveness_kills} starts")
                        continue
                record.crashes.append(now)
                while record.crashes and record.crashes[0] < now - self.window_s:
                    record.crashes.popleft()
                if len(record.crashes) > self.max_restarts:
                    self._give_up(part, record, f"crashed {len(record.crashes)} times in {self.window_s:.0f} s")
                    continue
                delay = min(self.first_delay_s * 2 ** (len(record.crashes) - 1), self.max_delay_s)
                record.restart_at = now + delay
                self.report(f"{part.name} stopped; restarting it in {delay:.1f} s")
            if now >= record.restart_at:
                record.restart_at = None
                record.restarts += 1
                record.served, record.unserving_since, record.serving_since = False, None, None
                try:
                    part.start()
                except Exception as exc:  # it counts as the next crash at the next round
                    self.report(f"{part.name} could not be started again: {exc}")

    def _give_up(self, part: Supervised, record: RestartRecord, why: str) -> None:
        record.given_up = True
        essential = self.essential(part)
        self.report(f"{part.name} {why}: a crash loop, left down"
                    f"{'; the cluster cannot serve without it' if essential else ''}")
        if essential:
            self.failed.set()

    def _unresponsive(self, part: Supervised, record: RestartRecord, now: float) -> bool:
        """Whether ``part`` has not served for ``unresponsive_s``. Silence counts only once it has served
        since its start: before, it is still starting (a start that never ends is its launcher's to time out)."""
        if now - record.probed_at < self.probe_every_s:
            return False
        record.probed_at = now
        serving = part.serving()
        if serving is None and not record.served:
            return False
        if serving:
            record.served, record.unserving_since = True, None
            record.serving_since = now if record.serving_since is None else record.serving_since
            if now - record.serving_since >= self.unresponsive_s:
                record.liveness_kills = 0
            return False
        record.serving_since = None
        if record.unserving_since is None:
            record.unserving_since = now
        return now - record.unserving_since >= self.unresponsive_s
