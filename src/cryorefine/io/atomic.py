"""Atomic writes: a file appears complete under its final name or not at all."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp{os.getpid()}{final.suffix}")
    try:
        yield tmp
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()


def copy_atomically(source: Path | str, path: Path | str) -> None:
    """Copy the file `source` to `path`, the same bytes, atomically (a file of a run that repeats one it wrote)."""
    with atomic_path(path) as tmp:
        shutil.copyfile(source, tmp)
