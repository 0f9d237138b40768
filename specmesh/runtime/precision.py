"""What a target's weights are computed in (light: no torch, so the command line and launcher can check it)."""

from __future__ import annotations

from specmesh.errors import InvalidArgument

# shipped: a GGUF target computed on its own 4/8-bit blocks (CPU); fp32: on the de-quantized weights, token
# for token what Hugging Face computes (other models: in their loaded dtype, for both); q8_0: any Llama-family
# model's projections rounded to 8-bit blocks at load (int8 weight-only, CPU).
PRECISIONS = ("shipped", "fp32", "q8_0")


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise InvalidArgument("precision", f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    return precision
