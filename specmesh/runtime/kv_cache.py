"""Per-request KV sessions: the keys and values of a request's committed tokens, plus room for one tree.

A verification pass writes a tree's rows right after the committed entries; the verdict then keeps only
the accepted path, moving its entries into place, so the cache never holds rejected guesses. Sessions of
one runtime share a ``KVBudget`` (``--kv-cache-gb``): a session that would grow past it raises
``ResourceExhausted`` instead, unchanged. (On CUDA the runtime's sessions live in a paged pool instead:
``kv_pool.py``.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specmesh.errors import InvalidArgument, ResourceExhausted

_GROWTH_CHUNK = 256  # capacity grows in whole chunks so that most steps allocate nothing


class KVBudget:
    """The bytes every session of one runtime may hold together."""

    def __init__(self, capacity_bytes: int, position_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.position_bytes = position_bytes  # K and V of one position, every layer
        self.used_bytes = 0

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def take(self, nbytes: int) -> None:
        if nbytes > self.free_bytes:
            raise ResourceExhausted(f"KV cache full: {nbytes / 2**20:.1f} MiB more asked for, "
                                    f"{self.free_bytes / 2**20:.1f} of {self.capacity_bytes / 2**20:.1f} MiB free")
        self.used_bytes += nbytes

    def give(self, nbytes: int) -> None:
        self.used_bytes -= nbytes

    def extra_bytes(self, session: KVSession, positions: int) -> int:
        """What ``session`` must take to hold ``positions`` entries."""
        return max(0, _capacity_for(positions, session.max_length) - session.capacity) * self.position_bytes


def _capacity_for(positions: int, max_length: int) -> int:
    return min(max_length, -(-positions // _GROWTH_CHUNK) * _GROWTH_CHUNK)


@dataclass
class KVSession:
    kv: torch.Tensor  # [num_layers, 2, num_kv_heads, capacity, head_dim]; index 0 = keys, 1 = values
    length: int = 0  # committed entries; entries past it are scratch
    max_length: int = 0  # the model's context length
    budget: KVBudget | None = None  # shared with the runtime's other sessions

    @property
    def capacity(self) -> int:
        return int(self.kv.shape[3])

    @property
    def nbytes(self) -> int:
        """Memory held by the buffer (committed entries, scratch and spare capacity)."""
        return self.kv.numel() * self.kv.element_size()

    def reserve(self, extra: int) -> None:
        """Make room for ``extra`` entries past the committed ones (grows the buffer, keeps contents)."""
        needed = self.length + extra
        if needed > self.max_length:
            raise InvalidArgument(
                "max_tokens", f"the request needs {needed} positions but the model's context is {self.max_length}"
            )
        if needed <= self.capacity:
            return
        capacity = _capacity_for(needed, self.max_length)
        if self.budget is not None:
            self.budget.take(self.budget.extra_bytes(self, needed))
        grown = self.kv.new_empty(*self.kv.shape[:3], capacity, self.kv.shape[4])
        grown[:, :, :, : self.length] = self.kv[:, :, :, : self.length]
        self.kv = grown

    def keep_rows(self, rows: list[int]) -> None:
        """Commit the scratch rows ``rows`` (increasing, relative to ``length``), packed into place."""
        if not rows:
            return
        if rows != list(range(len(rows))):  # the accepted path is not already in place
            source = torch.tensor(rows, device=self.kv.device) + self.length
            self.kv[:, :, :, self.length : self.length + len(rows)] = self.kv.index_select(3, source)
        self.length += len(rows)

    def rollback(self, length: int) -> None:
        """Forget every entry from ``length`` on."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: session holds {self.length} entries")
        self.length = length

    def free(self) -> None:
        if self.budget is not None:
            self.budget.give(self.nbytes)
        self.kv = self.kv.new_empty(*self.kv.shape[:3], 0, self.kv.shape[4])
        self.length = 0

    def __del__(self) -> None:  # a session dropped without free() gives its bytes back too
        if self.budget is not None and self.kv is not None:
            self.budget.give(self.nbytes)


def new_session(
    num_layers: int, num_kv_heads: int, head_dim: int, max_length: int, dtype: torch.dtype, device: torch.device,
    budget: KVBudget | None = None,
) -> KVSession:
    kv = torch.empty(num_layers, 2, num_kv_heads, 0, head_dim, dtype=dtype, device=device)
    return KVSession(kv=kv, length=0, max_length=max_length, budget=budget)
