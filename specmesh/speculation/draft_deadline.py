"""How long a step waits for each drafter's proposal, learnt from when its proposals arrive.

A pass never waits for a late or dead drafter: a proposal is waited for up to ``LATE_FACTOR`` times its
drafter's usual answer time, then left to arrive on its own (that step the request takes what the others
gave, or goes plain; it asks that drafter again once the answer is in). Every answer teaches the usual
time, the late ones too, so a drafter that became slower for good (a bigger batch of proposals, a busier
node) is soon waited for longer; one that stopped answering holds no step past the wait, and its calls
end at their own deadline, which marks it down. A drafter not yet heard from is waited for until that
deadline.
"""

from __future__ import annotations

from typing import Iterable

LATE_FACTOR = 3.0  # a proposal is late past 3x its drafter's usual answer time
MIN_WAIT_MS = 20.0  # ... and never before this: threads and a busy event loop jitter by milliseconds
ALPHA = 0.2  # weight of the newest answer time in the usual one


class DraftDeadlines:
    def __init__(self) -> None:
        self._usual_ms: dict[str, float] = {}

    def wait_s(self, names: Iterable[str]) -> float | None:
        """How long a step asking ``names`` waits for their proposals; None: until each call's own deadline
        (one of them not yet heard from)."""
        waits = []
        for name in names:
            usual = self._usual_ms.get(name)
            if usual is None:
                return None
            waits.append(max(MIN_WAIT_MS, LATE_FACTOR * usual))
        return max(waits) / 1e3 if waits else None

    def usual_ms(self, name: str) -> float | None:
        """How long ``name`` usually takes to answer; None: not yet heard from."""
        return self._usual_ms.get(name)

    def answered(self, name: str, ms: float) -> None:
        usual = self._usual_ms.get(name)
        self._usual_ms[name] = ms if usual is None else usual + ALPHA * (ms - usual)
