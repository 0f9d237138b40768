"""Tree attention for a whole batch of requests in one call, over a paged KV pool.

Row r belongs to request ``row_request[r]`` (-1: a padded row, owned by no one); it sees that request's
``cached`` committed entries, then the request's own tree rows listed in ``ancestors[r, :seen[r]]``
(root first, itself last): tree row a of a request sits at position ``cached + a``, and position p lives
in pool slot ``block_tables[b, p // page] * page + p % page``.

``paged_tree_attention_reference`` is the maths in PyTorch (the CPU path, and what the kernels are tested
against); ``paged_tree_attention_triton`` is two launches for the batch. Every row walks its keys in the
order plain decoding would have them (committed entries, then its ancestors by depth) in blocks of 64
aligned at key 0, with an online softmax. The first kernel takes the full blocks of committed entries,
reading each block once for a group of up to 16 rows of one request (their query heads for one kv head
stacked in 64 lines); the second continues each row from that state over its last blocks. Both hold the
same lines in the same layout, so a block sums alike in either, and a tree row's output is bit for bit
what plain decoding computes for the same token once its ancestors are committed: speculation cannot
change a greedy output through attention.
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
BLOCK_M = 64  # query lines a program holds at least: a group's rows x the query heads of one kv head
NUM_WARPS = 4  # both kernels': one layout, so a key block sums alike in either


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


def block_lines(group: int) -> int:
    """Query lines a program of either kernel holds (``group`` query heads per kv head)."""
    return max(BLOCK_M, triton.next_power_of_2(group))


def rows_per_group(num_heads: int, num_kv_heads: int) -> int:
    """Tree rows of one request that share a walk over their committed entries (their query heads for one
    kv head stacked in one program's lines)."""
    group = num_heads // num_kv_heads
    return block_lines(group) // triton.next_power_of_2(group)


def row_groups(row_request: np.ndarray, per_group: int, groups: int) -> np.ndarray:
    """[groups, 2] int64 (first row, rows): runs of at most ``per_group`` consecutive rows of one request,
    in row order; unused groups have 0 rows. ``row_request`` [rows]: -1 for padding; a request's rows
    are consecutive."""
    owned = np.flatnonzero(row_request >= 0)
    spans = []
    if owned.size:
        breaks = np.flatnonzero(np.diff(row_request[owned])) + 1  # where the next request's rows begin
        starts, ends = owned[np.r_[0, breaks]], np.r_[owned[breaks - 1] + 1, owned[-1] + 1]
        spans = [(f, min(per_group, int(b) - f)) for a, b in zip(starts, ends) for f in range(int(a), int(b), per_group)]
    if len(spans) > groups:
        raise ValueError(f"row_groups: {len(spans)} groups do not fit in {groups}")
    table = np.zeros((groups, 2), dtype=np.int64)
    table[: len(spans)] = spans if spans else table[:0]
    return table


def group_bound(rows: int, requests: int, per_group: int) -> int:
    """Groups ``row_groups`` may need for a pass of ``rows`` rows and ``requests`` requests (shapes only)."""
    return -(-rows // per_group) + requests


@triton.jit
def _committed_blocks_kernel(
    q_ptr,  # [rows, heads, HEAD_DIM]
    k_ptr,  # [slots, kv_heads, HEAD_DIM]
    v_ptr,  # [slots, kv_heads, HEAD_DIM]
    block_tables_ptr,  # [batch, max_pages]
    cached_ptr,  # [batch]
    row_request_ptr,  # [rows]
    groups_ptr,  # [groups, 2]: first row, rows
    acc_ptr,  # [rows, heads, HEAD_DIM] fp32: the online softmax's state after the committed blocks
    max_ptr,  # [rows, heads] fp32
    sum_ptr,  # [rows, heads] fp32
    scale_log2,
    stride_qr, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_POW2: tl.constexpr,
    HEADS: tl.constexpr,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # program (group of rows of one request, kv head): the full key blocks of committed entries, read once
    # for every row of the group
    group = tl.program_id(0)
    kv_head = tl.program_id(1)
    first = tl.load(groups_ptr + group * 2)
    count = tl.load(groups_ptr + group * 2 + 1)
    request = tl.where(count > 0, tl.load(row_request_ptr + first), 0)
    request = tl.where(request >= 0, request, 0)
    prefix = tl.where(count > 0, tl.load(cached_ptr + request), 0)
    shared_end = (prefix // BLOCK_N) * BLOCK_N

    offs_m = tl.arange(0, BLOCK_M)
    line_ok = (offs_m % GROUP_POW2 < GROUP) & (offs_m // GROUP_POW2 < count)
    row = first + offs_m // GROUP_POW2
    head = kv_head * GROUP + offs_m % GROUP_POW2
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + row[:, None] * stride_qr + head[:, None] * stride_qh + offs_d[None, :], mask=line_ok[:, None],
                other=0.0)
    k_head_ptr = k_ptr + kv_head * stride_kh
    v_head_ptr = v_ptr + kv_head * stride_vh
    table = block_tables_ptr + request * stride_bt

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(0, shared_end, BLOCK_N):
        t = start + offs_n
        key_ok = t < shared_end
        slot = tl.load(table + t // PAGE, mask=key_ok, other=0).to(tl.int64) * PAGE + t % PAGE
        acc, row_max, row_sum = _attend_key_block(
            acc, row_max, row_sum, q, k_head_ptr, v_head_ptr, slot, key_ok, line_ok[:, None] & key_ok[None, :],
            stride_ks, stride_vs, scale_log2, offs_d,
        )  # fmt: skip
    line = row * HEADS + head
    tl.store(acc_ptr + line[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=line_ok[:, None])
    tl.store(max_ptr + line, row_max, mask=line_ok)
    tl.store(sum_ptr + line, row_sum, mask=line_ok)


@triton.jit
def _tree_blocks_kernel(
    q_ptr,  # [rows, heads, HEAD_DIM]
    k_ptr,  # [slots, kv_heads, HEAD_DIM]
    v_ptr,  # [slots, kv_heads, HEAD_DIM]
    block_tables_ptr,  # [batch, max_pages] int32 or int64
    cached_ptr,  # [batch] int32 or int64
    row_request_ptr,  # [rows] int32 or int64
    ancestors_ptr,  # [rows, max_depth] int32 or int64
    seen_ptr,  # [rows] int32 or int64
    acc_ptr,  # [rows, heads, HEAD_DIM] fp32: the state the committed blocks left
    max_ptr,  # [rows, heads] fp32
    sum_ptr,  # [rows, heads] fp32
    out_ptr,  # [rows, heads, HEAD_DIM]
    scale_log2,  # softmax scale times log2(e): the online softmax uses exp2
    stride_qr, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_or, stride_oh, stride_bt, stride_anc,
    GROUP: tl.constexpr,  # query heads per kv head
    HEADS: tl.constexpr,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,  # the committed-blocks kernel's: one layout, so each block sums alike in both
    BLOCK_N: tl.constexpr,
):
    # program (row, kv head): the row's remaining blocks (the last committed entries, then its ancestors),
    # continuing from the committed blocks' state
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    owner = tl.load(row_request_ptr + row)
    owned = owner >= 0
    request = tl.where(owned, owner, 0)
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

    line = row * HEADS + head
    state_ok = head_ok & (offs_m * 0 + owner >= 0)  # as a vector: the interpreter masks with vectors only
    acc = tl.load(acc_ptr + line[:, None] * HEAD_DIM + offs_d[None, :], mask=state_ok[:, None], other=0.0)
    row_max = tl.load(max_ptr + line, mask=state_ok, other=float("-inf"))
    row_sum = tl.load(sum_ptr + line, mask=state_ok, other=0.0)
    for start in range((prefix // BLOCK_N) * BLOCK_N, keys, BLOCK_N):  # key t: committed t, or ancestor t - prefix
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
    groups: torch.Tensor | None = None,  # [groups, 2] (first row, rows): ``row_groups``; made here if None
) -> torch.Tensor:  # [rows, heads, head_dim]; padded rows are zeros
    """The reference's maths in two launches: the committed entries' full key blocks, read once for each
    group of a request's rows; then each row's own blocks. Shapes only (never values) decide the grids, so
    a call can be captured in a CUDA graph and replayed with other lengths, trees and block tables."""
    rows, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"paged_tree_attention_triton: head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"paged_tree_attention_triton: {num_heads} heads is not a multiple of {num_kv_heads} kv heads")
    if query.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_tree_attention_triton: the head dimension must be dense")
    group = num_heads // num_kv_heads
    if groups is None:
        per_group = rows_per_group(num_heads, num_kv_heads)
        groups = torch.from_numpy(row_groups(row_request.cpu().numpy(), per_group,
                                             group_bound(rows, cached.shape[0], per_group))).to(query.device)
    acc = torch.empty(rows, num_heads, head_dim, dtype=torch.float32, device=query.device)
    row_max = torch.empty(rows, num_heads, dtype=torch.float32, device=query.device)
    row_sum = torch.empty(rows, num_heads, dtype=torch.float32, device=query.device)
    scale_log2 = scale * math.log2(math.e)
    shapes = dict(GROUP=group, HEADS=num_heads, PAGE=page_size, HEAD_DIM=head_dim, BLOCK_M=block_lines(group), BLOCK_N=BLOCK_N,
                  num_warps=NUM_WARPS)
    _committed_blocks_kernel[(groups.shape[0], num_kv_heads)](
        query, k_cache, v_cache, block_tables, cached, row_request, groups, acc, row_max, row_sum, scale_log2,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0), GROUP_POW2=triton.next_power_of_2(group), **shapes,
    )  # fmt: skip
    out = torch.empty_like(query)  # every element is written: padded rows get zeros
    _tree_blocks_kernel[(rows, num_kv_heads)](
        query, k_cache, v_cache, block_tables, cached, row_request, ancestors, seen, acc, row_max, row_sum, out,
        scale_log2, query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), ancestors.stride(0), **shapes,
    )  # fmt: skip
    return out
