"""Per-request KV sessions: the keys and values of a request's committed tokens, plus room for one tree.

A verification pass writes a tree's rows right after the committed entries; the verdict then keeps only
the accepted path, moving its entries into place, so the cache never holds rejected guesses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specmesh.errors import InvalidArgument

_GROWTH_CHUNK = 256  # capacity grows in whole chunks so that most steps allocate nothing


@dataclass
class KVSession:
    kv: torch.Tensor  # [num_layers, 2, num_kv_heads, capacity, head_dim]; index 0 = keys, 1 = values
    length: int = 0  # committed entries; entries past it are scratch
    max_length: int = 0  # the model's context length

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
        capacity = min(self.max_length, -(-needed // _GROWTH_CHUNK) * _GROWTH_CHUNK)
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
        self.kv = self.kv.new_empty(*self.kv.shape[:3], 0, self.kv.shape[4])
        self.length = 0


def new_session(
    num_layers: int, num_kv_heads: int, head_dim: int, max_length: int, dtype: torch.dtype, device: torch.device
) -> KVSession:
    kv = torch.empty(num_layers, 2, num_kv_heads, 0, head_dim, dtype=dtype, device=device)
    return KVSession(kv=kv, length=0, max_length=max_length)
