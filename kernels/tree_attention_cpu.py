"""Row-exact tree attention on the CPU (``cpu/tree_attention.cpp``, built by ``cpu_ops.load_cpu_ops``).

The same maths as ``tree_attention_reference.masked_attention``; unlike it, a query row's output is bit for
bit the same whether the row is scored alone or inside a tree, which the quantized runtime needs.
"""

from __future__ import annotations

import torch


def tree_attention_cpu(
    query: torch.Tensor,  # [rows, heads, head_dim] fp32
    key: torch.Tensor,  # [kv_heads, capacity, head_dim]: `cached` committed positions, then the tree's rows
    value: torch.Tensor,  # [kv_heads, capacity, head_dim]
    cached: int,
    tree_mask: torch.Tensor,  # [rows, rows] bool: row i sees tree row j
    scale: float,
) -> torch.Tensor:  # [rows, heads, head_dim]
    return torch.ops.specmesh_cpu.tree_attention(query, key, value, cached, tree_mask, scale)
