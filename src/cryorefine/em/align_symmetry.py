"""A map made without symmetry (C1) turned so that a point group's axes are its own, and symmetrised (RELION's
relion_align_symmetry, which RELION's InitialModel job runs on the C1 model for --sym other than C1).

RELION's search (src/apps/align_symmetry.cpp): for each of 400 random rotations, uniform over SO(3), and then a local
grid of ±2 steps of 2° around the best in rot, tilt and psi, the map turned by that rotation is compared with its
own symmetrised copy (the plain squared difference in real space); the best rotation turns the map, and the
symmetry is applied. Here the same search, on a copy of the map binned to at most WORKING_BOX_PX (RELION's
--box_size 64); rotations and symmetrisation in real space by trilinear interpolation (RELION turns the map in
Fourier space).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cryorefine.core.euler import euler_to_matrix
from cryorefine.core.fourier import downsample_volume
from cryorefine.core.symmetry import SymmetryGroup, symmetrise_volume

#: RELION's --nr_uniform, --local_search_range, --local_search_step and --box_size
N_RANDOM_ROTATIONS = 400
LOCAL_SEARCH_RANGE = 2
LOCAL_SEARCH_STEP_DEG = 2.0
WORKING_BOX_PX = 64


def rotated_volume(volume: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """`volume` (N, N, N; z, y, x; origin at N//2) turned by `matrix`: out(x) = V(Mᵀ x) for (x, y, z) offsets from the
    origin, by trilinear interpolation, zero outside the box."""
    n = volume.shape[0]
    z, y, x = (np.indices(volume.shape).reshape(3, -1) - n // 2).astype(np.float64)
    sx, sy, sz = np.asarray(matrix, dtype=np.float64).T @ np.stack([x, y, z]) + n // 2
    x0, y0, z0 = np.floor(sx).astype(np.int64), np.floor(sy).astype(np.int64), np.floor(sz).astype(np.int64)
    fx, fy, fz = sx - x0, sy - y0, sz - z0
    out = np.zeros(x.shape)
    for dz in (0, 1):
        for dy in (0, 1):
            for dx in (0, 1):
                xi, yi, zi = x0 + dx, y0 + dy, z0 + dz
                inside = (xi >= 0) & (xi < n) & (yi >= 0) & (yi < n) & (zi >= 0) & (zi < n)
                weight = (fx if dx else 1 - fx) * (fy if dy else 1 - fy) * (fz if dz else 1 - fz)
                out[inside] += weight[inside] * volume[zi[inside], yi[inside], xi[inside]]
    return out.reshape(volume.shape)


def uniform_euler_angles_deg(n_rotations: int, rng: np.random.Generator) -> np.ndarray:
    """(n, 3) rot, tilt, psi drawn as RELION's align_symmetry draws them: rot and psi uniform, tilt uniform over 180°
    kept with probability |sin tilt| (uniform directions)."""
    angles = np.empty((n_rotations, 3))
    for i in range(n_rotations):
        rot = rng.uniform(0.0, 360.0)
        while True:
            tilt = rng.uniform(0.0, 180.0)
            if rng.uniform() < abs(np.sin(np.radians(tilt))):
                break
        angles[i] = rot, tilt, rng.uniform(0.0, 360.0)
    return angles


def asymmetry(volume: np.ndarray, group: SymmetryGroup) -> float:
    """Σ (V − V symmetrised)²: how far `volume` is from having the group's symmetry about its axes."""
    return float(np.sum((volume - symmetrise_volume(volume, group)) ** 2))


@dataclass(frozen=True)
class SymmetryAlignment:
    """The rotation found (Euler angles in degrees and its matrix), the map turned by it and symmetrised, and the
    asymmetry (`asymmetry`, on the working box) before and after the turn."""

    angles_deg: tuple
    matrix: np.ndarray
    volume: np.ndarray
    asymmetry_before: float
    asymmetry_after: float


def align_to_symmetry(volume: np.ndarray, group: SymmetryGroup, rng: np.random.Generator,
                      n_random: int = N_RANDOM_ROTATIONS) -> SymmetryAlignment:
    """The rotation that best gives `volume` the symmetry of `group` about the group's axes (module docstring), and
    the map turned by it and symmetrised."""
    volume = np.asarray(volume, dtype=np.float64)
    if group.order == 1:
        return SymmetryAlignment((0.0, 0.0, 0.0), np.eye(3), volume.copy(), 0.0, 0.0)
    n = volume.shape[0]
    work = volume if n <= WORKING_BOX_PX else downsample_volume(volume, WORKING_BOX_PX)

    def best_of(angles):
        scores = [asymmetry(rotated_volume(work, euler_to_matrix(*a)), group) for a in angles]
        return angles[int(np.argmin(scores))], float(np.min(scores))

    best, _ = best_of(uniform_euler_angles_deg(n_random, rng))
    steps = np.arange(-LOCAL_SEARCH_RANGE, LOCAL_SEARCH_RANGE + 1) * LOCAL_SEARCH_STEP_DEG
    local = np.array([best + np.array([a, b, c]) for a in steps for b in steps for c in steps])
    best, score = best_of(local)
    matrix = np.asarray(euler_to_matrix(*best), dtype=np.float64)
    turned = symmetrise_volume(rotated_volume(volume, matrix), group)
    return SymmetryAlignment(tuple(float(a) for a in best), matrix, turned, asymmetry(work, group), score)
