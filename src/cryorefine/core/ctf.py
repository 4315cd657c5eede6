"""RELION's contrast transfer function (src/ctf.h, src/ctf.cpp: CTF::getCTF, CTF::getFftwImage).

At spatial frequency (X, Y) in 1/Å, with u² = X² + Y²:

    CTF = −scale · sin(γ) · exp(−B·u²/4)
    γ   = π·λ·(−Δf(X, Y))·u² + (π/2)·Cs·λ³·u⁴ − φ − atan(Q0 / √(1 − Q0²))

where λ is the relativistic electron wavelength, Cs is in Å (the STAR value in mm × 1e7), φ is the
phase-plate shift in radians (the STAR value is in degrees), Q0 is the amplitude contrast, B the
CTF B-factor in Å² and Δf(X, Y) the astigmatic defocus (positive = underfocus):

    Δf(X, Y)·u² = U·(X cos α + Y sin α)² + V·(−X sin α + Y cos α)²,   α = defocus angle,

i.e. the defocus along the direction at angle α from the x axis is U and perpendicular to it V.
RELION's optional dose-based damping, CTF padding, magnification matrices and higher-order
aberrations are not modelled here.

Layout: the half transforms of core.fourier, (…, N, N//2+1), rows ky and columns kx in integer
frequencies, (X, Y) = (kx, ky) / (N · pixel size). As in RELION's FFTW loops, the Nyquist row of
an even box (row N/2) is evaluated at ky = +N/2.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from cryorefine.core.arrays import Array, ArrayModule, to_host

# RELION's constant: λ[Å] = 12.2643247 / sqrt(V · (1 + 0.978466e-6 · V)), V in volts.
_WAVELENGTH_NUMERATOR = 12.2643247
_RELATIVISTIC_PER_VOLT = 0.978466e-6


def electron_wavelength_angstrom(voltage_kv: npt.ArrayLike, xp: ArrayModule = np) -> Array:
    """Relativistic electron wavelength in Å for an accelerating voltage in kV (RELION's formula)."""
    volts = xp.asarray(voltage_kv, dtype=xp.float64) * 1e3
    return _WAVELENGTH_NUMERATOR / xp.sqrt(volts * (1.0 + _RELATIVISTIC_PER_VOLT * volts))


def _half_frequencies(size_px: int, xp: ArrayModule) -> tuple[Array, Array]:
    """Integer (ky, kx) of the half-transform layout, Nyquist row of an even box at +N/2."""
    ky = xp.arange(size_px, dtype=xp.float64)
    ky = xp.where(ky < size_px // 2 + 1, ky, ky - size_px)
    kx = xp.arange(size_px // 2 + 1, dtype=xp.float64)
    return ky[:, None], kx[None, :]


@dataclass(frozen=True)
class CtfParameters:
    """The CTF values of an image, or of a batch of B images: each a scalar or an array of length B (broadcast
    together). Units: Å, degrees, kV, mm; `bfactor` in Å², `amplitude_contrast` in [0, 1]."""

    pixel_size_angstrom: npt.ArrayLike
    defocus_u_angstrom: npt.ArrayLike
    defocus_v_angstrom: npt.ArrayLike
    defocus_angle_deg: npt.ArrayLike
    voltage_kv: npt.ArrayLike
    cs_mm: npt.ArrayLike
    amplitude_contrast: npt.ArrayLike
    phase_shift_deg: npt.ArrayLike = 0.0
    bfactor: npt.ArrayLike = 0.0
    scale: npt.ArrayLike = 1.0


def ctf_2d(size_px: int, ctf: CtfParameters, abs_value: bool = False, only_flip_phases: bool = False,
           intact_until_first_peak: bool = False, xp: ArrayModule = np, dtype: npt.DTypeLike = np.float32) -> Array:
    """RELION CTFs of a batch on the half-transform layout -> (B, N, N//2+1).

    `ctf` holds the B images' values (B = 1 when all are scalars). Computed in float64, returned as `dtype`.
    Flags as relion_refine's --ctf_phase_flipped (`abs_value`), --only_flip_phases and --ctf_intact_first_peak.
    """
    # the per-image coefficients on the host (B numbers each): on the device each would be a kernel of its own,
    # and the range check a reduction over the batch, which CuPy compiles again for each power-of-two class of
    # batch sizes (benchmarks/README.md, "A first run on a machine")
    params = [np.asarray(to_host(getattr(ctf, f.name)), dtype=np.float64).reshape(-1)
              for f in dataclasses.fields(CtfParameters)]
    pix, du, dv, ang, kv, cs, q0, phase, bfac, scl = np.broadcast_arrays(*params)
    if np.any((q0 < 0.0) | (q0 > 1.0)):
        raise ValueError("amplitude_contrast must lie in [0, 1]")

    lam = electron_wavelength_angstrom(kv)
    inv_box2 = 1.0 / (size_px * pix) ** 2  # (integer frequency)² -> (1/Å)²
    alpha = np.deg2rad(ang)
    c, s = np.cos(alpha), np.sin(alpha)
    # γ = k_xx·kx² + k_xy·kx·ky + k_yy·ky² + k_4·|k|⁴ − offset, with k integer frequencies.
    k1 = -np.pi * lam * inv_box2
    coefficients = np.stack([
        k1 * (du * c * c + dv * s * s),  # k_xx
        k1 * 2.0 * (du - dv) * c * s,  # k_xy
        k1 * (du * s * s + dv * c * c),  # k_yy
        0.5 * np.pi * (cs * 1e7) * lam ** 3 * inv_box2 ** 2,  # k_4
        np.deg2rad(phase) + np.arctan(q0 / np.sqrt(1.0 - q0 * q0)),  # offset
        -0.25 * inv_box2 * bfac,  # the envelope's exponent per |k|²
        scl])
    k_xx, k_xy, k_yy, k_4, offset, envelope, scl = (k[:, None, None] for k in xp.asarray(coefficients))

    ky, kx = _half_frequencies(size_px, xp)
    k2 = kx * kx + ky * ky
    gamma = k_xx * (kx * kx) + k_xy * (kx * ky) + k_yy * (ky * ky) + k_4 * (k2 * k2) - offset
    value = -xp.sin(gamma)
    if intact_until_first_peak:
        value = xp.where(xp.abs(gamma) < 0.5 * np.pi, 1.0, value)
    value = value * xp.exp(envelope * k2)
    if abs_value:
        value = xp.abs(value)
    elif only_flip_phases:
        value = xp.where(value < 0.0, -1.0, 1.0)
    return (scl * value).astype(dtype, copy=False)
