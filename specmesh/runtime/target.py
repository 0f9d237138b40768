"""Choosing the target runtime for a loaded model: the lean Llama path where it applies, else HF's forward."""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from specmesh.runtime.hf import HFRuntime
from specmesh.runtime.llama import LlamaRuntime, TreeBatch, lean_unsupported
from specmesh.tree import TokenTree, compile_tree


class TargetRuntime(Protocol):
    device: torch.device
    vocab_size: int
    max_length: int

    def new_session(self): ...

    def forward(self, batch: TreeBatch, logits_rows: torch.Tensor | None = None) -> torch.Tensor: ...


def make_runtime(hf_model: torch.nn.Module, lean: bool = True) -> TargetRuntime:
    if lean and lean_unsupported(hf_model.config) is None:
        return LlamaRuntime(hf_model)
    return HFRuntime(hf_model)


PREFILL_CHUNK = 512  # tokens per session per prefill pass: bounds the attention scores' memory


def prefill_sessions(runtime: TargetRuntime, sessions: Sequence, histories: Sequence[Sequence[int]]) -> None:
    """Extend each session's cache until it holds its whole history, all sessions in each pass (no logits)."""
    while True:
        pending = [(s, h) for s, h in zip(sessions, histories) if s.length < len(h)]
        if not pending:
            return
        trees = []
        for session, history in pending:
            chunk = history[session.length :][:PREFILL_CHUNK]
            trees.append(compile_tree(chunk[0], TokenTree.chain(chunk[1:])))
        batch_sessions = [s for s, _ in pending]
        runtime.forward(TreeBatch.build(batch_sessions, trees), logits_rows=torch.empty(0, dtype=torch.long))
        for session, tree in zip(batch_sessions, trees):
            session.keep_rows(list(range(tree.num_rows)))


def prefilled_session(runtime: TargetRuntime, tokens: Sequence[int]):
    """A new session whose cache holds ``tokens`` (no logits): a starting point for timing."""
    session = runtime.new_session()
    prefill_sessions(runtime, [session], [tokens])
    return session
