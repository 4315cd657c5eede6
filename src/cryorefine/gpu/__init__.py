"""The GPU's side of the engines: the stack allocator, the overlapped uploads, the cuFFT plans and tables kept outside
the arena, device sums and the MPI workers' collectives. CuPy is imported inside the functions that use it, never when
a module is imported."""

from __future__ import annotations

from typing import Any, TypeAlias

#: A CuPy ndarray: named in annotations without importing CuPy.
DeviceArray: TypeAlias = Any
