"""gpu.pinned: page-locked blocks made ahead are there for the first requests of their size."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import cupy_or_skip

from cryorefine.gpu.pinned import MIN_BLOCK_BYTES, PinnedAhead

pytestmark = pytest.mark.gpu


def test_blocks_made_ahead_serve_the_next_requests_of_their_size_without_new_blocks():
    cp = cupy_or_skip()
    import cupyx

    pool = cp.get_default_pinned_memory_pool()
    pool.free_all_blocks()
    size = MIN_BLOCK_BYTES + 4096  # a size no other test asks for
    ahead = PinnedAhead([size, size, size, 1024])  # the small one is left out
    assert ahead.wait() >= 0.0
    assert ahead.failure is None
    assert ahead.made_bytes == 3 * size
    assert pool.n_free_blocks() == 3
    taken = [cupyx.empty_pinned(size, dtype=np.uint8) for _ in range(3)]
    assert pool.n_free_blocks() == 0  # all three came from the blocks made ahead
    taken[0][:] = 7  # and they are host memory the caller may write
    assert int(taken[0][-1]) == 7
    del taken
    assert pool.n_free_blocks() == 3
    pool.free_all_blocks()


def test_nothing_to_make_waits_for_nothing():
    cupy_or_skip()
    ahead = PinnedAhead([1024, 0])
    assert ahead.sizes == []
    assert ahead.wait() < 0.1
    assert ahead.made_bytes == 0
