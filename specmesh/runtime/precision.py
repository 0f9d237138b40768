"""What a target's weights are computed in (light: no torch, so the command line and launcher can check it)."""

from __future__ import annotations

from specmesh.errors import InvalidArgument

# shipped: a GGUF target computed on its own 4/8-bit blocks (CPU); fp32: on the de-quantized weights, token
# for token what Hugging Face computes. Other models run in their loaded dtype either way.
PRECISIONS = ("shipped", "fp32")


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise InvalidArgument("precision", f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    return precision
