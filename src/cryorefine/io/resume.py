"""--continue: what a run saves beside each run_itNNN_optimiser.star (run_itNNN_resume.npz) so
that it can go on from that iteration exactly as it would have.

The file holds one JSON document (the options, the job's kind, scalars of the model, optimiser and
schedule, the random generator's state) and named arrays (spectra, per-particle poses, the job's
own arrays); the maps are read back from the iteration's MRC files. Written under a temporary name
and renamed, so a run killed while writing leaves the previous iteration's file intact.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from cryorefine.errors import InputError
from cryorefine.io.atomic import atomic_path

SUFFIX = "_resume.npz"


def save(path: Path | str, document: dict[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
    """Write `document` (JSON-able; numpy scalars become numbers) and the named `arrays` to `path`."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as handle:
            # numpy's stubs would match the mapping's values to allow_pickle
            np.savez(handle, document=np.array(json.dumps(document, default=_plain)),
                     **arrays)  # type: ignore[arg-type]


def resume_path(optimiser_star: Path | str) -> Path:
    """run_itNNN_resume.npz beside run_itNNN_optimiser.star."""
    name = str(optimiser_star)
    if not name.endswith("_optimiser.star"):
        raise InputError(f"{optimiser_star}: --continue takes a run_itNNN_optimiser.star file")
    return Path(name[: -len("_optimiser.star")] + SUFFIX)


def iteration_root(optimiser_star: Path | str) -> str:
    """out/run_itNNN of out/run_itNNN_optimiser.star (where the iteration's maps are)."""
    return str(optimiser_star)[: -len("_optimiser.star")]


def load(optimiser_star: Path | str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(document, arrays) saved beside `optimiser_star`."""
    path = resume_path(optimiser_star)
    if not Path(optimiser_star).is_file():
        raise InputError(f"{optimiser_star}: file not found; give a run_itNNN_optimiser.star of an earlier run")
    if not path.is_file():
        raise InputError(f"{path}: not found; --continue needs the files a cryorefine iteration writes beside its "
                         f"optimiser.star (to go on from a run of RELION's own, start a new run with its "
                         f"run_itNNN_data.star as --i and its map as --ref)")
    try:
        with np.load(path) as data:
            arrays = {name: data[name] for name in data.files}
        return json.loads(str(arrays.pop("document"))), arrays
    except Exception as exc:  # a cut or foreign file: zipfile, numpy and json raise assorted errors
        raise InputError(f"{path}: unreadable ({type(exc).__name__}: {exc}); continue from an earlier iteration's "
                         f"optimiser.star, or start the run again") from None


def load_config_values(optimiser_star: Path | str) -> dict[str, Any]:
    """The options (a dict) of the run that `optimiser_star` belongs to."""
    return load(optimiser_star)[0]["config"]


def _plain(value):
    """numpy scalars as Python numbers for JSON."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot save {type(value).__name__} for --continue")
