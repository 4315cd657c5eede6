"""Tests of gpu.allocator: the stack arena's bookkeeping on the CPU, and the CuPy binding on a GPU."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from conftest import cupy_or_skip

from cryorefine.errors import InputError
from cryorefine.gpu.allocator import MB, ArenaOutOfMemory, Block, Scope, StackArena, describe_usage


def _aligned(nbytes, alignment=256):
    return (nbytes + alignment - 1) // alignment * alignment


# -- nesting -----------------------------------------------------------------------------------


def test_scopes_must_nest_global_first():
    arena = StackArena(MB)
    assert arena.current_scope is None
    with pytest.raises(ValueError, match="outside any scope"):
        arena.allocate(10)
    for level in (Scope.ITERATION, Scope.PARTICLE, Scope.ORIENTATION):
        with pytest.raises(ValueError, match="GLOBAL"), arena.scope(level):
            pass
    with arena.scope(Scope.GLOBAL):
        assert arena.current_scope is Scope.GLOBAL
        with pytest.raises(ValueError), arena.scope(Scope.GLOBAL):
            pass
        with arena.scope(Scope.ITERATION), arena.scope(Scope.PARTICLE):
            assert arena.current_scope is Scope.PARTICLE
            for level in (Scope.GLOBAL, Scope.ITERATION, Scope.PARTICLE):
                with pytest.raises(ValueError, match="inside PARTICLE"), arena.scope(level):
                    pass
            with arena.scope(Scope.ORIENTATION):
                with pytest.raises(ValueError), arena.scope(Scope.ORIENTATION):
                    pass
                assert arena.current_scope is Scope.ORIENTATION
            assert arena.current_scope is Scope.PARTICLE
        with arena.scope(Scope.PARTICLE):  # a level may be skipped
            assert arena.current_scope is Scope.PARTICLE
    assert arena.current_scope is None
    with pytest.raises(ValueError, match="outside any scope"):
        arena.allocate(10)
    assert arena.top == 0


def test_scope_exit_on_exception_restores_the_mark():
    arena = StackArena(MB)
    with arena.scope(Scope.GLOBAL):
        arena.allocate(1000)
        mark = arena.top
        with pytest.raises(RuntimeError, match="boom"), arena.scope(Scope.ITERATION):
            arena.allocate(5000)
            raise RuntimeError("boom")
        assert arena.top == mark
        assert arena.current_scope is Scope.GLOBAL


# -- randomised refinement loop ----------------------------------------------------------------


def test_random_iterations_return_to_marks_and_peaks_match():
    rng = np.random.default_rng(20240611)
    arena = StackArena(1 << 30)
    box = 24
    expected_peaks = {level: 0 for level in Scope}
    expected_iteration_peaks = []
    expected_escaped = 0
    with arena.scope(Scope.GLOBAL):
        global_sizes = [int(n) for n in rng.integers(1, 200_000, size=3)]
        for n in global_sizes:
            arena.allocate(n)
        global_total = sum(_aligned(n) for n in global_sizes)
        assert arena.top == global_total
        for _ in range(50):
            mark_it = arena.top
            assert mark_it == global_total
            it_peak = 0
            with arena.scope(Scope.ITERATION):
                it_sizes = [int(n) for n in rng.integers(1, 50_000, size=rng.integers(1, 4))]
                it_blocks = [arena.allocate(n) for n in it_sizes]
                it_total = sum(_aligned(n) for n in it_sizes)
                it_inner = 0
                for _ in range(int(rng.integers(1, 5))):
                    batch = int(rng.integers(1, 65))
                    mark_p = arena.top
                    with arena.scope(Scope.PARTICLE):
                        p_sizes = [batch * box * box * 4, batch * box * box * 8, int(rng.integers(1, 999))]
                        p_blocks = [arena.allocate(n) for n in p_sizes]
                        p_total = sum(_aligned(n) for n in p_sizes)
                        assert arena.top == mark_p + p_total
                        p_inner = 0
                        for _ in range(int(rng.integers(1, 6))):
                            chunk = int(rng.integers(1, 20))
                            mark_o = arena.top
                            with arena.scope(Scope.ORIENTATION):
                                o_sizes = [chunk * batch * box * box * 8, chunk * batch * 4,
                                           int(rng.integers(1, 5000))]
                                o_blocks = [arena.allocate(n) for n in o_sizes]
                                o_aligned = [_aligned(n) for n in o_sizes]
                                assert arena.top == mark_o + sum(o_aligned)
                                arena.release(o_blocks.pop())  # the top one: its space comes back
                                assert arena.top == mark_o + sum(o_aligned[:-1])
                                work = int(rng.integers(1, 100_000))
                                o_blocks.append(arena.allocate(work))
                                chunk_peak = max(sum(o_aligned), sum(o_aligned[:-1]) + _aligned(work))
                                for i in rng.permutation(len(o_blocks)):
                                    arena.release(o_blocks[i])
                                assert arena.top == mark_o
                            assert arena.top == mark_o
                            expected_peaks[Scope.ORIENTATION] = max(expected_peaks[Scope.ORIENTATION],
                                                                    chunk_peak)
                            p_inner = max(p_inner, chunk_peak)
                        # The bottom block of the scope released first: nothing moves.
                        arena.release(p_blocks[0])
                        assert arena.top == mark_p + p_total
                        if rng.random() < 0.3:
                            expected_escaped += len(p_blocks) - 1  # left alive on purpose
                        else:
                            for block in reversed(p_blocks[1:]):
                                arena.release(block)
                            assert arena.top == mark_p
                    assert arena.top == mark_p
                    p_peak = p_total + p_inner
                    expected_peaks[Scope.PARTICLE] = max(expected_peaks[Scope.PARTICLE], p_peak)
                    it_inner = max(it_inner, p_peak)
                for block in it_blocks:
                    arena.release(block)
                it_peak = it_total + it_inner
            assert arena.top == mark_it
            expected_peaks[Scope.ITERATION] = max(expected_peaks[Scope.ITERATION], it_peak)
            expected_iteration_peaks.append(global_total + it_peak)
        expected_peaks[Scope.GLOBAL] = global_total + expected_peaks[Scope.ITERATION]
    assert arena.top == 0
    assert arena.high_water_by_scope() == expected_peaks
    assert arena.high_water_bytes == expected_peaks[Scope.GLOBAL]
    assert arena.iteration_peaks == expected_iteration_peaks
    assert arena.escaped_blocks == expected_escaped + len(global_sizes)
    assert expected_escaped > 0


# -- alignment and sizes -----------------------------------------------------------------------


def test_sizes_are_rounded_up_to_the_alignment():
    arena = StackArena(10_000, alignment=256)
    with arena.scope(Scope.GLOBAL):
        a = arena.allocate(1)
        b = arena.allocate(256)
        c = arena.allocate(257)
        d = arena.allocate(0)
        assert (a.offset, a.size) == (0, 256)
        assert (b.offset, b.size) == (256, 256)
        assert (c.offset, c.size) == (512, 512)
        assert (d.offset, d.size) == (1024, 0)
        assert len({a.serial, b.serial, c.serial, d.serial}) == 4
        assert arena.top == 1024
        assert arena.free_bytes == 10_000 - 1024
        assert arena.fits(8960)               # 8976 bytes left: 8960 is the most that fits
        assert not arena.fits(8961)           # rounds up to 9216
        with pytest.raises(ValueError):
            arena.allocate(-1)
    odd = StackArena(1 << 20, alignment=512)
    with odd.scope(Scope.GLOBAL):
        offsets = [odd.allocate(int(n)).offset for n in np.random.default_rng(0).integers(1, 3000, 20)]
    assert all(o % 512 == 0 for o in offsets)
    assert offsets == sorted(offsets)


# -- deferred release --------------------------------------------------------------------------


def test_release_of_the_top_block_reclaims_space():
    arena = StackArena(MB)
    with arena.scope(Scope.GLOBAL):
        a, b, c = (arena.allocate(1000) for _ in range(3))
        assert (a.offset, b.offset, c.offset, arena.top) == (0, 1024, 2048, 3 * 1024)
        arena.release(c)
        assert arena.top == 2 * 1024
        d = arena.allocate(100)
        assert d.offset == c.offset          # c's bytes are reused
        assert arena.top == 2 * 1024 + 256


def test_release_below_the_top_waits_for_the_blocks_above():
    arena = StackArena(MB)
    with arena.scope(Scope.GLOBAL):
        a, b, c = (arena.allocate(1000) for _ in range(3))
        arena.release(a)
        arena.release(b)
        assert arena.top == 3 * 1024          # c still live on top of them
        arena.release(b)                      # twice: ignored
        assert arena.top == 3 * 1024
        arena.release(c)
        assert arena.top == 0                 # c, then b, then a popped
        arena.release(a)                      # already popped: ignored
        assert arena.top == 0


def test_release_never_goes_below_the_current_scope_mark():
    arena = StackArena(MB)
    with arena.scope(Scope.GLOBAL):
        g = arena.allocate(4096)
        with arena.scope(Scope.ITERATION):
            arena.release(g)                  # g is an outer block: kept while ITERATION is open
            assert arena.top == 4096
            x = arena.allocate(512)
            arena.release(x)
            assert arena.top == 4096
        assert arena.top == 0                 # back in GLOBAL, the released g is popped


def test_stale_block_from_a_closed_scope_is_ignored():
    arena = StackArena(MB)
    with arena.scope(Scope.GLOBAL):
        with arena.scope(Scope.PARTICLE):
            old = arena.allocate(2048)
        assert arena.escaped_blocks == 1
        with arena.scope(Scope.PARTICLE):
            new = arena.allocate(2048)
            assert new.offset == old.offset and new.serial != old.serial
            arena.release(old)                # same offset, other serial: must not free `new`
            assert arena.top == 2048
            assert arena.allocate(256).offset == 2048
            arena.release(Block(new.offset, new.size, new.serial + 1000))  # never allocated
            assert arena.top == 2048 + 256


def test_escaped_blocks_counts_blocks_alive_at_scope_exit():
    arena = StackArena(MB)
    with arena.scope(Scope.GLOBAL):
        with arena.scope(Scope.ITERATION):
            kept = arena.allocate(100)
            with arena.scope(Scope.ORIENTATION):
                arena.allocate(100)
                arena.allocate(100)
                done = arena.allocate(100)
                arena.release(done)
            assert arena.escaped_blocks == 2
            arena.release(kept)
        assert arena.escaped_blocks == 2
        arena.allocate(100)
    assert arena.escaped_blocks == 3


def test_release_during_allocate_is_applied_afterwards(monkeypatch):
    # The garbage collector can free an array (and so release its block) at any Python
    # allocation, e.g. while allocate() builds its Block: that release must wait until the
    # new block is on the stack, or top would drop below it.
    from cryorefine.gpu import allocator

    pending = []

    class CollectingBlock(Block):
        def __init__(self, *args):
            super().__init__(*args)
            while pending:
                arena.release(pending.pop())

    monkeypatch.setattr(allocator, "Block", CollectingBlock)
    arena = StackArena(MB)
    with arena.scope(Scope.GLOBAL):
        a = arena.allocate(256)
        pending.append(a)
        b = arena.allocate(256)               # a released while b is being made
        assert not pending
        assert (b.offset, arena.top) == (256, 512)
        assert arena.allocate(256).offset == 512
        arena.release(b)
        assert arena.top == 768


# -- out of memory -----------------------------------------------------------------------------


def test_out_of_memory_message_and_type():
    arena = StackArena(10 * MB)
    with arena.scope(Scope.GLOBAL):
        arena.allocate(4 * MB)
        with arena.scope(Scope.ITERATION), arena.scope(Scope.PARTICLE):
            assert not arena.fits(8 * MB)
            with pytest.raises(ArenaOutOfMemory) as info:
                arena.allocate(8 * MB)
            err = info.value
            assert arena.top == 4 * MB         # nothing taken
            assert arena.allocate(6 * MB).size == 6 * MB   # still usable
    assert isinstance(err, InputError) and isinstance(err, ValueError)
    assert (err.scope, err.request_bytes, err.in_use_bytes, err.capacity_bytes) == \
        (Scope.PARTICLE, 8 * MB, 4 * MB, 10 * MB)
    msg = str(err)
    assert "\n" not in msg
    for part in ("PARTICLE", "8.00 MB", str(4 * MB), "10.00 MB", "--batch", "--free_gpu_memory"):
        assert part in msg
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == msg and again.scope is Scope.PARTICLE
    whole_box = str(ArenaOutOfMemory(Scope.ITERATION, 8 * MB, 4 * MB, 10 * MB))
    assert "--free_gpu_memory" in whole_box and "--batch does not change" in whole_box


# -- peaks -------------------------------------------------------------------------------------


def test_iteration_peaks_and_reset_peaks():
    arena = StackArena(MB)
    with arena.scope(Scope.GLOBAL):
        arena.allocate(1024)
        for extra in (4096, 1024, 2048):
            with arena.scope(Scope.ITERATION):
                arena.allocate(512)
                with arena.scope(Scope.PARTICLE):
                    arena.allocate(extra)
        assert arena.iteration_peaks == [1024 + 512 + 4096, 1024 + 512 + 1024, 1024 + 512 + 2048]
        assert arena.high_water_bytes == 1024 + 512 + 4096
        assert arena.high_water_by_scope()[Scope.PARTICLE] == 4096
        arena.reset_peaks()
        assert arena.high_water_bytes == 1024
        assert arena.high_water_by_scope() == {Scope.GLOBAL: 1024, Scope.ITERATION: 0,
                                               Scope.PARTICLE: 0, Scope.ORIENTATION: 0}
        with arena.scope(Scope.ITERATION):
            arena.allocate(256)
        assert arena.high_water_bytes == 1024 + 256
        assert arena.high_water_by_scope()[Scope.ITERATION] == 256
        assert len(arena.iteration_peaks) == 4
        line = describe_usage(arena)
    assert "\n" not in line
    assert "GLOBAL" in line and "ORIENTATION" in line and "1.00 MB" in line


# -- CuPy ----------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_device_arena_refinement_loop():
    cp = cupy_or_skip()
    from cryorefine.gpu.allocator import DeviceArena

    rng = np.random.default_rng(7)
    box = 32
    arena = DeviceArena(0, capacity_bytes=256 * MB)
    previous_allocator = cp.cuda.get_allocator()
    plan_cache_size = cp.fft.config.get_plan_cache().get_size()
    try:
        assert arena.capacity_bytes == 256 * MB and arena.top == 0
        with arena.installed(), arena.scope(Scope.GLOBAL):
            assert cp.fft.config.get_plan_cache().get_size() == 0
            reference = cp.full((box, box), 7.0, dtype=cp.float32)
            assert arena.ptr <= reference.data.ptr < arena.ptr + arena.capacity_bytes
            for it in range(50):
                mark_it = arena.top
                with arena.scope(Scope.ITERATION):
                    known = cp.full((64, 64), float(it), dtype=cp.float32)
                    sums = cp.zeros((box, box), dtype=cp.float64)
                    want_sums = np.zeros((box, box))
                    for _ in range(int(rng.integers(1, 4))):
                        batch = int(rng.integers(1, 48))
                        host = rng.normal(size=(batch, box, box)).astype(np.float32)
                        mark_p = arena.top
                        with arena.scope(Scope.PARTICLE):
                            images = cp.asarray(host)
                            spectra = cp.fft.fft2(images)
                            for chunk in range(int(rng.integers(1, 4))):
                                mark_o = arena.top
                                with arena.scope(Scope.ORIENTATION):
                                    scaled = cp.fft.fft2(images * (chunk + 1.0))
                                    diff = float(cp.abs(scaled - spectra * (chunk + 1.0)).max())
                                    assert diff < 1e-3 * (chunk + 1) * box * box
                                    del scaled
                                assert arena.top == mark_o
                            power = cp.abs(spectra) ** 2
                            sums += power.sum(axis=0)
                            del images, spectra, power
                        assert arena.top == mark_p
                        want_sums += (np.abs(np.fft.fft2(host.astype(np.float64))) ** 2).sum(axis=0)
                    np.testing.assert_allclose(cp.asnumpy(sums), want_sums, rtol=1e-4)
                    assert float(known.min()) == float(known.max()) == float(it)
                    del known, sums
                assert arena.top == mark_it
            assert float(reference.min()) == float(reference.max()) == 7.0
            with arena.scope(Scope.ITERATION), pytest.raises(ArenaOutOfMemory, match="ITERATION"):
                cp.empty(300 * MB // 4, dtype=cp.float32)
            del reference
        assert arena.top == 0
        assert arena.high_water_bytes > 0
        assert arena.escaped_blocks == 0
        assert len(arena.iteration_peaks) == 51
        assert "GLOBAL" in describe_usage(arena)
        assert cp.cuda.get_allocator() == previous_allocator
        assert cp.fft.config.get_plan_cache().get_size() == plan_cache_size
    finally:
        arena.close()
    assert arena.ptr == 0


@pytest.mark.gpu
def test_device_arena_too_large_a_reserve():
    cupy_or_skip()
    from cryorefine.gpu.allocator import DeviceArena

    with pytest.raises(ArenaOutOfMemory, match="free_gpu_memory"):
        DeviceArena(0, free_gpu_memory_mb=1e9)


@pytest.mark.gpu
def test_cupy_s_own_out_of_memory_errors_are_named_as_the_gpu_s_memory():
    """CuPy's two ways of saying the device has no room (its pool's OutOfMemoryError; a CUDA call's
    cudaErrorMemoryAllocation) are what `errors.gpu_memory_message` recognises, and another CUDA error is not."""
    cp = cupy_or_skip()
    from cryorefine.errors import gpu_memory_message

    free, total = cp.cuda.runtime.memGetInfo()
    with pytest.raises(cp.cuda.memory.OutOfMemoryError) as too_big:
        cp.cuda.MemoryPool().malloc(total + free)  # more than the device has, through a pool as CuPy's arrays ask
    assert "another process may hold that GPU's memory" in gpu_memory_message(too_big.value)
    with pytest.raises(cp.cuda.runtime.CUDARuntimeError) as no_room:
        cp.cuda.Memory(total + free)  # cudaMalloc itself, as the CUDA context's creation fails
    assert gpu_memory_message(no_room.value) is not None
    with pytest.raises(cp.cuda.runtime.CUDARuntimeError) as other:
        cp.cuda.runtime.setDevice(cp.cuda.runtime.getDeviceCount())  # a device that does not exist
    assert gpu_memory_message(other.value) is None
