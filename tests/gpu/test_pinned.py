"""gpu.pinned: page-locked blocks made ahead are there for the first requests of their size."""

from __future__ import annotations

import threading
import time

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
    assert ahead.wait() is None  # nothing run first
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
    tic = time.perf_counter()
    assert ahead.wait() is None
    assert time.perf_counter() - tic < 0.1
    assert ahead.made_bytes == 0


def test_the_first_step_runs_on_the_thread_before_the_blocks_on_a_stream_of_its_own():
    cp = cupy_or_skip()
    pool = cp.get_default_pinned_memory_pool()
    pool.free_all_blocks()
    seen = {}

    def first():
        seen["thread"] = threading.current_thread().name
        seen["stream"] = cp.cuda.get_current_stream().ptr
        seen["blocks_before"] = pool.n_free_blocks()
        return "made"

    size = MIN_BLOCK_BYTES + 8192
    ahead = PinnedAhead([size], first=first)
    assert ahead.wait() == "made"
    assert seen["thread"] != threading.current_thread().name
    assert seen["stream"] not in (0, cp.cuda.get_current_stream().ptr)  # not the caller's, nor the legacy default
    assert seen["blocks_before"] == 0 and pool.n_free_blocks() == 1 and ahead.made_bytes == size
    pool.free_all_blocks()


def test_a_failure_of_the_first_step_is_raised_by_wait_and_the_blocks_are_still_made():
    cupy_or_skip()

    def first():
        raise RuntimeError("NCCL could not connect")

    size = MIN_BLOCK_BYTES + 12288
    ahead = PinnedAhead([size], first=first)
    with pytest.raises(RuntimeError, match="NCCL could not connect"):
        ahead.wait()
    assert ahead.made_bytes == size
