"""The references' solvent masks (--flatten_solvent, --solvent_mask, --solvent_mask2) and the mask of
--solvent_correct_fsc, read and checked once, applied after each M-step as RELION's solventFlatten does.

RELION's rules (ml_optimiser.cpp solventFlatten, ml_optimiser_mpi.cpp
reconstructUnregularisedMapAndCalculateSolventCorrectedFSC):
- only with --flatten_solvent are the references masked: by --solvent_mask (soft values 0…1) when
  given, else by a soft sphere of the particle diameter;
- --solvent_mask2 marks a region (1 = in it) whose density is set to its own average after that
  (e.g. the inside of an icosahedral virus), with or without --solvent_mask;
- --solvent_correct_fsc needs --solvent_mask: the half maps' FSC is then the masked one, corrected by
  phase randomisation (core.fsc.solvent_corrected_fsc); without a mask it changes nothing.
Masks have values in [0, 1]; one of another box or pixel size (its header's) is re-scaled and re-boxed to the
particles', as RELION's checkMask does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from cryorefine.core import fourier
from cryorefine.core.arrays import Array, ArrayModule
from cryorefine.core.masks import solvent_flatten
from cryorefine.em.references import fit_to_particles
from cryorefine.em.schedule import default_particle_diameter_angstrom
from cryorefine.errors import InputError
from cryorefine.io import mrc

if TYPE_CHECKING:  # for annotations only
    from cryorefine.config import RefineConfig
    from cryorefine.em.state import ModelState

log = logging.getLogger("cryorefine")

#: Values this far outside [0, 1] are rounding (clipped); beyond it a mask is refused, as RELION refuses it.
MASK_VALUE_TOLERANCE = 1e-3


def read_mask(option: str, path: Path | str, box_px: int, pixel_size_angstrom: float, say: bool = False) -> np.ndarray:
    """A mask map (float64, host) for the particles, or an InputError naming the option, the file and what to do.
    Of another pixel or box size, it is re-scaled and re-boxed to the particles' as RELION's checkMask does it (with
    or without --trust_ref_size; `em.references.fit_to_particles`), said in a warning with `say`; values in [0, 1]."""
    try:
        volume, pixel = mrc.read_volume(path)
    except FileNotFoundError:
        raise InputError(f"{option} {path}: file not found; check the path") from None
    except InputError as exc:
        raise InputError(f"{option} {exc}") from None
    low, high = float(volume.min()), float(volume.max())
    if low < -MASK_VALUE_TOLERANCE or high > 1.0 + MASK_VALUE_TOLERANCE:
        raise InputError(f"{option} {path}: mask values run from {low:g} to {high:g}, outside [0, 1]; give a mask "
                         f"with 1 on the particle, 0 in the solvent and a soft edge (relion_mask_create)")
    if high <= 0.0:
        raise InputError(f"{option} {path}: the mask is zero everywhere; give a mask with 1 on the particle")
    if pixel is not None and abs(pixel - pixel_size_angstrom) <= 0.001:
        pixel = None  # RELION's tolerance: the particles' pixel size
    volume, said = fit_to_particles(volume.astype(np.float64), pixel, box_px, pixel_size_angstrom, even_down=False)
    if said and say:
        log.warning("%s %s %s (as RELION's refinement does)", option, path, said)
    if float(volume.max()) <= 0.0:
        raise InputError(f"{option} {path}: the mask re-boxed to the particles' {box_px} px is zero everywhere; give "
                         f"a mask with 1 on the particle inside their box")
    return np.clip(volume, 0.0, 1.0)


@dataclass
class SolventMasks:
    """The masks of a run (host float64 maps, None where not given) and how they are used."""

    flatten: bool  # --flatten_solvent: mask the references after each M-step
    sphere_radius_px: float  # the soft sphere used without --solvent_mask
    edge_px: float
    mask: np.ndarray | None = None  # --solvent_mask
    mask2: np.ndarray | None = None  # --solvent_mask2
    correct_fsc: bool = False  # --solvent_correct_fsc with a --solvent_mask
    # the soft spheres made on the host so far, by (box, dtype), read-only: made once, not at every M-step (a 128 px
    # InitialModel's "centring and masks" 0.04 → 0.01 s an iteration on the 2-core CPU machine; it was 0.08 s an
    # iteration on an H200's host); on a GPU it is made anew each time, holding no device memory
    _host_spheres: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def from_config(cls, config: RefineConfig, box_px: int, pixel_size_angstrom: float, diameter_angstrom: float,
                    say: bool = False) -> SolventMasks:
        """The masks of `config` for particles of `box_px` at `pixel_size_angstrom`; InputError on a bad mask.
        With `say`, options that change nothing are named in one INFO line each."""
        mask = mask2 = None
        if config.solvent_mask:
            mask = read_mask("--solvent_mask", config.solvent_mask, box_px, pixel_size_angstrom, say)
        if config.solvent_mask2:
            mask2 = read_mask("--solvent_mask2", config.solvent_mask2, box_px, pixel_size_angstrom, say)
        correct = bool(config.solvent_correct_fsc and mask is not None and config.auto_refine)
        if say:
            if config.solvent_correct_fsc and not correct:
                log.info("--solvent_correct_fsc: changes nothing here (%s)",
                         "a classification has no half maps" if not config.auto_refine
                         else "it needs --solvent_mask, as in RELION")
            if mask is not None and not config.flatten_solvent:
                log.info("--solvent_mask without --flatten_solvent: the references are not masked (RELION's rule)%s",
                         "; the mask is used for --solvent_correct_fsc" if correct else "; the mask changes nothing")
            if mask2 is not None and not config.flatten_solvent:
                log.info("--solvent_mask2 without --flatten_solvent: changes nothing (RELION's rule)")
        return cls(bool(config.flatten_solvent), diameter_angstrom / (2.0 * pixel_size_angstrom),
                   float(config.width_mask_edge_px), mask, mask2, correct)

    @classmethod
    def for_model(cls, config: RefineConfig, model: ModelState) -> SolventMasks:
        """The masks of `config` for a model's box and pixel size and the default particle diameter (an MPI
        worker's first M-step: the master has checked the files and said what changes nothing)."""
        box, pixel = model.ori_size_px, model.pixel_size_angstrom
        return cls.from_config(config, box, pixel, default_particle_diameter_angstrom(config, box, pixel))

    def reference_mask(self, box_px: int, xp: ArrayModule = np, dtype: npt.DTypeLike = np.float64) -> Array:
        """The mask the references are multiplied by, as `dtype`: --solvent_mask, else the soft sphere."""
        if self.mask is not None:
            return xp.asarray(self.mask, dtype=dtype)
        if xp is not np:
            return fourier.soft_spherical_mask(box_px, self.sphere_radius_px, self.edge_px, xp, dtype)
        key = (int(box_px), np.dtype(dtype).str)
        if key not in self._host_spheres:
            sphere = fourier.soft_spherical_mask(box_px, self.sphere_radius_px, self.edge_px, np, dtype)
            sphere.flags.writeable = False
            self._host_spheres[key] = sphere
        return self._host_spheres[key]

    def apply(self, volume: Array, xp: ArrayModule = np) -> Array:
        """A reference after the M-step as RELION's solventFlatten leaves it (unchanged without --flatten_solvent)."""
        if not self.flatten:
            return volume
        mask2 = None if self.mask2 is None else xp.asarray(self.mask2)
        return solvent_flatten(volume, self.reference_mask(volume.shape[-1], xp, volume.dtype), mask2, xp)
