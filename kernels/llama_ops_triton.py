"""The elementwise parts of a Llama layer fused into single Triton launches (the GPU step).

A one-token step on a GPU streams the weights in a few matrix products; everything between them (norms,
rotary embedding, K/V writes, residual adds, SiLU) is tiny, and as separate PyTorch ops it is ~25 kernel
launches a layer, which costs more than the products themselves on small models. Here each is one
launch a layer, computed row by row (a row's result never depends on other rows: batch-invariant).

Each op rounds where PyTorch's unfused ops would round in the model dtype, so results stay within a
rounding step of ``LlamaRuntime``'s (tests compare them under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, delta_ptr, weight_ptr, sum_ptr, out_ptr, hidden, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < hidden
    x = tl.load(x_ptr + row * hidden + offs, mask=ok, other=0.0)
    if HAS_DELTA:  # the residual add, rounded to the model dtype as PyTorch's would be
        x = (x.to(tl.float32) + tl.load(delta_ptr + row * hidden + offs, mask=ok, other=0.0).to(tl.float32))
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * hidden + offs, x, mask=ok)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / hidden
    normed = (xf * tl.rsqrt(variance + eps)).to(out_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + offs, mask=ok, other=0.0)
    tl.store(out_ptr + row * hidden + offs, (weight.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=ok)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(x + delta, rms_norm(x + delta) * weight) for x, delta [rows, hidden]; without ``delta``, (x, norm)."""
    rows, hidden = x.shape
    summed = torch.empty_like(x) if delta is not None else x
    out = torch.empty_like(x)
    _add_rms_norm_kernel[(rows,)](x, delta if delta is not None else x, weight, summed, out, hidden, eps,
                                  HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(hidden))
    return summed, out


@triton.jit
def _rope_and_cache_kernel(qkv_ptr, positions_ptr, cos_ptr, sin_ptr, slots_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
                           stride_qkv, stride_cache_slot, num_heads, num_kv_heads,
                           HEAD_DIM: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)  # query heads, then kv heads
    half = HEAD_DIM // 2
    offs = tl.arange(0, HEAD_DIM)
    partner = tl.where(offs < half, offs + half, offs - half)
    sign = tl.where(offs < half, -1.0, 1.0)
    position = tl.load(positions_ptr + row)
    cos = tl.load(cos_ptr + position * HEAD_DIM + offs).to(tl.float32)
    sin = tl.load(sin_ptr + position * HEAD_DIM + offs).to(tl.float32)
    base = qkv_ptr + row * stride_qkv + head * HEAD_DIM
    x = tl.load(base + offs)
    rotated = (sign * tl.load(base + partner).to(tl.float32)).to(x.dtype)
    # x * cos + rotate_half(x) * sin, each product rounded to the model dtype as PyTorch's ops do
    out = ((x.to(tl.float32) * cos).to(x.dtype).to(tl.float32) + (rotated.to(tl.float32) * sin).to(x.dtype).to(tl.float32))
    out = out.to(x.dtype)
    if head < num_heads:
        tl.store(q_ptr + (row * num_heads + head) * HEAD_DIM + offs, out)
    else:
        kv_head = head - num_heads
        slot = tl.load(slots_ptr + row)
        tl.store(k_cache_ptr + slot * stride_cache_slot + kv_head * HEAD_DIM + offs, out)
        value = tl.load(base + num_kv_heads * HEAD_DIM + offs)
        tl.store(v_cache_ptr + slot * stride_cache_slot + kv_head * HEAD_DIM + offs, value)


def rope_and_cache(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rotary embedding of q and k from the fused projection ``qkv`` [rows, (heads + 2 kv_heads) * head_dim];
    k and v written into the pool at ``slots`` [rows] (k_cache, v_cache [slots, kv_heads, head_dim]).
    ``cos``, ``sin`` [max_length, head_dim] tables indexed by ``positions`` [rows]. Returns q [rows, heads,
    head_dim]."""
    rows = qkv.shape[0]
    num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    q = torch.empty(rows, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    _rope_and_cache_kernel[(rows, num_heads + num_kv_heads)](
        qkv, positions, cos, sin, slots, q, k_cache, v_cache, qkv.stride(0), k_cache.stride(0), num_heads,
        num_kv_heads, HEAD_DIM=head_dim)
    return q


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, intermediate, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < intermediate
    gate = tl.load(gate_up_ptr + row * 2 * intermediate + offs, mask=ok, other=0.0)
    up = tl.load(gate_up_ptr + row * 2 * intermediate + intermediate + offs, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    activated = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # silu, rounded as F.silu's output is
    tl.store(out_ptr + row * intermediate + offs, (activated.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for ``gate_up`` [rows, 2 * intermediate] (gate first) -> [rows, intermediate]."""
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(width // 2, block))](gate_up, out, width // 2, BLOCK=block)
    return out
