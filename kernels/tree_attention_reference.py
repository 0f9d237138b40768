"""Tree attention in plain PyTorch: the maths the Triton kernel must reproduce.

A verification pass scores a token tree appended after a committed prefix. Every tree node attends to
all prefix keys and to its own ancestors in the tree (itself included), never to siblings or cousins.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def tree_attention_mask(prefix_len: int, tree_mask: torch.Tensor) -> torch.Tensor:
    """Full boolean mask [num_queries, prefix_len + num_queries]: True where attention is allowed."""
    num_queries = tree_mask.shape[0]
    prefix = torch.ones(num_queries, prefix_len, dtype=torch.bool, device=tree_mask.device)
    return torch.cat([prefix, tree_mask.to(torch.bool)], dim=1)


def masked_attention(
    query: torch.Tensor,  # [num_heads, num_queries, head_dim]
    key: torch.Tensor,  # [num_kv_heads, num_keys, head_dim]
    value: torch.Tensor,  # [num_kv_heads, num_keys, head_dim]
    mask: torch.Tensor | None,  # [num_queries, num_keys] bool (None: every key visible)
    scale: float,
) -> torch.Tensor:  # [num_heads, num_queries, head_dim]
    """Attention under a full boolean mask; GQA maps query head h to kv head h // (heads / kv_heads)."""
    return F.scaled_dot_product_attention(
        query.unsqueeze(0),
        key.unsqueeze(0),
        value.unsqueeze(0),
        attn_mask=mask,
        scale=scale,
        enable_gqa=query.shape[0] != key.shape[0],
    ).squeeze(0)


def tree_attention_reference(
    query: torch.Tensor,  # [num_heads, num_queries, head_dim]
    key: torch.Tensor,  # [num_kv_heads, num_keys, head_dim], num_keys = prefix_len + num_queries
    value: torch.Tensor,  # [num_kv_heads, num_keys, head_dim]
    tree_mask: torch.Tensor,  # [num_queries, num_queries] bool: query i may see tree node j
    scale: float,
) -> torch.Tensor:  # [num_heads, num_queries, head_dim]
    """Scaled dot-product attention of tree nodes over the prefix and their ancestors.

    Grouped-query attention: query head h reads key/value head h // (num_heads // num_kv_heads).
    """
    num_queries, num_keys = query.shape[1], key.shape[1]
    return masked_attention(query, key, value, tree_attention_mask(num_keys - num_queries, tree_mask), scale)
