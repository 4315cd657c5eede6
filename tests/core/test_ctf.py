"""Tests of core.ctf: physics oracles and the CTF rings of real particle stacks."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import cupy_or_skip

from cryorefine.core import fourier
from cryorefine.core.ctf import CtfParameters, ctf_2d, electron_wavelength_angstrom

REAL = Path(__file__).resolve().parents[3] / "shared/data/real"

# CODATA 2018 exact / recommended values (SI).
PLANCK_J_S = 6.62607015e-34
ELECTRON_MASS_KG = 9.1093837015e-31
ELEMENTARY_CHARGE_C = 1.602176634e-19
SPEED_OF_LIGHT_M_S = 299792458.0


def _codata_wavelength_angstrom(voltage_kv):
    volts = voltage_kv * 1e3
    m, e, c = ELECTRON_MASS_KG, ELEMENTARY_CHARGE_C, SPEED_OF_LIGHT_M_S
    momentum = np.sqrt(2 * m * e * volts * (1 + e * volts / (2 * m * c * c)))
    return PLANCK_J_S / momentum * 1e10


def _textbook_ctf(size_px, pixel_size, du, dv, angle_deg, kv, cs_mm, q0, phase_deg=0.0):
    """CTF in polar form: Δf(θ) = (U+V)/2 + (U−V)/2·cos 2(θ − α), χ = πλΔf u² − π/2·Cs·λ³u⁴ + φ,
    CTF = √(1−Q0²)·sin χ + Q0·cos χ, on the half layout with the Nyquist row at ky = +N/2.
    λ is RELION's (checked against CODATA in test_wavelength_known_values: they differ by 6e-6,
    which shifts the phase at high frequency by more than the tolerance here)."""
    lam = float(electron_wavelength_angstrom(kv))
    ky = np.arange(size_px, dtype=float)
    ky[ky > size_px // 2] -= size_px
    kx = np.arange(size_px // 2 + 1, dtype=float)
    fy, fx = np.meshgrid(ky / (size_px * pixel_size), kx / (size_px * pixel_size), indexing="ij")
    u2 = fx * fx + fy * fy
    theta = np.arctan2(fy, fx)
    defocus = 0.5 * (du + dv) + 0.5 * (du - dv) * np.cos(2 * (theta - np.deg2rad(angle_deg)))
    chi = np.pi * lam * defocus * u2 - 0.5 * np.pi * cs_mm * 1e7 * lam ** 3 * u2 * u2 + np.deg2rad(phase_deg)
    return np.sqrt(1 - q0 * q0) * np.sin(chi) + q0 * np.cos(chi)


# ---------------------------------------------------------------- analytic checks

def test_wavelength_known_values():
    assert electron_wavelength_angstrom(300.0) == pytest.approx(0.01969, abs=5e-6)
    assert electron_wavelength_angstrom(200.0) == pytest.approx(0.02508, abs=5e-6)
    assert electron_wavelength_angstrom(100.0) == pytest.approx(0.03701, abs=5e-6)
    volts = np.array([80.0, 120.0, 200.0, 300.0])
    np.testing.assert_allclose(electron_wavelength_angstrom(volts), _codata_wavelength_angstrom(volts), rtol=1e-5)


def test_defocus_zeros_are_where_pi_lambda_df_u2_is_n_pi():
    n_px, pix, kv = 256, 1.5, 300.0
    lam = _codata_wavelength_angstrom(kv)
    k_first = 20.0  # choose the defocus so the first zero lies on integer frequency 20
    defocus = 1.0 / (lam * (k_first / (n_px * pix)) ** 2)
    ctf = ctf_2d(n_px, CtfParameters(pix, defocus, defocus, 0.0, kv, 0.0, 0.0), dtype=np.float64)
    assert ctf.shape == (1, n_px, n_px // 2 + 1)
    row = ctf[0, 0]  # along +kx
    for n, k in ((1, 20), (4, 40), (9, 60), (16, 80), (25, 100)):  # zeros at k_first·√n
        assert abs(row[k]) < 1e-3, (n, k, row[k])
    # Between the zeros the CTF alternates sign, positive (RELION's sign) before the first one.
    assert np.all(row[1:20] > 0) and np.all(row[21:28] < 0)
    # Isotropic: the same along ky, and on the negative-ky rows.
    np.testing.assert_allclose(ctf[0, :101, 0], row[:101], atol=1e-12)
    np.testing.assert_allclose(ctf[0, n_px - 1:n_px - 100:-1, 0], row[1:100], atol=1e-12)


def test_spherical_aberration_zeros_and_amplitude_contrast():
    n_px, pix, kv, cs_mm = 200, 1.0, 300.0, 2.7
    lam = float(electron_wavelength_angstrom(kv))
    ctf = ctf_2d(n_px, CtfParameters(pix, 0.0, 0.0, 0.0, kv, cs_mm, 0.0), dtype=np.float64)[0, 0]
    k = np.arange(n_px // 2 + 1) / (n_px * pix)
    expected = -np.sin(0.5 * np.pi * cs_mm * 1e7 * lam ** 3 * k ** 4)
    np.testing.assert_allclose(ctf, expected, atol=1e-4)
    # Amplitude contrast enters as a phase atan(Q0/√(1−Q0²)): CTF(0) = Q0.
    for q0 in (0.07, 0.1, 0.5):
        c0 = ctf_2d(64, CtfParameters(1.0, 15000.0, 15000.0, 0.0, 300.0, 2.7, q0), dtype=np.float64)[0, 0, 0]
        assert c0 == pytest.approx(q0, abs=1e-12)


def test_matches_polar_textbook_form():
    n_px, pix = 96, 1.7
    du, dv, ang = np.array([21000.0, 9000.0]), np.array([17000.0, 12000.0]), np.array([33.0, -71.0])
    got = ctf_2d(n_px, CtfParameters(pix, du, dv, ang, 300.0, 2.7, 0.1, phase_shift_deg=np.array([0.0, 35.0])),
                 dtype=np.float64)
    for i, phase in enumerate((0.0, 35.0)):
        want = _textbook_ctf(n_px, pix, du[i], dv[i], ang[i], 300.0, 2.7, 0.1, phase)
        np.testing.assert_allclose(got[i], want, atol=2e-4)


def test_astigmatism_defocus_u_lies_along_the_angle():
    n_px, pix, kv = 128, 1.2, 300.0
    du, dv = 25000.0, 12000.0

    def iso(defocus):
        return ctf_2d(n_px, CtfParameters(pix, defocus, defocus, 0.0, kv, 2.7, 0.1), dtype=np.float64)[0]

    k = np.arange(1, n_px // 2)
    ctf_u, ctf_v = iso(du), iso(dv)
    # Angle 0: U along x, V along y.
    c = ctf_2d(n_px, CtfParameters(pix, du, dv, 0.0, kv, 2.7, 0.1), dtype=np.float64)[0]
    np.testing.assert_allclose(c[0, k], ctf_u[0, k], atol=1e-9)
    np.testing.assert_allclose(c[k, 0], ctf_v[0, k], atol=1e-9)
    # Angle 90: swapped.
    c = ctf_2d(n_px, CtfParameters(pix, du, dv, 90.0, kv, 2.7, 0.1), dtype=np.float64)[0]
    np.testing.assert_allclose(c[0, k], ctf_v[0, k], atol=1e-9)
    np.testing.assert_allclose(c[k, 0], ctf_u[k, 0], atol=1e-9)
    # Angle +45: U along the diagonal kx = ky (rows k), V along kx = -ky (rows N-k); -45 the reverse.
    diag_u = ctf_u[k, k]  # isotropic CTF at |k|√2
    c = ctf_2d(n_px, CtfParameters(pix, du, dv, 45.0, kv, 2.7, 0.1), dtype=np.float64)[0]
    np.testing.assert_allclose(c[k, k], diag_u, atol=1e-9)
    np.testing.assert_allclose(c[n_px - k, k], ctf_v[k, k], atol=1e-9)
    c = ctf_2d(n_px, CtfParameters(pix, du, dv, -45.0, kv, 2.7, 0.1), dtype=np.float64)[0]
    np.testing.assert_allclose(c[n_px - k, k], diag_u, atol=1e-9)
    assert np.max(np.abs(c[k, k] - diag_u)) > 0.5


def test_phase_shift_90_swaps_sin_and_cos():
    n_px, pix = 128, 1.0
    args = (pix, 18000.0, 15000.0, 20.0, 300.0, 2.7, 0.0)
    c0 = ctf_2d(n_px, CtfParameters(*args, phase_shift_deg=0.0), dtype=np.float64)[0]
    c90 = ctf_2d(n_px, CtfParameters(*args, phase_shift_deg=90.0), dtype=np.float64)[0]
    c180 = ctf_2d(n_px, CtfParameters(*args, phase_shift_deg=180.0), dtype=np.float64)[0]
    np.testing.assert_allclose(c0 ** 2 + c90 ** 2, 1.0, atol=1e-9)
    assert c90[0, 0] == pytest.approx(1.0)  # a 90° phase plate gives full contrast at k = 0
    np.testing.assert_allclose(c180, -c0, atol=1e-9)
    # Amplitude contrast Q0 = sin(φ) is the same phase as a phase plate of φ degrees.
    q_phase = ctf_2d(n_px, CtfParameters(pix, 18000.0, 15000.0, 20.0, 300.0, 2.7, np.sin(np.deg2rad(30.0))),
                     dtype=np.float64)
    p_phase = ctf_2d(n_px, CtfParameters(*args, phase_shift_deg=30.0), dtype=np.float64)
    np.testing.assert_allclose(q_phase, p_phase, atol=1e-9)


def test_bfactor_envelope_and_scale():
    n_px, pix, bfac = 128, 1.0, 150.0
    args = (pix, 15000.0, 14000.0, 10.0, 300.0, 2.7, 0.1)
    c0 = ctf_2d(n_px, CtfParameters(*args), dtype=np.float64)[0]
    cb = ctf_2d(n_px, CtfParameters(*args, bfactor=bfac, scale=0.8), dtype=np.float64)[0]
    u2 = fourier.radius_2d(n_px) ** 2 / (n_px * pix) ** 2
    ok = np.abs(c0) > 0.05
    np.testing.assert_allclose(cb[ok] / c0[ok], 0.8 * np.exp(-bfac * u2[ok] / 4), rtol=1e-9)
    # The amplitude envelope halves at u² = 4 ln 2 / B.
    k_half = np.sqrt(4 * np.log(2) / bfac) * n_px * pix
    assert np.exp(-bfac * (k_half / (n_px * pix)) ** 2 / 4) == pytest.approx(0.5)


def test_batch_broadcasting_dtype_and_flags():
    n_px = 64
    du = np.array([10000.0, 20000.0, 30000.0])
    pix = np.array([1.0, 1.5, 2.0])
    batch = ctf_2d(n_px, CtfParameters(pix, du, du * 0.9, 15.0, 300.0, 2.7, 0.1, bfactor=[0.0, 50.0, 100.0]))
    assert batch.shape == (3, n_px, n_px // 2 + 1) and batch.dtype == np.float32
    for i in range(3):
        one = ctf_2d(n_px, CtfParameters(pix[i], du[i], du[i] * 0.9, 15.0, 300.0, 2.7, 0.1, bfactor=50.0 * i))
        np.testing.assert_allclose(batch[i], one[0], atol=1e-6)
    focus = CtfParameters(4.0, 20000.0, 20000.0, 0.0, 300.0, 2.7, 0.1)
    plain = ctf_2d(n_px, focus, dtype=np.float64)[0]
    flipped = ctf_2d(n_px, focus, abs_value=True, dtype=np.float64)[0]
    signs = ctf_2d(n_px, focus, only_flip_phases=True, dtype=np.float64)[0]
    np.testing.assert_allclose(flipped, np.abs(plain))
    assert set(np.unique(signs)) == {-1.0, 1.0} and np.all(signs * plain >= 0)
    intact = ctf_2d(n_px, focus, intact_until_first_peak=True, dtype=np.float64)[0, 0]
    first_peak = int(np.argmax(np.diff(plain[0]) < 0))  # the CTF rises from Q0 to its first maximum
    assert first_peak > 3
    assert np.all(intact[:first_peak] == 1.0) and np.allclose(intact[first_peak + 1:], plain[0, first_peak + 1:])
    with pytest.raises(ValueError):
        ctf_2d(n_px, CtfParameters(1.0, 1e4, 1e4, 0.0, 300.0, 2.7, 1.5))



# ---------------------------------------------------------------- real particle stacks

def _read_real(star_rel, stack_rel):
    """Particles table (optics merged), pixel size per particle in Å, images (float64)."""
    starfile = pytest.importorskip("starfile")
    mrcfile = pytest.importorskip("mrcfile")
    blocks = starfile.read(REAL / star_rel, always_dict=True)
    if "optics" in blocks:
        parts = blocks["particles"].merge(blocks["optics"], on="rlnOpticsGroup", suffixes=("", "_optics"))
        pixel = parts["rlnImagePixelSize"].to_numpy(float)
    else:
        parts = next(iter(blocks.values()))
        pixel = parts["rlnDetectorPixelSize"].to_numpy(float) * 1e4 / parts["rlnMagnification"].to_numpy(float)
    index = np.array([int(name.split("@")[0]) - 1 for name in parts["rlnImageName"]])
    with warnings.catch_warnings():  # headers written by other programs: nonstandard map ID / stamp
        warnings.simplefilter("ignore", RuntimeWarning)
        mrc = mrcfile.mmap(REAL / stack_rel, permissive=True)
    with mrc:
        images = np.asarray(mrc.data[index], dtype=np.float64)
    return parts, pixel, images


def _rotational_average(half_power, size_px):
    """Mean over Fourier shells of (…, N, N//2+1) values (full-transform weighted)."""
    shells = fourier.shell_index_2d(size_px)
    mult = fourier.hermitian_weights_2d(size_px)
    n = size_px // 2 + 1
    return fourier.shell_sum(half_power * mult, shells, n) / fourier.shell_sum(mult, shells, n)


def _detrend(curve, shells, degree=4):
    t = (shells - shells.mean()) / shells.std()
    return curve - np.polyval(np.polyfit(t, curve, degree), t)


def _ring_correlations(parts, pixel, images, factors, low_res_angstrom=40.0, high_res_angstrom=8.0):
    """Pearson correlation, over the band low→high resolution, of the detrended log rotational
    average of the stack's power spectrum with the detrended rotational average of the mean CTF²
    for defocus × each factor."""
    n_px = images.shape[-1]
    images = images - images.mean(axis=(-2, -1), keepdims=True)
    ft = fourier.rfft2_centered(images)
    power = _rotational_average(np.mean(ft.real ** 2 + ft.imag ** 2, axis=0), n_px)
    box_angstrom = n_px * pixel[0]
    shells = np.arange(int(np.ceil(box_angstrom / low_res_angstrom)),
                       min(int(box_angstrom / high_res_angstrom), n_px // 2) + 1)
    data = _detrend(np.log(power[shells]), shells)
    out = {}
    for f in factors:
        ctf = ctf_2d(n_px, CtfParameters(pixel, parts["rlnDefocusU"].to_numpy(float) * f,
                                         parts["rlnDefocusV"].to_numpy(float) * f,
                                         parts["rlnDefocusAngle"].to_numpy(float), parts["rlnVoltage"].to_numpy(float),
                                         parts["rlnSphericalAberration"].to_numpy(float),
                                         parts["rlnAmplitudeContrast"].to_numpy(float)), dtype=np.float64)
        model = _detrend(_rotational_average(np.mean(ctf ** 2, axis=0), n_px)[shells], shells)
        out[f] = float(np.corrcoef(data, model)[0, 1])
    return out


REAL_STACKS = [
    pytest.param("relion31/relion31.star", "relion31/relion31.mrcs", 2.806, 5, id="relion31"),
    pytest.param("relion30_empiar10076/empiar_10076_7.star", "relion30_empiar10076/empiar_10076_7.mrc",
                 1.31, 7, id="empiar10076"),
    pytest.param("relion30_80s_subset/sample_particles_relion30.star", "relion30_80s_subset/sample.mrcs",
                 1.338, 8, id="80s_subset"),
]


@pytest.mark.parametrize("star_rel, stack_rel, pixel_angstrom, n_used", REAL_STACKS)
def test_real_stack_rings_match_star_defocus(star_rel, stack_rel, pixel_angstrom, n_used):
    if not REAL.is_dir():
        pytest.skip(f"{REAL} not present")
    parts, pixel, images = _read_real(star_rel, stack_rel)
    keep = parts["rlnVoltage"].to_numpy(float) == 300.0
    if not keep.all():
        # The 80S subset (ASPIRE test data) has rlnVoltage edited to 200 on rows 9-17 to create a
        # second optics group; those images come from the same 300 kV micrograph (their rings fit
        # 300 kV, not 200 kV), so only the rows labelled 300 kV are checked.
        parts, pixel, images = parts[keep].reset_index(drop=True), pixel[keep], images[keep]
    assert len(parts) == n_used
    np.testing.assert_allclose(pixel, pixel_angstrom, atol=1e-3)
    corr = _ring_correlations(parts, pixel, images, (0.7, 0.9, 1.0, 1.1, 1.4))
    assert corr[1.0] > 0.6, corr
    assert corr[1.0] > corr[0.7] + 0.4 and corr[1.0] > corr[1.4] + 0.4, corr
    assert corr[1.0] > corr[0.9] and corr[1.0] > corr[1.1], corr


@pytest.mark.gpu
def test_cupy_matches_numpy():
    cp = cupy_or_skip()
    rng = np.random.default_rng(1)
    n = 5
    params = dict(defocus_u_angstrom=rng.uniform(5000, 30000, n), defocus_v_angstrom=rng.uniform(5000, 30000, n),
                  defocus_angle_deg=rng.uniform(-180, 180, n), voltage_kv=300.0, cs_mm=2.7,
                  amplitude_contrast=0.1, phase_shift_deg=rng.uniform(0, 90, n), bfactor=rng.uniform(0, 100, n),
                  scale=rng.uniform(0.5, 1.0, n))
    want = ctf_2d(90, CtfParameters(1.3, **params), dtype=np.float64)
    got = ctf_2d(90, CtfParameters(1.3, **{k: cp.asarray(v) for k, v in params.items()}), xp=cp, dtype=cp.float64)
    assert isinstance(got, cp.ndarray)
    np.testing.assert_allclose(cp.asnumpy(got), want, atol=1e-12)
    got32 = ctf_2d(90, CtfParameters(1.3, **params), xp=cp)
    assert got32.dtype == cp.float32


def test_the_per_image_coefficients_stay_on_the_host():
    """On a GPU the per-image numbers (wavelength, astigmatism, phase offset, envelope) and the amplitude-contrast
    check are worked out on the host and uploaded once: the array module given is asked only for the
    image-sized arithmetic. (A device reduction for the check was compiled anew by CuPy for each batch size.)"""
    image_sized = ("asarray", "arange", "where", "sin", "exp", "abs", "float64")

    class ImageArithmeticOnly:
        def __getattr__(self, name):
            if name not in image_sized:
                raise AssertionError(f"ctf_2d asked the array module for {name}")
            return getattr(np, name)

    rng = np.random.default_rng(3)
    params = dict(defocus_u_angstrom=rng.uniform(5000, 30000, 4), defocus_v_angstrom=rng.uniform(5000, 30000, 4),
                  defocus_angle_deg=rng.uniform(-180, 180, 4), voltage_kv=300.0, cs_mm=2.7, amplitude_contrast=0.1,
                  phase_shift_deg=rng.uniform(0, 90, 4), bfactor=rng.uniform(0, 100, 4), scale=0.8)
    got = ctf_2d(48, CtfParameters(1.3, **params), intact_until_first_peak=True, xp=ImageArithmeticOnly(),
                 dtype=np.float64)
    want = ctf_2d(48, CtfParameters(1.3, **params), intact_until_first_peak=True, dtype=np.float64)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="amplitude_contrast"):
        ctf_2d(48, CtfParameters(1.3, **{**params, "amplitude_contrast": 1.2}), xp=ImageArithmeticOnly())
