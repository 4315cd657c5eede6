"""Small read-only device arrays made once and kept across batches: the masks and index tables that every batch of
an iteration would otherwise make again (a dozen kernel launches each, on the host's time).

While an arena serves CuPy, an array made in a batch's scope is gone when the scope closes, so the tables here take
their memory from CuPy's own pool instead, outside the arena (as `gpu.fft_plans`' work areas do), kept per device
and key, a few dozen at a time. Where that pool has no room, the table is made in the current scope and not kept.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

from cryorefine.gpu import DeviceArray

MAX_TABLES = 32
_tables: OrderedDict = OrderedDict()


def kept(key: tuple[Hashable, ...], make: Callable[[], DeviceArray]) -> DeviceArray:
    """The table of `key` on the current device: `make()`'s array, made on first use and kept (do not write to it)."""
    import cupy

    key = (cupy.cuda.runtime.getDevice(), *key)
    table = _tables.get(key)
    if table is not None:
        _tables.move_to_end(key)
        return table
    try:
        with cupy.cuda.using_allocator(cupy.get_default_memory_pool().malloc):
            table = make()
    except cupy.cuda.memory.OutOfMemoryError:  # no room outside the arena: made here, not kept
        return make()
    _tables[key] = table
    while len(_tables) > MAX_TABLES:
        _tables.popitem(last=False)
    return table


def clear() -> None:
    """Drop the kept tables (their memory goes back to CuPy's pool)."""
    _tables.clear()
