"""The cluster's yardstick at load: the same stepper in process (``EngineCore`` over the tree verifier, no
router, Redis or services), plain decoding of the same requests at the same concurrency.

A request's place is taken by the next one at the step it ends, as in the cluster's verifier; what the
cluster adds (admission, publishing, streaming, the processes beside the verifier) is the difference.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

from specmesh.runtime.tree_verifier import TreeVerifier, VerifyJob, VerifyResult
from specmesh.sampling import SamplingParams
from specmesh.speculation.engine import InlineExecutor
from specmesh.speculation.engine_core import EngineCore
from specmesh.speculation.policy import FixedPolicy
from specmesh.speculation.requests import Request


@dataclass(frozen=True)
class EngineRun:
    tokens_per_s: float
    full_pass_ms: float  # the mean pass with every request of the level decoding (0: none was timed)


class _TimedExecutor(InlineExecutor):
    """The process's tree verifier, as the core calls it, timing the passes where ``level`` requests decode."""

    def __init__(self, verifier: TreeVerifier, level: int) -> None:
        super().__init__(verifier)
        self.level = level
        self.full_passes: list[float] = []

    async def verify(self, jobs: list[VerifyJob]) -> list[VerifyResult]:
        started = time.perf_counter()
        results = await super().verify(jobs)
        if len(jobs) == self.level and all(job.history is None for job in jobs):
            self.full_passes.append(time.perf_counter() - started)
        return results


def engine_at_load(verifier: TreeVerifier, prompts: Sequence[Sequence[int]], max_tokens: int, level: int,
                   eos_token_ids: frozenset[int] = frozenset()) -> EngineRun:
    """Every prompt decoded plainly, ``level`` at a time: tokens/s from the first step to the last."""
    timed = _TimedExecutor(verifier, level)
    core = EngineCore(timed, eos_token_ids, max_running=level)
    waiting = [Request(tuple(p), SamplingParams(max_tokens=max_tokens), request_id=f"engine-{i}")
               for i, p in enumerate(prompts)][::-1]

    async def run() -> int:
        tokens = 0
        while waiting and core.num_requests < level:
            core.add(waiting.pop(), FixedPolicy().begin("", 0))
        while core.num_requests:
            for output in await core.step():
                tokens += len(output.token_ids)
                if output.finish_reason is not None and waiting:  # its place goes to the next at once
                    core.add(waiting.pop(), FixedPolicy().begin("", 0))
        return tokens

    started = time.perf_counter()
    tokens = asyncio.run(run())
    seconds = time.perf_counter() - started
    full = sum(timed.full_passes) / len(timed.full_passes) * 1e3 if timed.full_passes else 0.0
    return EngineRun(tokens / seconds, full)
