"""The starting references of a run: a map read and checked against the particles, and the
--ini_high low-pass that refine and classify apply to it (classify also to its class-1 map after a
cross-correlation iteration)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from cryorefine.core import fourier
from cryorefine.core.arrays import Array, array_module
from cryorefine.errors import InputError
from cryorefine.io import mrc

if TYPE_CHECKING:  # for annotations only
    import numpy as np

    from cryorefine.config import RefineConfig

#: what a size refusal adds: RELION's --trust_ref_size would go on, re-boxing the particles instead
NOT_REBOXED = "(cryorefine does not re-box the particles into the reference's size, as RELION's --trust_ref_size does)"


def read_reference(path: Path | str, box: int, pixel: float) -> np.ndarray:
    """A reference map checked against the particles: cubic of their box, at their pixel size."""
    reference, ref_pixel = mrc.read_volume(path)
    if ref_pixel is not None and abs(ref_pixel - pixel) > 0.01 * pixel:
        raise InputError(f"{path}: conflicting pixel sizes, the reference is {ref_pixel:g} Å/px but the particles "
                         f"are {pixel:g} Å/px; rescale the reference (relion_image_handler --i {path} --o "
                         f"ref_{box}px.mrc --rescale_angpix {pixel:g} --new_box {box}) {NOT_REBOXED}")
    if reference.shape[0] != box:
        raise InputError(f"{path}: the reference is {reference.shape[0]} px but the particles are {box} px; resize "
                         f"the reference (relion_image_handler --i {path} --o ref_{box}px.mrc --new_box {box}) "
                         f"{NOT_REBOXED}")
    return reference


#: Width in Fourier shells of the --ini_high low-pass's raised-cosine edge (RELION's WIDTH_FMASK_EDGE).
INI_HIGH_EDGE_SHELLS = 2.0


def lowpass_to_ini_high(volume: Array, config: RefineConfig, box: int, pixel: float) -> Array:
    """The volume low-passed to --ini_high (unchanged without it), with numpy or cupy as the volume is.

    As RELION's initialLowPassFilterReferences: a raised cosine INI_HIGH_EDGE_SHELLS wide that goes
    through 0.5 at the --ini_high shell (box·pixel/ini_high), 1 one shell below it and 0 one shell
    above it."""
    if not config.ini_high_angstrom:
        return volume
    xp = array_module(volume)
    start = box * pixel / config.ini_high_angstrom - INI_HIGH_EDGE_SHELLS / 2
    return fourier.lowpass_band_limited(volume, lambda r: fourier.raised_cosine(r, start, INI_HIGH_EDGE_SHELLS, xp),
                                        start + INI_HIGH_EDGE_SHELLS, xp)
