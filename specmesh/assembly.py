"""Putting an engine together from model references: the target runtime plus the named drafters."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from specmesh.drafters.base import Drafter
from specmesh.drafters.expert import ExpertDrafter, ExpertModel, ExpertSpec, drafter_dtype, load_expert
from specmesh.drafters.model import ModelDrafter
from specmesh.drafters.ngram import HistoryDrafter, NgramDrafter
from specmesh.classify import RequestClassifier
from specmesh.engine import Request, SpeculativeEngine
from specmesh.errors import InvalidArgument
from specmesh.models.runtime import TargetRuntime, make_runtime
from specmesh.models.loading import LoadedModel, TargetParts, load_hf_model, parts_of, pick_device, tokenizer_fingerprint
from specmesh.policy import adaptive_policy, check_speculation
from specmesh.prompts import encode_chat
from specmesh.sampling import SamplingParams


MODEL_FREE_DRAFTERS = {"ngram": NgramDrafter, "history": HistoryDrafter}
SHIPPED_EXPERTS = Path(__file__).parent / "experts"  # experts/<target>/<domain>/: made by `specmesh distill`


def shipped_experts(target_name: str) -> dict[str, Path]:
    """Name -> directory of the experts shipped for a target (the embedded default's: code, math, writing,
    knowledge, and chat, whose domain is general)."""
    folder = SHIPPED_EXPERTS / target_name.replace("/", "_")
    if not folder.is_dir():
        return {}
    return {d.name: d for d in sorted(folder.iterdir()) if (d / "drafter.json").is_file()}


def expert_directory(spec: str | Path, target_name: str) -> Path | None:
    """The directory of an expert named as a shipped one (``code``) or as a directory made by ``specmesh
    distill``; None when ``spec`` is neither."""
    shipped = shipped_experts(target_name).get(str(spec))
    if shipped is not None:
        return shipped
    return Path(spec) if (Path(spec) / "drafter.json").is_file() else None


def load_expert_for(directory: str | Path, target: LoadedModel | TargetParts,
                    device: str | None = None) -> tuple[ExpertModel, ExpertSpec]:
    """An expert drafter's model on ``device`` (default: where the target's embeddings are), refusing one
    trained for another tokenizer."""
    target = parts_of(target) if isinstance(target, LoadedModel) else target
    embedding = target.input_embeddings()
    device = pick_device(device) if device is not None else embedding.device
    model, spec = load_expert(directory, embedding, dtype=drafter_dtype(device), device=device)
    if spec.target.get("tokenizer_hash") != tokenizer_fingerprint(target.tokenizer):
        raise InvalidArgument("drafter", f"{directory} was trained for another vocabulary than {target.name!r}'s")
    return model, spec


@dataclass
class Assembly:
    target: LoadedModel
    runtime: TargetRuntime
    drafters: list[Drafter]

    def engine(self, max_tree_nodes: int, speculation: str = "adaptive") -> SpeculativeEngine:
        """An engine over the target and the drafters. ``speculation``, as the router's: ``adaptive``
        (drafters routed by request kind, trust-weighted fusion, budget by goodput), ``fixed`` (routed,
        the whole budget every step) or ``off``."""
        if check_speculation(speculation) == "off":
            max_tree_nodes = 0
        policy = adaptive_policy({}, adapt_budget=speculation == "adaptive")
        for drafter in self.drafters:
            policy.router.register(drafter)
        return SpeculativeEngine(
            self.runtime,
            drafters=self.drafters if max_tree_nodes > 0 else [],
            max_tree_nodes=max_tree_nodes,
            eos_token_ids=eos_token_ids(self.target),
            policy=policy,
        )

    def request(self, prompt: str, params: SamplingParams, classifier: RequestClassifier | None = None) -> Request:
        """A single-turn chat request, its kind classified from the prompt's text when a classifier is given."""
        ids = tuple(encode_chat(self.target.tokenizer, prompt))
        return Request(ids, params, kind=classifier.classify(prompt) if classifier is not None else "")


def configure_threads(threads: int | None) -> int:
    """Use ``threads`` intra-op threads (default: every core); returns the number set."""
    count = threads or os.cpu_count() or 1
    if count < 1:
        raise InvalidArgument("threads", f"must be >= 1, got {threads}")
    torch.set_num_threads(count)
    return count


def eos_token_ids(model: LoadedModel) -> list[int]:
    return list(parts_of(model).eos_token_ids)


def load_drafter(spec: str, target: LoadedModel | TargetParts, device: str | None, dtype: str | None) -> Drafter:
    """A model-free drafter (``ngram``, ``history``), a shipped expert's name (``code``), a drafter
    directory made by ``specmesh distill``, or a small LM sharing the target's tokenizer."""
    target = parts_of(target) if isinstance(target, LoadedModel) else target
    if spec in MODEL_FREE_DRAFTERS:
        return MODEL_FREE_DRAFTERS[spec]()
    directory = expert_directory(spec, target.name)
    if directory is not None:
        model, expert = load_expert_for(directory, target, device)
        return ExpertDrafter(model, name=expert.name, domain=expert.domain)
    try:
        loaded = load_hf_model(spec, dtype=dtype, device=device)
    except InvalidArgument as exc:
        raise InvalidArgument("drafter", f"{exc} (drafters: {', '.join([*MODEL_FREE_DRAFTERS, *shipped_experts(target.name)])}, a drafter directory or a model)") from None
    if tokenizer_fingerprint(loaded.tokenizer) != tokenizer_fingerprint(target.tokenizer):
        raise InvalidArgument("drafter", f"{spec!r} has a different vocabulary from the target {target.name!r}")
    return ModelDrafter(loaded.model, vocab_size=target.vocab_size, name=spec)


def assemble(
    model: str, drafters: Sequence[str] = ("ngram",), device: str | None = None, dtype: str | None = None
) -> Assembly:
    target = load_hf_model(model, dtype=dtype, device=device)
    runtime = make_runtime(target.model)
    return Assembly(target, runtime, [load_drafter(d, target, device, dtype) for d in drafters])
