"""Drafters by name: the model-free ones, the experts shipped for a target, drafter directories made by
``specmesh distill``, and small language models that share the target's tokenizer."""

from __future__ import annotations

from pathlib import Path

from specmesh.drafters.base import Drafter
from specmesh.drafters.eagle import EAGLE_PREFIX, load_eagle, load_eagle3
from specmesh.drafters.eagle import PREFIX as EAGLE3_PREFIX
from specmesh.drafters.expert import ExpertDrafter, ExpertModel, ExpertSpec, drafter_dtype, load_expert
from specmesh.drafters.feature import (
    FeatureDrafter,
    FeatureHead,
    check_feature_target,
    is_feature_drafter,
    load_feature_head,
)
from specmesh.drafters.model import ModelDrafter
from specmesh.drafters.ngram import HistoryDrafter, NgramDrafter
from specmesh.drafters.oracle import PREFIX as ORACLE_PREFIX
from specmesh.drafters.oracle import OracleDrafter
from specmesh.errors import InvalidArgument
from specmesh.runtime.loading import (
    LoadedModel,
    TargetParts,
    load_hf_model,
    parts_of,
    pick_device,
    tokenizer_fingerprint,
)
from specmesh.runtime.random_models import is_random

MODEL_FREE_DRAFTERS = {"ngram": NgramDrafter, "history": HistoryDrafter}
SHIPPED_EXPERTS = Path(__file__).parent.parent / "experts"  # experts/<target>/<domain>/: made by `specmesh distill`


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


def load_feature_for(directory: str | Path, target: LoadedModel | TargetParts, device: str | None = None) -> FeatureHead:
    """A feature drafter's head, refusing one made for another target: another vocabulary, another hidden
    size, or layers the target does not have."""
    target = parts_of(target) if isinstance(target, LoadedModel) else target
    embedding = target.input_embeddings()
    model, spec = load_feature_head(directory, embedding)
    check_feature_target(spec, tokenizer_fingerprint(target.tokenizer), target.hidden_size, target.num_layers,
                         str(directory))
    return model.to(pick_device(device) if device is not None else embedding.device)


def load_drafter(spec: str, target: LoadedModel | TargetParts, device: str | None, dtype: str | None) -> Drafter:
    """A model-free drafter (``ngram``, ``history``), a shipped expert's name (``code``), a drafter
    directory made by ``specmesh distill``, a published EAGLE-3 or EAGLE-1/2 head (``eagle3:DIR``,
    ``eagle:DIR``), or a small LM sharing the target's tokenizer."""
    target = parts_of(target) if isinstance(target, LoadedModel) else target
    if spec in MODEL_FREE_DRAFTERS:
        return MODEL_FREE_DRAFTERS[spec]()
    if spec.startswith(ORACLE_PREFIX):  # measurement only: it reads the answers, so never for a real model
        if not is_random(target.name):
            raise InvalidArgument("drafter", f"{spec!r}: the oracle drafter measures random:<architecture> targets "
                                  f"only, not {target.name!r}")
        return OracleDrafter(spec.removeprefix(ORACLE_PREFIX), target.vocab_size)
    for prefix, load in ((EAGLE3_PREFIX, load_eagle3), (EAGLE_PREFIX, load_eagle)):  # published EAGLE heads
        if spec.startswith(prefix):
            head = load(spec, target)
            return FeatureDrafter(head.to(pick_device(device) if device is not None else head.head.weight.device),
                                  name=f"{prefix}{Path(spec.removeprefix(prefix)).name}")
    directory = expert_directory(spec, target.name)
    if directory is not None and is_feature_drafter(directory):
        return FeatureDrafter(load_feature_for(directory, target, device), name=Path(directory).name)
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
