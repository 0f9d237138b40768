"""The verifier's pass curve, measured at start-up: what a pass costs by requests, trees and rows.

The speculation controller's cost model starts from it (``CostModel.calibrate``), so that it knows from
the first request whether a row is nearly free (a GPU, where an 8B pass is flat to hundreds of rows) or
costs a fifth of a step (2 CPU cores), instead of a prior measured on one machine. The passes also warm
the runtime up: on CUDA they compile the kernels and capture the graphs of the shapes they touch.

The grid grows the requests (1, 4, 16, 64), each with trees of 0, 4 and 16 nodes, until a pass takes
longer than ``time_cap_ms`` or ``FLAT_FACTOR`` one-token passes, whichever is longer (an offloaded
target's every pass streams the model: its first one alone may take longer than the cap, and the curve
is what tells the controller that rows are nearly free); each point is the median of a few passes after
one untimed one.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from specmesh.runtime.llama import TreeBatch
from specmesh.runtime.target import TargetRuntime, prefill_sessions
from specmesh.tree import TokenTree, compile_tree

REQUESTS = (1, 4, 16, 64)
TREE_NODES = (0, 4, 16)
CONTEXT_TOKENS = 40  # each request's committed tokens: a short history, inside one key block
FLAT_FACTOR = 4.0  # a pass this many one-token passes long is past any flat part: the curve has its shape


@dataclass(frozen=True)
class PassSample:
    """One measured verification pass: ``requests`` of which ``trees`` have a tree, ``rows`` in all."""

    requests: int
    trees: int
    rows: int
    ms: float


@dataclass(frozen=True)
class PassCurve:
    """A runtime's measured passes, and the device they ran on: a CPU verifier shares its machine's cores
    with whatever drafts beside it."""

    device: str  # "cpu", "cuda", ...
    samples: tuple[PassSample, ...]

    def rows_within(self, ms: float) -> int | None:
        """The most rows a pass of ``ms`` holds, by a straight line through the samples (ms = fixed +
        per row × rows); None where rows cost nothing measurable (a flat curve) or it cannot tell."""
        if len({s.rows for s in self.samples}) < 2:
            return None
        per_row, fixed = statistics.linear_regression([s.rows for s in self.samples], [s.ms for s in self.samples])
        if per_row <= 0:
            return None
        return max(1, int((ms - fixed) / per_row))


def _timed(runtime: TargetRuntime, batch: TreeBatch) -> float:
    started = time.perf_counter()
    logits = runtime.forward(batch)
    if isinstance(logits, torch.Tensor) and logits.device.type == "cuda":
        torch.cuda.synchronize(logits.device)
    return (time.perf_counter() - started) * 1e3


def measure_pass_curve(runtime: TargetRuntime, requests: Sequence[int] = REQUESTS, nodes: Sequence[int] = TREE_NODES,
                       repeats: int = 3, time_cap_ms: float = 100.0, max_sessions: int | None = None,
                       seed: int = 0) -> PassCurve:
    """Median milliseconds of passes over the grid (see the module doc); the sessions are freed after."""
    rng = random.Random(seed)
    vocab = runtime.vocab_size
    most = min(max(requests), max_sessions or max(requests))
    sessions, samples = [], []
    try:
        for count, n in [(count, n) for count in sorted(r for r in requests if r <= most) for n in nodes]:
            if len(sessions) < count:
                fresh = [runtime.new_session() for _ in range(count - len(sessions))]
                prefill_sessions(runtime, fresh, [[rng.randrange(vocab) for _ in range(CONTEXT_TOKENS)] for _ in fresh])
                sessions += fresh
            trees = [compile_tree(rng.randrange(vocab), TokenTree.chain([rng.randrange(vocab) for _ in range(n)]))
                     for _ in range(count)]
            batch = TreeBatch.build(sessions[:count], trees)
            _timed(runtime, batch)  # untimed: compiles and warms what this shape needs
            times = [_timed(runtime, batch)]
            cap = max(time_cap_ms, FLAT_FACTOR * samples[0].ms) if samples else max(time_cap_ms, FLAT_FACTOR * times[0])
            if times[0] <= cap:
                times += [_timed(runtime, batch) for _ in range(repeats - 1)]
            samples.append(PassSample(count, count if n else 0, count * (1 + n), round(statistics.median(times), 3)))
            if times[0] > cap:
                break  # bigger passes only take longer: the curve so far is what the controller needs
    finally:
        for session in sessions:
            session.free()
    return PassCurve(runtime.device.type, tuple(samples))
