"""A batch-invariant matrix product for the GPU step: y = x @ W.T + b whose every row is computed the same
way whatever the number of rows.

cuBLAS picks its kernel (tile shape, split of the reduction) from the whole problem's shape, so a row
scored in a pass of 160 rows may differ in the last bit from the same row in a pass of 16, and at a near
tie a greedy token flips. Here the tile shape and the split of K depend only on the weight's shape (and
the device): each output element is the same sequence of fp32 operations in every pass, wherever its row
sits in its tile. Rows go in tiles of 64 (the matrix instructions of a warp group; a one-request pass
masks most of a tile, which costs little while the weights stream); programs that share a weight tile
run next to one another, so a batch reads its weights from memory about once. Tile shapes: the best of
32 measured on an H100 (docs/experiments/2026-11-26-gpu-step-on-h100.md).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BLOCK_M = 64  # rows a tile: fixed, never chosen from the batch
BLOCK_N = 128
NUM_WARPS, NUM_STAGES = 4, 3


@triton.jit
def _partial_products(x_ptr, w_ptr, out_ptr, M, N, k_per_split, stride_xm, stride_wn, stride_split, stride_om,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # program (row tile, column tile, split): out[split, rows, columns] = x[rows, K range] @ W[columns, K range].T
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    first = tl.program_id(2) * k_per_split
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(first, first + k_per_split, BLOCK_K):
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k + offs_k)[None, :], mask=offs_m[:, None] < M, other=0.0)
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + (k + offs_k)[:, None], mask=offs_n[None, :] < N, other=0.0)
        acc = tl.dot(x, w, acc, input_precision="ieee")
    tl.store(out_ptr + tl.program_id(2) * stride_split + offs_m[:, None] * stride_om + offs_n[None, :], acc,
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _sum_splits(partial_ptr, bias_ptr, y_ptr, total, N, splits, stride_split,
                HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < total
    acc = tl.load(partial_ptr + offs, mask=ok, other=0.0)
    for split in range(1, splits):  # in split order: the same sum for every batch
        acc += tl.load(partial_ptr + split * stride_split + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


@functools.lru_cache(maxsize=None)
def _plan(n: int, k: int, programs: int) -> tuple[int, int]:
    """(BLOCK_K, splits of K) for a weight [n, k]: enough programs for one tile of rows to fill the device."""
    block_k = next((b for b in (64, 32) if k % b == 0), None)
    if block_k is None:
        raise ValueError(f"batch-invariant matmul: in_features {k} is not a multiple of 32")
    steps, tiles = k // block_k, triton.cdiv(n, BLOCK_N)
    splits = max(d for d in range(1, steps + 1) if steps % d == 0 and (d == 1 or tiles * d <= programs))
    return block_k, splits


def _programs(device: torch.device) -> int:
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 16


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, k] @ weight [n, k].T (+ bias [n]) -> [rows, n] in x's dtype, accumulated in fp32; row r of
    the result is bit for bit the same whatever ``rows`` is."""
    rows, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"batch-invariant matmul: x {tuple(x.shape)} and weight {tuple(weight.shape)} must share "
                         "a dense inner dimension")
    block_k, splits = _plan(n, k, _programs(x.device))
    partial = torch.empty(splits, rows, n, dtype=torch.float32, device=x.device)
    _partial_products[(triton.cdiv(rows, BLOCK_M), triton.cdiv(n, BLOCK_N), splits)](
        x, weight, partial, rows, n, k // splits, x.stride(0), weight.stride(0), partial.stride(0), partial.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=block_k, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block = 1024
    _sum_splits[(triton.cdiv(rows * n, block),)](
        partial, bias if bias is not None else partial, y, rows * n, n, splits, partial.stride(0),
        HAS_BIAS=bias is not None, BLOCK=block)
    return y
