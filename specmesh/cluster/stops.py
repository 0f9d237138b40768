"""Stop strings over streamed text: emit what can no longer begin a stop string, end at the first one.

Text arrives in pieces (each step's committed tokens, detokenized whole characters at a time: see
``gateway.TextStream``), so a stop string may straddle pieces. The scanner holds back the longest tail
that is the start of some stop string and releases it once the next piece rules the match out. The
output is cut where the earliest stop string begins, and the stop string itself is never emitted.
"""

from __future__ import annotations

from typing import Sequence

from specmesh.errors import InvalidArgument
from specmesh.prompts import check_text

MAX_STOPS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256


def check_stops(stops: Sequence[str], field: str = "stop") -> tuple[str, ...]:
    if len(stops) > MAX_STOPS:
        raise InvalidArgument(field, f"give at most {MAX_STOPS} stop strings, got {len(stops)}")
    for i, stop in enumerate(stops):
        if not stop:
            raise InvalidArgument(f"{field}[{i}]", "is empty")
        if len(stop) > MAX_STOP_CHARS:
            raise InvalidArgument(f"{field}[{i}]", f"is {len(stop)} characters; at most {MAX_STOP_CHARS}")
        check_text(f"{field}[{i}]", stop)
    return tuple(stops)


class StopScanner:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.held = ""  # text received and not emitted: it may be the start of a stop string
        self.emitted = 0  # characters emitted so far
        self.stop_end: int | None = None  # once stopped: where the stop string ends in the whole text

    @property
    def stopped(self) -> bool:
        return self.stop_end is not None

    def push(self, text: str) -> str:
        """The text that can be emitted now (nothing once a stop string was seen)."""
        if self.stopped:
            return ""
        self.held += text
        found = [(at, stop) for stop in self.stops if (at := self.held.find(stop)) >= 0]
        if found:
            at, stop = min(found, key=lambda pair: (pair[0], -len(pair[1])))
            self.stop_end = self.emitted + at + len(stop)
            return self._emit(at, keep=0)
        keep = max((k for stop in self.stops for k in range(1, len(stop)) if self.held.endswith(stop[:k])), default=0)
        return self._emit(len(self.held) - keep, keep)

    def flush(self) -> str:
        """At the end of the text: what was held back."""
        return "" if self.stopped else self._emit(len(self.held), keep=0)

    def _emit(self, upto: int, keep: int) -> str:
        out, self.held = self.held[:upto], self.held[len(self.held) - keep :] if keep else ""
        self.emitted += len(out)
        return out


def tokens_through(decode, token_ids: Sequence[int], chars: int) -> int:
    """The fewest leading tokens whose text reaches ``chars`` characters: a request that ended at a stop
    string counts the tokens up to the one that completed it (as a server checking after every token would)."""
    low, high = 0, len(token_ids)
    while low < high:
        middle = (low + high) // 2
        if len(decode(token_ids[:middle]).rstrip("\ufffd")) >= chars:
            high = middle
        else:
            low = middle + 1
    return low
