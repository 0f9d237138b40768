"""The quantized weights of a GGUF file, kept as the file stores them, under Hugging Face's parameter names.

A GGUF target is also converted once to fp32 safetensors (``loading.convert_gguf``): that copy supplies
everything the kernels do not take (norms, rotary settings, the config) and the fp32 path. This module
reads the block-quantized matrices themselves, so that the runtime can compute on them as shipped.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from specmesh.kernels.block_linear import FORMATS, BlockWeight

# GGUF tensor name -> Hugging Face parameter name (Llama-family layouts)
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter a GGUF tensor holds (None for tensors the block kernels do not take)."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    match = _LAYER.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"
    return None


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order [rows] that undoes llama.cpp's reordering of q/k projections for its RoPE layout (each
    head's rows go from interleaved pairs back to two halves)."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


def load_block_weights(gguf_path: Path, cache_dir: Path, config) -> dict[str, BlockWeight]:
    """``read_block_weights``, cached as ``gguf/blocks.safetensors`` in ``cache_dir`` (parsing a GGUF file's
    metadata takes seconds; the cache loads in milliseconds). A sub-directory: the model directory's own
    ``*.safetensors`` are its fp32 weights, and readers look there for them."""
    from safetensors.torch import load_file, save_file

    cache = Path(cache_dir) / "gguf" / "blocks.safetensors"
    if cache.exists():
        from safetensors import safe_open

        with safe_open(str(cache), "pt") as handle:
            formats = handle.metadata()
        weights = {name: BlockWeight(formats[name], data) for name, data in load_file(str(cache)).items()}
        return _tie_head(weights, config)
    weights = read_block_weights(gguf_path, config)
    stored = {name: w for name, w in weights.items() if not (name == "lm_head.weight" and w is weights.get(
        "model.embed_tokens.weight"))}
    cache.parent.mkdir(parents=True, exist_ok=True)
    partial = cache.with_suffix(".partial")
    save_file({name: w.data for name, w in stored.items()}, str(partial),
              metadata={name: w.format for name, w in stored.items()})
    partial.rename(cache)
    return weights


def _tie_head(weights: dict[str, BlockWeight], config) -> dict[str, BlockWeight]:
    if "lm_head.weight" not in weights and getattr(config, "tie_word_embeddings", False):
        if "model.embed_tokens.weight" in weights:
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return weights


def read_block_weights(path: Path, config) -> dict[str, BlockWeight]:
    """Every matrix of ``path`` stored in a format the block kernels compute on, by Hugging Face name, with
    llama.cpp's q/k row order undone. An untied model's head is ``lm_head.weight``; a tied one's is the
    embedding matrix (the runtime takes it for both)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    weights = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None or tensor.tensor_type.name not in FORMATS:
            continue
        weight = BlockWeight(tensor.tensor_type.name, torch.from_numpy(np.array(tensor.data, dtype=np.uint8)))
        if name.endswith("q_proj.weight"):
            weight = weight.rows(unpermute_rows(weight.shape[0], config.num_attention_heads))
        elif name.endswith("k_proj.weight"):
            weight = weight.rows(unpermute_rows(weight.shape[0], config.num_key_value_heads))
        weights[name] = weight
    return _tie_head(weights, config)


def check_block_weights(weights: dict[str, BlockWeight], model: torch.nn.Module) -> None:
    """Raise ValueError unless the first and last rows of every block weight de-quantize to exactly the
    model's fp32 parameters: the converted copy and the GGUF file must be the same model."""
    parameters = dict(model.named_parameters())
    if "lm_head.weight" not in parameters and hasattr(model, "lm_head"):
        parameters["lm_head.weight"] = model.lm_head.weight
    for name, weight in weights.items():
        if name not in parameters:
            raise ValueError(f"the GGUF file has {name}, the model does not")
        reference = parameters[name].detach()
        if tuple(reference.shape) != weight.shape:
            raise ValueError(f"{name}: GGUF shape {weight.shape}, model {tuple(reference.shape)}")
        ends = torch.tensor([0, weight.shape[0] - 1])
        if not torch.equal(weight.rows(ends).dequantize(reference.dtype), reference[ends]):
            raise ValueError(f"{name}: the GGUF weights differ from the converted model's")
