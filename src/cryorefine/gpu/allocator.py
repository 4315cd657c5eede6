"""Stack-based device memory: one arena per GPU, freed scope by scope.

Each GPU gets one arena, a single device allocation sized at start-up from the free memory
minus a reserve (``--free_gpu_memory``, in MB). Inside it, memory is handed out like a stack:
an allocation takes the bytes at ``top`` and moves ``top`` up. Allocations belong to nested
scopes, one per lifetime in the refinement loop::

    GLOBAL       things kept for the whole run (few: each step of an iteration opens ITERATION)
    ITERATION    an engine's set-up (sums, references and projector data, cached slices), upload slots
    PARTICLE     one batch of particles: images, CTFs, shifted copies
    ORIENTATION  one chunk of orientations: projections, differences, FFT work areas

A scope remembers ``top`` when it is entered (its *mark*). Leaving it sets ``top`` back to
that mark, which frees everything allocated in it at once. There is no free list and no
search: the arena cannot fragment, and a loop that runs the same scopes again and again uses
the same bytes again and again.

Scopes must nest: GLOBAL first, then each new scope deeper than the one open now (deeper
levels may be skipped). Entering a level at or above the current one is a ValueError, and so
is an allocation with no scope open.

Deferred pop. Code inside a scope (CuPy temporaries, most of all) also frees blocks one by
one. ``release`` marks a block released; while the topmost live block of the current scope is
released, it is popped and ``top`` goes down to its offset. A released block under a live one
keeps its bytes until everything above it is released too, or until its scope ends. A release
never lowers ``top`` below the current scope's mark: a released block of an outer scope is
popped later, once that scope is current again. A block whose scope has already ended is no
longer on the stack (blocks are told apart by serial number, not by offset), and releasing it
changes nothing, even if a newer block now has the same offset.

The rule that keeps this correct: an array must not outlive its scope. Once a scope has ended
its bytes belong to the next allocation, so an array kept past its scope (returned from the
``with`` block, kept in a cache, in a traceback) reads and writes memory that is someone
else's. Results that must survive are copied into a buffer of an outer scope, or to the host,
before the scope ends. ``escaped_blocks`` counts the blocks still not released when their scope
ended: in tests it should stay 0. Long-lived CuPy objects that hold device memory (random
generators, FFT plans) are made in the GLOBAL scope or outside ``DeviceArena.installed``;
``installed`` turns CuPy's cuFFT plan cache off for that reason.

StackArena holds the bookkeeping alone (offsets, no device), so it is tested on the CPU and
serves there as a fake device arena. DeviceArena adds the GPU allocation and the CuPy
allocator hook; CuPy is imported only when one is made.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from cryorefine.errors import InputError

MB = 2**20

__all__ = ["ArenaOutOfMemory", "Block", "DeviceArena", "Scope", "StackArena", "describe_usage", "free_device_bytes"]


class Scope(enum.IntEnum):
    """Lifetimes of device memory, outermost first."""

    GLOBAL = 0
    ITERATION = 1
    PARTICLE = 2
    ORIENTATION = 3


def _mb(nbytes: int) -> str:
    return f"{nbytes / MB:.2f}"


class ArenaOutOfMemory(InputError):
    """An allocation does not fit in the arena: too much work per batch for the GPU's budget."""

    def __init__(self, scope: Scope, request_bytes: int, in_use_bytes: int, capacity_bytes: int,
                 message: str | None = None):
        self.scope = Scope(scope)
        self.request_bytes = int(request_bytes)
        self.in_use_bytes = int(in_use_bytes)
        self.capacity_bytes = int(capacity_bytes)
        if message is None:
            message = (f"GPU memory arena full in the {self.scope.name} scope: a request of "
                       f"{_mb(self.request_bytes)} MB does not fit, {self.in_use_bytes} bytes "
                       f"({_mb(self.in_use_bytes)} MB) already in use of the "
                       f"{_mb(self.capacity_bytes)} MB arena budget; " + _out_of_memory_advice(self.scope))
        super().__init__(message)

    def __reduce__(self):
        # Keeps the exception picklable (it may travel between MPI ranks).
        return (type(self), (self.scope, self.request_bytes, self.in_use_bytes,
                             self.capacity_bytes, str(self)))


def _out_of_memory_advice(scope):
    """What to change: per-batch work (PARTICLE, ORIENTATION scopes) shrinks with --batch; the references and
    reconstructions of the padded box (GLOBAL, ITERATION) do not."""
    if Scope(scope) >= Scope.PARTICLE:
        return "lower --batch or raise the arena by lowering --free_gpu_memory"
    return ("the padded box's references and reconstructions need more: raise the arena by lowering "
            "--free_gpu_memory, or run on a GPU with more memory (--batch does not change this part)")


@dataclass(frozen=True)
class Block:
    """One allocation: bytes [offset, offset + size) of the arena; serial is unique per arena."""

    offset: int
    size: int
    serial: int


@dataclass
class _Frame:
    """An open scope."""

    level: Scope
    mark: int       # top when the scope was entered
    start: int      # index in the live stack of the scope's first block
    peak_top: int   # highest top seen while the scope was open


class StackArena:
    """The arena's bookkeeping, without a device: offsets only.

    Attributes: ``capacity_bytes``, ``alignment``, ``top`` (bytes in use, read-only),
    ``high_water_bytes`` (peak of ``top`` since the last ``reset_peaks``), ``iteration_peaks``
    (peak ``top`` of each ITERATION scope, appended when it ends; kept across
    ``reset_peaks``) and ``escaped_blocks`` (blocks not released when their scope ended).
    """

    def __init__(self, capacity_bytes: int, alignment: int = 256):
        if alignment <= 0:
            raise ValueError(f"alignment must be positive, got {alignment}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity must not be negative, got {capacity_bytes}")
        self.capacity_bytes = int(capacity_bytes)
        self.alignment = int(alignment)
        self.high_water_bytes = 0
        self.iteration_peaks: list[int] = []
        self.escaped_blocks = 0
        self._top = 0
        self._next_serial = 0
        self._frames: list[_Frame] = []
        self._stack: list[Block] = []          # live blocks, bottom to top
        self._live: dict[int, Block] = {}      # serial -> live block
        self._released: set[int] = set()       # serials of live blocks already released
        self._peaks = {level: 0 for level in Scope}
        # Releases can arrive from the garbage collector at any Python allocation, also in the
        # middle of allocate() or of a scope's exit; those are queued and applied afterwards.
        self._busy = False
        self._pending: list[Block] = []

    # -- state -------------------------------------------------------------------------------

    @property
    def top(self) -> int:
        """Bytes in use: the offset where the next allocation starts."""
        return self._top

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self._top

    @property
    def current_scope(self) -> Scope | None:
        return self._frames[-1].level if self._frames else None

    def aligned(self, nbytes: int) -> int:
        """nbytes rounded up to a multiple of the alignment."""
        return -(-int(nbytes) // self.alignment) * self.alignment

    def fits(self, nbytes: int) -> bool:
        """Whether an allocation of nbytes would succeed now."""
        return self.aligned(nbytes) <= self.free_bytes

    # -- scopes ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def scope(self, level: Scope) -> Iterator[StackArena]:
        """Open a scope deeper than the current one; on exit, top returns to its mark."""
        level = Scope(level)
        current = self.current_scope
        if current is None and level != Scope.GLOBAL:
            raise ValueError(f"the first scope must be GLOBAL, not {level.name}")
        if current is not None and level <= current:
            raise ValueError(f"cannot open a {level.name} scope inside {current.name}: scopes "
                             "nest GLOBAL > ITERATION > PARTICLE > ORIENTATION")
        frame = _Frame(level, self._top, len(self._stack), self._top)
        self._frames.append(frame)
        try:
            yield self
        finally:
            self._close(frame)

    def _close(self, frame: _Frame) -> None:
        if not self._frames or self._frames[-1] is not frame:
            raise RuntimeError(f"{frame.level.name} scope closed out of order")
        self._busy = True
        try:
            ending = self._stack[frame.start:]
            for block in ending:
                if block.serial not in self._released:
                    self.escaped_blocks += 1
                self._released.discard(block.serial)
                del self._live[block.serial]
            del self._stack[frame.start:]
            self._top = frame.mark
            self._frames.pop()
            if frame.level == Scope.ITERATION:
                self.iteration_peaks.append(frame.peak_top)
        finally:
            self._settle()

    # -- allocation --------------------------------------------------------------------------

    def allocate(self, nbytes: int) -> Block:
        """Take nbytes (rounded up to the alignment) at the top, for the current scope."""
        if nbytes < 0:
            raise ValueError(f"cannot allocate a negative size ({nbytes} bytes)")
        if not self._frames:
            raise ValueError("allocation outside any scope: open a GLOBAL scope first")
        size = self.aligned(nbytes)
        self._busy = True
        try:
            if size > self.capacity_bytes - self._top:
                raise ArenaOutOfMemory(self._frames[-1].level, size, self._top, self.capacity_bytes)
            block = Block(self._top, size, self._next_serial)
            self._next_serial += 1
            self._stack.append(block)
            self._live[block.serial] = block
            self._top += size
            self._record_peaks()
        finally:
            self._settle()
        return block

    def release(self, block: Block) -> None:
        """Mark a block released and pop released blocks off the top of the current scope.

        A block whose scope has ended, or that was already released, is ignored.
        """
        self._pending.append(block)
        if not self._busy:
            self._busy = True
            self._settle()

    def _settle(self) -> None:
        """Apply queued releases, pop what they free, and leave the busy state."""
        while self._pending:
            block = self._pending.pop()
            if self._live.get(block.serial) == block:
                self._released.add(block.serial)
        start = self._frames[-1].start if self._frames else 0
        while len(self._stack) > start and self._stack[-1].serial in self._released:
            popped = self._stack.pop()
            self._released.discard(popped.serial)
            del self._live[popped.serial]
            self._top = popped.offset
        self._busy = False

    # -- peaks -------------------------------------------------------------------------------

    def _record_peaks(self) -> None:
        top = self._top
        self.high_water_bytes = max(self.high_water_bytes, top)
        for frame in self._frames:
            frame.peak_top = max(frame.peak_top, top)
            self._peaks[frame.level] = max(self._peaks[frame.level], top - frame.mark)

    def high_water_by_scope(self) -> dict[Scope, int]:
        """Per level, the peak of (top - that level's mark) while it was open (0 if never)."""
        return dict(self._peaks)

    def reset_peaks(self) -> None:
        """Start a new measuring window for high_water_bytes and high_water_by_scope.

        The window starts from what is in use now; iteration_peaks is kept.
        """
        self._peaks = {level: 0 for level in Scope}
        self.high_water_bytes = self._top
        for frame in self._frames:
            self._peaks[frame.level] = self._top - frame.mark


class _BlockOwner:
    """Owner of one CuPy memory view: gives the block back when CuPy drops the view."""

    __slots__ = ("arena", "block")

    def __init__(self, arena: StackArena, block: Block):
        self.arena = arena
        self.block = block

    def __del__(self):
        self.arena.release(self.block)


class DeviceArena(StackArena):
    """A StackArena over one cudaMalloc'd region of a GPU, usable as CuPy's allocator.

    The capacity is ``capacity_bytes`` when given, otherwise the device's free memory (after
    CuPy's default pool has given back its cached blocks) minus ``free_gpu_memory_mb`` MB,
    which stays free for cuFFT, cuBLAS and the CUDA context. A device ``shared_by`` several
    processes (MPI workers on one GPU) gives each at most 1/shared_by of its total memory, less
    their reserves.
    """

    def __init__(self, device_id: int = 0, free_gpu_memory_mb: float = 0.0,
                 capacity_bytes: int | None = None, alignment: int = 256, shared_by: int = 1):
        import cupy

        self.device_id = int(device_id)
        self._memory = None
        self._pools: list[Any] = []  # the `pooled` pools open now, innermost last (`_Pooled`)
        with cupy.cuda.Device(self.device_id):
            cupy.get_default_memory_pool().free_all_blocks()
            free, total = cupy.cuda.runtime.memGetInfo()
            if capacity_bytes is None:
                capacity_bytes = int(free - free_gpu_memory_mb * MB)
                if shared_by > 1:  # an equal share of the card for each process on it, whoever starts first
                    capacity_bytes = min(capacity_bytes, int((total - shared_by * free_gpu_memory_mb * MB) / shared_by))
            capacity_bytes = int(capacity_bytes) // alignment * alignment
            if capacity_bytes <= 0:
                raise ArenaOutOfMemory(
                    Scope.GLOBAL, 0, 0, max(capacity_bytes, 0),
                    message=(f"no GPU memory arena on device {self.device_id}: {_mb(free)} MB free "
                             f"minus --free_gpu_memory {free_gpu_memory_mb:g} MB leaves "
                             f"{_mb(capacity_bytes)} MB; lower --free_gpu_memory or free memory "
                             "on that GPU"))
            super().__init__(capacity_bytes, alignment)
            try:
                self._memory = cupy.cuda.Memory(capacity_bytes)
            except (cupy.cuda.runtime.CUDARuntimeError, cupy.cuda.memory.OutOfMemoryError):
                raise ArenaOutOfMemory(
                    Scope.GLOBAL, capacity_bytes, 0, capacity_bytes,
                    message=(f"cannot reserve a {_mb(capacity_bytes)} MB GPU memory arena on "
                             f"device {self.device_id} ({_mb(free)} MB free); raise "
                             "--free_gpu_memory to make the arena smaller")) from None

    @property
    def ptr(self) -> int:
        """Device address of the arena's first byte (0 once closed)."""
        return 0 if self._memory is None else int(self._memory.ptr)

    def malloc(self, nbytes: int):
        """Allocate in the current scope; the returned MemoryPointer releases the block when
        CuPy drops it (the bytes come back once the block is on top, or at the scope's end).

        A request of 0 bytes gets a null pointer outside the arena, as from CuPy's own pool: a
        zero-size pointer into the arena shares its address with the next allocation, and
        cuFFT fails (CUFFT_EXEC_FAILED) when a plan's empty work area is such a pointer.
        """
        import cupy

        if self._memory is None:
            raise ValueError("the arena is closed")
        if nbytes == 0:
            return cupy.cuda.MemoryPointer(cupy.cuda.Memory(0), 0)
        block = self.allocate(nbytes)
        memory = cupy.cuda.UnownedMemory(self._memory.ptr + block.offset, block.size,
                                         _BlockOwner(self, block), self.device_id)
        return cupy.cuda.MemoryPointer(memory, 0)

    @contextlib.contextmanager
    def installed(self) -> Iterator[DeviceArena]:
        """Make this arena CuPy's allocator, with the cuFFT plan cache off, until exit.

        A cached cuFFT plan would keep its work area from a closed scope and write into
        bytes that were given to someone else, so plans are not cached meanwhile.
        """
        import cupy
        import cupy.fft

        with cupy.cuda.Device(self.device_id):
            cache = cupy.fft.config.get_plan_cache()
            old_cache_size = cache.get_size()
            previous = cupy.cuda.get_allocator()
            cache.set_size(0)
            cupy.cuda.set_allocator(self.malloc)
            try:
                yield self
            finally:
                cupy.cuda.set_allocator(previous)
                cache.set_size(old_cache_size)

    @contextlib.contextmanager
    def pooled(self) -> Iterator[DeviceArena]:
        """Serve CuPy from a caching pool whose chunks come from this arena's current scope, until exit.

        For code with many large temporaries freed out of order (the M-step's reconstruction):
        the pool reuses freed blocks where the stack could only pop its top. On exit the
        pool's unused chunks go back to the arena (and so to the stack once on top); arrays
        still alive keep theirs until they are dropped, as with any arena block.
        """
        import cupy

        pool = cupy.cuda.MemoryPool(self.malloc)
        previous = cupy.cuda.get_allocator()
        cupy.cuda.set_allocator(pool.malloc)
        self._pools.append(pool)
        try:
            yield self
        finally:
            self._pools.pop()
            cupy.cuda.set_allocator(previous)
            pool.free_all_blocks()

    def release_pooled(self) -> None:
        """The innermost `pooled` pool's unused blocks back to the arena (they are popped once on top): for
        memory freed below them, e.g. a large array moved to the host, to be usable again."""
        if self._pools:
            self._pools[-1].free_all_blocks()

    def close(self) -> None:
        """Free the device allocation. Every array from the arena must be gone by then."""
        self._memory = None


def free_device_bytes(arena: StackArena | None) -> int:
    """Bytes free for a run on the current device now: the arena's, else the device's and CuPy's default pool's."""
    if arena is not None:
        return arena.free_bytes
    import cupy

    free, _ = cupy.cuda.runtime.memGetInfo()
    return free + cupy.get_default_memory_pool().free_bytes()


def describe_usage(arena: StackArena) -> str:
    """One line for the logs: the arena's size, in use, and high water overall and per scope."""
    per_scope = ", ".join(f"{level.name} {_mb(peak)}" for level, peak in
                          arena.high_water_by_scope().items())
    return (f"GPU arena {_mb(arena.capacity_bytes)} MB: in use {_mb(arena.top)} MB, "
            f"high water {_mb(arena.high_water_bytes)} MB ({per_scope} MB)")
