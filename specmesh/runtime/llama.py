"""A lean forward path for Llama-family models that scores a batch of token trees in one pass.

Written for verification: rows of every request are packed into one ``[total_rows, hidden]`` matrix, so
each projection is a single matrix product for the whole batch; attention runs per request over its
KV session plus its tree, with the tree attention mask. On CUDA attention is the Triton kernel, elsewhere
the PyTorch reference.

Why not Hugging Face's forward: on a CPU its ``F.linear`` costs about as much per row for 2..8 rows as
for one, so scoring k+1 tokens costs nearly k+1 decode steps and speculation cannot pay. Here the
projections are fused (q/k/v, gate/up) and pre-packed (see ``linear.py``), which makes scoring up to 9
rows cost 1.0-1.2x one row on the embedded default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specmesh.errors import InvalidArgument
from specmesh.kernels.tree_attention_reference import masked_attention, tree_attention_mask
from specmesh.runtime.kv_cache import KVSession, new_session
from specmesh.runtime.linear import Int8Linear, PackedLinear, linear_for
from specmesh.tree import CompiledTree

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


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


@dataclass
class _Layer:
    input_norm: torch.Tensor  # [hidden]
    qkv: PackedLinear | Int8Linear  # hidden -> (heads + 2 * kv_heads) * head_dim
    out: PackedLinear | Int8Linear  # heads * head_dim -> hidden
    post_norm: torch.Tensor  # [hidden]
    gate_up: PackedLinear | Int8Linear  # hidden -> 2 * intermediate
    down: PackedLinear | Int8Linear  # intermediate -> hidden


class LlamaRuntime:
    """Target-model runtime: KV sessions and batched tree-scoring for a Llama-family model."""

    def __init__(self, hf_model: torch.nn.Module, head_weight: torch.Tensor | None = None, int8_weights: bool = False) -> None:
        """``hf_model``: a Llama-family causal LM, or its base model with ``head_weight`` [outputs, hidden]
        (drafters with a head over a vocabulary subset). ``int8_weights``: approximate int8 linears
        (``Int8Linear``), for drafters on CPU only; a target must stay exact."""
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
        head = head_weight if head_weight is not None else hf_model.lm_head.weight
        self.lm_head = linear_for(head, int8=int8_weights)  # hidden -> outputs
        self.rotary = inner.rotary_emb  # HF's module: knows the model's RoPE variant and scaling
        self.layers = [self._fuse_layer(layer) for layer in inner.layers]

    def _fuse_layer(self, layer: torch.nn.Module) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        bias = None
        if attn.q_proj.bias is not None:
            bias = torch.cat([p.bias.detach() for p in projections])
        return _Layer(
            input_norm=layer.input_layernorm.weight.detach(),
            qkv=linear_for(torch.cat([p.weight.detach() for p in projections]), bias, int8=self.int8_weights),
            out=linear_for(attn.o_proj.weight, int8=self.int8_weights),
            post_norm=layer.post_attention_layernorm.weight.detach(),
            gate_up=linear_for(torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()]), int8=self.int8_weights),
            down=linear_for(mlp.down_proj.weight, int8=self.int8_weights),
        )

    def new_session(self) -> KVSession:
        return new_session(
            len(self.layers), self.num_kv_heads, self.head_dim, self.max_length, self.dtype, self.device
        )

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return weight * (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype)

    @torch.no_grad()  # not inference_mode: KV sessions are updated in place between passes
    def forward(self, batch: TreeBatch, logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Score every row of every tree; writes each tree's K/V after its session's committed entries.

        Returns logits [total_rows, vocab] (or only for ``logits_rows``), in fp32. Sessions' committed
        lengths are unchanged: the caller keeps the accepted rows with ``KVSession.keep_rows``.
        """
        tree_masks, full_masks = [], []  # per request, on the device, built once for all layers
        for session, mask, start, end in zip(batch.sessions, batch.masks, batch.cu_rows, batch.cu_rows[1:]):
            session.reserve(end - start)
            tree_masks.append(mask.to(self.device))  # [rows_i, rows_i]: what the Triton kernel takes
            single = end - start == 1  # one row sees every key: no mask needed
            full_masks.append(  # [rows_i, cached_i + rows_i]: what the PyTorch path takes
                None if single or self.device.type == "cuda" else tree_attention_mask(session.length, tree_masks[-1])
            )
        input_ids = batch.input_ids.to(self.device)
        positions = batch.positions.to(self.device)
        x = self.embed[input_ids]  # [rows, hidden]
        cos, sin = self.rotary(x, positions.unsqueeze(0))  # [1, rows, head_dim] each
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [rows, 1, head_dim]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        rows = x.shape[0]
        for index, layer in enumerate(self.layers):
            h = self._norm(x, layer.input_norm)
            qkv = layer.qkv(h)  # [rows, q_size + 2 * kv_size]
            q = qkv[:, :q_size].reshape(rows, self.num_heads, self.head_dim)
            k = qkv[:, q_size : q_size + kv_size].reshape(rows, self.num_kv_heads, self.head_dim)
            v = qkv[:, q_size + kv_size :].reshape(rows, self.num_kv_heads, self.head_dim)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            attended = torch.empty(rows, self.num_heads, self.head_dim, dtype=x.dtype, device=x.device)
            for session, mask, full_mask, start, end in zip(
                batch.sessions, tree_masks, full_masks, batch.cu_rows, batch.cu_rows[1:]
            ):
                cached = session.length
                kv = session.kv[index]  # [2, kv_heads, capacity, head_dim]
                kv[0, :, cached : cached + end - start] = k[start:end].transpose(0, 1)
                kv[1, :, cached : cached + end - start] = v[start:end].transpose(0, 1)
                attended[start:end] = self._attend(
                    q[start:end].transpose(0, 1), kv[0, :, : cached + end - start], kv[1, :, : cached + end - start],
                    mask, full_mask,
                ).transpose(0, 1)
            x = x + layer.out(attended.reshape(rows, q_size))
            h = self._norm(x, layer.post_norm)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        if logits_rows is not None:
            x = x[logits_rows.to(self.device)]
        return self.lm_head(self._norm(x, self.final_norm)).float()

    def _attend(self, q, k, v, tree_mask: torch.Tensor, full_mask: torch.Tensor | None) -> torch.Tensor:
        # q [heads, n, head_dim]; k, v [kv_heads, cached + n, head_dim]; tree_mask [n, n];
        # full_mask [n, cached + n] (None when n == 1): the same mask with the prefix columns added
        if q.device.type == "cuda":
            from specmesh.kernels.tree_attention_triton import tree_attention_triton

            return tree_attention_triton(q, k, v, tree_mask, self.scale)
        return masked_attention(q, k, v, full_mask, self.scale)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [rows, heads, head_dim]; cos, sin [rows, 1, head_dim]: rotate the two halves of each head
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)
