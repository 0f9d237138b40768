"""The verifier's batch scheduler: which waiting jobs go into the next verification pass."""

from __future__ import annotations

import time
from typing import Callable, Sequence, TypeVar

Job = TypeVar("Job")


def plan_batch(
    waiting: Sequence[Job],  # in readiness order: the longest waiting first
    rows_of: Callable[[Job], int],  # target rows the job costs (tree nodes + root + any prefill)
    request_of: Callable[[Job], str],
    max_rows: int,
) -> tuple[list[Job], list[Job]]:
    """(batch, still waiting): jobs in readiness order while their rows fit ``max_rows``, at most one
    per request (a request's next step depends on its previous one). The first job always goes, so
    one job larger than the budget cannot stall the queue; a job that does not fit does not block a
    smaller one behind it."""
    batch: list[Job] = []
    rest: list[Job] = []
    rows = 0
    requests: set[str] = set()
    for job in waiting:
        cost = rows_of(job)
        request = request_of(job)
        if request not in requests and (not batch or rows + cost <= max_rows):
            batch.append(job)
            rows += cost
            requests.add(request)
        else:
            rest.append(job)
    return batch, rest


class PassRhythm:
    """Continuous batching's rhythm: which requests the next pass should wait a moment for.

    Under load every request in flight sends its next job as soon as its last result arrives, but the
    router turns the results of one pass into new jobs one after another, so they reach the queue
    spread over a few milliseconds. Taking whatever is there splits one round of requests into two
    passes, each paying the pass's fixed cost (measured through the cluster on 2 cores at concurrency
    16: 8.6 jobs a pass instead of 16). So when jobs are waiting but some requests of the last pass
    have not sent their next one yet, the verifier waits for them — at most ``max_wait_share`` of a
    pass's recent duration, so a request that has ended (or went elsewhere) costs only that once.
    """

    def __init__(self, max_wait_share: float = 0.25, max_wait_ms: float = 50.0, average: float = 0.8) -> None:
        self.max_wait_share = max_wait_share
        self.max_wait_ms = max_wait_ms
        self.average = average  # weight of the past in the pass time's moving average
        self.pass_ms = 0.0
        self.expected: set[str] = set()  # requests of the last pass, until their next job arrives
        self.answered_at: dict[str, float] = {}  # request -> when a pass last answered it (until it ends)

    def passed(self, request_ids: Sequence[str], pass_ms: float) -> None:
        """A pass answered these requests in ``pass_ms``."""
        self.expected = set(request_ids)
        now = time.monotonic()
        self.answered_at.update((request_id, now) for request_id in request_ids)
        self.pass_ms = pass_ms if not self.pass_ms else self.average * self.pass_ms + (1 - self.average) * pass_ms

    def ended(self, request_id: str) -> None:
        """The request is over: nothing more will come from it."""
        self.expected.discard(request_id)
        self.answered_at.pop(request_id, None)

    def busy(self, within_s: float = 1.0) -> bool:
        """Whether a request answered within ``within_s`` is still going: a pass that holds only a prefill
        (the others' next jobs not there yet) does not have the verifier to itself."""
        cutoff = time.monotonic() - within_s
        self.answered_at = {r: at for r, at in self.answered_at.items() if at >= cutoff}
        return bool(self.answered_at)

    def missing(self, ready_request_ids: Sequence[str]) -> set[str]:
        """Requests of the last pass whose next job is not among the ready ones."""
        return self.expected - set(ready_request_ids)

    def wait_ms(self) -> float:
        """How long the next pass may wait for the missing requests."""
        return min(self.max_wait_share * self.pass_ms, self.max_wait_ms)
