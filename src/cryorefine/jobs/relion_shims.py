"""`cryorefine install-relion-shims DIR`: `relion_refine` and `relion_refine_mpi` scripts in DIR that run
`cryorefine relion_refine "$@"`, so that whatever finds relion_refine on the PATH (RELION's GUI, its queue templates,
scripts) runs cryorefine with the same command line.

The scripts run the Python that installed them (`sys.executable -m cryorefine`), so they work without activating its
environment. A file of those names in DIR that this command did not write (RELION's own programs, or links to them)
is never overwritten; its own scripts are written again.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from cryorefine import __version__
from cryorefine.errors import InputError
from cryorefine.io.atomic import atomic_path

SHIM_NAMES = ("relion_refine", "relion_refine_mpi")
#: the line that marks a script as written here (and so safe to write again)
MARK = "# written by cryorefine install-relion-shims"


def shim_text(name, python):
    """The script `name` that runs `python -m cryorefine relion_refine` with its arguments."""
    return (f"#!/bin/sh\n{MARK} (cryorefine {__version__}): RELION's {name} command line, run by cryorefine\n"
            f"exec {shlex.quote(str(python))} -m cryorefine relion_refine \"$@\"\n")


def written_here(path) -> bool:
    """Whether `path` is a script of this command (a link, even to one, is not: it is someone else's file)."""
    path = Path(path)
    if path.is_symlink() or not path.is_file():
        return False
    with open(path, "rb") as f:
        return MARK.encode() in f.read(4096)


def install(folder, python=None):
    """Write the scripts into `folder` (made if missing); their paths. InputError where a file of theirs is there
    and was not written by this command."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise InputError(f"{folder}: not a folder; give the folder to put relion_refine and relion_refine_mpi in")
    paths = [folder / name for name in SHIM_NAMES]
    for path in paths:
        if (path.exists() or path.is_symlink()) and not written_here(path):
            raise InputError(f"{path}: exists and was not written by cryorefine install-relion-shims (RELION's own "
                             f"program?); left as it is: give another folder, and put it first on the PATH")
    try:
        for path in paths:
            with atomic_path(path) as tmp:
                tmp.write_text(shim_text(path.name, python or sys.executable))
                os.chmod(tmp, 0o755)
    except OSError as exc:
        raise InputError(f"{folder}: cannot write the scripts there ({exc.strerror or exc}); give a folder of "
                         f"your own") from None
    return paths
