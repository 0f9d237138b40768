"""The batch's speculation budget, chosen by the goodput measured (tokens committed per second of the step
loop's own cycle), not predicted.

The adaptive requests of a step follow one *arm*: plain decoding (0), their policy's own choice (``POLICY``,
the goodput model of ``goodput.py``), or a fixed number of nodes each. The step loop runs an arm for a
window of steps and measures what the window committed over its wall time, all overheads in; the arm with
the best decayed mean runs — the first (plain decoding) unless another leads it by ``LEAD`` — and each
other arm gets a short try every ``TRY_EVERY`` windows. At a new load the first arm gets a window and the
others a try each: on open prompts, where plain decoding pays, a load's first measurements cost little. Arms are
measured per load (running requests, to the nearest power of two) and request kind (the batch's, when
its adaptive requests share one): what pays at one request rarely does at 64, and what pays for a request
that rewrites its prompt rarely does for an open question. A new load next to a measured one starts from
it: its best arm first, the others' standing carried over, rescaled by the first window (a burst's tail
passes through every load below it). Plain decoding is one arm, so speculation that measures slower than
plain is not kept; a fixed budget is another, so a model that under-drafts where trees pay is overruled.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

from specmesh.speculation.policy import DEFAULT_FIXED_TREE_NODES

POLICY = -1  # the arm where each request's policy chooses its own budget
MIXED = "mixed"  # the kind of a batch whose adaptive requests are of several kinds
# tried in this order at a new load: plain decoding, the policy, and the fixed budget `specmesh tune` chose
DEFAULT_ARMS = (0, POLICY, DEFAULT_FIXED_TREE_NODES)
# what another arm must gain over the first to run instead: one window's noise locked in a slower arm for
# TRY_EVERY windows (embedded target, MT-Bench, 4 requests: a new engine ran 0.88x plain; 0.99x with it)
LEAD = 0.05
WINDOW_STEPS = 4  # steps a window measures, at least,
TRY_STEPS = 2  # or a try of an arm that is not the best (its mean spans tries; a losing try costs its steps)
WINDOW_S = 0.02  # and at least this long (a lone request's steps are ~1 ms on a tiny target)
ALPHA = 0.5  # weight of a window in its arm's mean (a change of workload shows within two tries)
# windows between tries of an arm that is not the best: a try's changes of arm cost beyond its own steps
# (drafters catch up, late proposals take the cores), so on 2 cores tries every 1-40 windows, by how far
# behind an arm was, left adaptive at 0.82-0.84x plain where plain paid best (random:tiny, oracle 0.6,
# 16 and 64 requests); every 64: 0.87-0.96x and 0.80-0.94x (two runs)
TRY_EVERY = 64


@dataclass
class _Arm:
    goodput: float | None = None  # decayed mean tokens/s (None: not measured at this load)
    due: int = 0  # the window index it is tried at, while not the best


@dataclass
class _Load:
    arms: dict[int, _Arm]
    windows: int = 0  # windows measured at this load
    seeded: bool = False  # the goodputs are another load's shares of its best, until a window here rescales them


@dataclass
class _Window:
    arm: int
    load: tuple[int, str]  # load class, kind
    started: float
    length: int  # steps, at least
    switched: bool = False  # its arm is not the last window's: its first step is not scored
    steps: int = 0
    tokens: int = 0


class BatchBudget:
    """Which arm the adaptive requests of each step follow (``arm``), and what each step gave (``measured``).

    The step loop calls ``arm(running)`` before planning a step and ``measured(tokens)`` after it with the
    tokens the step committed; a window's time runs from its first step's start to the start of the step after
    its last, so the loop's own work between steps counts."""

    def __init__(self, arms: tuple[int, ...] = DEFAULT_ARMS, clock: Callable[[], float] = time.perf_counter) -> None:
        if not arms:
            raise ValueError("at least one arm")
        self.arms = arms
        self.clock = clock
        self._loads: dict[tuple[int, str], _Load] = {}  # (load class, kind) -> its arms
        self._window: _Window | None = None

    @staticmethod
    def load_class(running: int) -> int:
        """Powers of two at the middle of their class (1, 2, 3-5, 6-11, 12-22, 23-45, ...): a load that
        wavers by a request or two as requests end and join stays in one."""
        return round(math.log2(max(running, 1)))

    def arm(self, running: int, kind: str = MIXED) -> int:
        """The arm of the next step with ``running`` requests, its adaptive ones of ``kind``."""
        now = self.clock()
        load = (self.load_class(running), kind)
        window = self._window
        if window is not None and window.load == load and (window.steps < window.length
                                                           or now - window.started < WINDOW_S):
            return window.arm
        if window is not None and window.steps >= min(window.length, TRY_STEPS):
            self._close(window, now)  # scored at the load it began at, should the load have moved
        arm, trying = self._choose(load)
        switched = window is not None and window.arm != arm
        self._window = _Window(arm, load, now, TRY_STEPS if trying else WINDOW_STEPS, switched)
        return arm

    def measured(self, tokens: int, clean: bool = True) -> None:
        """``tokens``: what the step committed; ``clean`` False: the step also cached prompts (a burst's
        first step), or ran beside proposals still on their way (an earlier arm's drafting, whose cost would
        be this one's), which says nothing of the arm, so the window starts again after it. The first step
        after a change of arm is not scored either: drafters catch up on the context they missed (measured:
        2-step tries of k = 4 at 64 requests scored 0.69x plain where the whole run gave 1.03x)."""
        window = self._window
        if window is None:
            return
        if clean and not window.switched:
            window.steps += 1
            window.tokens += tokens
        else:
            window.steps, window.tokens, window.started, window.switched = 0, 0, self.clock(), False

    def idle(self) -> None:
        """No request is left running: the window ends here, scored on what it measured (the wait for the
        next request is nobody's arm's)."""
        window, self._window = self._window, None
        if window is not None and window.steps:
            self._close(window, self.clock())

    def goodput(self, running: int, kind: str = MIXED) -> dict[int, float | None]:
        """Each arm's mean tokens/s at this load and kind (None: not measured)."""
        state = self._loads.get((self.load_class(running), kind))
        return {arm: state.arms[arm].goodput if state else None for arm in self.arms}

    def learned(self) -> list[tuple[int, str, int, float]]:
        """(the load's power of two of requests, kind, arm, mean tokens/s) of every arm measured."""
        return [(1 << load, kind, name, arm.goodput) for (load, kind), state in sorted(self._loads.items())
                if not state.seeded for name, arm in state.arms.items() if arm.goodput is not None]

    def _close(self, window: _Window, now: float) -> None:
        state = self._loads[window.load]
        arm = state.arms[window.arm]
        goodput = window.tokens / max(now - window.started, 1e-9)
        if state.seeded:  # the neighbour's shares, in this load's tokens/s
            scale = goodput / arm.goodput if arm.goodput else 0.0
            for other in state.arms.values():
                other.goodput = other.goodput * scale if other.goodput is not None and scale else None
            state.seeded = False
        arm.goodput = goodput if arm.goodput is None else (1 - ALPHA) * arm.goodput + ALPHA * goodput
        state.windows += 1
        if window.arm != self._best(state):  # tried and still losing: tried again later
            arm.due = state.windows + TRY_EVERY

    def _best(self, state: _Load) -> int:
        """The arm with the best mean; the first arm unless another beats it by ``LEAD``."""
        measured = [(arm.goodput, name) for name, arm in state.arms.items() if arm.goodput is not None]
        if not measured:
            return self.arms[0]
        goodput, name = max(measured)
        first = state.arms[self.arms[0]].goodput
        return self.arms[0] if first is not None and goodput < (1 + LEAD) * first else name

    def _choose(self, load: tuple[int, str]) -> tuple[int, bool]:
        """The next window's arm, and whether it is a try (not the best)."""
        state = self._loads.get(load)
        if state is None:
            state = self._loads[load] = self._seeded(load)
        for name in self.arms:  # every arm not measured yet, in order: the first a window, the others tries
            if state.arms[name].goodput is None:
                return name, name != self.arms[0]
        best = self._best(state)
        due = [name for name in self.arms if name != best and state.arms[name].due <= state.windows]
        return (min(due, key=lambda name: state.arms[name].due), True) if due else (best, False)

    def _seeded(self, load: tuple[int, str]) -> _Load:
        """A new load's arms: a measured neighbour's (twice or half the requests, the same kind), as shares of
        its best, the others tried in ``TRY_EVERY`` windows; blank where no neighbour was measured. Farther
        loads say little: at 1 request the policy's trees ran 2.4x plain, at 16 0.84x (random:tiny, oracle
        0.8, the cluster)."""
        for other in ((load[0] - 1, load[1]), (load[0] + 1, load[1])):
            near = self._loads.get(other)
            if near is not None and not near.seeded and any(a.goodput is not None for a in near.arms.values()):
                break
        else:
            return _Load({name: _Arm() for name in self.arms})
        top = near.arms[self._best(near)].goodput
        arms = {}
        for name, arm in near.arms.items():
            share = arm.goodput / top if arm.goodput is not None and top else None
            arms[name] = _Arm(share, 0 if share == 1.0 else TRY_EVERY)
        return _Load(arms, seeded=True)
