"""Page pool bookkeeping: free list, reference counts, page tables, width buckets, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from stare_jax.sampling.paged_kv import PagePool, PagesExhausted, page_table, pages_for, width_bucket


def test_alloc_share_release_round_trip():
    pool = PagePool(6)
    assert pool.num_free == 5 and pool.num_used == 0
    a = pool.alloc(3)
    assert a == [1, 2, 3] and 0 not in a  # page 0 (trash) is never handed out
    pool.share(a[:2])  # a second owner of two prefix pages
    pool.release(a)
    assert pool.num_free == 3 and pool.refs_N[1] == 1 and pool.refs_N[3] == 0
    pool.release(a[:2])
    assert pool.all_free() and pool.peak_used == 3


def test_exhaustion_is_clear_and_atomic():
    pool = PagePool(4)
    pool.alloc(2)
    with pytest.raises(PagesExhausted, match="sampling.engine.num_pages"):
        pool.alloc(2)
    assert pool.num_free == 1  # nothing was taken by the failed call


def test_bad_use_raises():
    with pytest.raises(ValueError, match="num_pages must be >= 2"):
        PagePool(1)
    pool = PagePool(4)
    with pytest.raises(ValueError, match="not allocated"):
        pool.release([2])
    with pytest.raises(ValueError, match="sharing a free page"):
        pool.share([1])
    with pytest.raises(ValueError, match="more than the table width"):
        page_table([[1, 2, 3]], 2)


def test_page_table_and_buckets():
    table = page_table([[4, 2], [], [7]], 4)
    np.testing.assert_array_equal(table, [[4, 2, 0, 0], [0, 0, 0, 0], [7, 0, 0, 0]])
    assert table.dtype == np.int32
    assert [pages_for(n, 4) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
    assert [width_bucket(n, 16) for n in (0, 1, 3, 5, 16)] == [1, 1, 4, 8, 16]
    assert width_bucket(9, 10) == 10 and width_bucket(11, 10) == 11  # capped at the context; beyond: exact


def test_prefill_width_is_a_power_of_two_bucket_of_the_longest_chunk():
    """A prefill call's row width: at least 32, the power of two covering its longest chunk, at most prefill_chunk
    (33-64-token prompts take 64 columns, not 256); the engine, its AOT trace and the plan all use this rule."""
    from stare_jax.config.engine import EngineConfig

    ec = EngineConfig(prefill_chunk=256)
    assert [ec.prefill_width(n) for n in (1, 32, 33, 64, 65, 200, 256, 9216)] == [32, 32, 64, 64, 128, 256, 256, 256]
    assert EngineConfig(prefill_chunk=20).prefill_width(5) == 20  # a chunk below 32 caps it
    assert EngineConfig(prefill_chunk=100).prefill_width(70) == 100  # not a power of two: capped there
