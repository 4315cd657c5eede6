"""Gradient refinement of references (RELION 4/5's VDAM, `--grad`): the schedule and the update, as typed functions
that any job's M-step can call (the initial model now; 2D classification's --grad later).

One iteration of VDAM, as RELION runs it (ml_optimiser.cpp MlOptimiser::iterate, maximization,
maximizationGradientParameters; backprojector.cpp reweightGrad, getFristMoment, getSecondMoment, applyMomenta,
reconstructGrad):
- the E-step runs on a mini-batch of particles (`subset_size`), split at random into two pseudo-half sets;
- per half h the batch's gradient on the padded Fourier grid is g_h = (Σ w·CTF/σ²·(X − CTF·P_ref)) / max(1, W_h),
  W_h = Σ w·CTF²/σ² (RELION back-projects the residual X − CTF·P_ref; here the same sum is written as
  data_h − W_h·F_ref from the ordinary sums, which differs only by where the interpolation happens);
- first moments m_h = μ1·m_h + (1 − μ1)·g_h (μ1 = 0.9; m_h = g_h the first time), a second moment
  v = μ2·v + (1 − μ2)·|g_2 − g_1|²/|(g_1 + g_2)/2|² (μ2 = 0.999: the noise-to-signal ratio per coefficient), and
  the step's direction G = ((m_1 + m_2)/2) / (√v + 10⁻¹²);
- an FSC estimate per shell from the momenta: noise = mean |m_1 − m_2|, signal = mean |F_ref| (amplitudes, not
  powers), SNR = 2·T·signal/noise with T the iteration's τ² fudge, FSC = SNR/(1 + SNR);
- the reference's padded transform (without gridding pre-correction) moves by
  F_ref += s·(FSC·G − (1 − FSC)·F_ref) inside the current radius, s the iteration's step size times
  (1 − exp(−(3K + 10)·p_class)); the map is its inverse transform (no gridding correction, as RELION's
  reconstructGrad).
The schedule over --iter (RELION's initialiseGeneral, updateSubsetSize, updateStepSize, updateTau2Fudge, here for
the initial model, `--denovo_3dref`): the first 30 % of the iterations ("initial") take `grad_ini_subset` particles,
the last 20 % ("final") `grad_fin_subset`, those between a linear ramp; the step size falls along a sigmoid from
0.9 to 0.5 and the τ² fudge rises along one from 1 to --tau2_fudge, both over the iterations between.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cryorefine.core import fourier
from cryorefine.core.arrays import Array, ArrayModule
from cryorefine.core.grid import PaddedGrid
from cryorefine.core.padded_transforms import compact_rows, padded_inverse_window
from cryorefine.core.reconstruct import hermitian_plane

#: RELION's --grad_ini_frac and --grad_fin_frac: the shares of --iter in the initial and the final phase
INITIAL_FRACTION = 0.3
FINAL_FRACTION = 0.2
#: RELION's --mu: the momentum of the first moments (and of the model's other parameters under VDAM)
MOMENTUM = 0.9
#: RELION's getSecondMoment lambda: the momentum of the second moment
SECOND_MOMENT_MOMENTUM = 0.999
#: the second moment before the first update (RELION's MOM2_INIT_CONSTANT)
SECOND_MOMENT_START = 1.0
#: RELION's step size of the 3D initial model (--grad_stepsize) and its start (the "<0.9/0.5>-step" scheme)
INITIAL_MODEL_STEP_SIZE = 0.5
INITIAL_MODEL_FIRST_STEP_SIZE = 0.9
#: the small number RELION adds where the update divides
EPSILON = 1e-12


@dataclass(frozen=True)
class GradientPhases:
    """RELION's split of --iter into the initial, the in-between and the final iterations (grad_ini_iter,
    grad_inbetween_iter, grad_fin_iter)."""

    initial: int
    between: int
    final: int

    @property
    def n_iterations(self) -> int:
        return self.initial + self.between + self.final


def gradient_phases(n_iterations: int, initial_fraction: float = INITIAL_FRACTION,
                    final_fraction: float = FINAL_FRACTION) -> GradientPhases:
    """The phases of `n_iterations` (RELION: the fractions truncated to whole iterations; shares above 0.9 together
    scaled down so that a tenth is left between)."""
    if initial_fraction + final_fraction > 0.9:
        total = initial_fraction + final_fraction + 0.1
        initial_fraction, final_fraction = initial_fraction / total, final_fraction / total
    initial = int(n_iterations * initial_fraction)
    final = int(n_iterations * final_fraction)
    return GradientPhases(initial, max(0, n_iterations - initial - final), final)


def initial_model_subset_sizes(n_particles: int) -> tuple[int, int]:
    """RELION's default mini-batch sizes of the 3D initial model (initialiseGeneral, is_3d_model): initial
    max(min(0.5 % of the particles, 5000), 200), final max(min(10 %, 50000), 1000)."""
    initial = int(max(min(n_particles * 0.005, 5000), 200))
    final = int(max(min(n_particles * 0.1, 50000), 1000))
    return initial, final


def subset_size(iteration: int, phases: GradientPhases, initial_size: int, final_size: int,
                n_particles: int) -> int | None:
    """The mini-batch of `iteration` (RELION's updateSubsetSize without --auto_refine): `initial_size` before the
    in-between phase, then a linear ramp to `final_size`, which the final phase keeps; None (every particle) where
    the batch would hold them all."""
    if iteration < phases.initial:
        size = initial_size
    elif iteration < phases.initial + phases.between:
        size = initial_size + math.floor((iteration - phases.initial) / phases.between * (final_size - initial_size)
                                         + 0.5)
    else:
        size = final_size
    return None if size >= n_particles else int(size)


def _sigmoid_from_start(iteration: int, start: float, length: float) -> float:
    """RELION's falling sigmoid of updateStepSize/updateTau2Fudge: 1 before `start`, 0 after `start + length`."""
    length = max(length, 1e-6)
    exponent = (iteration - start - length / 2.0) / (length / 4.0)
    if exponent > 300:
        return 0.0
    return 1.0 / (10.0 ** exponent + 1.0)


def step_size(iteration: int, phases: GradientPhases, final_step: float = INITIAL_MODEL_STEP_SIZE,
              first_step: float = INITIAL_MODEL_FIRST_STEP_SIZE) -> float:
    """The iteration's step size (RELION's updateStepSize, "<inflate>-step" scheme with inflate = first/final): from
    `first_step` to `final_step` along a sigmoid over the first half of the in-between iterations."""
    scale = _sigmoid_from_start(iteration, phases.initial, phases.between / 2.0)
    return first_step * scale + final_step * (1.0 - scale)


def tau2_fudge_at(iteration: int, phases: GradientPhases, tau2_fudge: float) -> float:
    """The iteration's τ² fudge (RELION's updateTau2Fudge, "<T>-step" scheme of the initial model): from 1 to
    `tau2_fudge` along a sigmoid over the first quarter of the in-between iterations."""
    scale = _sigmoid_from_start(iteration, phases.initial, phases.between / 4.0)
    return 1.0 * scale + tau2_fudge * (1.0 - scale)


def class_step_size(step: float, class_fraction: float, n_classes: int) -> float:
    """A class's share of the step (RELION's maximization: step·(1 − exp(−(3K + 10)·p_class)))."""
    return step * (1.0 - math.exp(-(3 * n_classes + 10) * class_fraction))


@dataclass
class Moments:
    """The momenta of one class on the full padded grid (r_max N/2, compact layout, `core.grid.PaddedGrid`):
    first moments of the two pseudo-half sets (complex, zeros before the first update) and the second moment (real,
    SECOND_MOMENT_START before it, as RELION's MlModel starts it)."""

    first: list  # two complex arrays
    second: Array

    @classmethod
    def start(cls, grid: PaddedGrid, xp: ArrayModule = np) -> Moments:
        return cls([xp.zeros(grid.shape, np.complex128), xp.zeros(grid.shape, np.complex128)],
                   xp.full(grid.shape, SECOND_MOMENT_START, dtype=np.float64))


def _inner(grid: PaddedGrid, full: PaddedGrid) -> tuple[slice, slice, slice]:
    """The part of a `full`-radius compact array that a smaller `grid` (same box and padding) covers."""
    offset = full.origin - grid.origin
    d, _, w = grid.shape
    return slice(offset, offset + d), slice(offset, offset + d), slice(0, w)


def _shell_means(values: Array, shells: Array, inside: Array, n_shells: int, xp: ArrayModule) -> Array:
    """Mean of `values` per shell over the elements `inside`."""
    idx = xp.where(inside, shells, n_shells)
    totals = fourier.shell_sum(xp.where(inside, values, 0.0), idx, n_shells, xp)
    counts = fourier.shell_sum(inside.astype(np.float64), idx, n_shells, xp)
    return xp.where(counts > 0, totals / xp.maximum(counts, 1.0), 0.0)


@dataclass(frozen=True)
class GradientStep:
    """What one VDAM update gave: the reference's new padded transform (compact, the sums' radius) and the FSC
    estimate per shell of the unpadded grid (N//2 + 1)."""

    reference_ft: Array
    fsc_estimate: np.ndarray


def gradient_update(reference_ft: Array, half_sums: list, grid: PaddedGrid, moments: Moments, *, step: float,
                    tau2_fudge: float, xp: ArrayModule = np) -> GradientStep:
    """One VDAM update of a reference (module docstring) from the pseudo-half sets' sums `half_sums`
    [(data, weight), (data, weight)] on `grid` (the current radius), the reference's padded transform
    `reference_ft` on the same grid (`core.projector.Projector` without gridding); `moments` (full radius) are
    updated in place. The sums' x = 0 planes are made Hermitian in place."""
    full = PaddedGrid.create(grid.size_px, grid.padding_factor, grid.size_px // 2)
    inner = _inner(grid, full)
    r2 = grid.radius2(xp)
    inside = r2 < grid.r_max_padded ** 2
    pf = grid.padding_factor
    shells = xp.floor(xp.sqrt(r2) / pf + 0.5).astype(np.int64)
    n_shells = grid.size_px // 2 + 1
    ref = xp.asarray(reference_ft).astype(np.complex128)
    gradients = []
    for (data, weight), first in zip(half_sums, moments.first):
        data[:, :, 0], weight[:, :, 0] = hermitian_plane(data, weight, xp)
        w = xp.asarray(weight, dtype=np.float64)
        g = xp.where(inside, (xp.asarray(data, dtype=np.complex128) - w * ref) / xp.maximum(1.0, w), 0)
        gradients.append(g)
        m = first[inner]
        first[inner] = g if not bool(xp.any(m != 0)) else MOMENTUM * m + (1.0 - MOMENTUM) * g
    g1, g2 = gradients
    mean = (g1 + g2) / 2.0
    ratio = xp.abs(g2 - g1) ** 2 / (xp.abs(mean) ** 2 + EPSILON)
    v = moments.second[inner]
    moments.second[inner] = xp.where(inside, SECOND_MOMENT_MOMENTUM * v + (1.0 - SECOND_MOMENT_MOMENTUM) * ratio, v)
    m1, m2 = moments.first[0][inner], moments.first[1][inner]
    direction = ((m1 + m2) / 2.0) / (xp.sqrt(moments.second[inner]) + EPSILON)
    noise = _shell_means(xp.abs(m1 - m2), shells, inside, n_shells, xp)
    signal = _shell_means(xp.abs(ref), shells, inside, n_shells, xp)
    snr = xp.where(noise > 0, 2.0 * tau2_fudge * signal / xp.where(noise > 0, noise, 1.0), 0.0)
    fsc = xp.clip(snr / (1.0 + snr), 0.0, 1.0)
    f = fsc[xp.minimum(shells, n_shells - 1)]
    new = xp.where(inside, ref + step * (f * direction - (1.0 - f) * ref), 0)
    return GradientStep(new, np.asarray(fsc.get() if hasattr(fsc, "get") else fsc))


def map_from_padded_ft(reference_ft: Array, grid: PaddedGrid, xp: ArrayModule = np) -> Array:
    """The real (N, N, N) map whose padded transform (compact, `core.projector`'s normalisation DFT3/N², without
    gridding pre-correction) is `reference_ft`: the inverse of `core.projector.Projector(map, do_gridding=False)`
    within the grid's radius, float64 (RELION's windowToOridimRealSpace, without gridding correction)."""
    n, npad = grid.size_px, grid.padded_size_px
    r_pad = grid.r_max_padded
    rows, rows_fft = compact_rows(grid)
    wx = min(grid.shape[2], r_pad + 1, npad // 2 + 1)
    ft = xp.zeros((npad, npad, npad // 2 + 1), dtype=np.complex128)
    rows_fft_d = xp.asarray(rows_fft)
    block = xp.asarray(reference_ft)[rows[0]:rows[-1] + 1, rows[0]:rows[-1] + 1, :wx]
    ft[rows_fft_d[:, None], rows_fft_d[None, :], :wx] = block
    volume = padded_inverse_window(ft, n, xp, r_max_padded=r_pad)
    return volume * (float(n) ** 2 / float(npad) ** 3)
