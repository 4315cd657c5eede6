"""The one exception type for bad input (the CLI prints its message as one line and exits 2), the line for an
output that did not fit on its disk and the line for a GPU whose memory ran out outside the arena, which one process
and an MPI job both print, and a run stopped by Ctrl-C or SIGTERM."""

from __future__ import annotations

import errno
import sys

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # an output that did not fit: the user's to fix, not ours


class InputError(ValueError):
    """Bad user input: the message names the file, the column or value, and what to do."""


def disk_full_message(exc: BaseException) -> str | None:
    """What to tell the user when `exc` is a full disk (or quota) met while writing, else None."""
    if not isinstance(exc, OSError) or exc.errno not in DISK_FULL_ERRNOS:
        return None
    where = f" writing {exc.filename}" if exc.filename else ""
    return (f"no space left on the device{where}: free space where the run writes (--o), then carry on from its "
            "last complete iteration with --continue (its _optimiser.star)")


CUDA_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation, CUDARuntimeError.status


def gpu_memory_message(exc: BaseException) -> str | None:
    """What to tell the user when `exc` is the GPU's memory running out outside the arena (CuPy's OutOfMemoryError,
    or a CUDA call failing with cudaErrorMemoryAllocation, as the CUDA context's creation does on a GPU another
    process has filled), else None. Only where CuPy was imported: without it there was no GPU."""
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return None
    out_of_memory = isinstance(exc, cupy.cuda.memory.OutOfMemoryError) or (
        isinstance(exc, cupy.cuda.runtime.CUDARuntimeError) and getattr(exc, "status", None) == CUDA_MEMORY_ALLOCATION)
    if not out_of_memory:
        return None
    return (f"the GPU's memory ran out outside cryorefine's arena ({exc}): another process may hold that GPU's memory "
            "(nvidia-smi lists them); run on a free GPU (--gpu), or raise --free_gpu_memory to leave more of it "
            "outside the arena")


def resource_message(exc: BaseException) -> str | None:
    """The line for an exception that is a resource running out, the user's to fix (a full disk:
    `disk_full_message`; the GPU's memory outside the arena: `gpu_memory_message`), else None; what one process
    and an MPI job both print."""
    return disk_full_message(exc) or gpu_memory_message(exc)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread during a run as Ctrl-C raises KeyboardInterrupt (the command line installs
    the handler), so that both stop the run the same way."""


class RunInterrupted(Exception):
    """A run stopped by Ctrl-C or SIGTERM once the files of its iterations were written: the message names the last
    complete iteration and the --continue line that resumes it; `exit_code`: 130 (Ctrl-C) or 143 (SIGTERM)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code
