"""Feature drafters: a small head that reads the target's own hidden states (EAGLE, Li et al. 2024-25).

The target's hidden state at position t already holds most of what it will say next. The head takes,
at each position t, the target's hidden states after a few of its layers (``feature_layers``: low, middle
and top, as EAGLE-3 fuses them) and the embedding of the token that followed, and predicts the token
after that, through one decoder layer. To draft further than the target's features reach, it feeds its
own output hidden state in place of the target's fused features (EAGLE's autoregression in feature
space); training unrolls that loop a few steps ("training-time test") so the head learns to read its
own outputs as well as the target's.

One step at position p (g: fused target features, or the head's previous output):
    x = [norm_e(embed(token[p + 1])), norm_g(g)]                    [2 * hidden]
    h = g + attn(x)                                                  (attention over earlier positions)
    out = h + mlp(norm_post(h))                                      [hidden]  -> next step's g
    logits = head(norm_final(out))                                   [subset + 1]  (last: fallback)
The head covers the most frequent answer tokens plus a fallback class ("none of these"), as the experts'.

A drafter directory holds ``drafter.json`` (kind "feature", the target's name, tokenizer hash, hidden size
and layers, the architecture, measured agreement and cost, the command that made it) and
``weights.safetensors``; the input embeddings are the target's, read at load.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specmesh.drafters.base import DrafterBase
from specmesh.drafters.graphed_entry import GraphedEntry
from specmesh.drafters.shape import (WIDE_DEPTH, WIDE_WIDTH, Step, best_first_tree, confident_tree, round_steps,
                                     round_visibility)
from specmesh.errors import InvalidArgument
from specmesh.kernels.block_linear import quantize
from specmesh.runtime.features import Features
from specmesh.runtime.linear import BlockLinear, block_kernel_available, linear_for
from specmesh.tree import ROOT, TokenTree

FORMAT = "specmesh-feature-drafter/1"


@dataclass(frozen=True)
class FeatureConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    feature_layers: tuple[int, ...]  # the target's layers read (hidden states after that many layers)
    rope_theta: float
    rms_norm_eps: float
    subset_size: int
    feature_norms: bool = True  # each target layer RMS-normed before they are fused (ours; EAGLE-3 fuses them raw)
    fallback: bool = True  # the head's last output means "none of these" (ours; EAGLE-3's head has none)
    # how a step reads its token and g: "norms" (ours, EAGLE-3): attention over [norm(embedding), norm(g)], g
    # the residual; "fc" (EAGLE-1/2): x = fc([embedding, g]) is the attention's input, unnormed, and the residual
    mix: str = "norms"
    mix_bias: bool = False  # "fc" with a bias (some EAGLE-1 checkpoints)
    final_norm: bool = True  # RMS-norm the output before the head (EAGLE-1/2 give it to the target's head raw)
    rope_scaling: dict | None = None  # a RoPE scaling whose frequencies do not depend on the length (llama3, ...)

    @classmethod
    def for_target(cls, config, feature_layers: Sequence[int], subset_size: int) -> FeatureConfig:
        """The head at the target's width, heads and MLP size."""
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        heads = config.num_attention_heads
        return cls(config.hidden_size, heads, config.num_key_value_heads,
                   getattr(config, "head_dim", None) or config.hidden_size // heads, config.intermediate_size,
                   tuple(int(n) for n in feature_layers), float(theta), float(config.rms_norm_eps), subset_size,
                   rope_scaling=rope_scaling_of({"rope_parameters": rope}))


STATIC_ROPE_TYPES = ("linear", "llama3", "yarn")  # scalings whose frequencies do not depend on the length


def rope_scaling_of(config: dict) -> dict | None:
    """A checkpoint config's RoPE scaling (``rope_scaling``, or transformers 5's ``rope_parameters``)
    without its theta; None for plain RoPE. Refuses a scaling that varies with the length."""
    scaling = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    scaling.pop("rope_theta", None)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind not in STATIC_ROPE_TYPES:
        raise InvalidArgument("drafter", f"RoPE scaling {kind!r} is not supported in a feature head (only "
                              f"{', '.join(STATIC_ROPE_TYPES)})")
    return {**scaling, "rope_type": kind}


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float,
                scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] -> cos, sin [..., head_dim] (Llama's rotation of the two halves), with ``scaling``'s
    frequencies and attention factor where the head has one."""
    inverse, factor = _inverse_frequencies(head_dim, theta, json.dumps(scaling, sort_keys=True) if scaling else "")
    angles = positions.float().unsqueeze(-1) * inverse.to(positions.device)  # [..., head_dim / 2]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos() * factor, angles.sin() * factor


@functools.lru_cache(maxsize=16)
def _inverse_frequencies(head_dim: int, theta: float, scaling: str) -> tuple[torch.Tensor, float]:
    """[head_dim / 2] fp32 and the attention factor: plain RoPE's, or transformers' own for a scaling (its
    JSON), computed as the target model computes them."""
    if not scaling:
        return theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim), 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    parameters = json.loads(scaling)
    longest = int(parameters.get("original_max_position_embeddings", 8192) * parameters.get("factor", 1.0))
    config = LlamaConfig(hidden_size=head_dim, num_attention_heads=1, head_dim=head_dim, rope_theta=theta,
                         rope_scaling=parameters, max_position_embeddings=max(longest, 1))
    inverse, factor = ROPE_INIT_FUNCTIONS[parameters["rope_type"]](config, "cpu")
    return inverse.float(), float(factor)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class FeatureHead(nn.Module):
    """The trainable head; ``embedding`` [vocab, hidden] is the target's (frozen, not saved)."""

    def __init__(self, config: FeatureConfig, embedding: torch.Tensor, subset_ids: torch.Tensor) -> None:
        super().__init__()
        self.config = config
        h, layers = config.hidden_size, len(config.feature_layers)
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.register_buffer("embedding", embedding.detach().clone(), persistent=False)  # [vocab, hidden]
        self.register_buffer("subset_ids", subset_ids.to(torch.long), persistent=False)  # [subset]
        self.feature_norms = nn.ModuleList(RMSNorm(h, config.rms_norm_eps) for _ in range(layers if config.feature_norms
                                                                                       else 0))
        # without norms, while training: each layer divided by a fixed scale (its RMS), folded into fuse after
        self.register_buffer("feature_scales", torch.ones(layers), persistent=False)  # [layers]
        self.fuse = nn.Linear(layers * h, h, bias=False)  # the target's layers -> one feature
        if config.mix == "fc":
            self.mix = nn.Linear(2 * h, h, bias=config.mix_bias)  # [embedding, g] -> the layer's input
        else:
            self.embed_norm = RMSNorm(h, config.rms_norm_eps)
            self.input_norm = RMSNorm(h, config.rms_norm_eps)
        self.qkv = nn.Linear(h if config.mix == "fc" else 2 * h, q_size + 2 * kv_size, bias=False)
        self.out = nn.Linear(q_size, h, bias=False)
        self.post_norm = RMSNorm(h, config.rms_norm_eps)
        self.gate_up = nn.Linear(h, 2 * config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, h, bias=False)
        self.final_norm = RMSNorm(h, config.rms_norm_eps)
        self.head = nn.Linear(h, len(subset_ids) + config.fallback, bias=False)  # last row: the fallback class

    @property
    def fallback(self) -> int | None:
        """The output meaning "none of these" (None: the head has none)."""
        return self.head.out_features - 1 if self.config.fallback else None

    def fused(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., layers, hidden] -> g [..., hidden]."""
        if not self.config.feature_norms:
            return self.fuse((features.float() / self.feature_scales.unsqueeze(-1)).flatten(-2))
        normed = [norm(features[..., i, :].float()) for i, norm in enumerate(self.feature_norms)]
        return self.fuse(torch.cat(normed, dim=-1))

    def fold_feature_scales(self) -> None:
        """Fold the training-time layer scales into ``fuse``: the same map over raw features, as drafting
        and EAGLE-3's layout read them."""
        with torch.no_grad():
            per_column = self.feature_scales.repeat_interleave(self.config.hidden_size)  # [layers * hidden]
            self.fuse.weight /= per_column
            self.feature_scales.fill_(1.0)

    def step_inputs(self, g: torch.Tensor, next_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """g [..., hidden], next_ids [...] -> the attention's input [..., 2 * hidden] ("norms") or [..., hidden]
        ("fc"), and the residual [..., hidden]."""
        embedded = self.embedding[next_ids].to(g.dtype)
        if self.config.mix == "fc":
            x = self.mix(torch.cat([embedded, g], dim=-1))
            return x, x
        return torch.cat([self.embed_norm(embedded), self.input_norm(g)], dim=-1), g

    def final(self, out: torch.Tensor) -> torch.Tensor:
        """A step's output [..., hidden] as its head reads it."""
        return self.final_norm(out) if self.config.final_norm else out

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """x [..., 2 * hidden] -> q [..., heads, head_dim], k and v [..., kv_heads, head_dim], q and k rotated."""
        c = self.config
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        qkv = self.qkv(x)
        q = qkv[..., :q_size].unflatten(-1, (c.num_heads, c.head_dim))
        k = qkv[..., q_size : q_size + kv_size].unflatten(-1, (c.num_kv_heads, c.head_dim))
        v = qkv[..., q_size + kv_size :].unflatten(-1, (c.num_kv_heads, c.head_dim))
        cos, sin = rope_tables(positions, c.head_dim, c.rope_theta, c.rope_scaling)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def finish(self, residual: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """residual [..., hidden], attended [..., heads * head_dim] -> the step's output hidden state."""
        h = residual + self.out(attended)
        gate, up = self.gate_up(self.post_norm(h)).chunk(2, dim=-1)
        return h + self.down(F.silu(gate) * up)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.head(self.final(out))

    def unrolled(self, features: torch.Tensor, next_ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test. features [batch, T, layers, hidden] (right-padded), next_ids [batch, T]: the
        token after each position. Returns each step's output hidden states [batch, T, hidden]: step 0 reads
        the target's features everywhere; step j at position p reads step j-1's output at p-1, i.e. it
        drafts its j-th token past the target's last feature at p-j, attending to the target-fed keys up to
        p-j and its own keys at p-j+1..p (as drafting does). Each output predicts the token after next_ids."""
        c = self.config
        batch, length = next_ids.shape
        positions = torch.arange(length, device=next_ids.device)
        groups = c.num_heads // c.num_kv_heads
        scale = c.head_dim ** -0.5
        g = self.fused(features)  # [batch, T, hidden]
        keys: list[tuple[torch.Tensor, torch.Tensor]] = []  # per step: k, v [batch, kv_heads, T, head_dim]
        outputs = []
        for j in range(steps):
            x, residual = self.step_inputs(g, next_ids)
            q, k, v = self.project(x, positions)
            q = q.transpose(1, 2)  # [batch, heads, T, head_dim]
            keys.append((k.transpose(1, 2).repeat_interleave(groups, 1), v.transpose(1, 2).repeat_interleave(groups, 1)))
            k0, v0 = keys[0]
            scores = q @ k0.transpose(-1, -2) * scale  # [batch, heads, T, T]
            visible = torch.ones(length, length, dtype=torch.bool, device=q.device).tril(-j)  # key <= p - j
            scores = scores.masked_fill(~visible, float("-inf"))
            diagonal, values = [], []
            for i in range(1, j + 1):  # step i's key at p - j + i: the head's own earlier guesses
                ki, vi = (_shift(t, j - i) for t in keys[i])
                diagonal.append((q * ki).sum(-1, keepdim=True) * scale)  # [batch, heads, T, 1]
                values.append(vi)
            weights = torch.cat([scores, *diagonal], dim=-1).softmax(-1)
            attended = weights[..., :length] @ v0
            for i, vi in enumerate(values):
                attended = attended + weights[..., length + i : length + i + 1] * vi
            out = self.finish(residual, attended.transpose(1, 2).flatten(-2))  # [batch, T, hidden]
            outputs.append(out)
            g = _shift(out.unsqueeze(1), 1).squeeze(1)  # step j+1 at p reads this step's output at p-1
        return outputs

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return dict(self.state_dict())


def _shift(x: torch.Tensor, by: int) -> torch.Tensor:
    """x [batch, heads, T, ...] -> x shifted ``by`` positions later along T (zeros first)."""
    if by == 0:
        return x
    return torch.cat([torch.zeros_like(x[:, :, :by]), x[:, :, :-by]], dim=2)


@dataclass
class FeatureSpec:
    """What ``drafter.json`` says about a feature drafter."""

    name: str
    target: dict  # {"name", "tokenizer_hash", "vocab_size", "hidden_size", "precision"}
    architecture: dict  # FeatureConfig's fields
    kind: str = "feature"
    domain: str = "general"
    measured: dict = field(default_factory=dict)
    training: dict = field(default_factory=dict)

    @property
    def config(self) -> FeatureConfig:
        return FeatureConfig(**{**self.architecture, "feature_layers": tuple(self.architecture["feature_layers"])})

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **asdict(self)}, indent=2) + "\n"

    @classmethod
    def read(cls, directory: Path) -> FeatureSpec:
        data = json.loads((Path(directory) / "drafter.json").read_text())
        if data.pop("format", None) != FORMAT:
            raise InvalidArgument("drafter", f"{directory}/drafter.json is not in format {FORMAT}")
        return cls(**data)


def check_feature_target(spec: FeatureSpec, tokenizer_hash: str, hidden_size: int, num_layers: int, where: str) -> None:
    """Refuse a head made for another target: it would read hidden states that mean something else."""
    made_for = spec.target
    if made_for.get("tokenizer_hash") != tokenizer_hash:
        raise InvalidArgument("drafter", f"{where} was trained for another vocabulary than this target's "
                              f"({made_for.get('name')!r}'s)")
    if made_for.get("hidden_size") != hidden_size:
        raise InvalidArgument("drafter", f"{where} reads hidden states of size {made_for.get('hidden_size')}; "
                              f"this target's are {hidden_size}")
    if max(spec.config.feature_layers) > num_layers:
        raise InvalidArgument("drafter", f"{where} reads layer {max(spec.config.feature_layers)}; this target has "
                              f"{num_layers}")


def is_feature_drafter(directory: str | Path) -> bool:
    file = Path(directory) / "drafter.json"
    return file.is_file() and json.loads(file.read_text()).get("format") == FORMAT


def load_feature_head(directory: str | Path, embedding: torch.Tensor) -> tuple[FeatureHead, FeatureSpec]:
    """The head in ``directory`` over ``embedding`` (the target's), in fp32 on the embedding's device."""
    from safetensors.torch import load_file

    directory = Path(directory)
    spec = FeatureSpec.read(directory)
    tensors = load_file(str(directory / "weights.safetensors"))
    subset = tensors.pop("subset_ids").to(torch.long)
    model = FeatureHead(spec.config, embedding.float(), subset)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    if missing or unexpected:
        raise InvalidArgument("drafter", f"{directory}: weights do not match drafter.json (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]})")
    return model.to(embedding.device).eval(), spec


class FeatureMismatch(InvalidArgument):
    """Features that do not fit the head (another target, other layers, a malformed block)."""

    def __init__(self, message: str) -> None:
        super().__init__("features", message)


@dataclass
class _FeatureRequest:
    committed: list[int]  # every committed token
    pending: torch.Tensor | None = None  # target features heard and not yet fed [known - fed, layers, hidden]
    first: int = 0  # position of the first feature held (a long prompt's earliest are not sent)
    known: int = 0  # positions with target features: first .. first + known - 1
    fed: int = 0  # of those, entries in the cache (the real ones, kept between proposals)
    keys: torch.Tensor | None = None  # [2, kv_heads, capacity, head_dim]: real entries, then scratch
    last_out: torch.Tensor | None = None  # the output hidden state of the last real entry [hidden]
    last_step: Step | None = None  # the distribution after it, where it was computed with it
    position: int = 0  # while drafting: the position of the last entry fed
    out: torch.Tensor | None = None  # while drafting: its output [hidden]
    graph: GraphedEntry | None = None  # on CUDA: the one-entry step over ``keys``


class FeatureDrafter(DrafterBase):
    """Drafts a confidence-shaped tree (``shape.py``) from the target's features, one request at a time.

    Per request it holds the target features heard so far and a KV cache of its own entries over them.
    A proposal feeds the new real entries, then drafts in feature space: past the last target feature,
    every position (committed tokens without features yet, assumed tokens, guesses) reads the head's own
    previous output. Linears are pre-packed (int8 on a CPU where it pays), as the experts'; on CUDA the head
    drafts in bf16 (a guess streams every weight once: half of fp32's bytes).
    """

    kind = "feature"

    def __init__(self, model: FeatureHead, name: str, max_depth: int = 8, branch_below: float = 0.6,
                 branch_width: int = 2, stop_below: float = 0.0, int8_weights: bool | None = None,
                 dtype: torch.dtype | None = None, static_entries: bool | None = None) -> None:
        """``int8_weights``: approximate 8-bit linears on a CPU (None: where they pay), as Q8_0 blocks
        where specmesh's kernel runs (Q4_0 was 12% faster a guess and 0.006 less agreement). ``dtype``: the
        head's compute precision (None: bf16 on CUDA, fp32 on a CPU). ``static_entries``: one-entry steps in
        fixed shapes, captured as CUDA graphs on a GPU (None: on CUDA; on a CPU they run eagerly)."""
        from specmesh.drafters.expert import drafter_dtype, drafter_int8

        device = model.head.weight.device
        self.dtype = dtype or (drafter_dtype(device) if device.type == "cuda" else torch.float32)
        if model.head.weight.dtype != self.dtype:  # a copy: the caller's head may serve another drafter as it is
            model = copy.deepcopy(model).to(self.dtype)
        self.name = name
        self.domains = ("general",)
        self.model = model
        self.config = model.config
        self.feature_layers = model.config.feature_layers
        if int8_weights is None:
            int8_weights = drafter_int8(device, model.head.weight.dtype)
        blocks = int8_weights and block_kernel_available(device)
        pack = lambda layer: (BlockLinear(quantize(layer.weight.detach(), "Q8_0")) if blocks  # noqa: E731
                              else linear_for(layer.weight.detach(), None, int8=int8_weights))
        # the decoder layer as one C++ call (kernels/cpu/llama_layer.cpp), which takes the "norms" step's inputs
        self._one_call = blocks and model.config.mix == "norms"
        self._fuse, self._qkv, self._out = pack(model.fuse), pack(model.qkv), pack(model.out)
        self._gate_up, self._down, self._head = pack(model.gate_up), pack(model.down), pack(model.head)
        self._feature_norms = (torch.stack([norm.weight.detach() for norm in model.feature_norms])  # [layers, hidden]
                               if model.config.feature_norms else None)
        self.subset_ids = model.subset_ids.tolist()
        self.max_depth, self.branch_below, self.branch_width, self.stop_below = max_depth, branch_below, branch_width, stop_below
        self._requests: dict[str, _FeatureRequest] = {}
        self._rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None
        self._static_entries = device.type == "cuda" if static_entries is None else static_entries

    # -- the Drafter interface ----------------------------------------------------------------------
    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        self._requests[request_id] = _FeatureRequest([int(t) for t in prompt_ids])

    def commit(self, request_id: str, new_token_ids: Sequence[int]) -> None:
        self._requests[request_id].committed.extend(int(t) for t in new_token_ids)

    def end(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def add_features(self, request_id: str, block: Features) -> None:
        """The target's hidden states at positions block.start.. (sent once the tokens they follow were
        committed). The first block may start anywhere (a long prompt's tail); later ones continue where
        the last ended. Refuses (``FeatureMismatch``) what does not fit: other layers or sizes, values
        that are not finite, gaps, positions past the committed tokens."""
        state = self._requests[request_id]
        features, start = block.values, block.start
        expected = (len(self.feature_layers), self.config.hidden_size)
        if tuple(block.layers) != self.feature_layers:
            raise FeatureMismatch(f"features of layers {list(block.layers)}; this drafter reads {list(self.feature_layers)}")
        if features.dim() != 3 or tuple(features.shape[1:]) != expected:
            raise FeatureMismatch(f"expected [n, {expected[0]}, {expected[1]}] features, got {list(features.shape)}")
        if start < 0:
            raise FeatureMismatch(f"features start at position {start}")
        if not torch.isfinite(features).all():
            raise FeatureMismatch("features hold NaN or infinite values")
        if state.known == 0:
            state.first = start
        elif start > state.first + state.known:
            raise FeatureMismatch(f"features start at position {start}; the drafter holds up to {state.first + state.known}")
        elif start < state.first + state.known:  # a verifier's re-prefill sends known positions again
            features, start = features[state.first + state.known - start :], state.first + state.known
        if start + features.shape[0] > len(state.committed) - 1:
            raise FeatureMismatch(f"features reach position {start + features.shape[0] - 1}, past the committed tokens")
        if features.shape[0]:
            features = features.to(self.model.head.weight.device)
            state.pending = features if state.pending is None else torch.cat([state.pending, features])
            state.known += features.shape[0]

    def propose(self, request_id: str, budget: int, assumed: Sequence[int] = ()) -> TokenTree:
        state = self._requests[request_id]
        if budget <= 0 or state.known == 0:
            return TokenTree()  # no features yet (before the prefill's result): nothing to read
        with torch.no_grad():
            first = self._catch_up(state, [*state.committed, *assumed])
            if budget > self.max_depth * self.branch_width:  # EAGLE-2's dynamic tree: one pass a round
                slots: dict[int, int] = {}
                outputs: dict[int, torch.Tensor] = {}
                return best_first_tree(first, lambda grown, nodes: self._score(state, grown, nodes, slots, outputs),
                                       budget, WIDE_DEPTH, WIDE_WIDTH, stop_index=self.model.fallback)
            return confident_tree(first, self._advance(state), budget, self.max_depth, self.branch_below,
                                  self.branch_width, stop_index=self.model.fallback, stop_below=self.stop_below)

    # -- drafting ----------------------------------------------------------------------------------
    def _catch_up(self, state: _FeatureRequest, context: list[int]) -> Step:
        """Feed the real entries not yet cached, then the positions past the last target feature (reading
        the head's own outputs); return the distribution of the token after ``context``. Entry p reads g at p
        and token p + 1 and predicts token p + 2."""
        if state.fed < state.known:
            start = state.first + state.fed
            block, state.pending = state.pending, None  # fed once: the cache holds what they gave
            step = None
            if self._static_entries and block.shape[0] == 1:  # the usual step's one new feature
                last, step = self._entry(state, self._fused(block)[0], context[start + 1], start)
            else:
                following = context[start + 1 : start + 1 + block.shape[0]]
                last = self._entries(state, self._fused(block), following, start)[-1]
            state.fed, state.last_out, state.last_step = state.known, last, step
        out, step = state.last_out, state.last_step
        for position in range(state.first + state.fed, len(context) - 1):  # scratch: rewritten next proposal
            out, step = self._entry(state, out, context[position + 1], position)
        state.position, state.out = len(context) - 1, out
        return step or self._step(out)

    def _advance(self, state: _FeatureRequest):
        def advance(token: int) -> Step:  # the guess follows the last fed token: one more scratch entry
            state.out, step = self._entry(state, state.out, token, state.position)
            state.position += 1
            return step
        return advance

    def _score(self, state: _FeatureRequest, grown: TokenTree, nodes: list[int], slots: dict[int, int],
               outputs: dict[int, torch.Tensor]) -> list[Step]:
        """One best-first round: an entry for each of ``nodes`` (its parent's output and its token), in one
        pass; returns the distributions after them. A node's entry sees the context's entries and its
        ancestors' (``slots``: node -> cache index; ``outputs``: node -> its entry's output; earlier rounds',
        and this round's are added). The tree's entries follow the context's in the cache as scratch,
        rewritten by the next proposal."""
        base = state.position - state.first  # cache index of the first tree entry: the context's come before
        start = base + len(slots)
        depths = grown.depths()
        parents = [grown.parents[n] for n in nodes]
        g = torch.stack([state.out if p == ROOT else outputs[p] for p in parents])  # [n, hidden]
        ids = torch.tensor([grown.tokens[n] for n in nodes], device=g.device)
        positions = [state.position + depths[n] - 1 for n in nodes]
        visible = round_visibility(grown, nodes, base, slots)  # [n, cache indices so far]
        out = self._attend(state, g, ids, positions, start, visible.to(g.device))  # [n, hidden]
        outputs.update(zip(nodes, out))
        return round_steps(self._head(self.model.final(out)).float().softmax(-1), self.subset_ids)  # [n, outputs]

    def _entry(self, state: _FeatureRequest, g: torch.Tensor, token: int, position: int) -> tuple[torch.Tensor, Step]:
        """One entry (g [hidden] and the token after it, at ``position``): its output [hidden] and the next
        distribution. On CUDA a captured graph per request and cache (~45 kernels replayed as one)."""
        if not self._static_entries:
            out = self._entries(state, g.unsqueeze(0), [token], position)[-1]
            return out, self._step(out)
        index = position - state.first
        self._reserve(state, index + 1)
        if state.graph is None or state.graph.keys is not state.keys:
            tables = self._rope(state.first + state.keys.shape[2])
            state.graph = GraphedEntry(self._one_entry, state.keys, tables)
        out, probs, top = state.graph.run(g.unsqueeze(0), token, position, index)
        values, indices = top.tolist()  # the step's one read from the device
        return out[0].clone(), Step(probs, self.subset_ids, list(zip(map(int, indices), values)))

    def _one_entry(self, keys: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], g: torch.Tensor,
                   token: torch.Tensor, position: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``_entries`` of one entry in fixed shapes (graph-capturable): keys [2, kv_heads, capacity, head_dim],
        g [1, hidden], token, position and cache index [1] -> its output [1, hidden], the next distribution
        [outputs] (fp32) and its top ``branch_width`` [2 (p, index), width]; the entry attends to cache indices
        0..index."""
        m = self.model
        x, residual = m.step_inputs(g, token)
        q, k, v = self._split(self._qkv(x))
        cos, sin = (t.index_select(0, position).unsqueeze(1) for t in tables)  # [1, 1, head_dim]
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        keys[0].index_copy_(1, index, k.transpose(0, 1))
        keys[1].index_copy_(1, index, v.transpose(0, 1))
        visible = (torch.arange(keys.shape[2], device=keys.device) <= index).unsqueeze(0)  # [1, capacity]
        attended = F.scaled_dot_product_attention(q.transpose(0, 1), keys[0], keys[1], attn_mask=visible,
                                                  enable_gqa=True)  # [heads, 1, head_dim]
        out = self._finish(residual, attended.transpose(0, 1).reshape(1, -1))
        probs = self._distribution(out)
        top = probs.topk(min(self.branch_width, probs.shape[0]))
        return out, probs, torch.stack([top.values, top.indices.float()])  # indices < 2 ** 24: exact in fp32

    def _split(self, qkv: torch.Tensor):
        """qkv [n, q + 2 kv] -> q [n, heads, head_dim], k and v [n, kv_heads, head_dim]."""
        c = self.config
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        return (qkv[:, :q_size].unflatten(-1, (c.num_heads, c.head_dim)),
                qkv[:, q_size : q_size + kv_size].unflatten(-1, (c.num_kv_heads, c.head_dim)),
                qkv[:, q_size + kv_size :].unflatten(-1, (c.num_kv_heads, c.head_dim)))

    def _finish(self, residual: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """residual [n, hidden], attended [n, heads * head_dim] -> the entries' outputs [n, hidden]."""
        h = residual + self._out(attended)
        gate, up = self._gate_up(self.model.post_norm(h)).chunk(2, dim=-1)
        return h + self._down(F.silu(gate) * up)

    def _step(self, out: torch.Tensor) -> Step:
        return Step(self._distribution(out.unsqueeze(0)), self.subset_ids)

    def _distribution(self, out: torch.Tensor) -> torch.Tensor:
        """An entry's output [1, hidden] -> the next token's distribution over the head's outputs (fp32)."""
        return self._head(self.model.final(out))[0].float().softmax(-1)

    def _fused(self, features: torch.Tensor) -> torch.Tensor:
        # features [n, layers, hidden] -> g [n, hidden]: every layer's norm at once (one op each, not per layer)
        x = features.float()
        if self._feature_norms is None:
            return self._fuse(x.flatten(1).to(self.dtype))
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps) * self._feature_norms
        return self._fuse(normed.flatten(1).to(self.dtype))

    def _entries(self, state: _FeatureRequest, g: torch.Tensor, next_ids: Sequence[int], start: int) -> torch.Tensor:
        """Feed entries at positions start.. (g [n, hidden], the tokens after each); write their K/V at those
        positions (overwriting any scratch there) and return their outputs [n, hidden]."""
        m, c = self.model, self.config
        n = g.shape[0]
        offset = start - state.first  # cache index of position ``start``
        self._reserve(state, offset + n)
        cos, sin = self._rope(start + n)
        ids = torch.tensor(next_ids, device=g.device)
        if self._one_call:  # ~100 small ops become one: most of a guess's time on a CPU was their dispatch
            mask = torch.ones(n, n, dtype=torch.bool).tril()
            return torch.ops.specmesh_cpu.llama_layer(
                g.float().contiguous(), m.input_norm.weight.detach(), m.post_norm.weight.detach(),
                self._qkv.packed.data, self._qkv.format_id, None, self._out.packed.data, self._out.format_id,
                self._gate_up.packed.data, self._gate_up.format_id, self._down.packed.data, self._down.format_id,
                cos[start : start + n].contiguous(), sin[start : start + n].contiguous(), [state.keys], [offset],
                [0, n], [mask], c.num_heads, c.num_kv_heads, c.intermediate_size, c.rms_norm_eps, c.head_dim ** -0.5,
                m.embed_norm(m.embedding[ids].float()).contiguous())
        mask = None if n == 1 else torch.ones(n, offset + n, dtype=torch.bool, device=g.device).tril(offset)  # causal
        return self._attend(state, g, ids, list(range(start, start + n)), offset, mask)

    def _attend(self, state: _FeatureRequest, g: torch.Tensor, ids: torch.Tensor, positions: list[int], offset: int,
                visible: torch.Tensor | None) -> torch.Tensor:
        """Entries g [n, hidden] with the tokens after them ids [n] at ``positions`` (n), written at cache
        indices offset..offset + n - 1; each attends to the cache indices ``visible`` [n, offset + n] marks
        (None: all up to its own). Returns their outputs [n, hidden]."""
        n = g.shape[0]
        self._reserve(state, offset + n)
        cos, sin = self._rope(max(positions) + 1)
        at = torch.tensor(positions, device=g.device)
        x, residual = self.model.step_inputs(g, ids)
        q, k, v = self._split(self._qkv(x))
        cos, sin = cos[at].unsqueeze(1), sin[at].unsqueeze(1)  # [n, 1, head_dim]
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        state.keys[0, :, offset : offset + n] = k.transpose(0, 1)
        state.keys[1, :, offset : offset + n] = v.transpose(0, 1)
        keys, values = state.keys[0, :, : offset + n], state.keys[1, :, : offset + n]  # [kv_heads, offset + n, d]
        attended = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=visible,
                                                  enable_gqa=True)  # [heads, n, head_dim]
        return self._finish(residual, attended.transpose(0, 1).reshape(n, -1))

    def _rope(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [>= length, head_dim], computed once and grown by doubling."""
        if self._rope_tables is None or self._rope_tables[0].shape[0] < length:
            size = max(length, 2 * (0 if self._rope_tables is None else self._rope_tables[0].shape[0]), 1024)
            positions = torch.arange(size, device=self.model.head.weight.device)
            c = self.config
            self._rope_tables = tuple(t.to(self.dtype) for t in rope_tables(positions, c.head_dim, c.rope_theta,
                                                                            c.rope_scaling))
        return self._rope_tables

    def _reserve(self, state: _FeatureRequest, length: int) -> None:
        c = self.config
        capacity = 0 if state.keys is None else state.keys.shape[2]
        if length <= capacity:
            return
        grown = torch.zeros(2, c.num_kv_heads, max(length, 2 * capacity, 64), c.head_dim,
                            device=self.model.head.weight.device, dtype=self.dtype)
        if state.keys is not None:
            grown[:, :, :capacity] = state.keys
        state.keys = grown


def subset_head_rows(target_head: torch.Tensor, subset_ids: torch.Tensor) -> torch.Tensor:
    """The target's LM head rows for the subset, plus a zero fallback row: a head that starts where the
    target's own would read a feature like its top layer's."""
    rows = target_head.detach().float().cpu()[subset_ids]
    return torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
