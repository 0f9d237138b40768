"""What a decode pass costs by its rows: a fixed part any pass pays whatever its size (launching the layers'
work; on a CPU with a small target most of a pass) and a part per row. What a prefill chunk adds to a pass
beside decoding rows is measured against it (``prefill_pace.py``).

Counted all per row (the mean time per row), a small pass looks dear: the fixed part spread over few rows.
"""

from __future__ import annotations

from dataclasses import dataclass

WEIGHT = 0.1  # of the newest pass in the running sums: about the last 10 passes count
SPREAD = 0.25  # the passes' sizes must spread this much (standard deviation over mean) for a line: over
# passes of nearly one size, timing noise alone sets the slope


@dataclass
class PassCost:
    """``ms = fixed_ms + row_ms * rows``, fitted on the passes observed (exponentially weighted least
    squares). Until the passes' sizes differ enough for a line, all of a pass's time is counted per row (the
    fixed part 0); while they do not, the line follows their mean (a pass's cost grows with its requests'
    caches: a fit frozen at the first passes says a chunk beside them costs what the cache's growth does)."""

    fixed_ms: float = 0.0
    row_ms: float = 0.0  # 0: no pass observed yet
    _x: float = 0.0  # weighted means of rows, ms, rows², rows·ms
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    def observe(self, rows: int, ms: float) -> None:
        if rows <= 0 or ms <= 0:
            return
        w = WEIGHT if self._x else 1.0  # the first pass alone sets the means
        self._x += w * (rows - self._x)
        self._y += w * (ms - self._y)
        self._xx += w * (rows * rows - self._xx)
        self._xy += w * (rows * ms - self._xy)
        mean_per_row = self._y / self._x
        variance = self._xx - self._x * self._x
        if variance <= (SPREAD * self._x) ** 2:  # passes of one size: the line through their mean, its slope kept
            if self.fixed_ms == 0.0 or self._y < self.row_ms * self._x:
                self.fixed_ms, self.row_ms = 0.0, mean_per_row
            else:
                self.fixed_ms = self._y - self.row_ms * self._x
            return
        slope = (self._xy - self._x * self._y) / variance
        # a line through the origin or steeper is all per row; a negative slope (noise) keeps the last fit
        if slope >= mean_per_row:
            self.fixed_ms, self.row_ms = 0.0, mean_per_row
        elif slope > 0:
            self.fixed_ms, self.row_ms = self._y - slope * self._x, slope

    def ms(self, rows: int) -> float:
        """What a pass of ``rows`` rows costs (0 before any pass is observed)."""
        return self.fixed_ms + self.row_ms * rows
