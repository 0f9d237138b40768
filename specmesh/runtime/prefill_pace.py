"""How fast a long prompt is cached: beside decoding requests, on average a share of the verifier's time, in
chunks that each cost about a few passes' share at once; alone, in passes of about a time budget.

A chunk's rows attend over their request's whole cache, which each pass must read for them however few they
are: measured on 2 cores with the embedded target beside 4 decoding requests (a 16 ms pass), one token at
1,400 cached positions adds 7.5 ms to the pass and 32 tokens 58 ms. So no chunk of a long prompt fits in
each pass's share; a chunk every few passes, paid for by the passes between, does (the bank below), and
being larger it reads the cache fewer times for the same tokens. Each chunk pass is measured, not predicted
(the cost per token grows with the cache: no line over rows fits a whole prompt): its extra time over a
decode pass of its size is drawn from the bank, and the next chunk is sized on it; alone, the next is sized
on the last pass's time.
"""

from __future__ import annotations

from dataclasses import dataclass

CHUNK_PASSES = 2.0  # a chunk costs about this many passes' share: a neighbour's token waits ~2x once, then not
FIRST_ROWS = 8  # rows of the first chunk paced, before any is measured


@dataclass
class PrefillPace:
    """The bank of prefill time (ms) and the size of the next chunk (rows) beside decoding and alone."""

    rows: int = FIRST_ROWS
    bank_ms: float = 0.0
    alone_rows: int = FIRST_ROWS
    row_ms: float | None = None  # a row's cost in the last alone pass, until it sized the next chunk paced

    def grant(self, budget_ms: float) -> int:
        """A pass beside decoding requests with a prefill under way: its share ``budget_ms`` goes to the bank
        (which holds at most one chunk's worth: no credit piles up); returns the rows its chunks may take,
        0 while a chunk is being paid for."""
        self.bank_ms = min(self.bank_ms + budget_ms, CHUNK_PASSES * budget_ms)
        if self.row_ms is not None:  # paced after alone passes (a burst's last prompts): sized on what they measured
            self.rows = max(1, min(self.alone_rows, round(CHUNK_PASSES * budget_ms / self.row_ms)))
            self.row_ms = None
        return self.rows if self.bank_ms > 0 else 0

    def spent(self, rows: int, added_ms: float, budget_ms: float, max_rows: int) -> None:
        """A pass's chunks, ``rows`` in all (new requests' first chunks too: a burst's are the first measure of
        what a row costs), added ``added_ms`` to it: drawn from the bank; the next chunks are sized on them to
        cost ``CHUNK_PASSES`` shares (at most twice or half these, at most ``max_rows``)."""
        self.bank_ms -= added_ms
        if not rows:
            return
        scale = min(2.0, max(0.5, CHUNK_PASSES * budget_ms / max(added_ms, 1e-3)))
        self.rows = max(1, min(max_rows, round(rows * scale)))

    def alone(self, rows: int, ms: float, budget_ms: float, max_rows: int) -> None:
        """A pass of ``rows`` chunk rows alone (new requests' first chunks too: a burst's are the first
        measure of what a row costs) took ``ms``: the next alone is sized to take ``budget_ms`` (at most
        twice or half this one, at most ``max_rows``)."""
        if rows:
            scale = min(2.0, max(0.5, budget_ms / max(ms, 1e-3)))
            self.alone_rows = max(1, min(max_rows, round(rows * scale)))
            self.row_ms = max(ms, 1e-3) / rows
