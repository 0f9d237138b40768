"""Cancellation that a library swallowed, raised again.

redis-py's asyncio client (5.2 to 8.1, measured) often returns a command's answer although the task
awaiting it was cancelled meanwhile: of 200 tasks cancelled during an ``XRANGE``, 128-151 went on.
A task that awaits another task hands its cancellation to that task, so one swallowed cancellation
keeps a whole request decoding for a client that left. Code that must stop when cancelled checks
after such awaits."""

from __future__ import annotations

import asyncio


async def cancel_all(*tasks: asyncio.Future) -> None:
    """Cancel ``tasks`` and wait until each has ended, whatever its outcome."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def raise_if_cancelled() -> None:
    """Raise CancelledError if the current task was asked to cancel and has not (Python 3.11+)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
