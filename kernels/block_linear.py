"""Linear layers over GGUF-style quantized blocks (Q4_0, Q4_1, Q8_0), computed as shipped on a CPU.

The C++ kernel is ``cpu/block_linear.cpp``, built by ``cpu_ops.load_cpu_ops``. The PyTorch reference
(``quantized_reference``) is the maths it must reproduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # weights per block along the input dimension
FORMATS = {"Q4_0": (2, 18), "Q4_1": (3, 20), "Q8_0": (8, 34)}  # GGML type id, bytes a block of 32


@dataclass(frozen=True)
class BlockWeight:
    """A weight [out_features, in_features] in a GGUF block format, bytes as the file stores them:
    data uint8 [out_features, in_features / 32 * block bytes] (see ``cpu/block_linear.cpp``)."""

    format: str  # "Q4_0", "Q4_1" or "Q8_0"
    data: torch.Tensor

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"no block kernel for {self.format} (have {', '.join(FORMATS)})")
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.data.shape[1] % FORMATS[self.format][1]:
            raise ValueError(f"{self.format} data must be uint8 [out, blocks * {FORMATS[self.format][1]}]")

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.data.shape[1] // FORMATS[self.format][1] * BLOCK

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, index: torch.Tensor) -> BlockWeight:
        """The output features ``index`` [out] in that order (e.g. to undo a row permutation)."""
        return BlockWeight(self.format, self.data[index].contiguous())

    @staticmethod
    def cat(weights: list[BlockWeight]) -> BlockWeight:
        """Stack along out_features (fused projections); all must share their format and input size."""
        first = weights[0]
        if any(w.format != first.format or w.shape[1] != first.shape[1] for w in weights):
            raise ValueError("fused block weights must share their format and input size")
        return BlockWeight(first.format, torch.cat([w.data for w in weights]))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [out, in] (what the kernel multiplies by)."""
        out, inputs = self.shape
        blocks = self.data.reshape(out, inputs // BLOCK, FORMATS[self.format][1])
        d = blocks[..., :2].contiguous().view(torch.float16).to(dtype)  # [out, blocks, 1]
        if self.format == "Q8_0":
            q = blocks[..., 2:].contiguous().view(torch.int8).to(dtype)
            return (q * d).reshape(out, inputs)
        nibbles = blocks[..., -BLOCK // 2 :]
        q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).to(dtype)  # [out, blocks, 32]
        if self.format == "Q4_0":
            return ((q - 8) * d).reshape(out, inputs)
        m = blocks[..., 2:4].contiguous().view(torch.float16).to(dtype)
        return (q * d + m).reshape(out, inputs)


def quantize(weight: torch.Tensor, format: str) -> BlockWeight:
    """Round a weight [out, in] (in % 32 == 0) to blocks of ``format`` as llama.cpp's reference quantizers
    do: Q8_0 d = max |w| / 127; Q4_1 d = (max - min) / 15, m = min; Q4_0 d = -(signed max |w|) / 8."""
    out, inputs = weight.shape
    if format not in FORMATS or inputs % BLOCK:
        raise ValueError(f"cannot quantize [{out}, {inputs}] to {format}: formats {', '.join(FORMATS)}, in % 32 == 0")
    blocks = weight.detach().float().reshape(out, inputs // BLOCK, BLOCK)
    if format == "Q8_0":
        d = (blocks.abs().amax(-1, keepdim=True) / 127).half()
        q = torch.round(blocks / d.float().clamp_min(1e-30)).clamp(-127, 127).to(torch.int8)
        parts = [d.view(torch.uint8), q.view(torch.uint8)]
    else:
        if format == "Q4_1":
            low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
            d, m = ((high - low) / 15).half(), low.half()
            q = torch.round((blocks - m.float()) / d.float().clamp_min(1e-30)).clamp(0, 15)
            head = [d.view(torch.uint8), m.view(torch.uint8)]
        else:
            extreme = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
            d = (extreme / -8).half()
            safe = torch.where(d.float() == 0, torch.ones_like(d.float()), d.float())
            q = torch.round(blocks / safe + 8).clamp(0, 15)
            head = [d.view(torch.uint8)]
        q = q.to(torch.uint8)
        parts = [*head, q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)]
    return BlockWeight(format, torch.cat(parts, dim=-1).reshape(out, -1).contiguous())


PAIR = 16  # output features a packed block holds: one 512-bit register of fp32 sums, two 256-bit ones


@dataclass(frozen=True)
class PackedBlocks:
    """A ``BlockWeight`` in the kernel's layout, as many bytes as the file's: features in pairs of groups of 8
    (16 features), each block of a pair contiguous: its 16 fp16 d, its 16 fp16 m (Q4_1), then its codes in
    64-byte vectors whose byte 4 f + i holds codes of feature f: 8-bit, vector j holds input 4 j + i; 4-bit,
    vector j holds input 8 j + i in its low nibble and 8 j + 4 + i in its high one. So one load and at most
    two masks give a register of 16 features x 4 inputs; a group of 8 is each vector's half. data uint8
    [pairs, in / 32, pair block bytes]; features past out_features are zeros."""

    format: str
    data: torch.Tensor
    out_features: int

    @classmethod
    def pack(cls, weight: BlockWeight) -> PackedBlocks:
        out, inputs = weight.shape
        pairs, blocks = -(-out // PAIR), inputs // BLOCK
        raw = weight.data.reshape(out, blocks, FORMATS[weight.format][1])
        raw = torch.cat([raw, raw.new_zeros(pairs * PAIR - out, blocks, raw.shape[-1])])
        scales = 4 if weight.format == "Q4_1" else 2  # d (and m), fp16 each

        def by_pair(part: torch.Tensor) -> torch.Tensor:  # [pairs * 16, blocks, b] -> [pairs, blocks, 16 * b]
            return part.reshape(pairs, PAIR, blocks, -1).transpose(1, 2).reshape(pairs, blocks, -1)

        codes = raw[..., scales:]  # [pairs * 16, blocks, 16 or 32]
        if weight.format == "Q8_0":  # [pair, feature, blocks, vector, input] -> [pair, blocks, vector, feature, input]
            vectors = codes.reshape(pairs, PAIR, blocks, BLOCK // 4, 4).permute(0, 2, 3, 1, 4)
        else:  # the file's nibble byte j: input j (low), input j + 16 (high)
            codes = torch.cat([codes & 0x0F, codes >> 4], dim=-1).reshape(pairs, PAIR, blocks, BLOCK // 8, 2, 4)
            vectors = (codes[..., 0, :] | (codes[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)
        parts = [by_pair(raw[..., 0:2])]
        if weight.format == "Q4_1":
            parts.append(by_pair(raw[..., 2:4]))
        parts.append(vectors.reshape(pairs, blocks, -1))
        return cls(weight.format, torch.cat(parts, dim=-1).contiguous(), out)


def block_linear(x: torch.Tensor, weight: PackedBlocks) -> torch.Tensor:
    """x [rows, in] -> [rows, out] fp32 with the compiled kernel (``cpu_ops.load_cpu_ops`` first): each row's
    activations are rounded to 8 bits per block of 32, as llama.cpp does (see ``quantized_reference``)."""
    return torch.ops.specmesh_cpu.block_linear(x.float(), weight.data, FORMATS[weight.format][0], weight.out_features)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, in] -> (codes int8 [rows, in], scales [rows, in / 32]): the kernel's per-row, per-block
    8-bit activations (scale = max |x| / 127, codes rounded to nearest even)."""
    rows, inputs = x.shape
    blocks = x.float().reshape(rows, inputs // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1)  # [rows, blocks]
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inverse.unsqueeze(-1)).to(torch.int8).reshape(rows, inputs)
    return codes, amax / 127.0


def quantized_reference(x: torch.Tensor, weight: BlockWeight) -> torch.Tensor:
    """The kernel's maths in fp64 on the same 8-bit activations: x [rows, in] -> [rows, out]."""
    codes, scales = quantize_activations(x)
    rows, inputs = x.shape
    x_hat = (codes.double().reshape(rows, -1, BLOCK) * scales.double().unsqueeze(-1)).reshape(rows, inputs)
    return x_hat @ weight.dequantize(torch.float64).T
