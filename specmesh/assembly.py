"""Putting an engine together from model references: the target runtime plus the named drafters."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch

from specmesh.drafters.base import Drafter
from specmesh.drafters.model import ModelDrafter
from specmesh.drafters.ngram import HistoryDrafter, NgramDrafter
from specmesh.engine import SpeculativeEngine
from specmesh.errors import InvalidArgument
from specmesh.models.runtime import TargetRuntime, make_runtime
from specmesh.models.loading import LoadedModel, load_hf_model, tokenizer_fingerprint

MODEL_FREE_DRAFTERS = {"ngram": NgramDrafter, "history": HistoryDrafter}


@dataclass
class Assembly:
    target: LoadedModel
    runtime: TargetRuntime
    drafters: list[Drafter]

    def engine(self, max_tree_nodes: int) -> SpeculativeEngine:
        return SpeculativeEngine(
            self.runtime,
            drafters=self.drafters if max_tree_nodes > 0 else [],
            max_tree_nodes=max_tree_nodes,
            eos_token_ids=eos_token_ids(self.target),
        )


def configure_threads(threads: int | None) -> int:
    """Use ``threads`` intra-op threads (default: every core); returns the number set."""
    count = threads or os.cpu_count() or 1
    if count < 1:
        raise InvalidArgument("threads", f"must be >= 1, got {threads}")
    torch.set_num_threads(count)
    return count


def eos_token_ids(model: LoadedModel) -> list[int]:
    ids = model.model.generation_config.eos_token_id if model.model.generation_config else None
    if ids is None:
        ids = model.tokenizer.eos_token_id
    return [ids] if isinstance(ids, int) else list(ids or [])


def load_drafter(spec: str, target: LoadedModel, device: str | None, dtype: str | None) -> Drafter:
    """``ngram`` for prompt lookup, else a model reference for a small LM sharing the target's tokenizer."""
    if spec in MODEL_FREE_DRAFTERS:
        return MODEL_FREE_DRAFTERS[spec]()
    try:
        loaded = load_hf_model(spec, dtype=dtype, device=device)
    except InvalidArgument as exc:
        raise InvalidArgument("drafter", f"{exc} (drafters: {', '.join(MODEL_FREE_DRAFTERS)} or a model)") from None
    if tokenizer_fingerprint(loaded.tokenizer) != tokenizer_fingerprint(target.tokenizer):
        raise InvalidArgument("drafter", f"{spec!r} has a different vocabulary from the target {target.name!r}")
    return ModelDrafter(loaded.model, vocab_size=target.model.config.vocab_size, name=spec)


def assemble(
    model: str, drafters: Sequence[str] = ("ngram",), device: str | None = None, dtype: str | None = None
) -> Assembly:
    target = load_hf_model(model, dtype=dtype, device=device)
    runtime = make_runtime(target.model)
    return Assembly(target, runtime, [load_drafter(d, target, device, dtype) for d in drafters])
