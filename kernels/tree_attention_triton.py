"""Tree attention as a Triton kernel: the maths of ``tree_attention_reference``, flash-attention style.

One program handles one query head and one block of tree nodes. It streams the key/value blocks of
the committed prefix (no mask), then those of the tree itself (masked by ``tree_mask``), keeping an
online softmax (running max, running sum, unnormalised output) in fp32 registers, and writes the
normalised output once, in the input dtype.

The runtime calls this only on CUDA; under ``TRITON_INTERPRET=1`` it also runs on CPU tensors (tests).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _attend_key_block(
    acc,  # [BLOCK_M, HEAD_DIM] fp32, unnormalised output so far
    row_max,  # [BLOCK_M] fp32, running max of the scores (log2 units), -inf before any visible key
    row_sum,  # [BLOCK_M] fp32, running sum of exp2(score - row_max)
    q,  # [BLOCK_M, HEAD_DIM]
    k_head_ptr,
    v_head_ptr,
    key_idx,  # [BLOCK_N] key positions of this block
    key_ok,  # [BLOCK_N] positions that exist (guards the loads)
    visible,  # [BLOCK_M, BLOCK_N] query may attend to key
    stride_kn,
    stride_vn,
    scale_log2,
    offs_d,  # [HEAD_DIM]
):
    """Fold one block of keys into the online softmax; returns the updated (acc, row_max, row_sum)."""
    k_t = tl.load(k_head_ptr + key_idx[None, :] * stride_kn + offs_d[:, None], mask=key_ok[None, :], other=0.0)
    v = tl.load(v_head_ptr + key_idx[:, None] * stride_vn + offs_d[None, :], mask=key_ok[:, None], other=0.0)

    scores = tl.dot(q, k_t, input_precision="ieee") * scale_log2  # [BLOCK_M, BLOCK_N]
    scores = tl.where(visible, scores, float("-inf"))

    new_max = tl.maximum(row_max, tl.max(scores, axis=1))
    # A row that has seen no visible key yet keeps max -inf; subtract 0 there so nothing becomes NaN.
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    correction = tl.exp2(row_max - safe_max)  # rescales what was accumulated under the old max
    probs = tl.exp2(scores - safe_max[:, None])  # [BLOCK_M, BLOCK_N], 0 where not visible

    row_sum = row_sum * correction + tl.sum(probs, axis=1)
    acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v, input_precision="ieee")
    return acc, new_max, row_sum


@triton.jit
def _tree_attention_kernel(
    q_ptr,  # [num_heads, num_queries, HEAD_DIM]
    k_ptr,  # [num_kv_heads, prefix_len + num_queries, HEAD_DIM]
    v_ptr,  # [num_kv_heads, prefix_len + num_queries, HEAD_DIM]
    mask_ptr,  # [num_queries, num_queries] int8, nonzero where query i may see tree node j
    out_ptr,  # [num_heads, num_queries, HEAD_DIM]
    num_queries,
    prefix_len,
    heads_per_kv_head,
    scale_log2,  # softmax scale times log2(e): the kernel works with exp2
    stride_qh,
    stride_qm,
    stride_kh,
    stride_kn,
    stride_vh,
    stride_vn,
    stride_oh,
    stride_om,
    stride_mask,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    head = tl.program_id(0)
    kv_head = head // heads_per_kv_head
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # tree nodes this program answers for
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    query_ok = offs_m < num_queries

    q_ptrs = q_ptr + head * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
    q = tl.load(q_ptrs, mask=query_ok[:, None], other=0.0)
    k_head_ptr = k_ptr + kv_head * stride_kh
    v_head_ptr = v_ptr + kv_head * stride_vh

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)

    # The committed prefix: every tree node sees every prefix key.
    for start in range(0, prefix_len, BLOCK_N):
        key_idx = start + offs_n
        key_ok = key_idx < prefix_len
        visible = query_ok[:, None] & key_ok[None, :]
        acc, row_max, row_sum = _attend_key_block(
            acc, row_max, row_sum, q, k_head_ptr, v_head_ptr, key_idx, key_ok, visible,
            stride_kn, stride_vn, scale_log2, offs_d,
        )  # fmt: skip

    # The tree: node i sees node j only where tree_mask[i, j] (its ancestors and itself).
    for start in range(0, num_queries, BLOCK_N):
        node = start + offs_n
        node_ok = node < num_queries
        allowed = tl.load(
            mask_ptr + offs_m[:, None] * stride_mask + node[None, :],
            mask=query_ok[:, None] & node_ok[None, :],
            other=0,
        )
        acc, row_max, row_sum = _attend_key_block(
            acc, row_max, row_sum, q, k_head_ptr, v_head_ptr, prefix_len + node, node_ok, allowed != 0,
            stride_kn, stride_vn, scale_log2, offs_d,
        )  # fmt: skip

    out = acc / tl.where(row_sum > 0.0, row_sum, 1.0)[:, None]  # a query that sees no key gets zeros
    out_ptrs = out_ptr + head * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=query_ok[:, None])


def _check_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tree_mask: torch.Tensor) -> None:
    """Raise ValueError naming what is wrong, before anything is launched (checks survive ``python -O``)."""
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if tensor.dim() != 3:
            raise ValueError(f"tree_attention_triton: {name} must be 3-D [heads, tokens, head_dim], "
                             f"got shape {tuple(tensor.shape)}")
    num_heads, num_queries, head_dim = query.shape
    num_kv_heads, num_keys, _ = key.shape
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"tree_attention_triton: head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    if key.shape != value.shape or key.shape[2] != head_dim:
        raise ValueError(f"tree_attention_triton: key {tuple(key.shape)} and value {tuple(value.shape)} must both be "
                         f"[num_kv_heads, num_keys, {head_dim}]")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"tree_attention_triton: num_heads {num_heads} is not a multiple of "
                         f"num_kv_heads {num_kv_heads}")
    if num_keys < num_queries:
        raise ValueError(f"tree_attention_triton: num_keys {num_keys} < num_queries {num_queries}: "
                         "the tree's own keys must follow the prefix's")
    if tuple(tree_mask.shape) != (num_queries, num_queries):
        raise ValueError(f"tree_attention_triton: tree_mask must be [{num_queries}, {num_queries}], "
                         f"got {tuple(tree_mask.shape)}")
    if query.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"tree_attention_triton: dtype must be one of {SUPPORTED_DTYPES}, got {query.dtype}")
    if not key.dtype == value.dtype == query.dtype:
        raise ValueError(f"tree_attention_triton: query, key and value must share one dtype, "
                         f"got {query.dtype}, {key.dtype}, {value.dtype}")
    if not key.device == value.device == query.device:
        raise ValueError(f"tree_attention_triton: query, key and value must be on one device, "
                         f"got {query.device}, {key.device}, {value.device}")


def tree_attention_triton(
    query: torch.Tensor,  # [num_heads, num_queries, head_dim]
    key: torch.Tensor,  # [num_kv_heads, num_keys, head_dim], num_keys = prefix_len + num_queries
    value: torch.Tensor,  # [num_kv_heads, num_keys, head_dim]
    tree_mask: torch.Tensor,  # [num_queries, num_queries] bool: query i may see tree node j
    scale: float,
) -> torch.Tensor:  # [num_heads, num_queries, head_dim]
    """Scaled dot-product attention of tree nodes over the prefix and their ancestors (Triton).

    Same contract as ``tree_attention_reference``: grouped-query attention maps query head h to
    key/value head h // (num_heads // num_kv_heads). Accumulates in fp32 and returns the input dtype.
    A query whose mask row allows no key (possible only with an empty prefix and a row of False,
    never for a valid tree) gets zeros.
    """
    _check_inputs(query, key, value, tree_mask)
    num_heads, num_queries, head_dim = query.shape
    num_kv_heads, num_keys, _ = key.shape

    # Strided views are fine (a KV session hands over a slice of its buffer); only the head dimension
    # must be dense, so a copy is made only where it is not.
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    mask = tree_mask.to(device=query.device, dtype=torch.int8).contiguous()
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_queries == 0:
        return out

    block_m = min(64, max(16, triton.next_power_of_2(num_queries)))
    block_n = 64
    grid = (num_heads, triton.cdiv(num_queries, block_m))
    _tree_attention_kernel[grid](
        query, key, value, mask, out,
        num_queries, num_keys - num_queries, num_heads // num_kv_heads, scale * math.log2(math.e),
        query.stride(0), query.stride(1),
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        out.stride(0), out.stride(1),
        mask.stride(0),
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
    )  # fmt: skip
    return out
