"""A drafter service's sessions: one per request, bounded in count and tokens, checked on every call."""

from __future__ import annotations

import ctypes
import time
from collections import OrderedDict
from typing import Callable, Sequence

import numpy as np

from specmesh.drafters.base import Drafter
from specmesh.errors import InvalidArgument, NotFound
from specmesh.runtime.features import Features
from specmesh.tree import MAX_TREE_NODES

DEFAULT_SESSION_TOKENS = 1 << 15  # without a target's context to go by
DEFAULT_TOTAL_TOKENS = 1 << 20  # all sessions together (prompt lookup's index: ~0.8 KB a token)
TRIM_EVERY_S = 5.0  # how often freed memory may be handed back to the system
# A session unused this long has most likely lost its router (killed: it closes nothing); a live request
# that drafts again after it is re-opened on NOT_FOUND, one prompt's prefill
DEFAULT_IDLE_S = 60.0
# Requests closed lately: a router's open and close of a request are separate calls, and a client that
# leaves at once can have its close run first; the open that comes after it then opens nothing
CLOSED_REMEMBERED = 4096
# Proposals in one ProposeMany call: a step's worth (the engine core runs at most 256 requests a pass)
MAX_PROPOSE_ITEMS = 256


def trim_heap() -> None:
    """Give the C heap's free memory back to the system (glibc keeps freed small blocks otherwise)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class DrafterSessions:
    """The drafter's sessions, bounded three ways: no session grows past ``max_session_tokens`` (the
    target's context: no request is longer); past ``max_sessions`` sessions, or ``max_total_tokens``
    tokens in all, the least recently used are ended (their routers re-open them on NOT_FOUND). Sessions
    idle for ``idle_s`` end too (``end_idle``). Memory freed by ended sessions goes back to the system
    (``trim``)."""

    def __init__(self, drafter: Drafter, vocab_size: int, max_sessions: int,
                 max_session_tokens: int = DEFAULT_SESSION_TOKENS, max_total_tokens: int = DEFAULT_TOTAL_TOKENS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.drafter = drafter
        self.clock = clock
        self.vocab_size = vocab_size
        self.max_sessions = max_sessions
        self.max_session_tokens = max_session_tokens
        self.max_total_tokens = max(max_total_tokens, max_session_tokens)
        self._sessions: OrderedDict[str, int] = OrderedDict()  # request -> tokens held, least recently used first
        self._used: dict[str, float] = {}  # request -> when it was last opened or drafted for (monotonic)
        # the hashes of requests closed lately, a ring: no Python object is kept per close, since small
        # objects made while sessions are freed pin the allocator's arenas (~1 GB kept after 1,000 closes)
        self._closed = np.zeros(CLOSED_REMEMBERED, dtype=np.int64)
        self._closes = 0  # closes so far (the next one's slot: this modulo the ring's size)
        self.total_tokens = 0
        self._ended = 0  # sessions ended since the heap was last trimmed
        self._trimmed_at = 0.0

    def __len__(self) -> int:
        return len(self._sessions)

    def _check_tokens(self, field: str, tokens: Sequence[int], held: int = 0) -> None:
        if held + len(tokens) > self.max_session_tokens:
            raise InvalidArgument(field, f"would make the session {held + len(tokens)} tokens long; at most "
                                         f"{self.max_session_tokens} (the target's context)")
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidArgument(field, f"token ids {bad[:5]} are outside the vocabulary (0..{self.vocab_size - 1})")

    def _hold(self, request_id: str, tokens: int) -> None:
        """The session now holds ``tokens`` more; end the least recently used others past the bounds."""
        self._sessions[request_id] = self._sessions.get(request_id, 0) + tokens
        self._sessions.move_to_end(request_id)
        self._used[request_id] = self.clock()
        self.total_tokens += tokens
        while len(self._sessions) > 1 and (len(self._sessions) > self.max_sessions
                                           or self.total_tokens > self.max_total_tokens):
            self._end(next(iter(self._sessions)))

    def _end(self, request_id: str) -> None:
        self.total_tokens -= self._sessions.pop(request_id)
        self._used.pop(request_id, None)
        self._ended += 1
        self.drafter.end(request_id)

    def open(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        if not request_id:
            raise InvalidArgument("request_id", "is empty")
        if not prompt_ids:
            raise InvalidArgument("prompt_ids", "is empty; a session starts from at least one token")
        self._check_tokens("prompt_ids", prompt_ids)
        if (self._closed[:min(self._closes, CLOSED_REMEMBERED)] == hash(request_id)).any():
            return  # its request has ended: the close overtook this open
        if request_id in self._sessions:
            self._end(request_id)
        self.drafter.start(request_id, list(prompt_ids))
        self._hold(request_id, len(prompt_ids))

    def propose(self, request_id: str, committed: Sequence[int], budget: int, assumed: Sequence[int] = (),
                features: Features | None = None):
        if not 0 <= budget <= MAX_TREE_NODES:
            raise InvalidArgument("budget", f"must be in 0..{MAX_TREE_NODES}, got {budget}")
        if request_id not in self._sessions:
            raise NotFound(f"no drafting session for request {request_id!r}; open one first")
        self._check_tokens("committed", committed, self._sessions[request_id])
        self._check_tokens("assumed", assumed)  # guessed tokens, not held
        if committed:
            self.drafter.commit(request_id, list(committed))
        self._hold(request_id, len(committed))
        if features is not None:  # a drafter that reads none refuses them (InvalidArgument)
            self.drafter.add_features(request_id, features)
        return self.drafter.propose(request_id, budget, list(assumed))

    def close(self, request_id: str, committed: Sequence[int]) -> None:
        self._closed[self._closes % CLOSED_REMEMBERED] = hash(request_id)
        self._closes += 1
        if request_id not in self._sessions:
            return
        try:
            self._check_tokens("committed", committed, self._sessions[request_id])
            if committed:
                self.drafter.commit(request_id, list(committed))
        finally:
            self._end(request_id)

    def end_idle(self, idle_s: float) -> int:
        """End the sessions unused for ``idle_s`` seconds or more; how many ended."""
        now = self.clock()
        stale = [r for r in self._sessions if now - self._used[r] >= idle_s]
        for request_id in stale:
            self._end(request_id)
        return len(stale)

    def trim_due(self, now: float) -> bool:
        """Sessions ended, and the last trim is ``TRIM_EVERY_S`` ago."""
        return bool(self._ended) and now - self._trimmed_at >= TRIM_EVERY_S

    def trim(self, now: float) -> bool:
        """Hand freed memory back to the system when it is due."""
        if not self.trim_due(now):
            return False
        trim_heap()
        self._ended, self._trimmed_at = 0, now
        return True
