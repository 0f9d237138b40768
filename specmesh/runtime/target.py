"""Choosing the target runtime for a loaded model: the lean Llama path where it applies, else HF's forward;
on the GGUF file's own blocks ("shipped" precision) or on the de-quantized weights ("fp32")."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterable, Mapping, Protocol, Sequence

import torch

from specmesh.errors import InvalidArgument
from specmesh.kernels.block_linear import BlockWeight, quantize
from specmesh.kernels.cpu_ops import KernelUnavailable, build_every_path, load_cpu_ops
from specmesh.runtime.gguf import check_block_weights, load_block_weights
from specmesh.runtime.hf import HFRuntime
from specmesh.runtime.llama import LlamaRuntime, Scores, TreeBatch, lean_unsupported
from specmesh.runtime.loading import LoadedModel, cache_root, load_hf_model, pick_device, pick_dtype, resolve_model_dir
from specmesh.runtime.precision import check_precision
from specmesh.tree import chained

log = logging.getLogger(__name__)


class TargetRuntime(Protocol):
    device: torch.device
    vocab_size: int
    max_length: int

    def new_session(self): ...

    def forward(self, batch: TreeBatch, logits_rows: torch.Tensor | None = None) -> torch.Tensor: ...


def make_runtime(
    hf_model: torch.nn.Module, lean: bool = True, block_weights: Mapping[str, BlockWeight] | None = None,
    kv_cache_gb: float | None = None, batch_invariant: bool | None = None,
) -> TargetRuntime:
    """The lean runtime where it computes this model exactly (on CUDA: paged KV pool of ``kv_cache_gb``,
    fused kernels, CUDA graphs; elsewhere sessions capped at ``kv_cache_gb`` together), else Hugging
    Face's forward."""
    if lean and lean_unsupported(hf_model.config) is None:
        if hf_model.device.type == "cuda" and not block_weights:
            from specmesh.runtime.paged_llama import PagedLlamaRuntime

            return PagedLlamaRuntime(hf_model, kv_cache_gb=kv_cache_gb, batch_invariant=batch_invariant)
        return LlamaRuntime(hf_model, block_weights=block_weights, kv_cache_gb=kv_cache_gb)
    return HFRuntime(hf_model)


def shipped_blocks(loaded: LoadedModel, precision: str = "shipped") -> dict[str, BlockWeight] | None:
    """The blocks to compute on (a GGUF's own for ``shipped``; every projection rounded to Q8_0 for
    ``q8_0``), or None (with the reason logged) where the target runs on its weights as loaded: fp32 asked
    for, a shipped model that is not GGUF, not a CPU, not fp32 activations, no kernel."""
    check_precision(precision)
    if precision == "fp32" or (precision == "shipped" and loaded.gguf is None):
        return None
    weight = loaded.model.get_input_embeddings().weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        log.info("%s: GGUF blocks are computed on CPUs in fp32; running de-quantized on %s in %s",
                 loaded.name, weight.device, weight.dtype)
        return None
    if lean_unsupported(loaded.model.config) is not None:
        return None
    try:
        load_cpu_ops(cache_root() / "extensions")
    except KernelUnavailable as exc:
        log.warning("%s runs de-quantized to fp32: the quantized kernel is not available (%s)", loaded.name, exc)
        return None
    if precision == "q8_0":
        return quantized_projections(loaded.model.named_parameters(), loaded.model.lm_head.weight, "Q8_0")
    blocks = load_block_weights(loaded.gguf, loaded.converted, loaded.model.config)
    check_block_weights(blocks, loaded.model)
    return blocks


def quantized_projections(parameters: Iterable[tuple[str, torch.Tensor]], head: torch.Tensor,
                          format: str) -> dict[str, BlockWeight]:
    """A Llama-family model's projections (its named parameters, by Hugging Face name) and ``head`` (as
    ``lm_head.weight``) rounded to ``format`` blocks, each whose inputs fill blocks of 32 (int8 weight-only
    for any such model: ``--precision q8_0``; a drafter's approximate linears)."""
    blocks = {}
    for name, parameter in parameters:
        if parameter.dim() == 2 and "embed_tokens" not in name and parameter.shape[1] % 32 == 0:
            blocks[name] = quantize(parameter, format)
    if "lm_head.weight" not in blocks and head.shape[1] % 32 == 0:  # a tied head is listed under the embeddings' name
        blocks["lm_head.weight"] = quantize(head, format)
    return blocks


def prepare_target(model: str, every_cpu_kernel: bool = False) -> str:
    """Convert a GGUF target once, build the quantized kernel (every CPU's with ``every_cpu_kernel``) and
    cache the file's blocks (what ``make install`` does, so that nothing waits for it later). Returns a line
    saying what is ready."""
    from transformers import AutoConfig

    source, gguf = resolve_model_dir(model)
    if gguf is None:
        return f"{source}"
    try:
        load_cpu_ops(cache_root() / "extensions")
        if every_cpu_kernel:
            build_every_path(cache_root() / "extensions")
    except KernelUnavailable as exc:
        return f"{source} (fp32 only: {exc})"
    load_block_weights(gguf, Path(source), AutoConfig.from_pretrained(source))
    return f"{source} (shipped precision ready)"


def target_runtime(loaded: LoadedModel, precision: str = "shipped", kv_cache_gb: float | None = None,
                   batch_invariant: bool | None = None) -> TargetRuntime:
    """The runtime a verifier or ``generate`` serves ``loaded`` with, in ``precision`` (see
    ``precision.PRECISIONS``), its KV cache within ``kv_cache_gb``; ``batch_invariant``: see
    ``PagedLlamaRuntime``."""
    return make_runtime(loaded.model, block_weights=shipped_blocks(loaded, precision), kv_cache_gb=kv_cache_gb,
                        batch_invariant=batch_invariant)


def load_target(model: str, dtype: str | None = None, device: str | None = None, precision: str = "shipped",
                kv_cache_gb: float | None = None, batch_invariant: bool | None = None,
                offload: bool = False) -> tuple[LoadedModel, TargetRuntime]:
    """The target loaded and the runtime it is served with (``target_runtime``). ``offload``: its decoder
    layers stay in host memory, in the compute device's dtype, streamed to ``device`` a layer at a time
    (``offload.py``); its own weights, never GGUF blocks or ``q8_0``."""
    if not offload:
        loaded = load_hf_model(model, dtype=dtype, device=device)
        return loaded, target_runtime(loaded, precision, kv_cache_gb, batch_invariant)
    loaded, compute = load_on_host(model, dtype, device, precision, "an offloaded target")
    from specmesh.runtime.paged_llama import PagedLlamaRuntime

    return loaded, PagedLlamaRuntime(loaded.model, kv_cache_gb=kv_cache_gb, batch_invariant=batch_invariant,
                                     offload=compute)


def host_compute_device(precision: str, device: str | None, what: str) -> torch.device:
    """The device a target held in host memory computes on (``what``: an offloaded or a tensor-parallel
    target), once its precision is one it computes itself: its own weights, never GGUF blocks or ``q8_0``."""
    check_precision(precision)
    if precision == "q8_0":
        raise InvalidArgument("precision", f"{what} computes its own weights: q8_0 does not apply")
    return pick_device(device)


def check_lean(config, what: str) -> None:
    reason = lean_unsupported(config)
    if reason:
        raise InvalidArgument("model", f"{what} needs the lean runtime: {reason}")


def load_on_host(model: str, dtype: str | None, device: str | None, precision: str,
                 what: str) -> tuple[LoadedModel, torch.device]:
    """The target in host memory, in the dtype of the device it will compute on, for a runtime that places
    its weights itself (see ``host_compute_device``), on the lean runtime. Also that device."""
    compute = host_compute_device(precision, device, what)
    loaded = load_hf_model(model, dtype=pick_dtype(dtype, compute), device="cpu")
    check_lean(loaded.model.config, what)
    return loaded, compute


PREFILL_CHUNK = 512  # tokens per session per prefill pass: bounds the attention scores' memory


def prefill_sessions(runtime: TargetRuntime, sessions: Sequence, histories: Sequence[Sequence[int]],
                     feature_layers: Sequence[int] = ()) -> list[torch.Tensor]:
    """Extend each session's cache until it holds its whole history, all sessions in each pass (no logits).
    With ``feature_layers``: each session's hidden states at the positions it prefilled
    ([positions, layers, hidden], see ``score_with_features``), else []."""
    features: list[list[torch.Tensor]] = [[] for _ in sessions]
    while True:
        pending = [(i, s, h) for i, (s, h) in enumerate(zip(sessions, histories)) if s.length < len(h)]
        if not pending:
            break
        trees = [chained(history[session.length :][:PREFILL_CHUNK]) for _, session, history in pending]
        batch = TreeBatch.build([s for _, s, _ in pending], trees)
        no_logits = torch.empty(0, dtype=torch.long)
        if feature_layers:
            hidden = score_with_features(runtime, batch, feature_layers, no_logits).features
            for (i, _, _), start, end in zip(pending, batch.cu_rows, batch.cu_rows[1:]):
                features[i].append(hidden[start:end])
        else:
            runtime.forward(batch, logits_rows=no_logits)
        for (_, session, _), tree in zip(pending, trees):
            session.keep_rows(list(range(tree.num_rows)))
    return [torch.cat(parts) if parts else None for parts in features] if feature_layers else []


def score_with_features(runtime: TargetRuntime, batch: TreeBatch, feature_layers: Sequence[int],
                        logits_rows: torch.Tensor | None = None) -> Scores:
    """A pass that also returns hidden states after ``feature_layers`` (lean runtimes only)."""
    if not hasattr(runtime, "score"):
        raise InvalidArgument("feature_layers", f"{type(runtime).__name__} cannot return hidden states; "
                              "feature drafters need the lean runtime")
    return runtime.score(batch, logits_rows, feature_layers)


def prefilled_session(runtime: TargetRuntime, tokens: Sequence[int]):
    """A new session whose cache holds ``tokens`` (no logits): a starting point for timing."""
    session = runtime.new_session()
    prefill_sessions(runtime, [session], [tokens])
    return session
