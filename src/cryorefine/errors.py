"""The one exception type for bad input (the CLI prints its message as one line and exits 2), and the one
line for an output that did not fit on its disk, which one process and an MPI job both print."""

import errno

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # an output that did not fit: the user's to fix, not ours


class InputError(ValueError):
    """Bad user input: the message names the file, the column or value, and what to do."""


def disk_full_message(exc):
    """What to tell the user when `exc` is a full disk (or quota) met while writing, else None."""
    if not isinstance(exc, OSError) or exc.errno not in DISK_FULL_ERRNOS:
        return None
    where = f" writing {exc.filename}" if exc.filename else ""
    return (f"no space left on the device{where}: free space where the run writes (--o), then carry on from its "
            "last complete iteration with --continue (its _optimiser.star)")
