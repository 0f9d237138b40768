"""Arguments the bench commands share."""

from __future__ import annotations

import math

from specmesh.errors import InvalidArgument


def number_list(name: str, text: str, low: float, high: float = math.inf, kind: type = int) -> list:
    """A flag's comma-separated numbers of ``kind`` (int or float), each in ``low..high``."""
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        noun = "integers" if kind is int else "numbers"
        raise InvalidArgument(name, f"must be comma-separated {noun}, got {text!r}") from None
    if not values or not all(low <= v <= high for v in values):
        bounds = f"in {low}..{high}" if high != math.inf else f">= {low}"
        raise InvalidArgument(name, f"each must be {bounds}, got {text!r}")
    return values
