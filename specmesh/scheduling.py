"""The verifier's batch scheduler: which waiting jobs go into the next verification pass."""

from __future__ import annotations

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
