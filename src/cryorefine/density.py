"""Density maps from atomic models (PDB / mmCIF, gzipped or not) through gemmi.

The model is moved so that its centre of mass lies on voxel N//2 (the origin convention of
core.fourier), its density is sampled by gemmi on a grid `oversample` times finer than the
target with an extra Gaussian blur that keeps aliasing below 1 %, and the result is brought to
the target grid by Fourier cropping, with the blur divided out and an optional cosine-edged
low-pass. Output axes are (z, y, x), as mrcfile returns an MRC volume.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from cryorefine.core import fourier

_ALIAS_LEVEL = 0.01  # Gaussian blur amplitude at the Nyquist frequency of the fine grid


def _window_ft_3d(ft, new_size_px):
    """Crop a 3D half transform (M, M, M//2+1) to the layout of a smaller cube (N, N, N//2+1)."""
    old = ft.shape[0]
    pos, neg = (new_size_px + 1) // 2, new_size_px // 2
    rows = np.r_[0:pos, old - neg:old]
    return ft[np.ix_(rows, rows, np.arange(new_size_px // 2 + 1))]


def density_from_model(model_path: Path | str, box_px: int, pixel_size_angstrom: float,
                       resolution_angstrom: float | None = None, scattering: str = "xray", use_bfactors: bool = True,
                       oversample: int = 2, model_index: int = 0) -> np.ndarray:
    """Density (N, N, N) float32, axes (z, y, x), of an atomic model centred on voxel N//2.

    `scattering` "xray" gives electron density in e/Å³ (IT92 factors: the integral over the
    box is the number of electrons); "electron" gives gemmi's electron-scattering (Coulomb
    potential) density. With `resolution_angstrom` the map is low-passed there with a
    2-shell cosine edge; without it, it is band-limited at the Nyquist frequency of the box.
    Atomic B-factors are honoured unless `use_bfactors` is False (then B = 0 for every atom).
    Atoms beyond the box wrap around periodically: choose a box that holds the model.
    """
    import gemmi  # only needed here; keeps the package import light

    box_px = int(box_px)
    pixel_size_angstrom = float(pixel_size_angstrom)
    calculators = {"xray": gemmi.DensityCalculatorX, "electron": gemmi.DensityCalculatorE}
    if scattering not in calculators:
        raise ValueError(f"scattering must be one of {sorted(calculators)}, not {scattering!r}")

    structure = gemmi.read_structure(str(Path(model_path)))
    structure.remove_empty_chains()
    model = structure[model_index]
    if not use_bfactors:
        for cra in model.all():
            cra.atom.b_iso = 0.0
            cra.atom.aniso = gemmi.SMat33f(0, 0, 0, 0, 0, 0)

    fine_px = box_px * int(oversample)
    fine_spacing = pixel_size_angstrom / oversample
    edge_angstrom = fine_px * fine_spacing
    centre_angstrom = (fine_px // 2) * fine_spacing
    com = model.calculate_center_of_mass()
    shift = gemmi.Vec3(centre_angstrom - com.x, centre_angstrom - com.y, centre_angstrom - com.z)
    model.transform_pos_and_adp(gemmi.Transform(gemmi.Mat33(), shift))
    structure.cell = gemmi.UnitCell(edge_angstrom, edge_angstrom, edge_angstrom, 90.0, 90.0, 90.0)
    structure.spacegroup_hm = "P 1"

    # Blur B such that exp(-B s²/4) = _ALIAS_LEVEL at the fine Nyquist s = 1/(2·spacing).
    blur = 4.0 * math.log(1.0 / _ALIAS_LEVEL) * (2.0 * fine_spacing) ** 2
    calc = calculators[scattering]()
    calc.grid.setup_from(structure)
    calc.grid.set_size(fine_px, fine_px, fine_px)
    calc.d_min = 0.0  # keep the grid size set above
    calc.blur = blur
    calc.put_model_density_on_grid(model)
    fine = np.array(calc.grid, copy=True, dtype=np.float64).transpose(2, 1, 0)  # (x,y,z) -> (z,y,x)

    ft = _window_ft_3d(fourier.rfft3_centered(fine), box_px)
    s2 = fourier.radius_3d(box_px) ** 2 / (box_px * pixel_size_angstrom) ** 2
    ft = ft * np.exp(0.25 * blur * s2)  # undo the anti-aliasing blur
    if resolution_angstrom is not None:
        ft = fourier.lowpass_filter_3d(ft, box_px, float(resolution_angstrom), pixel_size_angstrom)
    else:
        ft = ft * (fourier.radius_3d(box_px) <= box_px // 2)
    return fourier.irfft3_centered(ft, box_px).astype(np.float32)
