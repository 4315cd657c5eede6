"""Device objects made once and kept across batches and iterations, outside the arena: cuFFT plans (`gpu.fft_plans`)
and small read-only tables that every batch would otherwise make again (the images' mask, each coefficient's
shell: a dozen kernel launches each, on the host's time).

While an arena serves CuPy, whatever a batch's scope allocates is gone when the scope closes, so a `KeptObjects`
makes its objects with CuPy's own pool as the allocator instead: their memory comes from outside the arena (what
--free_gpu_memory leaves), kept per device and key, the last `max_kept` used. Where that pool has no room, `get`
says so and the caller makes the object in the current scope, not kept. `clear_all` drops every kind's objects as a
GPU run ends (`estep.backend.CudaBackend.run_scope`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Any

from cryorefine.gpu import DeviceArray


class KeptObjects:
    """Objects of one kind kept per (device, key), the `max_kept` last used."""

    _every: list[KeptObjects] = []  # every instance, for `clear_all`

    def __init__(self, max_kept: int) -> None:
        self.max_kept = int(max_kept)
        self._objects: OrderedDict = OrderedDict()
        KeptObjects._every.append(self)

    def get(self, key: tuple[Hashable, ...], make: Callable[[], Any],
            no_room: tuple[type[BaseException], ...] = ()) -> Any | None:
        """The object of `key` on the current device: `make()`'s, made on first use with its memory from CuPy's pool
        and kept; None where that pool has no room for it (CuPy's OutOfMemoryError, or one of `no_room`, raised by
        `make`)."""
        import cupy

        key = (cupy.cuda.runtime.getDevice(), *key)
        kept = self._objects.get(key)
        if kept is not None:
            self._objects.move_to_end(key)
            return kept
        try:
            with cupy.cuda.using_allocator(cupy.get_default_memory_pool().malloc):
                kept = make()
        except (cupy.cuda.memory.OutOfMemoryError, *no_room):
            return None
        self._objects[key] = kept
        while len(self._objects) > self.max_kept:
            self._objects.popitem(last=False)
        return kept

    def clear(self) -> None:
        """Drop the kept objects (their memory goes back to CuPy's pool)."""
        self._objects.clear()

    def keys(self) -> Iterator[tuple[Hashable, ...]]:
        """The kept objects' (device, key), the least recently used first."""
        return iter(list(self._objects))

    def __len__(self) -> int:
        return len(self._objects)


#: the small read-only tables (`table`)
TABLES = KeptObjects(32)


def table(key: tuple[Hashable, ...], make: Callable[[], DeviceArray]) -> DeviceArray:
    """The table of `key` on the current device: `make()`'s array, made on first use and kept where CuPy's pool has
    room, else made now in the current scope (do not write to it)."""
    kept = TABLES.get(key, make)
    return make() if kept is None else kept


def clear_all() -> None:
    """Drop the kept objects of every kind."""
    for objects in KeptObjects._every:
        objects.clear()
