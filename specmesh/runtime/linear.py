"""Linear layers laid out once for the fastest product on their device.

Verification multiplies every weight by a handful of rows (the tree's nodes). On a CPU, MKL's
``F.linear`` costs about as much per row for 2..8 rows as for one (measured on the embedded default,
2 threads: one pass over 9 rows 1.8x one row), which would make every drafted token nearly as
expensive as a decode step. oneDNN with the weight pre-packed for a small batch costs the same for
1..9 rows (1.0-1.2x) and is faster even for one row, so on CPU the weights are packed once at load.
On CUDA, and where oneDNN is missing, ``W @ x.T`` (flat for 1..3 rows on CPU) or plain ``F.linear``.

A target shipped block-quantized (GGUF Q4_0/Q4_1/Q8_0) can be computed as shipped on a CPU with
``BlockLinear``: the kernel reads the file's own blocks, ~6x fewer bytes a step than fp32, and scores
each row of a tree exactly as it would score that row alone.

Drafters may trade exactness for speed (their numbers never reach the output: verification keeps
only what the target itself produces), so on a CPU they can use ``Int8Linear``: at one row a step
the product only streams the weights, and int8 streams a quarter of fp32's bytes.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from specmesh.errors import InvalidArgument
from specmesh.kernels.block_linear import FORMATS, BlockWeight, PackedBlocks, block_linear

_PACK_BATCH_HINT = 8  # oneDNN picks its blocking for this many rows; 1..16 rows stay flat with it
_WEIGHT_LEFT_MAX_ROWS = 3


class PackedLinear:
    """y = x @ weight.T + bias for x [rows, in_features] -> [rows, out_features]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True) -> None:
        """``pack=False``: compute from ``weight`` itself (a buffer refilled between calls)."""
        self.weight = weight.detach()  # [out_features, in_features]
        self.bias = bias.detach() if bias is not None else None  # [out_features]
        self.out_features, self.in_features = self.weight.shape
        self.packed = _pack_onednn(self.weight) if pack else None
        if self.packed is not None:
            self.weight = None  # the packed copy replaces it; keep one copy in memory

    @property
    def kind(self) -> str:
        return "onednn" if self.packed is not None else "torch"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        if x.device.type == "cpu" and x.shape[0] <= _WEIGHT_LEFT_MAX_ROWS:
            y = torch.mm(self.weight, x.t()).t()
            return y + self.bias if self.bias is not None else y
        return F.linear(x, self.weight, self.bias)


def _pack_onednn(weight: torch.Tensor) -> torch.Tensor | None:
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
        probe = torch.zeros(1, weight.shape[1], dtype=weight.dtype)
        torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (RuntimeError, NotImplementedError):
        return None
    return packed


class Int8Linear:
    """y ~ x @ weight.T + bias with int8 weights (symmetric, one scale per output row) and each call's
    rows quantized on the fly (FBGEMM's dynamic linear) for x [rows, in_features] -> [rows, out_features].

    Approximate: for drafters only. Measured on a 3-layer expert of the embedded default, one thread:
    a drafting step 0.55-0.65x the time of ``PackedLinear``'s.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        weight = weight.detach().float()
        self.out_features, self.in_features = weight.shape
        scales = (weight.abs().amax(dim=1) / 127).clamp_min(1e-12)  # [out_features]
        with warnings.catch_warnings():  # quantized tensors are deprecated as a public API, not the ops
            warnings.simplefilter("ignore", UserWarning)
            quantized = torch.quantize_per_channel(
                weight, scales.double(), torch.zeros(self.out_features, dtype=torch.long), 0, torch.qint8
            )
        self.packed = torch.ops.quantized.linear_prepack(quantized, None if bias is None else bias.detach().float())

    kind = "int8"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # reduce_range: 7-bit activations, so AVX2's 16-bit pairwise sums of u8 x s8 cannot saturate
        return torch.ops.quantized.linear_dynamic(x.float().contiguous(), self.packed, True).to(x.dtype)


class BlockLinear:
    """y = x @ weight.T + bias with the weight in a GGUF block format, for x [rows, in_features] ->
    [rows, out_features] fp32 on a CPU (the kernel must be loaded: ``kernels.cpu_ops.load_cpu_ops``)."""

    def __init__(self, weight: BlockWeight, bias: torch.Tensor | None = None) -> None:
        self.format = weight.format
        self.format_id = FORMATS[weight.format][0]  # GGML's type id, what the C++ kernels take
        self.packed = PackedBlocks.pack(weight)  # the only copy kept
        self.bias = bias.detach().float() if bias is not None else None  # [out_features]
        self.out_features, self.in_features = weight.shape

    @property
    def kind(self) -> str:
        return self.format.lower()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = block_linear(x, self.packed)
        return y + self.bias if self.bias is not None else y


class InvariantLinear:
    """y = x @ weight.T + bias whose rows never depend on the other rows of the call (Triton, GPU; see
    ``kernels/matmul_triton.py``): a verifier's batches then give each request exactly its own logits."""

    kind = "batch-invariant"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        from specmesh.kernels.matmul_triton import check_inner

        self.weight = weight.detach().contiguous()  # [out_features, in_features]
        self.bias = bias.detach() if bias is not None else None
        self.out_features, self.in_features = self.weight.shape
        try:
            check_inner(self.in_features)
        except ValueError as exc:
            raise InvalidArgument("batch_invariant", f"{exc}: serve this model with --no-batch-invariant") from None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from specmesh.kernels.matmul_triton import invariant_linear

        return invariant_linear(x.contiguous(), self.weight, self.bias)


def int8_available(device: torch.device | str) -> bool:
    """Whether ``Int8Linear`` runs here: CPUs with FBGEMM (x86)."""
    if torch.device(device).type != "cpu" or "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:
        Int8Linear(torch.ones(2, 4))(torch.ones(1, 4))
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return True


def block_kernel_available(device: torch.device | str) -> bool:
    """Whether specmesh's C++ block kernel runs here (built on first use): a CPU with a compiler, or a
    cached build."""
    if torch.device(device).type != "cpu":
        return False
    from specmesh.kernels.cpu_ops import KernelUnavailable, load_cpu_ops
    from specmesh.runtime.loading import cache_root

    try:
        load_cpu_ops(cache_root() / "extensions")
    except KernelUnavailable:
        return False
    return True


def linear_for(weight: torch.Tensor, bias: torch.Tensor | None = None, int8: bool = False) -> PackedLinear | Int8Linear:
    return Int8Linear(weight, bias) if int8 else PackedLinear(weight, bias)
