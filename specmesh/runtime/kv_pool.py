"""One paged KV pool for every request of a runtime, with a memory budget.

The pool is allocated once (``--kv-cache-gb``): keys and values of every layer live in fixed pages of
``page_size`` positions, and a request's session is the list of pages it holds (its block table). A
verification pass writes each row's K/V into a slot (page * page_size + offset) and attention reads the
pages through the block table, so no buffer is ever grown by copying and every pass has the same tensors.

When the pool cannot give a request the pages it needs, ``reserve`` raises ``ResourceExhausted``: the
caller frees idle sessions or refuses the job; memory is never over-committed.
"""

from __future__ import annotations

import torch

from specmesh.errors import InvalidArgument, ResourceExhausted

PAGE_SIZE = 16  # positions per page: a tree's spare slots waste at most one page per request
TRASH_PAGE = 0  # never handed out: padded rows of a shape-stable pass write their K/V here


class KVPool:
    """Pages of keys and values for ``num_layers`` layers: ``k[layer]`` is [slots, kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 budget_bytes: int, page_size: int = PAGE_SIZE) -> None:
        self.page_size = page_size
        self.page_bytes = num_layers * 2 * page_size * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
        self.num_pages = int(budget_bytes // self.page_bytes)
        if self.num_pages < 2:
            raise InvalidArgument("kv_cache_gb", f"{budget_bytes / 2**30:.3g} GiB holds fewer than two pages of "
                                  f"{self.page_bytes / 2**20:.3g} MiB ({page_size} positions of every layer)")
        slots = self.num_pages * page_size
        self.k = torch.zeros(num_layers, slots, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self._free = list(range(self.num_pages - 1, TRASH_PAGE, -1))  # a stack: low pages first

    def move(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy every layer's K/V from slots ``source`` to slots ``target`` ([n] each)."""
        source, target = source.to(self.k.device), target.to(self.k.device)
        for cache in (self.k, self.v):  # index_select copies first: overlapping moves are safe
            cache.index_copy_(1, target, cache.index_select(1, source))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def capacity_pages(self) -> int:
        """Pages a request can ever hold (all but the trash page)."""
        return self.num_pages - 1

    def pages_for(self, positions: int) -> int:
        return -(-positions // self.page_size)

    @property
    def free_bytes(self) -> int:
        return len(self._free) * self.page_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_pages * self.page_bytes

    def extra_bytes(self, session: PagedSession, positions: int) -> int:
        """What ``session`` must take to hold ``positions`` entries."""
        return max(0, self.pages_for(positions) - len(session.pages)) * self.page_bytes

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise ResourceExhausted(f"KV cache full: {count} pages asked for, {len(self._free)} of "
                                    f"{self.capacity_pages} free")
        taken = self._free[len(self._free) - count :]
        del self._free[len(self._free) - count :]
        return taken[::-1]

    def release(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

    def new_session(self, max_length: int) -> PagedSession:
        return PagedSession(self, [], 0, max_length)


class PagedSession:
    """A request's committed K/V in the pool: ``length`` entries in ``pages``, then scratch."""

    def __init__(self, pool: KVPool, pages: list[int], length: int, max_length: int) -> None:
        self.pool = pool
        self.pages = pages
        self.length = length
        self.max_length = max_length

    @property
    def capacity(self) -> int:
        return len(self.pages) * self.pool.page_size

    @property
    def nbytes(self) -> int:
        return len(self.pages) * self.pool.page_bytes

    def reserve(self, extra: int) -> None:
        """Hold pages for ``extra`` entries past the committed ones (``ResourceExhausted`` when the pool
        cannot give them; the session is then unchanged)."""
        needed = self.length + extra
        if needed > self.max_length:
            raise InvalidArgument(
                "max_tokens", f"the request needs {needed} positions but the model's context is {self.max_length}"
            )
        missing = self.pool.pages_for(needed) - len(self.pages)
        if missing > 0:
            self.pages.extend(self.pool.allocate(missing))

    def slots(self, start: int, count: int) -> torch.Tensor:
        """Pool slots of positions ``start .. start + count - 1`` ([count] long, on the CPU)."""
        positions = torch.arange(start, start + count)
        pages = torch.tensor(self.pages, dtype=torch.long)[positions // self.pool.page_size]
        return pages * self.pool.page_size + positions % self.pool.page_size

    def keep_rows(self, rows: list[int]) -> None:
        """Commit the scratch rows ``rows`` (increasing, relative to ``length``), packed into place."""
        if not rows:
            return
        if rows != list(range(len(rows))):  # the accepted path is not already in place
            self.pool.move(self.slots(self.length, rows[-1] + 1)[torch.tensor(rows)], self.slots(self.length, len(rows)))
        self.length += len(rows)
        self._trim()

    def rollback(self, length: int) -> None:
        """Forget every entry from ``length`` on."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: session holds {self.length} entries")
        self.length = length
        self._trim()

    def _trim(self) -> None:
        # keep the committed entries' pages and one spare (the next tree usually fits in it)
        keep = self.pool.pages_for(self.length) + 1
        if len(self.pages) > keep:
            self.pool.release(self.pages[keep:])
            del self.pages[keep:]

    def free(self) -> None:
        self.pool.release(self.pages)
        self.pages = []
        self.length = 0

    def __del__(self) -> None:  # a session dropped without free() gives its pages back too
        if self.pages:
            self.free()
