"""Tree attention for a whole batch of requests in one call, over a paged KV pool.

Row r belongs to request ``row_request[r]`` (-1: a padded row, owned by no one); it sees that request's
``cached`` committed entries, then the request's own tree rows listed in ``ancestors[r, :seen[r]]``
(root first, itself last): tree row a of a request sits at position ``cached + a``, and position p lives
in pool slot ``block_tables[b, p // page] * page + p % page``.

``paged_tree_attention_reference`` is the maths in PyTorch (the CPU path, and what the kernel is tested
against); ``paged_tree_attention_triton`` is one launch for the batch: one program per (row, kv head),
the query heads that share the kv head stacked in one block. A program walks the row's keys in the
order plain decoding would have them (committed entries, then its ancestors by depth) in blocks of
fixed size, so a tree row's output is bit for bit what plain decoding computes for the same token once
its ancestors are committed: speculation cannot change a greedy output through attention.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from specmesh.kernels.tree_attention_reference import masked_attention
from specmesh.kernels.tree_attention_triton import SUPPORTED_HEAD_DIMS, _attend_key_block

BLOCK_N = 64  # keys per step of the online softmax


def ancestor_table(masks: list[torch.Tensor], rows: int, depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' view of a batch of trees laid out one after another, padded to ``rows`` rows and
    ``depth`` ancestors: (row_request [rows], ancestors [rows, depth], seen [rows]), long, on the CPU.
    ``masks[b]`` [n_b, n_b] bool: row i of request b sees its tree row j (parents precede children)."""
    sees = [mask.numpy().astype(bool, copy=False) for mask in masks]
    widest = max((m.shape[0] for m in sees), default=1)
    table = np.zeros((rows, widest), dtype=bool)  # every tree's mask, one under the other
    row_request = np.full(rows, -1, dtype=np.int64)
    start = 0
    for b, mask in enumerate(sees):  # numpy, not torch ops: a verifier builds this on every pass's critical path
        table[start : start + mask.shape[0], : mask.shape[0]] = mask
        row_request[start : start + mask.shape[0]] = b
        start += mask.shape[0]
    row, column = np.nonzero(table)  # by row, then column: each row's ancestors by depth
    seen = table.sum(1).astype(np.int64)
    first = np.cumsum(seen) - seen
    ancestors = np.zeros((rows, depth), dtype=np.int64)
    ancestors[row, np.arange(row.shape[0]) - first[row]] = column
    return torch.from_numpy(row_request), torch.from_numpy(ancestors), torch.from_numpy(seen)


def paged_tree_attention_reference(
    query: torch.Tensor,  # [rows, heads, head_dim]
    k_cache: torch.Tensor,  # [slots, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [slots, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [batch, max_pages] int: the pages of each request, in position order
    cached: torch.Tensor,  # [batch] int: committed entries before each request's rows
    row_request: torch.Tensor,  # [rows] int: the request of each row, -1 for padding
    ancestors: torch.Tensor,  # [rows, max_depth] int: tree rows each row sees, root first, itself last
    seen: torch.Tensor,  # [rows] int: how many of ``ancestors`` are valid
    page_size: int,
    scale: float,
) -> torch.Tensor:  # [rows, heads, head_dim]; padded rows are zeros
    out = torch.zeros_like(query)
    owners, lengths, counts = row_request.tolist(), cached.tolist(), seen.tolist()
    for b, length in enumerate(lengths):
        rows = [r for r, owner in enumerate(owners) if owner == b]
        if not rows:
            continue
        n = max(int(ancestors[r, counts[r] - 1]) for r in rows) + 1  # the request's tree rows
        positions = torch.arange(length + n, device=query.device)
        slots = block_tables[b].long()[positions // page_size] * page_size + positions % page_size
        mask = torch.zeros(len(rows), length + n, dtype=torch.bool, device=query.device)
        mask[:, :length] = True
        valid = torch.arange(ancestors.shape[1], device=query.device) < seen[rows, None]  # [len(rows), max_depth]
        which = torch.arange(len(rows), device=query.device)[:, None].expand_as(valid)
        mask[which[valid], length + ancestors[rows].long()[valid]] = True
        out[rows] = masked_attention(
            query[rows].transpose(0, 1), k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1), mask, scale,
        ).transpose(0, 1)
    return out


@triton.jit
def _paged_tree_attention_kernel(
    q_ptr,  # [rows, heads, HEAD_DIM]
    k_ptr,  # [slots, kv_heads, HEAD_DIM]
    v_ptr,  # [slots, kv_heads, HEAD_DIM]
    block_tables_ptr,  # [batch, max_pages] int32 or int64
    cached_ptr,  # [batch] int32 or int64
    row_request_ptr,  # [rows] int32 or int64
    ancestors_ptr,  # [rows, max_depth] int32 or int64
    seen_ptr,  # [rows] int32 or int64
    out_ptr,  # [rows, heads, HEAD_DIM]
    scale_log2,  # softmax scale times log2(e): the online softmax uses exp2
    stride_qr, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_or, stride_oh, stride_bt, stride_anc,
    GROUP: tl.constexpr,  # query heads per kv head
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,  # >= GROUP
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    request = tl.load(row_request_ptr + row)
    owned = request >= 0
    request = tl.where(owned, request, 0)
    prefix = tl.where(owned, tl.load(cached_ptr + request), 0)
    keys = prefix + tl.where(owned, tl.load(seen_ptr + row), 0)  # a padded row walks no key

    offs_m = tl.arange(0, BLOCK_M)  # the query heads of this kv head
    head_ok = offs_m < GROUP
    head = kv_head * GROUP + offs_m
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + row * stride_qr + head[:, None] * stride_qh + offs_d[None, :], mask=head_ok[:, None], other=0.0)
    k_head_ptr = k_ptr + kv_head * stride_kh
    v_head_ptr = v_ptr + kv_head * stride_vh
    table = block_tables_ptr + request * stride_bt

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(0, keys, BLOCK_N):  # key t: committed entry t, or ancestor t - prefix
        t = start + offs_n
        key_ok = t < keys
        in_tree = key_ok & (t >= prefix)
        ancestor = tl.load(ancestors_ptr + row * stride_anc + (t - prefix), mask=in_tree, other=0)
        position = tl.where(in_tree, prefix + ancestor, t)
        slot = tl.load(table + position // PAGE, mask=key_ok, other=0).to(tl.int64) * PAGE + position % PAGE
        acc, row_max, row_sum = _attend_key_block(
            acc, row_max, row_sum, q, k_head_ptr, v_head_ptr, slot, key_ok, head_ok[:, None] & key_ok[None, :],
            stride_ks, stride_vs, scale_log2, offs_d,
        )  # fmt: skip

    out = acc / tl.where(row_sum > 0.0, row_sum, 1.0)[:, None]
    tl.store(out_ptr + row * stride_or + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


def paged_tree_attention_triton(
    query: torch.Tensor,  # [rows, heads, head_dim]
    k_cache: torch.Tensor,  # [slots, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [slots, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [batch, max_pages] int32 or int64
    cached: torch.Tensor,  # [batch] int32 or int64
    row_request: torch.Tensor,  # [rows] int32 or int64
    ancestors: torch.Tensor,  # [rows, max_depth] int32 or int64
    seen: torch.Tensor,  # [rows] int32 or int64
    page_size: int,
    scale: float,
) -> torch.Tensor:  # [rows, heads, head_dim]; padded rows are zeros
    """The reference's maths in one launch. Shapes only (never values) decide the grid, so a call can be
    captured in a CUDA graph and replayed with other lengths, trees and block tables."""
    rows, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"paged_tree_attention_triton: head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"paged_tree_attention_triton: {num_heads} heads is not a multiple of {num_kv_heads} kv heads")
    if query.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_tree_attention_triton: the head dimension must be dense")
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)  # every element is written: padded rows get zeros
    _paged_tree_attention_kernel[(rows, num_kv_heads)](
        query, k_cache, v_cache, block_tables, cached, row_request, ancestors, seen, out, scale * math.log2(math.e),
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0), ancestors.stride(0),
        GROUP=group, PAGE=page_size, HEAD_DIM=head_dim, BLOCK_M=max(16, triton.next_power_of_2(group)),
        BLOCK_N=BLOCK_N,
    )  # fmt: skip
    return out
