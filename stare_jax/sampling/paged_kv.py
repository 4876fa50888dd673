"""Host-side bookkeeping of the paged KV cache: the free list, reference counts and page tables.

The device pool itself (per layer k/v [K, num_pages, page_size, Dh]: paged_attention.pool_shape) is created by
stare_jax.models.paged_attention.init_pages and only ever touched by jitted programs; this module decides which
physical page holds which tokens. Page 0 is reserved as the trash page (never allocated). A page's reference
count is the number of owners (sequences, or a prompt's prefix entry while its samples are being admitted);
only full pages of a prompt prefix are ever shared, so no two sequences write to the same page.
"""

from __future__ import annotations

import numpy as np

from stare_jax.models.paged_attention import TRASH_PAGE


class PagesExhausted(RuntimeError):
    """The page pool has fewer free pages than a request needs (raise sampling.engine.num_pages)."""


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold num_tokens tokens."""
    return -(-max(int(num_tokens), 0) // int(page_size))


class PagePool:
    """Free list + reference counts over physical pages 1..num_pages-1 (page 0 is the trash page)."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"sampling.engine.num_pages must be >= 2 (page 0 is the trash page), got {num_pages}")
        self.num_pages = int(num_pages)
        self.refs_N = np.zeros((num_pages,), np.int32)
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low page ids first
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - len(self._free)

    def alloc(self, n: int) -> list[int]:
        """n fresh pages with one reference each; PagesExhausted (nothing allocated) if fewer are free."""
        if n > len(self._free):
            raise PagesExhausted(
                f"{n} pages needed, {len(self._free)} free of {self.num_pages - 1}: raise sampling.engine.num_pages"
            )
        out = [self._free.pop() for _ in range(n)]
        self.refs_N[out] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return out

    def share(self, pages) -> None:
        """One more owner for each page (prefix sharing)."""
        pages = list(pages)
        if any(self.refs_N[p] <= 0 for p in pages):
            raise ValueError(f"sharing a free page: {[p for p in pages if self.refs_N[p] <= 0]}")
        np.add.at(self.refs_N, pages, 1)

    def release(self, pages) -> None:
        """One owner fewer for each page; pages nobody owns go back to the free list."""
        for p in pages:
            if p == TRASH_PAGE or self.refs_N[p] <= 0:
                raise ValueError(f"releasing page {p}, which is not allocated")
            self.refs_N[p] -= 1
            if self.refs_N[p] == 0:
                self._free.append(p)

    def all_free(self) -> bool:
        """Every page back on the free list with no owner (after a complete engine call)."""
        return len(self._free) == self.num_pages - 1 and not np.any(self.refs_N)


def page_table(rows: list[list[int]], width: int) -> np.ndarray:
    """[len(rows), width] int32 page table, unused entries pointing at the trash page."""
    out = np.full((len(rows), width), TRASH_PAGE, np.int32)
    for r, pages in enumerate(rows):
        if len(pages) > width:
            raise ValueError(f"row {r} has {len(pages)} pages, more than the table width {width}")
        out[r, : len(pages)] = pages
    return out


def width_bucket(num_pages: int, cap: int) -> int:
    """Page-table width for a call: the next power of two >= num_pages (at least 1), at most cap, so the
    number of compiled programs is logarithmic in the context while attention reads about the live pages.
    Not 1.5x steps (tried twice, ~6% faster CPU greedy decode in paired runs): with them the full test suite
    segfaults inside jaxlib 0.10.2's executable serialization when the persistent compilation cache is on (5 of 5
    full runs, tests/unit/tools/test_rollout.py's decode programs; with powers of two 1 of 1 full cached run passes),
    and
    `stare-jax compare` runs with that cache. The decode step narrows its own read inside the program instead
    (models.paged_attention.over_live_pages: the fewest of 1/2 ... 7/8 or all of this width)."""
    n = max(int(num_pages), 1)
    return min(1 << (n - 1).bit_length(), int(cap)) if n <= cap else n
