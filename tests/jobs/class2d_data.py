"""A small simulated 2D classification set: particles of three distinct 2D views (projections of the example
ribosome along z, y and x), each at a random in-plane angle and shift, with CTFs and white noise."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import starfile
from conftest import EXAMPLE_MAP, write_mrc

BOX_PX = 32
PIXEL_ANGSTROM = 12.0


def true_views() -> np.ndarray:
    """(3, N, N): the example map at 32 px projected along its z, y and x axes, each scaled to unit peak."""
    from cryorefine.core.fourier import downsample_volume
    from cryorefine.io.mrc import read_volume

    volume = downsample_volume(read_volume(EXAMPLE_MAP)[0], BOX_PX).astype(np.float64)
    views = np.stack([volume.sum(axis=axis) for axis in (0, 1, 2)])
    return views / views.max(axis=(1, 2), keepdims=True)


def rotated(image: np.ndarray, angle_deg: float, shift_x_px: float = 0.0, shift_y_px: float = 0.0) -> np.ndarray:
    """The image turned by `angle_deg` about its centre N//2 and moved by the shift, by bilinear interpolation in
    real space (zero outside)."""
    n = image.shape[0]
    y, x = np.mgrid[:n, :n].astype(np.float64) - n // 2
    a = np.deg2rad(angle_deg)
    x, y = x - shift_x_px, y - shift_y_px
    sx = np.cos(a) * x + np.sin(a) * y + n // 2
    sy = -np.sin(a) * x + np.cos(a) * y + n // 2
    x0, y0 = np.floor(sx).astype(int), np.floor(sy).astype(int)
    fx, fy = sx - x0, sy - y0
    out = np.zeros_like(image)
    for dy, dx, w in ((0, 0, (1 - fy) * (1 - fx)), (0, 1, (1 - fy) * fx), (1, 0, fy * (1 - fx)), (1, 1, fy * fx)):
        xi, yi = x0 + dx, y0 + dy
        inside = (xi >= 0) & (xi < n) & (yi >= 0) & (yi < n)
        out += np.where(inside, w * image[np.clip(yi, 0, n - 1), np.clip(xi, 0, n - 1)], 0.0)
    return out


def best_rotated_correlation(average: np.ndarray, truth: np.ndarray, step_deg: float = 3.0) -> float:
    """The largest correlation of `average` with `truth` turned by any multiple of `step_deg` (inside the circle
    of radius N/2 − 2), the centre of each moved to the other's by up to 2 px."""
    n = truth.shape[0]
    inside = np.hypot(*(np.mgrid[:n, :n] - n // 2)) < n // 2 - 2
    a = average[inside] - average[inside].mean()
    best = -1.0
    for angle in np.arange(0.0, 360.0, step_deg):
        for dx in (-2, -1, 0, 1, 2):
            for dy in (-2, -1, 0, 1, 2):
                b = rotated(truth, angle, dx, dy)[inside]
                b = b - b.mean()
                best = max(best, float(a @ b / np.sqrt((a @ a) * (b @ b) + 1e-300)))
    return best


def make_views_set(folder: Path | str, n_each: int, snr: float = 0.5, seed: int = 0, normalised: bool = False,
                   pixel_angstrom: float = PIXEL_ANGSTROM) -> tuple[Path, np.ndarray]:
    """n_each particles of each of the three views in folder/views.star (+ views.mrcs): random psi, shifts of up to
    2 px, CTFs of 1-2.5 µm defocus (300 kV), white noise of variance var(signal)/`snr` in the particle's circle;
    `normalised`: the images divided by the noise's σ, as RELION's extraction normalises particles (background σ 1,
    so that the norm corrections are about 1). Returns the STAR file's path and the true view of each particle (0,
    1, 2)."""
    from cryorefine.core import fourier
    from cryorefine.core.ctf import CtfParameters, ctf_2d

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    views = true_views()
    truth = np.repeat(np.arange(3), n_each)
    rng.shuffle(truth)
    n = truth.size
    psi = rng.uniform(0.0, 360.0, n)
    shifts = rng.uniform(-2.0, 2.0, (n, 2))
    defocus = rng.uniform(10000.0, 25000.0, n)
    clean = np.stack([rotated(views[v], p, sx, sy) for v, p, (sx, sy) in zip(truth, psi, shifts)])
    ctf = ctf_2d(BOX_PX, CtfParameters(pixel_angstrom, defocus, defocus, 0.0, 300.0, 2.7, 0.1), dtype=np.float64)
    signal = fourier.irfft2_centered(fourier.rfft2_centered(clean) * ctf, BOX_PX)
    circle = np.hypot(*(np.mgrid[:BOX_PX, :BOX_PX] - BOX_PX // 2)) < BOX_PX // 2 - 2
    sigma = np.sqrt(signal[:, circle].var() / snr)
    images = signal + rng.normal(scale=sigma, size=signal.shape)
    images = (images / sigma if normalised else images).astype(np.float32)
    write_mrc(folder / "views.mrcs", images, pixel_angstrom)
    particles = pd.DataFrame({
        "rlnImageName": [f"{i + 1:06d}@views.mrcs" for i in range(n)],
        "rlnDefocusU": defocus, "rlnDefocusV": defocus, "rlnDefocusAngle": np.zeros(n),
        "rlnOriginXAngst": np.zeros(n), "rlnOriginYAngst": np.zeros(n), "rlnOpticsGroup": np.ones(n, dtype=int),
    })
    optics = pd.DataFrame({"rlnOpticsGroup": [1], "rlnOpticsGroupName": ["opticsGroup1"],
                           "rlnAmplitudeContrast": [0.1], "rlnSphericalAberration": [2.7], "rlnVoltage": [300.0],
                           "rlnImagePixelSize": [pixel_angstrom], "rlnImageSize": [BOX_PX],
                           "rlnImageDimensionality": [2]})
    star = folder / "views.star"
    starfile.write({"optics": optics, "particles": particles}, star)
    return star, truth
