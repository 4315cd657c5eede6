"""The GPU's side of the engines: the stack allocator, the overlapped uploads, the cuFFT plans and tables kept outside
the arena, device sums, the MPI workers' collectives and the page-locked host blocks they make ahead for the maps.
CuPy is imported inside the functions that use it, never when a module is imported."""

from __future__ import annotations

from typing import Any, TypeAlias

#: A CuPy ndarray: named in annotations without importing CuPy.
DeviceArray: TypeAlias = Any
