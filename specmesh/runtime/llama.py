"""A lean forward path for Llama-family models that scores a batch of token trees in one pass.

Written for verification: rows of every request are packed into one ``[total_rows, hidden]`` matrix, so
each projection is a single matrix product for the whole batch; attention runs per request over its
KV session plus its tree, with the tree attention mask. On CUDA attention is the Triton kernel, elsewhere
the PyTorch reference; on a GGUF target's own blocks (CPU), the row-exact C++ kernel.

Why not Hugging Face's forward: on a CPU its ``F.linear`` costs about as much per row for 2..8 rows as
for one, so scoring k+1 tokens costs nearly k+1 decode steps and speculation cannot pay. Here the
projections are fused (q/k/v, gate/up) and pre-packed (see ``linear.py``), which makes scoring up to 9
rows cost 1.0-1.2x one row on the embedded default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple, Sequence

import torch
import torch.nn.functional as F

from specmesh.errors import InvalidArgument
from specmesh.kernels.block_linear import BlockWeight
from specmesh.kernels.tree_attention_cpu import tree_attention_cpu
from specmesh.kernels.tree_attention_reference import masked_attention, tree_attention_mask
from specmesh.runtime.kv_cache import KVBudget, KVSession, new_session
from specmesh.runtime.linear import BlockLinear, Int8Linear, PackedLinear, linear_for
from specmesh.tree import CompiledTree

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
DEFAULT_KV_MEMORY_SHARE = 0.25  # of the machine's memory, for the KV cache when no --kv-cache-gb is given


def _memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def lean_unsupported(config) -> str | None:
    """Why the lean path would not compute exactly this model (None when it would)."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {config.model_type!r} (lean: {', '.join(SUPPORTED_MODEL_TYPES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} (lean: silu)"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    if config.model_type == "llama" and getattr(config, "attention_bias", False):
        return "attention output bias"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    return None


class Scores(NamedTuple):
    """What one pass computed: logits [rows, vocab] fp32, and the chosen layers' hidden states
    [rows, layers, hidden] in the runtime's dtype (None when none were asked for)."""

    logits: torch.Tensor
    features: torch.Tensor | None = None


def check_feature_layers(layers: Sequence[int], num_layers: int) -> None:
    """Feature layers name hidden states after 1..num_layers decoder layers, each once."""
    if any(not 1 <= n <= num_layers for n in layers) or len(set(layers)) != len(layers):
        raise InvalidArgument("feature_layers", f"must be distinct layer counts in 1..{num_layers}, got {list(layers)}")


@dataclass(frozen=True)
class TreeBatch:
    """One verification pass over several requests, flattened (the ``cu_rows`` offsets delimit each)."""

    input_ids: torch.Tensor  # [total_rows] long
    positions: torch.Tensor  # [total_rows] long: cache length + depth in the tree
    cu_rows: tuple[int, ...]  # [batch + 1]: request i owns rows cu_rows[i]:cu_rows[i+1]
    masks: tuple[torch.Tensor, ...]  # per request [rows_i, rows_i] bool tree mask
    sessions: tuple[KVSession, ...]

    @classmethod
    def build(cls, sessions: list[KVSession], trees: list[CompiledTree]) -> TreeBatch:
        if len(sessions) != len(trees):
            raise ValueError(f"{len(sessions)} sessions but {len(trees)} trees")
        cu = [0]
        for tree in trees:
            cu.append(cu[-1] + tree.num_rows)
        return cls(
            input_ids=torch.cat([t.input_ids for t in trees]),
            positions=torch.cat([t.depths + s.length for s, t in zip(sessions, trees)]),
            cu_rows=tuple(cu),
            masks=tuple(t.mask for t in trees),
            sessions=tuple(sessions),
        )

    @property
    def size(self) -> int:
        return len(self.sessions)


Linear = PackedLinear | Int8Linear | BlockLinear


@dataclass
class _Layer:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # hidden -> (heads + 2 * kv_heads) * head_dim
    out: Linear  # heads * head_dim -> hidden
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear  # intermediate -> hidden


class LlamaRuntime:
    """Target-model runtime: KV sessions and batched tree-scoring for a Llama-family model."""

    def __init__(
        self, hf_model: torch.nn.Module, head_weight: torch.Tensor | None = None, int8_weights: bool = False,
        block_weights: Mapping[str, BlockWeight] | None = None, kv_cache_gb: float | None = None,
    ) -> None:
        """``hf_model``: a Llama-family causal LM, or its base model with ``head_weight`` [outputs, hidden]
        (drafters with a head over a vocabulary subset). ``int8_weights``: approximate int8 linears
        (``Int8Linear``), for drafters on CPU only; a target must stay exact. ``block_weights``: the
        model's GGUF blocks by Hugging Face name (``gguf.load_block_weights``; ``lm_head.weight`` is the
        head's, ``head_weight``'s too), computed as shipped
        (``BlockLinear``, CPU) wherever a whole fused projection has them. ``kv_cache_gb``: what all
        sessions may hold together (default: a quarter of the machine's memory)."""
        config = hf_model.config
        reason = lean_unsupported(config)
        if reason:
            raise InvalidArgument("model", f"no lean runtime for this model: {reason}")
        inner = getattr(hf_model, "model", hf_model)
        self.config = config
        self.device = inner.embed_tokens.weight.device
        self.dtype = inner.embed_tokens.weight.dtype
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.vocab_size = config.vocab_size
        self.max_length = config.max_position_embeddings
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.embed = inner.embed_tokens.weight.detach()  # [vocab, hidden]
        self.final_norm = inner.norm.weight.detach()  # [hidden]
        self.int8_weights = int8_weights
        self.block_weights = dict(block_weights or {})
        head = head_weight if head_weight is not None else hf_model.lm_head.weight
        self.lm_head = self._linear(["lm_head.weight"], [head])  # hidden -> outputs
        self.rotary = inner.rotary_emb  # HF's module: knows the model's RoPE variant and scaling
        self.layers = self._build_layers(inner.layers)
        # On blocks, activations are rounded to 8 bits (a step function): every row must then be computed
        # exactly as it would be alone, attention included, or last-bit differences become other tokens.
        self.exact_rows = isinstance(self.lm_head, BlockLinear) or any(
            isinstance(layer.qkv, BlockLinear) for layer in self.layers)
        # Every projection on blocks: each layer is one call of the C++ layer (no per-op dispatch).
        self.fused_layers = all(isinstance(p, BlockLinear) for layer in self.layers
                                for p in (layer.qkv, layer.out, layer.gate_up, layer.down))
        if kv_cache_gb is not None and not kv_cache_gb > 0:
            raise InvalidArgument("kv_cache_gb", f"must be > 0, got {kv_cache_gb}")
        position_bytes = len(self.layers) * 2 * self.num_kv_heads * self.head_dim * self.embed.element_size()
        capacity = kv_cache_gb * 2**30 if kv_cache_gb is not None else DEFAULT_KV_MEMORY_SHARE * _memory_bytes()
        self.pool = KVBudget(int(capacity), position_bytes)

    def _linear(self, names: list[str | None], weights: list[torch.Tensor], bias: torch.Tensor | None = None) -> Linear:
        """One linear over the rows of ``weights`` stacked (a fused projection): on their GGUF blocks when
        all of them have blocks of one format, else on the model's weights."""
        blocks = [self.block_weights.get(name) for name in names if name is not None]
        if len(blocks) == len(weights) and all(b is not None for b in blocks):
            if len({b.format for b in blocks}) == 1:
                return BlockLinear(BlockWeight.cat(blocks) if len(blocks) > 1 else blocks[0], bias)
        return linear_for(stacked(weights), bias, int8=self.int8_weights)

    def _build_layers(self, layers: Sequence[torch.nn.Module]) -> Sequence[_Layer]:
        return [self._fuse_layer(index, layer) for index, layer in enumerate(layers)]

    def _fuse_layer(self, index: int, layer: torch.nn.Module, linear: Callable[..., Linear] | None = None) -> _Layer:
        """``layer``'s weights as the runtime computes them, each fused projection made by ``linear`` (default:
        ``_linear``, on its blocks or packed)."""
        linear = linear or self._linear
        attn, mlp = layer.self_attn, layer.mlp
        prefix = f"model.layers.{index}."
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        bias = None
        if attn.q_proj.bias is not None:
            bias = torch.cat([p.bias.detach() for p in projections])
        names = lambda *parts: [f"{prefix}{part}.weight" for part in parts]  # noqa: E731
        return _Layer(
            input_norm=layer.input_layernorm.weight.detach(),
            qkv=linear(names("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                       [p.weight for p in projections], bias),
            out=linear(names("self_attn.o_proj"), [attn.o_proj.weight]),
            post_norm=layer.post_attention_layernorm.weight.detach(),
            gate_up=linear(names("mlp.gate_proj", "mlp.up_proj"), [mlp.gate_proj.weight, mlp.up_proj.weight]),
            down=linear(names("mlp.down_proj"), [mlp.down_proj.weight]),
        )

    @property
    def precision(self) -> str:
        """What the weights are computed in: the GGUF formats ("Q4_1+Q8_0") or the dtype ("float32")."""
        linears = [self.lm_head] + [p for layer in self.layers
                                    for p in (layer.qkv, layer.out, layer.gate_up, layer.down)]
        formats = sorted({p.format for p in linears if isinstance(p, BlockLinear)})
        return "+".join(formats) if formats else str(self.dtype).removeprefix("torch.")

    def new_session(self) -> KVSession:
        return new_session(
            len(self.layers), self.num_kv_heads, self.head_dim, self.max_length, self.dtype, self.device, self.pool
        )

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return weight * (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype)

    def forward(self, batch: TreeBatch, logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Score every row of every tree; writes each tree's K/V after its session's committed entries.

        Returns logits [total_rows, vocab] (or only for ``logits_rows``), in fp32. Sessions' committed
        lengths are unchanged: the caller keeps the accepted rows with ``KVSession.keep_rows``.
        """
        return self.score(batch, logits_rows).logits

    @torch.no_grad()  # not inference_mode: KV sessions are updated in place between passes
    def score(self, batch: TreeBatch, logits_rows: torch.Tensor | None = None,
              feature_layers: Sequence[int] = ()) -> Scores:
        """``forward``'s logits, and the residual stream of every row after each of ``feature_layers``
        (1..layers: the hidden state after that many decoder layers, before the final norm)."""
        check_feature_layers(feature_layers, len(self.layers))
        tree_masks, full_masks = [], []  # per request, on the device, built once for all layers
        for session, mask, start, end in zip(batch.sessions, batch.masks, batch.cu_rows, batch.cu_rows[1:]):
            session.reserve(end - start)
            tree_masks.append(mask.to(self.device))  # [rows_i, rows_i]: what the Triton kernel takes
            single = end - start == 1  # one row sees every key: no mask needed
            full_masks.append(  # [rows_i, cached_i + rows_i]: what the PyTorch path takes
                None if single or self.device.type == "cuda" or self.exact_rows
                else tree_attention_mask(session.length, tree_masks[-1])
            )
        input_ids = batch.input_ids.to(self.device)
        positions = batch.positions.to(self.device)
        x = self.embed[input_ids]  # [rows, hidden]
        cos, sin = self.rotary(x, positions.unsqueeze(0))  # [1, rows, head_dim] each
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [rows, 1, head_dim]
        rows = x.shape[0]
        captured: dict[int, torch.Tensor] = {}  # layers done -> [rows, hidden]
        wanted = frozenset(feature_layers)
        if self.fused_layers:
            x = self._fused_layers(x, cos[:, 0].contiguous(), sin[:, 0].contiguous(), batch, tree_masks,
                                   captured, wanted)
        for index, layer in enumerate([] if self.fused_layers else self.layers):
            q, k, v = self._attention_inputs(layer, x, cos, sin)
            attended = torch.empty(rows, self.num_heads, self.head_dim, dtype=x.dtype, device=x.device)
            for session, mask, full_mask, start, end in zip(
                batch.sessions, tree_masks, full_masks, batch.cu_rows, batch.cu_rows[1:]
            ):
                cached = session.length
                kv = session.kv[index]  # [2, kv_heads, capacity, head_dim]
                kv[0, :, cached : cached + end - start] = k[start:end].transpose(0, 1)
                kv[1, :, cached : cached + end - start] = v[start:end].transpose(0, 1)
                if self.exact_rows:
                    attended[start:end] = tree_attention_cpu(q[start:end], kv[0], kv[1], cached, mask, self.scale)
                    continue
                attended[start:end] = self._attend(
                    q[start:end].transpose(0, 1), kv[0, :, : cached + end - start], kv[1, :, : cached + end - start],
                    mask, full_mask,
                ).transpose(0, 1)
            x = self._finish_layer(layer, x, attended)
            if index + 1 in wanted:
                captured[index + 1] = x
        features = torch.stack([captured[n] for n in feature_layers], dim=1) if feature_layers else None
        if logits_rows is not None:
            x = x[logits_rows.to(self.device)]
        logits = self.lm_head(self._norm(x, self.final_norm)).float() if x.shape[0] else x.new_empty(0, self.vocab_size)
        return Scores(logits, features)

    def _attention_inputs(self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        # x [rows, hidden]; cos, sin [rows, 1, head_dim] -> q [rows, heads, head_dim], k and v [rows, kv_heads,
        # head_dim], q and k rotated
        rows, q_size, kv_size = x.shape[0], self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = layer.qkv(self._norm(x, layer.input_norm))  # [rows, q_size + 2 * kv_size]
        q = qkv[:, :q_size].reshape(rows, self.num_heads, self.head_dim)
        k = qkv[:, q_size : q_size + kv_size].reshape(rows, self.num_kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size :].reshape(rows, self.num_kv_heads, self.head_dim)
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def _finish_layer(self, layer: _Layer, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        # x [rows, hidden], attended [rows, heads, head_dim]: the output projection and the MLP, with residuals
        x = x + self._reduce(layer.out(attended.reshape(x.shape[0], -1)))
        gate, up = layer.gate_up(self._norm(x, layer.post_norm)).chunk(2, dim=-1)
        return x + self._reduce(layer.down(F.silu(gate) * up))

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A projection's output summed over the ranks that hold the rest of it (tensor parallelism)."""
        return partial

    def _fused_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: TreeBatch,
                      tree_masks: list[torch.Tensor], captured: dict[int, torch.Tensor],
                      wanted: frozenset[int]) -> torch.Tensor:
        # x [rows, hidden] fp32; cos, sin [rows, head_dim]: every layer as one C++ call (kernels/cpu/llama_layer.cpp)
        cached = [session.length for session in batch.sessions]
        masks = [mask.bool().contiguous() for mask in tree_masks]
        x = x.contiguous()
        for index, layer in enumerate(self.layers):
            x = torch.ops.specmesh_cpu.llama_layer(
                x, layer.input_norm, layer.post_norm, layer.qkv.packed.data, layer.qkv.format_id, layer.qkv.bias,
                layer.out.packed.data, layer.out.format_id, layer.gate_up.packed.data, layer.gate_up.format_id,
                layer.down.packed.data, layer.down.format_id, cos, sin, [s.kv[index] for s in batch.sessions],
                cached, list(batch.cu_rows), masks, self.num_heads, self.num_kv_heads, layer.down.in_features,
                float(self.eps), float(self.scale))
            if index + 1 in wanted:
                captured[index + 1] = x
        return x

    def _attend(self, q, k, v, tree_mask: torch.Tensor, full_mask: torch.Tensor | None) -> torch.Tensor:
        # q [heads, n, head_dim]; k, v [kv_heads, cached + n, head_dim]; tree_mask [n, n];
        # full_mask [n, cached + n] (None when n == 1): the same mask with the prefix columns added
        if q.device.type == "cuda":
            from specmesh.kernels.tree_attention_triton import tree_attention_triton

            return tree_attention_triton(q, k, v, tree_mask, self.scale)
        return masked_attention(q, k, v, full_mask, self.scale)


def stacked(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """The rows of ``weights`` as one matrix (a fused projection's); one weight as it is."""
    return torch.cat([w.detach() for w in weights]) if len(weights) > 1 else weights[0].detach()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [rows, heads, head_dim]; cos, sin [rows, 1, head_dim]: rotate the two halves of each head
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)
