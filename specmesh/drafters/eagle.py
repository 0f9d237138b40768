"""Published EAGLE heads as feature drafters: ``--drafter eagle3:/path/to/checkpoint`` and ``eagle:``.

An EAGLE-3 head (Li et al. 2025) as SafeAILab/EAGLE and SpecForge publish it is the feature head of
``feature.py`` in another layout, with two differences: the three target layers are fused raw (no norm
of each), and its head covers a draft vocabulary without a "none of these" class. The checkpoint is a
folder with ``config.json`` (a LlamaConfig: hidden size, heads, MLP size, ``vocab_size`` = the target's,
``draft_vocab_size``) and its tensors (``model.safetensors`` or ``pytorch_model.bin``):

    fc.weight                          [hidden, 3 * hidden]   the target's three layers, concatenated
    midlayer.input_layernorm.weight    [hidden]               the next token's embedding (the target's)
    midlayer.hidden_norm.weight        [hidden]               the fused feature, or the last output
    midlayer.self_attn.{q,k,v}_proj    [.., 2 * hidden]       over [embedding, feature]
    midlayer.self_attn.o_proj, midlayer.post_attention_layernorm, midlayer.mlp.{gate,up,down}_proj
    norm.weight, lm_head.weight        [draft vocab, hidden]
    d2t [draft vocab] int64            target id = draft id + d2t[draft id]
    t2d [vocab] bool                   which target ids the draft vocabulary holds

The layers read are the hidden states after layers (2, N/2, N-3) of an N-layer target, or those its
config names (``eagle_config.eagle_aux_hidden_state_layer_ids``, SpecForge's count: the output of layer
i, i.e. after i + 1 layers). A head made for another target is refused before it drafts: another hidden
size, vocabulary, tokenizer (when the folder has one) or layers the target lacks.

An EAGLE-1/2 head (SafeAILab/EAGLE, ``eagle:DIR``) reads the target's last hidden state after its final
norm, one decoder layer deep, and drafts through the target's own LM head:

    fc.weight [hidden, 2 * hidden] (fc.bias)   [embedding of the next token, feature] -> the layer's input
    layers.0.self_attn.{q,k,v,o}_proj, layers.0.post_attention_layernorm, layers.0.mlp.{gate,up,down}_proj
                                               a Llama layer without an input norm; its output is the next
                                               feature, read unnormed by the target's LM head

(``embed_tokens.weight``, when shipped, is the target's and is not read.) As a feature drafter it reads
the hidden state after the target's N layers and applies the target's final norm itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specmesh.drafters.feature import FeatureConfig, FeatureHead, rope_scaling_of
from specmesh.errors import InvalidArgument
from specmesh.runtime.loading import TargetParts, tokenizer_fingerprint

PREFIX = "eagle3:"
EAGLE_PREFIX = "eagle:"
LAYER = "midlayer."
EAGLE_LAYER = "layers.0."


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder: its safetensors files, else ``pytorch_model.bin`` (read with
    ``weights_only``: no code in a pickle runs)."""
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if files:
        return {k: v for f in files for k, v in load_file(str(f)).items()}
    binary = directory / "pytorch_model.bin"
    if binary.is_file():
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise InvalidArgument("drafter", f"{directory}: no *.safetensors nor pytorch_model.bin")


def default_layers(num_layers: int) -> tuple[int, ...]:
    """The target layers EAGLE-3 reads by default: a low, the middle and a high one."""
    return (2, num_layers // 2, num_layers - 3)


def feature_layers(config: dict, num_layers: int) -> tuple[int, ...]:
    named = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return tuple(int(i) + 1 for i in named) if named else default_layers(num_layers)


def load_eagle3(spec: str, target: TargetParts) -> FeatureHead:
    """The head in ``eagle3:DIR`` over ``target``'s embeddings, in fp32, checked against the target."""
    directory = Path(spec.removeprefix(PREFIX))
    where = f"{PREFIX}{directory}"
    if not (directory / "config.json").is_file():
        raise InvalidArgument("drafter", f"{where}: no config.json (an EAGLE-3 checkpoint folder)")
    config = json.loads((directory / "config.json").read_text())
    tensors = read_tensors(directory)
    names = ["fc.weight", "norm.weight", "lm_head.weight", *(LAYER + n for n in (
        "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
        *(f"self_attn.{p}_proj.weight" for p in "qkvo"), *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))))]
    missing = [n for n in names if n not in tensors]
    if missing:
        raise InvalidArgument("drafter", f"{where} is not an EAGLE-3 head in the published layout: no "
                              f"{', '.join(missing[:4])}")
    if config.get("norm_before_residual"):
        raise InvalidArgument("drafter", f"{where}: norm_before_residual heads are not supported")
    hidden, layers = int(config["hidden_size"]), feature_layers(config, target.num_layers)
    fc = tensors["fc.weight"]
    check_target(directory, where, config, target, fc, len(layers))
    if not all(1 <= n <= target.num_layers for n in layers):
        raise InvalidArgument("drafter", f"{where} reads layers {list(layers)}; this target has {target.num_layers}")
    subset = draft_to_target(tensors, target.vocab_size, where)
    heads = int(config["num_attention_heads"])
    head_config = FeatureConfig(
        hidden_size=hidden, num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads", heads)),
        head_dim=int(config.get("head_dim") or hidden // heads), intermediate_size=int(config["intermediate_size"]),
        feature_layers=layers, rope_theta=rope_theta_of(config), rope_scaling=rope_scaling_of(config),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), subset_size=len(subset), feature_norms=False,
        fallback=False)
    model = FeatureHead(head_config, target.input_embeddings().float(), subset)
    weight = lambda name: tensors[LAYER + name].float()  # noqa: E731
    state = {
        "fuse.weight": fc.float(), "embed_norm.weight": weight("input_layernorm.weight"),
        "input_norm.weight": weight("hidden_norm.weight"),
        "qkv.weight": torch.cat([weight(f"self_attn.{p}_proj.weight") for p in "qkv"]),
        "out.weight": weight("self_attn.o_proj.weight"), "post_norm.weight": weight("post_attention_layernorm.weight"),
        "gate_up.weight": torch.cat([weight("mlp.gate_proj.weight"), weight("mlp.up_proj.weight")]),
        "down.weight": weight("mlp.down_proj.weight"), "final_norm.weight": tensors["norm.weight"].float(),
        "head.weight": tensors["lm_head.weight"].float(),
    }
    return loaded(model, state, where)


def rope_theta_of(config: dict) -> float:
    """A checkpoint config's RoPE base (``rope_theta``, or inside transformers 5's ``rope_parameters``)."""
    return float(config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta") or 10000.0)


def loaded(model: FeatureHead, state: dict[str, torch.Tensor], where: str) -> FeatureHead:
    """``model`` holding ``state`` (a checkpoint's tensors under our names), in eval mode; a checkpoint whose
    shapes disagree with its own config is refused."""
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise InvalidArgument("drafter", f"{where}: tensors do not match config.json: {str(exc).splitlines()[1:2]}") from None
    return model.eval()


def check_target(directory: Path, where: str, config: dict, target: TargetParts, fc: torch.Tensor,
                 features: int) -> None:
    """Refuse a head made for another target: its fc reads ``features`` hidden states of another size, or
    its vocabulary or (when the folder has one) tokenizer is not the target's."""
    hidden = int(config["hidden_size"])
    if hidden != target.hidden_size or tuple(fc.shape) != (hidden, features * target.hidden_size):
        raise InvalidArgument("drafter", f"{where} reads hidden states of size {fc.shape[1] // features} into a "
                              f"{hidden}-wide layer; this target's hidden states are {target.hidden_size}")
    if int(config.get("vocab_size", -1)) != target.vocab_size:
        raise InvalidArgument("drafter", f"{where} was made for a vocabulary of {config.get('vocab_size')} tokens; "
                              f"this target's has {target.vocab_size}")
    if (directory / "tokenizer.json").is_file() or (directory / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        if tokenizer_fingerprint(AutoTokenizer.from_pretrained(directory)) != tokenizer_fingerprint(target.tokenizer):
            raise InvalidArgument("drafter", f"{where}'s tokenizer is not the target's ({target.name!r})")


def load_eagle(spec: str, target: TargetParts) -> FeatureHead:
    """The EAGLE-1/2 head in ``eagle:DIR`` over ``target``'s embeddings, final norm and LM head, in fp32,
    checked against the target."""
    directory = Path(spec.removeprefix(EAGLE_PREFIX))
    where = f"{EAGLE_PREFIX}{directory}"
    if not (directory / "config.json").is_file():
        raise InvalidArgument("drafter", f"{where}: no config.json (an EAGLE checkpoint folder)")
    config = json.loads((directory / "config.json").read_text())
    tensors = {name.removeprefix("model."): t for name, t in read_tensors(directory).items()}
    names = ["fc.weight", *(EAGLE_LAYER + n for n in (
        "post_attention_layernorm.weight", *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
        *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))))]
    missing = [n for n in names if n not in tensors]
    if missing:
        raise InvalidArgument("drafter", f"{where} is not an EAGLE head in the published layout: no "
                              f"{', '.join(missing[:4])}")
    if any(name.startswith("layers.1.") for name in tensors) or int(config.get("num_hidden_layers", 1)) != 1:
        raise InvalidArgument("drafter", f"{where}: heads of more than one decoder layer are not supported")
    fc = tensors["fc.weight"]
    check_target(directory, where, config, target, fc, 2)  # fc reads [embedding, feature]
    if target.output_head is None:
        raise InvalidArgument("drafter", f"{where} drafts through the target's LM head, which {target.name!r} "
                              "does not provide here")
    final_norm, lm_head = target.output_head()
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_config = FeatureConfig(
        hidden_size=hidden, num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads", heads)),
        head_dim=int(config.get("head_dim") or hidden // heads), intermediate_size=int(config["intermediate_size"]),
        feature_layers=(target.num_layers,), rope_theta=rope_theta_of(config), rope_scaling=rope_scaling_of(config),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), subset_size=target.vocab_size, feature_norms=True,
        fallback=False, mix="fc", mix_bias="fc.bias" in tensors, final_norm=False)
    model = FeatureHead(head_config, target.input_embeddings().float(), torch.arange(target.vocab_size))
    weight = lambda name: tensors[EAGLE_LAYER + name].float()  # noqa: E731
    state = {
        "feature_norms.0.weight": final_norm.float().cpu(),  # the target's own final norm, applied here
        "fuse.weight": torch.eye(hidden), "mix.weight": fc.float(),
        **({"mix.bias": tensors["fc.bias"].float()} if "fc.bias" in tensors else {}),
        "qkv.weight": torch.cat([weight(f"self_attn.{p}_proj.weight") for p in "qkv"]),
        "out.weight": weight("self_attn.o_proj.weight"), "post_norm.weight": weight("post_attention_layernorm.weight"),
        "gate_up.weight": torch.cat([weight("mlp.gate_proj.weight"), weight("mlp.up_proj.weight")]),
        "down.weight": weight("mlp.down_proj.weight"), "final_norm.weight": torch.ones(hidden),
        "head.weight": lm_head.float().cpu(),
    }
    return loaded(model, state, where)


def draft_to_target(tensors: dict[str, torch.Tensor], vocab_size: int, where: str) -> torch.Tensor:
    """The target id of each draft id [draft vocab] from ``d2t`` (and ``t2d``, when given, must agree);
    without a map the draft vocabulary is the target's."""
    rows = tensors["lm_head.weight"].shape[0]
    if "d2t" not in tensors:
        if rows != vocab_size:
            raise InvalidArgument("drafter", f"{where}: a draft vocabulary of {rows} tokens needs its d2t map")
        return torch.arange(vocab_size)
    d2t = tensors["d2t"].to(torch.long)
    ids = torch.arange(d2t.shape[0]) + d2t
    if d2t.shape != (rows,) or ids.min() < 0 or ids.max() >= vocab_size or ids.unique().numel() != rows:
        raise InvalidArgument("drafter", f"{where}: its d2t map does not name {rows} distinct ids of the target's "
                              f"{vocab_size}-token vocabulary")
    if "t2d" in tensors:
        t2d = tensors["t2d"].to(torch.bool)
        if t2d.shape != (vocab_size,) or not torch.equal(t2d.nonzero().flatten(), ids.sort().values):
            raise InvalidArgument("drafter", f"{where}: its t2d and d2t maps disagree")
    return ids


def write_eagle3(model: FeatureHead, directory: Path, vocab_size: int, max_position_embeddings: int,
                 tokenizer=None, card: dict | None = None) -> None:
    """``model`` (a head in EAGLE-3's form: ``feature_norms`` and ``fallback`` off) as a published EAGLE-3
    checkpoint that ``load_eagle3`` and other engines read; the target's ``tokenizer`` beside it (so a
    loader can check it) and ``card`` (what specmesh measured) in ``specmesh.json``."""
    from safetensors.torch import save_file

    c = model.config
    if c.feature_norms or c.fallback:
        raise InvalidArgument("format", "EAGLE-3's layout has no per-layer feature norms and no fallback class: "
                              "train the head with --format eagle3")
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    q, k, v = state["qkv.weight"].split([q_size, kv_size, kv_size])
    gate, up = state["gate_up.weight"].chunk(2)
    subset, order = model.subset_ids.cpu().sort()  # draft ids in the target's order, as published heads have them
    state["head.weight"] = state["head.weight"][order]
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[subset] = True
    tensors = {"fc.weight": state["fuse.weight"], "norm.weight": state["final_norm.weight"],
               "lm_head.weight": state["head.weight"],
               LAYER + "input_layernorm.weight": state["embed_norm.weight"],
               LAYER + "hidden_norm.weight": state["input_norm.weight"],
               LAYER + "self_attn.q_proj.weight": q, LAYER + "self_attn.k_proj.weight": k,
               LAYER + "self_attn.v_proj.weight": v, LAYER + "self_attn.o_proj.weight": state["out.weight"],
               LAYER + "post_attention_layernorm.weight": state["post_norm.weight"],
               LAYER + "mlp.gate_proj.weight": gate, LAYER + "mlp.up_proj.weight": up,
               LAYER + "mlp.down_proj.weight": state["down.weight"]}
    tensors = {name: t.half().contiguous() for name, t in tensors.items()}
    tensors |= {"d2t": (subset - torch.arange(len(subset))).to(torch.long), "t2d": t2d}
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "num_hidden_layers": 1, "hidden_act": "silu",
        "vocab_size": vocab_size, "draft_vocab_size": len(subset), "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "max_position_embeddings": max_position_embeddings,
        **({"rope_scaling": c.rope_scaling} if c.rope_scaling else {}),
        "tie_word_embeddings": False, "torch_dtype": "float16",
        # SpecForge's count (the output of layer i): the hidden state after i + 1 layers
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [n - 1 for n in c.feature_layers],
                         "use_aux_hidden_state": True},
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(directory / "model.safetensors"))
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    if card is not None:
        (directory / "specmesh.json").write_text(json.dumps(card, indent=2) + "\n")
