"""Real architectures with random weights (``--model random:llama-3-8b``): speed you can check without
downloading a model. A step's time does not depend on the weights' values, only on their shapes.

The configurations are the published ones' shapes (hidden size, layers, heads, vocabulary, RoPE), and
``tiny``: a near-free target (2 layers, 128 wide) whose pass costs little next to the cluster's own hops,
so that what the cluster adds a step can be measured on a CPU as it would be beside a GPU's fast pass;
weights are drawn as the architecture's own initialisation draws them, in the target's dtype, from a
seed, on a GPU where there is one (``random_model``).
Such a target has no text: its tokenizer names token i ``<i>`` (so ``"<5> <17>"`` is tokens 5 and 17),
and a cluster serving it is sent token ids.
"""

from __future__ import annotations

import logging

import torch

from specmesh.errors import InvalidArgument

log = logging.getLogger(__name__)

PREFIX = "random:"

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
_LLAMA31_ROPE = {**_LLAMA3_ROPE, "factor": 8.0}

ARCHITECTURES: dict[str, dict] = {
    "tiny": dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=4096,
                 max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         max_position_embeddings=131072, rope_scaling=_LLAMA3_ROPE, rope_theta=500000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=True),
    "llama-3.2-3b": dict(model_type="llama", hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         max_position_embeddings=131072, rope_scaling=_LLAMA3_ROPE, rope_theta=500000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=True),
    "llama-3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                       rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=131072, rope_scaling=_LLAMA31_ROPE, rope_theta=500000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=False),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False),
}


def is_random(model: str) -> bool:
    return model.startswith(PREFIX)


def random_config(model: str):
    """The transformers config of ``random:<architecture>``."""
    from transformers import AutoConfig

    name = model.removeprefix(PREFIX)
    if name not in ARCHITECTURES:
        raise InvalidArgument("model", f"unknown random architecture {name!r}; known: {', '.join(ARCHITECTURES)}")
    fields = dict(ARCHITECTURES[name])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


@torch.no_grad()
def random_model(model: str, dtype: torch.dtype, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """A causal LM of ``random:<architecture>`` with random weights, built directly on ``device``: the layers
    built uninitialised, then every weight drawn as the architecture's initialisation draws it (matrices
    N(0, initializer_range), norms one, biases zero) by ``seed``. The values are drawn on a GPU when there is
    one, also for weights kept in host memory (``--offload``): an 8B model's take seconds there, minutes on a
    CPU's one-threaded generator."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    config = random_config(model)
    with torch.device(device), no_init_weights():
        hf_model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    hf_model.tie_weights()
    drawn_on = torch.device("cuda") if device.type == "cpu" and torch.cuda.is_available() else device
    draw_weights(hf_model, config.initializer_range, seed, drawn_on)
    return hf_model.eval()


@torch.no_grad()
def draw_weights(hf_model: torch.nn.Module, std: float, seed: int, drawn_on: torch.device) -> None:
    """Every parameter (a tied one once) in place: a matrix from N(0, std), drawn on ``drawn_on`` in order
    from one seeded generator; a vector (a norm's weight, a bias) one for norms, zero otherwise."""
    generator = torch.Generator(drawn_on).manual_seed(seed)
    for name, weight in hf_model.named_parameters():
        if weight.ndim == 1:
            weight.fill_(1.0 if "norm" in name else 0.0)
            continue
        values = torch.empty(weight.shape, dtype=weight.dtype, device=drawn_on).normal_(0.0, std, generator=generator)
        weight.copy_(values)


def weight_bytes(hf_model: torch.nn.Module) -> int:
    """Bytes a one-token step must read: every matrix the layers and the head multiply by (the embedding
    table is only indexed)."""
    inner = getattr(hf_model, "model", hf_model)
    layers = sum(p.numel() * p.element_size() for p in inner.layers.parameters())
    head = hf_model.lm_head.weight
    return layers + head.numel() * head.element_size() + inner.norm.weight.numel() * inner.norm.weight.element_size()


def random_tokenizer(config):
    """A tokenizer for ``config``'s vocabulary in which token i is the word ``<i>``: text round-trips
    through the ids, and the services' fingerprint checks work as for a real model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"<{i}>" for i in range(config.vocab_size)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces

    def word(token_id) -> str | None:
        token_id = token_id[0] if isinstance(token_id, (list, tuple)) else token_id
        return words[token_id] if isinstance(token_id, int) and 0 <= token_id < len(words) else None

    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token=words[0], bos_token=word(config.bos_token_id),
                                   eos_token=word(config.eos_token_id))
