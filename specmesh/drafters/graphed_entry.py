"""A feature head's one-entry step over one request's KV cache, as a CUDA graph.

On a GPU a drafted token is ~45 small kernels (norms, rotations, the cache write, attention, five
products, the head) whose launches cost several times their work: a Llama-3-8B-wide EAGLE-3 head took
1.3-1.9 ms a guess eagerly on an H200 against ~0.2 ms of weights to stream. Captured once per request
and cache, a guess is an input copy, one replay and one read. Off CUDA the same fixed-shape step runs
eagerly (what the tests exercise on a CPU).
"""

from __future__ import annotations

from typing import Callable

import torch

# (keys, rope tables, g, token, position, index) -> the step's output tensors
EntryFn = Callable[..., tuple[torch.Tensor, ...]]


class GraphedEntry:
    """``step`` over static inputs; ``keys`` and ``tables`` are read by address, so they are held here."""

    def __init__(self, step: EntryFn, keys: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.step, self.keys, self.tables = step, keys, tables
        cuda = keys.device.type == "cuda"
        self.g: torch.Tensor | None = None  # [1, hidden]: allocated on the first run
        self.ints = torch.zeros(3, 1, dtype=torch.long, device=keys.device)  # token, position, index
        self.staged = torch.zeros(3, 1, dtype=torch.long, pin_memory=cuda)  # their next values, on the host
        self.copied = torch.cuda.Event() if cuda else None  # the staged values reached the device
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, ...] = ()

    def _call(self) -> tuple[torch.Tensor, ...]:
        return self.step(self.keys, self.tables, self.g, self.ints[0], self.ints[1], self.ints[2])

    def run(self, g: torch.Tensor, token: int, position: int, index: int) -> tuple[torch.Tensor, ...]:
        """The step's outputs for these inputs: on CUDA the graph's own buffers, valid until the next run."""
        if self.g is None:
            self.g = torch.empty_like(g)
        self.g.copy_(g)
        if self.copied is None:
            self.ints[:, 0] = torch.tensor((token, position, index))
            return self._call()
        self.copied.synchronize()  # the last copy has left the host buffer (long since, as a rule)
        self.staged[:, 0] = torch.tensor((token, position, index))
        self.ints.copy_(self.staged, non_blocking=True)  # one copy, not three kernels
        self.copied.record()
        if self.graph is None:
            return self._capture()
        self.graph.replay()
        return self.outputs

    def _capture(self) -> tuple[torch.Tensor, ...]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # this call's own entry, run for real: loads kernels before the capture
            first = self._call()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # recorded, not run (the entry is written once); its own memory pool: a shared one dies with its last graph
        with torch.cuda.graph(self.graph):
            self.outputs = self._call()
        return first
