"""A batch-invariant matrix product for the GPU step: y = x @ W.T + b whose every row is computed the same
way whatever the number of rows.

cuBLAS picks its kernel (tile shape, split of the reduction) from the whole problem's shape, so a row
scored in a pass of 160 rows may differ in the last bit from the same row in a pass of 16, and at a near
tie a greedy token flips. Here the reduction is fixed by the weight's shape and the device alone: K is cut
into the same splits, each walked from its start in steps of 16 by the matrix instructions, the splits
summed in split order. Each output element is then the same sequence of fp32 operations in every pass.
The tile a program computes only says which elements it computes, not how (the GPU's matrix instructions
give each element the same bits whatever the tile's shape, measured on an H100 for every tile of the
ladder): a pass takes the tile that suits its row count from ``TILES`` (few rows: narrow tiles, so that
many programs stream the weights; many rows: tall tiles, so that each weight tile is read about once).
K is split only for weights too narrow to give every multiprocessor a program of 16 columns; unsplit
products store their rows directly. Tile measurements: docs/experiments/.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MIN_COLUMNS = 16  # the narrowest column tile: a weight of n outputs gives n / 16 programs without a split


@dataclass(frozen=True)
class Tile:
    rows: int
    columns: int
    depth: int  # K a step of the loop: how much streams per pipeline stage (not how the sums go)
    warps: int
    stages: int


# (most rows, tile): a pass takes the first tile whose bound covers its rows. The fastest of 15 at each row
# count for a Llama-3-8B step on an H100 (docs/experiments/2026-11-27-batch-invariant-by-default.md).
TILES: tuple[tuple[int, Tile], ...] = (
    (16, Tile(16, 16, 256, 4, 4)),
    (32, Tile(16, 32, 256, 4, 3)),
    (64, Tile(64, 32, 128, 4, 4)),
    (128, Tile(64, 64, 128, 4, 3)),
    (320, Tile(64, 128, 64, 4, 4)),
    (1 << 62, Tile(128, 128, 64, 4, 3)),
)


def tile_for(rows: int) -> Tile:
    return next(tile for most, tile in TILES if rows <= most)


@triton.jit
def _partial_products(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, k_per_split, stride_xm, stride_wn, stride_split,
                      stride_om, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    # program (row tile, column tile, split): out[split, rows, columns] = x[rows, K range] @ W[columns, K range].T;
    # with one split, out is y itself: the bias added and the result in y's dtype
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    first = tl.program_id(2) * k_per_split
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(first, first + k_per_split, BLOCK_K):
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k + offs_k)[None, :], mask=offs_m[:, None] < M, other=0.0)
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + (k + offs_k)[:, None], mask=offs_n[None, :] < N, other=0.0)
        acc = tl.dot(x, w, acc, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + tl.program_id(2) * stride_split + offs_m[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


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


STEPS = (64, 32, 16)  # K steps a split may be cut in: the matrix instructions take K 16 at a time


def check_inner(k: int) -> None:
    if k % STEPS[-1]:
        raise ValueError(f"batch-invariant matmul: in_features {k} is not a multiple of {STEPS[-1]}")


@functools.lru_cache(maxsize=None)
def plan(n: int, k: int, programs: int) -> int:
    """Splits of K for a weight [n, k]: the fewest that give ``programs`` programs of 16 columns (one split
    for any weight wide enough), each split a multiple of the largest step dividing k."""
    check_inner(k)
    steps = k // next(step for step in STEPS if k % step == 0)
    tiles = triton.cdiv(n, MIN_COLUMNS)
    return min(d for d in range(1, steps + 1) if steps % d == 0 and (tiles * d >= programs or d == steps))


def device_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 16


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     tile: Tile | None = None) -> torch.Tensor:
    """x [rows, k] @ weight [n, k].T (+ bias [n]) -> [rows, n] in x's dtype, accumulated in fp32; row r of
    the result is bit for bit the same whatever ``rows`` is. ``tile``: the ladder's choice unless given."""
    rows, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"batch-invariant matmul: x {tuple(x.shape)} and weight {tuple(weight.shape)} must share "
                         "a dense inner dimension")
    splits = plan(n, k, device_programs(x.device))
    tile = tile or tile_for(rows)
    per_split = k // splits
    depth = tile.depth if per_split % tile.depth == 0 else next(step for step in STEPS if per_split % step == 0)
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    partial = y if splits == 1 else torch.empty(splits, rows, n, dtype=torch.float32, device=x.device)
    _partial_products[(triton.cdiv(rows, tile.rows), triton.cdiv(n, tile.columns), splits)](
        x, weight, bias if bias is not None and splits == 1 else x, partial, rows, n, k // splits, x.stride(0),
        weight.stride(0), partial.stride(0) if splits > 1 else 0, partial.stride(-2),
        HAS_BIAS=bias is not None and splits == 1, BLOCK_M=tile.rows, BLOCK_N=tile.columns, BLOCK_K=depth,
        num_warps=tile.warps, num_stages=tile.stages)
    if splits > 1:
        block = 1024
        _sum_splits[(triton.cdiv(rows * n, block),)](
            partial, bias if bias is not None else partial, y, rows * n, n, splits, partial.stride(0),
            HAS_BIAS=bias is not None, BLOCK=block)
    return y
