"""How long a step waits for each drafter's proposal, learnt from when its proposals arrive.

A pass never waits for a late or dead drafter: a proposal is waited for up to ``LATE_FACTOR`` times its
drafter's usual answer time, then dropped (that step the request takes what the others gave, or goes
plain). A late answer's time is unknown, so the wait it cost counts in its place: a drafter that became
slower for good (a bigger batch of proposals, a busier node) is soon waited for longer, while one that
stopped answering is benched after ``STRIKES`` late steps in a row, for a back-off that doubles while it
stays late. A drafter not yet heard from is waited for as long as its own call deadline allows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

LATE_FACTOR = 3.0  # a proposal is late past 3x its drafter's usual answer time
MIN_WAIT_MS = 20.0  # ... and never before this: threads and a busy event loop jitter by milliseconds
ALPHA = 0.2  # weight of the newest answer time in the usual one
STRIKES = 3  # late steps in a row that bench a drafter
BENCH_S = 1.0  # the first back-off; it doubles each bench in a row, up to MAX_BENCH_S
MAX_BENCH_S = 30.0


@dataclass
class _Pace:
    usual_ms: float
    strikes: int = 0  # late steps in a row
    benches: int = 0  # benches in a row (since its last answer in time)
    benched_until: float = 0.0


class DraftDeadlines:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._pace: dict[str, _Pace] = {}

    def wait_s(self, names: Iterable[str]) -> float | None:
        """How long a step asking ``names`` waits for their proposals; None: until each call's own deadline
        (one of them not yet heard from)."""
        waits = []
        for name in names:
            pace = self._pace.get(name)
            if pace is None:
                return None
            waits.append(max(MIN_WAIT_MS, LATE_FACTOR * pace.usual_ms))
        return max(waits) / 1e3 if waits else None

    def usual_ms(self, name: str) -> float | None:
        """How long ``name`` usually takes to answer; None: not yet heard from."""
        pace = self._pace.get(name)
        return None if pace is None else pace.usual_ms

    def benched(self, name: str) -> bool:
        """Whether ``name`` sits steps out, late too often."""
        pace = self._pace.get(name)
        return pace is not None and self._clock() < pace.benched_until

    def answered(self, name: str, ms: float) -> None:
        pace = self._pace.get(name)
        if pace is None:
            self._pace[name] = _Pace(ms)
            return
        pace.usual_ms += ALPHA * (ms - pace.usual_ms)
        pace.strikes = pace.benches = 0

    def late(self, name: str, waited_ms: float) -> None:
        pace = self._pace.setdefault(name, _Pace(waited_ms))
        pace.usual_ms += ALPHA * (waited_ms - pace.usual_ms)  # at least this long: the wait stands in for it
        pace.strikes += 1
        if pace.strikes >= STRIKES:
            pace.benched_until = self._clock() + min(MAX_BENCH_S, BENCH_S * 2 ** pace.benches)
            pace.benches += 1
            pace.strikes = 0
