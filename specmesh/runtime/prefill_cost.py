"""What caching a history costs a verification pass: a fixed part that any prefill call pays whatever its
size (launching the layers' work; on a CPU with a small target most of the call) and a part per token.

Chunked prefill sizes its chunks on the part per token. Sized on the mean time per token instead, a small
chunk looks dear (the fixed part spread over few tokens), so the next chunk is smaller still: measured on
2 cores with ``random:tiny``, prompts of ~130 tokens were cached 1–4 tokens a pass after their first 64,
every pass paying the fixed ~3 ms.
"""

from __future__ import annotations

from dataclasses import dataclass

WEIGHT = 0.1  # of the newest call in the running sums: about the last 10 calls count
SPREAD = 0.25  # the calls' sizes must spread this much (standard deviation over mean) for a line: over
# chunks of nearly one size, timing noise alone sets the slope


@dataclass
class PrefillCost:
    """``ms = fixed_ms + marginal_ms * tokens``, fitted on the prefill calls observed (exponentially
    weighted least squares). Until the calls' sizes differ enough for a line, all of a call's time is
    counted per token (the fixed part 0): sizes then stay small, as when nothing is known."""

    fixed_ms: float = 0.0
    marginal_ms: float = 0.0  # 0: no call observed yet
    _x: float = 0.0  # weighted means of tokens, ms, tokens², tokens·ms
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    def observe(self, tokens: int, ms: float) -> None:
        if tokens <= 0 or ms <= 0:
            return
        w = WEIGHT if self._x else 1.0  # the first call alone sets the means
        self._x += w * (tokens - self._x)
        self._y += w * (ms - self._y)
        self._xx += w * (tokens * tokens - self._xx)
        self._xy += w * (tokens * ms - self._xy)
        mean_per_token = self._y / self._x
        variance = self._xx - self._x * self._x
        if variance <= (SPREAD * self._x) ** 2:
            if self.marginal_ms == 0.0:
                self.marginal_ms = mean_per_token
            return
        slope = (self._xy - self._x * self._y) / variance
        # a line through the origin or steeper is all per token; a negative slope (noise) keeps the last fit
        if slope >= mean_per_token:
            self.fixed_ms, self.marginal_ms = 0.0, mean_per_token
        elif slope > 0:
            self.fixed_ms, self.marginal_ms = self._y - slope * self._x, slope

    def tokens_within(self, budget_ms: float) -> int:
        """Tokens a call may cache within ``budget_ms`` (at least 1). Where the fixed part alone exceeds the
        budget no chunk keeps within it, and each further call pays it again: the tokens then take the budget
        on top of the fixed part (a chunk's time at most twice the fixed part)."""
        if self.marginal_ms <= 0:
            return 1
        return max(1, int(max(budget_ms - self.fixed_ms, min(self.fixed_ms, budget_ms)) / self.marginal_ms))
