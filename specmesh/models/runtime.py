"""Choosing the target runtime for a loaded model: the lean Llama path where it applies, else HF's forward."""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from specmesh.models.hf_runtime import HFRuntime
from specmesh.models.llama import LlamaRuntime, TreeBatch, lean_unsupported
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


def prefilled_session(runtime: TargetRuntime, tokens: Sequence[int]):
    """A new session whose cache holds ``tokens`` (one pass, no logits): a starting point for timing."""
    session = runtime.new_session()
    prefix = compile_tree(tokens[0], TokenTree.chain(tokens[1:]))
    runtime.forward(TreeBatch.build([session], [prefix]), logits_rows=torch.empty(0, dtype=torch.long))
    session.keep_rows(list(range(prefix.num_rows)))
    return session
