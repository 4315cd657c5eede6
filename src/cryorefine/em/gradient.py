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
0.9 to 0.5 and the τ² fudge rises along one from 1 to --tau2_fudge, both over the iterations between. 2D
classification (`--grad` of class2d, ref_dim 2) takes RELION's 2D sizes (`class2d_subset_sizes`), a step size from 0.9
to 0.3, and may replace its least active class by a copy of its most erring one (`class_to_replace`,
--class_inactivity_threshold); a run of several classes takes every particle in its last iteration.

The VDAM M-step of a job's classes (`vdam_maximization`, RELION's maximization and maximizationOtherParameters under
--grad) is written once here for the 2D and the 3D jobs. The momenta (`Moments`) live in the model
(`em.state.ModelState.moments`, RELION's MlModel Igrad1/Igrad2), kept in single precision as RELION's files hold them
(`moments_as_relion`, `moments_from_relion`), so that a run continued from its files goes on exactly as it would have.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from cryorefine.core import fourier
from cryorefine.core.arrays import Array, ArrayModule, to_host
from cryorefine.core.grid import PaddedGrid
from cryorefine.core.padded_transforms import compact_rows, padded_inverse_window, padded_inverse_window_2d
from cryorefine.core.projector import BackProjector, Projector, padded_references_2d, relion_power_spectrum
from cryorefine.core.reconstruct import hermitian_plane, reconstruction_noise_sigma2
from cryorefine.em import mstep, schedule
from cryorefine.em.loop import IterationPlan
from cryorefine.estep.engine import WeightedSums

if TYPE_CHECKING:  # for annotations only
    from cryorefine.config import RefineConfig
    from cryorefine.em.state import ModelState

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
#: RELION's step size of 2D classification and its start (the "<0.9/0.3>-step" scheme)
CLASS2D_STEP_SIZE = 0.3
CLASS2D_FIRST_STEP_SIZE = 0.9
#: the small number RELION adds where the update divides
EPSILON = 1e-12
#: RELION's XMIPP_EQUAL_ACCURACY: a class whose first pseudo-half set's weights sum to no more is not updated
EQUAL_ACCURACY = 1e-6
#: RELION's cadence under --grad (expectationSetup): the angular accuracy is estimated, and with --auto_sampling the
#: sampling updated, once every this many iterations
AUTO_SAMPLING_EVERY = 10
#: RELION's iterate under --grad: before this iteration the counters of iterations without resolution gain and without
#: large changes of the hidden variables start every iteration at 0
COUNTERS_FROM_ITERATION = 10
#: the precision the momenta are kept in (RELION's files of them are single precision)
FIRST_MOMENT_DTYPE = np.complex64
SECOND_MOMENT_DTYPE = np.float32
#: elements of a full-radius class grid per stack of 2D classes stepped at once (`class_stacks`): 32 classes of
#: 360 px at padding 2
CLASS_STACK_ELEMENTS = 1 << 23


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


def class2d_subset_sizes(n_particles: int) -> tuple[int, int]:
    """RELION's default mini-batch sizes of 2D classification (initialiseGeneral, ref_dim 2): initial
    max(min(0.5 % of the particles, 10000), 200), final max(min(5 %, 100000), 1000)."""
    initial = int(max(min(n_particles * 0.005, 10000), 200))
    final = int(max(min(n_particles * 0.05, 100000), 1000))
    return initial, final


def subset_size(iteration: int, phases: GradientPhases, initial_size: int, final_size: int,
                n_particles: int, n_classes: int = 1) -> int | None:
    """The mini-batch of `iteration` (RELION's updateSubsetSize without --auto_refine): `initial_size` before the
    in-between phase, then a linear ramp to `final_size`, which the final phase keeps; None (every particle) where
    the batch would hold them all, and in the last iteration of a run of several classes."""
    if iteration < phases.initial:
        size = initial_size
    elif iteration < phases.initial + phases.between:
        size = initial_size + math.floor((iteration - phases.initial) / phases.between * (final_size - initial_size)
                                         + 0.5)
    else:
        size = final_size
    if size >= n_particles or (iteration == phases.n_iterations and n_classes > 1):
        return None
    return int(size)


def mini_batch(iteration: int, phases: GradientPhases, subset_sizes: tuple[int, int], n_particles: int,
               n_classes: int, random_seed: int, stream: int) -> np.ndarray:
    """The sorted particle indices of the iteration's mini-batch: a random draw of RELION's size (`subset_size`) from
    the stream [random_seed, iteration, stream], every particle where the batch would hold them all."""
    size = subset_size(iteration, phases, *subset_sizes, n_particles, n_classes)
    draw = np.random.default_rng([random_seed, iteration, stream])
    return np.sort(draw.permutation(n_particles)[: size or n_particles])


def pseudo_halves(members: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A mini-batch split into RELION's two pseudo-half sets, by the parity of the particle's index (even: the
    first), as RELION's storeWeightedSums splits them."""
    return members[members % 2 == 0], members[members % 2 == 1]


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
    """The iteration's τ² fudge (RELION's updateTau2Fudge, "<T>-step" scheme of the initial model and of 2D
    classification): from 1 to `tau2_fudge` along a sigmoid over the first quarter of the in-between iterations."""
    scale = _sigmoid_from_start(iteration, phases.initial, phases.between / 4.0)
    return 1.0 * scale + tau2_fudge * (1.0 - scale)


def class_step_size(step: float, class_fraction: float, n_classes: int) -> float:
    """A class's share of the step (RELION's maximization: step·(1 − exp(−(3K + 10)·p_class)))."""
    return step * (1.0 - math.exp(-(3 * n_classes + 10) * class_fraction))


def writes_files(iteration: int, n_iterations: int, whole_batch: bool, every: int) -> bool:
    """Whether a gradient run writes the iteration's files (RELION's MlOptimiser::write under --grad): every `every`
    iterations (--grad_write_iter), at the last, and in every iteration whose batch holds every particle."""
    return whole_batch or iteration % max(1, int(every)) == 0 or iteration == n_iterations


def estimates_accuracy(iteration: int, n_iterations: int) -> bool:
    """Whether a gradient run estimates the angular and translational accuracy before the iteration's E-step (RELION's
    expectationSetup under --grad: iterations 0 and 1, every AUTO_SAMPLING_EVERY, and the last)."""
    return iteration <= 1 or iteration % AUTO_SAMPLING_EVERY == 0 or iteration == n_iterations


def updates_sampling(iteration: int) -> bool:
    """Whether a gradient run with --auto_sampling may change its sampling before the iteration's E-step (RELION's
    expectationSetup under --grad: from iteration 2, once every AUTO_SAMPLING_EVERY iterations)."""
    return iteration > 1 and iteration % AUTO_SAMPLING_EVERY == 0


def counters_at_start(optimiser, iteration: int):
    """The optimiser state at the start of `iteration` of a gradient run: before COUNTERS_FROM_ITERATION the counters
    of iterations without resolution gain and without large hidden-variable changes are 0 (RELION's iterate)."""
    if iteration >= COUNTERS_FROM_ITERATION:
        return optimiser
    return dataclasses.replace(optimiser, nr_iter_wo_resol_gain=0, nr_iter_wo_large_hidden_variable_changes=0)


def auto_sampling(optimiser, model: ModelState, config: RefineConfig):
    """The sampling of a gradient run with --auto_sampling (RELION's updateAngularSampling in relion_refine under
    --grad, not an auto-refine; `em.schedule.update_sampling` with its rules): where the resolution did not improve
    in the last iteration (changes of the hidden variables do not count under --grad) and the oversampled angular
    step is not below 0.75 × the estimated accuracy (`optimiser.acc_rot_deg`), the HEALPix order goes up by one while
    it stays below --auto_local_healpix_order (a gradient run never goes to local searches) and the offsets take
    RELION's step min(1.5 Å, 0.75 × acc_trans)·2^oversampling within 5 × the last changes of the offsets (never
    coarser than before). The new optimiser state. (relion_refine_mpi has a rule of its own, updateAngularSamplingGrad;
    RELION's GUI runs the InitialModel job without MPI, so relion_refine's is the one its users meet.)"""
    optimiser, _ = schedule.update_sampling(optimiser, model, config, schedule.ScheduleState(),
                                            auto_ignore_angle_changes=True, local_searches_allowed=False)
    return optimiser


@dataclass
class GradientPlan(IterationPlan):
    """An iteration plan of a gradient run: the iteration's step size (before a class's share, `class_step_size`)
    and τ² fudge, whether its batch holds every particle (the other parameters then take no momentum), and whether a
    class may be replaced (RELION: between the initial and the final phase)."""

    step_size: float = 0.0
    tau2_fudge: float = 1.0
    whole_batch: bool = False
    may_replace_class: bool = False


@dataclass
class Moments:
    """The momenta of one class on the full padded grid (r_max N/2, compact layout, `core.grid.PaddedGrid`, 2D or
    3D): first moments of the two pseudo-half sets (complex, zeros before the first update) and the second moment
    (real, SECOND_MOMENT_START before it, as RELION's MlModel starts it), in single precision."""

    first: list  # two complex arrays
    second: Array

    @classmethod
    def start(cls, grid: PaddedGrid, xp: ArrayModule = np) -> Moments:
        return cls([xp.zeros(grid.shape, FIRST_MOMENT_DTYPE), xp.zeros(grid.shape, FIRST_MOMENT_DTYPE)],
                   xp.full(grid.shape, SECOND_MOMENT_START, dtype=SECOND_MOMENT_DTYPE))

    def copy(self) -> Moments:
        return Moments([m.copy() for m in self.first], self.second.copy())


def _inner(grid: PaddedGrid, full: PaddedGrid) -> tuple[slice, ...]:
    """The part of a `full`-radius compact array that a smaller `grid` (same box and padding) covers."""
    offset = full.origin - grid.origin
    d, w = grid.shape[0], grid.shape[-1]
    return (slice(offset, offset + d),) * (grid.ndim - 1) + (slice(0, w),)


def _make_hermitian(data: Array, weight: Array, ndim: int, xp: ArrayModule) -> None:
    """The sums' x = 0 plane (3D) or column (2D) made Hermitian in place (RELION's enforceHermitianSymmetry)."""
    if ndim == 3:
        data[:, :, 0], weight[:, :, 0] = hermitian_plane(data, weight, xp)
        return
    o = (data.shape[-2] - 1) // 2  # in 2D, of each of a stack (…, 2R+3, R+2) of sums alike
    column, wcolumn = data[..., :, 0].copy(), weight[..., :, 0].copy()
    data[..., :, 0] = column + xp.conj(column[..., ::-1])
    weight[..., :, 0] = wcolumn + wcolumn[..., ::-1]
    data[..., o, 0], weight[..., o, 0] = column[..., o], wcolumn[..., o]


def _shell_means(values: Array, shells: Array, inside: Array, n_shells: int, xp: ArrayModule) -> Array:
    """Mean of `values` per shell over the elements `inside`."""
    idx = xp.where(inside, shells, n_shells)
    totals = fourier.shell_sum(xp.where(inside, values, 0.0), idx, n_shells, xp)
    counts = fourier.shell_sum(inside.astype(np.float64), idx, n_shells, xp)
    return xp.where(counts > 0, totals / xp.maximum(counts, 1.0), 0.0)


@dataclass(frozen=True)
class GradientStep:
    """What one VDAM update gave: the reference's new padded transform (compact, the sums' radius), the FSC
    estimate per shell of the unpadded grid (N//2 + 1), and the mean power of the step's direction over the grid
    (RELION's avg_grad, by which the most erring class is found); of a stack of classes, each with a leading class
    axis (the mean powers an array)."""

    reference_ft: Array
    fsc_estimate: np.ndarray
    mean_power: float | np.ndarray = 0.0


def gradient_update(reference_ft: Array, half_sums: list, grid: PaddedGrid, moments: Moments, *,
                    step: float | Array, tau2_fudge: float, xp: ArrayModule = np) -> GradientStep:
    """One VDAM update of a reference (module docstring) from the pseudo-half sets' sums `half_sums`
    [(data, weight), (data, weight)] on `grid` (the current radius, 2D or 3D), the reference's padded transform
    `reference_ft` on the same grid (`core.projector.Projector` without gridding); `moments` (full radius) are
    updated in place, in their own precision. The sums' x = 0 planes are made Hermitian in place. Of a stack of
    classes alike, every array with a leading class axis and `step` of shape (K, 1, …) (`update_classes_2d`)."""
    full = PaddedGrid.create(grid.size_px, grid.padding_factor, grid.size_px // 2, ndim=grid.ndim)
    inner = (Ellipsis, *_inner(grid, full))
    axes = tuple(range(-grid.ndim, 0))
    r2 = grid.radius2(xp)
    inside = r2 < grid.r_max_padded ** 2
    pf = grid.padding_factor
    shells = xp.floor(xp.sqrt(r2) / pf + 0.5).astype(np.int64)
    n_shells = grid.size_px // 2 + 1
    ref = xp.asarray(reference_ft).astype(np.complex128)
    gradients = []
    for (data, weight), first in zip(half_sums, moments.first):
        _make_hermitian(data, weight, grid.ndim, xp)
        w = xp.asarray(weight, dtype=np.float64)
        g = xp.where(inside, (xp.asarray(data, dtype=np.complex128) - w * ref) / xp.maximum(1.0, w), 0)
        gradients.append(g)
        m = first[inner].astype(np.complex128)
        started = xp.any(m != 0, axis=axes, keepdims=True)  # a first moment still all zeros takes the gradient
        first[inner] = xp.where(started, MOMENTUM * m + (1.0 - MOMENTUM) * g, g)
    g1, g2 = gradients
    mean = (g1 + g2) / 2.0
    ratio = xp.abs(g2 - g1) ** 2 / (xp.abs(mean) ** 2 + EPSILON)
    v = moments.second[inner].astype(np.float64)
    moments.second[inner] = xp.where(inside, SECOND_MOMENT_MOMENTUM * v + (1.0 - SECOND_MOMENT_MOMENTUM) * ratio, v)
    m1, m2 = (moments.first[h][inner].astype(np.complex128) for h in (0, 1))
    direction = xp.where(inside, ((m1 + m2) / 2.0) / (xp.sqrt(moments.second[inner].astype(np.float64)) + EPSILON),
                         0)
    noise = _shell_means(xp.abs(m1 - m2), shells, inside, n_shells, xp)
    signal = _shell_means(xp.abs(ref), shells, inside, n_shells, xp)
    snr = xp.where(noise > 0, 2.0 * tau2_fudge * signal / xp.where(noise > 0, noise, 1.0), 0.0)
    fsc = xp.clip(snr / (1.0 + snr), 0.0, 1.0)
    f = fsc[..., xp.minimum(shells, n_shells - 1)]
    new = xp.where(inside, ref + step * (f * direction - (1.0 - f) * ref), 0)
    mean_power = np.asarray(to_host(xp.mean(xp.abs(direction) ** 2, axis=axes)))
    return GradientStep(new, np.asarray(to_host(fsc)), float(mean_power) if mean_power.ndim == 0 else mean_power)


def map_from_padded_ft(reference_ft: Array, grid: PaddedGrid, xp: ArrayModule = np) -> Array:
    """The real (N, N, N) map (or (N, N) image of a 2D grid) whose padded transform (compact, `core.projector`'s
    normalisation DFT/N², without gridding pre-correction) is `reference_ft`: the inverse of
    `core.projector.Projector(map, do_gridding=False)` within the grid's radius, float64 (RELION's
    windowToOridimRealSpace, without gridding correction)."""
    n, npad = grid.size_px, grid.padded_size_px
    r_pad = grid.r_max_padded
    rows, rows_fft = compact_rows(grid)
    wx = min(grid.shape[-1], r_pad + 1, npad // 2 + 1)
    rows_fft_d = xp.asarray(rows_fft)
    if grid.ndim == 2:  # of a stack (…, 2R+3, R+2) of 2D classes alike
        reference_ft = xp.asarray(reference_ft)
        ft = xp.zeros(reference_ft.shape[:-2] + (npad, npad // 2 + 1), dtype=np.complex128)
        ft[..., rows_fft_d, :wx] = reference_ft[..., rows[0]:rows[-1] + 1, :wx]
        return padded_inverse_window_2d(ft, n, xp) * (float(n) ** 2 / float(npad) ** 2)
    ft = xp.zeros((npad, npad, npad // 2 + 1), dtype=np.complex128)
    block = xp.asarray(reference_ft)[rows[0]:rows[-1] + 1, rows[0]:rows[-1] + 1, :wx]
    ft[rows_fft_d[:, None], rows_fft_d[None, :], :wx] = block
    volume = padded_inverse_window(ft, n, xp, r_max_padded=r_pad)
    return volume * (float(n) ** 2 / float(npad) ** 3)


def shifted_moments(moments: Moments, grid: PaddedGrid, shift_px: Sequence[float]) -> Moments:
    """The momenta of a 2D class whose image moves by `shift_px` (x, y; pixels): the first moments' transforms
    multiplied by exp(−2πi·k·shift/Np) (RELION's centerClasses under --grad, shiftImageInContinuousFourierTransform
    on the padded grid `grid`); the second moment stays."""
    ky, kx = grid.frequencies()
    turn = -2j * np.pi / grid.padded_size_px
    phase = np.exp(turn * float(shift_px[1]) * ky) * np.exp(turn * float(shift_px[0]) * kx)  # a product of 1D factors
    return Moments([(m * phase).astype(m.dtype) for m in moments.first], moments.second.copy())


def full_grid(size_px: int, padding_factor: float, ndim: int) -> PaddedGrid:
    """The grid of a class's momenta: the whole box (r_max N/2)."""
    return PaddedGrid.create(size_px, padding_factor, size_px // 2, ndim=ndim)


def _relion_window(grid: PaddedGrid) -> tuple[slice, ...]:
    """The part of a full-radius compact array that RELION's arrays of the momenta hold: (Np[, Np], Np/2 + 1),
    frequency 0 at Np/2 along z and y, x from 0."""
    npad = grid.padded_size_px
    start = grid.origin - npad // 2
    return (slice(start, start + npad),) * (grid.ndim - 1) + (slice(0, npad // 2 + 1),)


def _interleaved(values: np.ndarray) -> np.ndarray:
    """A complex array as float32 with real and imaginary parts side by side along x (RELION's files of them)."""
    out = np.empty(values.shape[:-1] + (2 * values.shape[-1],), dtype=np.float32)
    out[..., 0::2], out[..., 1::2] = values.real, values.imag
    return out


def moments_as_relion(moments: Moments, grid: PaddedGrid) -> tuple[list[np.ndarray], np.ndarray]:
    """(first moments of the two pseudo-half sets, second moment) as RELION writes them (MlModel::write): float32
    arrays (Np[, Np], 2·(Np/2 + 1)), each complex value as its real and imaginary parts side by side, frequency 0
    at Np/2 along z and y; the second moment's imaginary parts 0. `grid`: the full grid (`full_grid`)."""
    window = _relion_window(grid)
    first = [_interleaved(to_host(m)[window]) for m in moments.first]
    second = _interleaved(np.asarray(to_host(moments.second)[window], dtype=np.complex64))
    return first, second


def moments_from_relion(first: Sequence[np.ndarray], second: np.ndarray, grid: PaddedGrid) -> Moments:
    """The Moments that `moments_as_relion` wrote as (`first`, `second`) on `grid` (the full grid); the rest of the
    compact arrays, which no update reads, as `Moments.start` has them."""
    moments = Moments.start(grid)
    window = _relion_window(grid)
    for target, values in zip(moments.first, first):
        target[window] = np.asarray(values[..., 0::2], dtype=np.float32) + 1j * np.asarray(values[..., 1::2],
                                                                                          dtype=np.float32)
    moments.second[window] = np.asarray(second[..., 0::2], dtype=SECOND_MOMENT_DTYPE)
    return moments


# ---------------------------------------------------------------------- the M-step of a gradient run
def with_momentum(previous: float | np.ndarray | None, new: float | np.ndarray, mu: float) -> float | np.ndarray:
    """mu·previous + (1 − mu)·new (RELION's parameters under --grad); `new` where there is no previous value."""
    if previous is None:
        return new
    return mu * np.asarray(previous) + (1.0 - mu) * np.asarray(new)


def class_to_replace(pdf_class: np.ndarray, class_errors: np.ndarray, threshold: float) -> tuple[int, int] | None:
    """(the class to drop, the class it becomes a copy of), or None (RELION's maximizationGradientParameters with
    --class_inactivity_threshold): the least active class is dropped where its share is below threshold / (the
    number of classes with a share); it takes the place of a copy of the class of the largest error (the mean power
    of its step times its share)."""
    if threshold <= 0:
        return None
    pdf = np.asarray(pdf_class, dtype=np.float64)
    active = int(np.count_nonzero(pdf > 0))
    drop = int(np.argmin(pdf))
    if active == 0 or pdf[drop] >= threshold / active:
        return None
    return drop, int(np.argmax(np.asarray(class_errors, dtype=np.float64)))


@dataclass
class ClassUpdate:
    """One class's VDAM step (`update_class`): its new map (float64, before masks), τ² (the previous map's power per
    shell) and the reconstruction's σ² (of the first pseudo-half set), its updated momenta, the FSC estimate and the
    mean power of the step's direction."""

    map: np.ndarray
    tau2: np.ndarray
    sigma2: np.ndarray
    moments: Moments
    fsc_estimate: np.ndarray
    mean_power: float


def update_class(previous_map: np.ndarray, halves: list, moments: Moments, *, padding_factor: float, r_max: int,
                 step: float, tau2_fudge: float, xp: ArrayModule = np) -> ClassUpdate:
    """The VDAM step of one class (2D image or 3D map) from its pseudo-half sets' sums `halves` [(data, weight) × 2]
    at the current radius `r_max`, worked out on `xp`'s device (the sums are taken there, where a GPU engine's
    already are; their x = 0 planes are made Hermitian in place); `moments` are not changed (the update has a copy).
    The update's arrays are on the host."""
    previous = xp.asarray(np.asarray(previous_map, dtype=np.float64))
    box = previous.shape[0]
    n_shells = box // 2 + 1
    grid = PaddedGrid.create(box, padding_factor, r_max, ndim=previous.ndim)
    reference_ft = Projector(previous, padding_factor, r_max, do_gridding=False, xp=xp).data
    t2 = np.asarray(to_host(Projector(previous, padding_factor, r_max, xp=xp).power_spectrum),
                    dtype=np.float64)[:n_shells]
    t2[r_max + 1:] = 0.0
    halves = [(xp.asarray(data), xp.asarray(weight)) for data, weight in halves]
    # the noise of the reconstruction from the first pseudo-half set's weights (RELION's updateSSNRarrays of its first
    # back-projector)
    sigma2 = np.asarray(to_host(BackProjector.from_arrays(halves[0][0], halves[0][1], box, padding_factor, r_max,
                                                          xp=xp).noise_sigma2()), dtype=np.float64)[:n_shells]
    working = (moments.copy() if xp is np
               else Moments([xp.asarray(m) for m in moments.first], xp.asarray(moments.second)))
    update = gradient_update(reference_ft, halves, grid, working, step=step, tau2_fudge=tau2_fudge, xp=xp)
    image = to_host(map_from_padded_ft(update.reference_ft, grid, xp))
    if xp is not np:
        working = Moments([to_host(m) for m in working.first], to_host(working.second))
    return ClassUpdate(image, t2, sigma2, working, update.fsc_estimate, float(update.mean_power))


def update_classes_2d(previous_maps: Sequence[np.ndarray], halves: Sequence[list], moments: Sequence[Moments], *,
                      padding_factor: float, r_max: int, steps: Sequence[float], tau2_fudge: float,
                      xp: ArrayModule = np) -> list[ClassUpdate]:
    """`update_class` of several 2D classes in one pass of stacked arrays (their references' transforms, spectra,
    updates and images each in one batched operation: on an H200, 100 classes of 360 px took 0.84–0.99 s an
    iteration one at a time, mostly in launches and transfers, 0.48 s so): class k from `previous_maps[k]`, its
    pseudo-half sets' sums `halves[k]`, its momenta `moments[k]` (not changed) and its step `steps[k]`. The
    updates, as `update_class` gives each."""
    previous = xp.asarray(np.stack([np.asarray(m, dtype=np.float64) for m in previous_maps]))
    box = previous.shape[-1]
    n_shells = box // 2 + 1
    grid = PaddedGrid.create(box, padding_factor, r_max, ndim=2)
    reference_ft = padded_references_2d(previous, grid, np.float64, xp, do_gridding=False)
    tau2 = np.asarray(to_host(relion_power_spectrum(padded_references_2d(previous, grid, np.float64, xp), grid, xp)),
                      dtype=np.float64)[:, :n_shells]
    tau2[:, r_max + 1:] = 0.0
    del previous
    sums = [(xp.stack([xp.asarray(h[i][0]) for h in halves]), xp.stack([xp.asarray(h[i][1]) for h in halves]))
            for i in (0, 1)]
    # the noise of each reconstruction from the first pseudo-half set's weights (as `update_class`)
    sigma2 = np.asarray(to_host(reconstruction_noise_sigma2(sums[0][1], grid, xp)), dtype=np.float64)[:, :n_shells]
    working = Moments([xp.asarray(np.stack([m.first[i] for m in moments])) for i in (0, 1)],
                      xp.asarray(np.stack([m.second for m in moments])))
    step = xp.asarray(np.asarray(steps, dtype=np.float64).reshape(-1, 1, 1))
    update = gradient_update(reference_ft, sums, grid, working, step=step, tau2_fudge=tau2_fudge, xp=xp)
    del sums, reference_ft
    images = np.asarray(to_host(map_from_padded_ft(update.reference_ft, grid, xp)))
    firsts = [np.asarray(to_host(m)) for m in working.first]
    second = np.asarray(to_host(working.second))
    powers = np.atleast_1d(update.mean_power)
    return [ClassUpdate(images[k], tau2[k], sigma2[k], Moments([firsts[0][k], firsts[1][k]], second[k]),
                        update.fsc_estimate[k], float(powers[k])) for k in range(len(previous_maps))]


def class_stacks(n_classes: int, grid: PaddedGrid) -> list[range]:
    """The classes (0 … n_classes−1) in stacks for `update_classes_2d` of about CLASS_STACK_ELEMENTS elements of
    the full-radius `grid` each, so that its temporaries stay bounded at any box size and number of classes."""
    per_stack = max(1, CLASS_STACK_ELEMENTS // int(np.prod(grid.shape)))
    return [range(k, min(n_classes, k + per_stack)) for k in range(0, n_classes, per_stack)]


@dataclass(frozen=True)
class Replacement:
    """A class dropped for its inactivity and made a copy of another (`class_to_replace`)."""

    dropped: int
    copied: int


def vdam_maximization(model: ModelState, sums: Sequence[WeightedSums], plan: GradientPlan, config: RefineConfig,
                      peers: mstep.Peers, finish: Callable[[np.ndarray, Moments], tuple[np.ndarray, Moments]],
                      inactivity_threshold: float = 0.0, xp: ArrayModule = np,
                      parts: dict[str, float] | None = None) -> tuple[ModelState, Replacement | None]:
    """The M-step of a gradient run of K classes from its two pseudo-half sets' sums (`sums`, one unit each, every
    class in both), as RELION's maximization under --grad: the step of each class with a share and weights
    (`update_class`, on `xp`'s device; 2D classes in stacks, `update_classes_2d`; under MPI of the classes whose
    volumes are here, the others' gathered from `peers`); with
    `inactivity_threshold` and `plan.may_replace_class`, the least active class replaced (`class_to_replace`: it
    takes the other's previous map, its new momenta, share, spectra and directions, and is not updated); then
    `finish(map, moments)` on every class (RELION's centerClasses and solventFlatten); the class shares, direction
    distributions and the other parameters with momentum (RELION's maximizationOtherParameters: 0.9, none where the
    batch holds every particle). The new model, and the replacement made; the seconds of its parts are added to
    `parts` (`mstep.timed_part`)."""
    previous = model
    model = dataclasses.replace(model)
    k_classes, n_shells = model.n_classes, model.n_shells
    r_max = plan.sizes.current_size_px // 2
    small = WeightedSums.total([s.without_volumes() for s in sums])
    pdf_previous = np.asarray(previous.pdf_class, dtype=np.float64)
    stepped = {}  # the classes to step: their pseudo-half sets' sums
    for k in range(k_classes):
        if not all(mstep.volumes_here(s, k) for s in sums):
            continue
        halves = [(s.data[k], s.weight[k]) for s in sums]
        for s in sums:
            s.data[k] = s.weight[k] = None
        if pdf_previous[k] <= 0 or float(halves[0][1].sum()) <= EQUAL_ACCURACY:
            continue  # RELION keeps the previous reference of a class without share or weights
        stepped[k] = halves
    made = {}
    with mstep.timed_part(parts, "class steps", xp):
        steps = {k: class_step_size(plan.step_size, pdf_previous[k], k_classes) for k in stepped}
        order = [k for k in sorted(stepped) if np.ndim(previous.maps[0][k]) == 2]  # 2D classes: stacks at once
        for stack in class_stacks(len(order), full_grid(model.ori_size_px, config.padding_factor, 2)):
            ks = [order[i] for i in stack]
            updates = update_classes_2d([previous.maps[0][k] for k in ks], [stepped.pop(k) for k in ks],
                                        [previous.moments[k] for k in ks], padding_factor=config.padding_factor,
                                        r_max=r_max, steps=[steps[k] for k in ks], tau2_fudge=plan.tau2_fudge, xp=xp)
            made.update(zip(ks, updates))
        for k in sorted(stepped):  # 3D maps: one at a time
            made[k] = update_class(previous.maps[0][k], stepped.pop(k), previous.moments[k],
                                   padding_factor=config.padding_factor, r_max=r_max, step=steps[k],
                                   tau2_fudge=plan.tau2_fudge, xp=xp)
    with mstep.timed_part(parts, "maps shared among the workers", np):
        made = mstep.gathered(peers, made)

    def rows(values, shape):
        return np.zeros(shape) if values is None or np.shape(values) != shape else np.array(values, dtype=np.float64)

    maps = list(previous.maps[0])
    moments = list(previous.moments)
    tau2, ssnr, ref_sigma2 = (rows(getattr(previous, name), (1, k_classes, n_shells))
                              for name in ("tau2", "ssnr", "reference_sigma2"))
    fsc = rows(previous.fsc_halves, (k_classes, n_shells))
    errors = np.zeros(k_classes)
    for k, update in made.items():
        maps[k], moments[k] = update.map, update.moments
        tau2[0, k] = 0.0
        tau2[0, k, : update.tau2.size] = update.tau2
        ref_sigma2[0, k] = 0.0
        ref_sigma2[0, k, : update.sigma2.size] = update.sigma2
        with np.errstate(divide="ignore", invalid="ignore"):
            s = np.where(update.sigma2 > 0, plan.tau2_fudge * update.tau2[: update.sigma2.size] / update.sigma2, 0.0)
        s[r_max + 1:] = 0.0
        ssnr[0, k] = 0.0
        ssnr[0, k, : s.size] = s
        fsc[k] = update.fsc_estimate[:n_shells]
        errors[k] = update.mean_power * pdf_previous[k]
    shares = pdf_previous.copy()
    directions_previous = previous.pdf_direction
    replaced = class_to_replace(pdf_previous, errors, inactivity_threshold) if plan.may_replace_class else None
    if replaced is not None:
        drop, copy = replaced
        maps[drop], moments[drop] = previous.maps[0][copy], moments[copy].copy()
        shares[drop] = pdf_previous[copy]
        for array, old in ((tau2, previous.tau2), (ssnr, previous.ssnr)):
            if old is not None and np.shape(old) == array.shape:
                array[0, drop] = old[0, copy]
        if directions_previous is not None:
            directions_previous = np.array(directions_previous, dtype=np.float64)
            directions_previous[drop] = directions_previous[copy]
    with mstep.timed_part(parts, "centring and masks", np):
        for k in range(k_classes):
            image, moments[k] = finish(np.asarray(maps[k], dtype=np.float64), moments[k])
            maps[k] = np.asarray(image, dtype=np.float32)
    model.maps = [maps]
    model.moments = moments
    model.tau2, model.ssnr, model.reference_sigma2, model.fsc_halves = tau2, ssnr, ref_sigma2, fsc
    mu = 0.0 if plan.whole_batch else MOMENTUM
    batch = np.asarray(small.pdf_class, dtype=np.float64)
    total = float(batch.sum())
    if total > 0:
        shares = mu * shares + (1.0 - mu) * batch / total
        shares = shares / shares.sum() if shares.sum() > 0 else shares
    model.pdf_class = model.class_distribution = shares
    directions = np.asarray(small.pdf_direction, dtype=np.float64).reshape(k_classes, -1)
    total = directions.sum()
    directions = directions / total if total > 0 else np.full(directions.shape, 1.0 / directions.size)
    with mstep.timed_part(parts, "other parameters", np):
        mstep.maximize_other_parameters(model, config, [small], False)
        other_parameters_with_momentum(model, previous, directions_previous, directions, mu)
    return model, None if replaced is None else Replacement(*replaced)


def other_parameters_with_momentum(model: ModelState, previous: ModelState, directions_previous: np.ndarray | None,
                                   directions: np.ndarray, mu: float) -> None:
    """RELION's maximizationOtherParameters under --grad, on `model` (whose parameters are the mini-batch's): each
    parameter averaged with its previous value, momentum `mu` (RELION's 0.9; 0 where the batch holds every particle;
    the first iteration's previous values are the start's): noise spectra, σ of the offsets (as σ²), average norm,
    scales and the direction distributions (`directions`, from `directions_previous`)."""
    model.sigma2_noise = with_momentum(previous.sigma2_noise, model.sigma2_noise, mu)
    model.sigma_offset_angstrom = float(np.sqrt(with_momentum(previous.sigma_offset_angstrom ** 2,
                                                              model.sigma_offset_angstrom ** 2, mu)))
    model.avg_norm_correction = float(with_momentum(previous.avg_norm_correction, model.avg_norm_correction, mu))
    if model.scale_correction is not None and previous.scale_correction is not None:
        model.scale_correction = with_momentum(previous.scale_correction, model.scale_correction, mu)
    if directions_previous is not None and np.shape(directions_previous) == np.shape(directions):
        directions = with_momentum(directions_previous, directions, mu)
    model.pdf_direction = directions


def optimiser_labels(plan: GradientPlan | None, config: RefineConfig, phases: GradientPhases,
                     subset_sizes: tuple[int, int], n_particles: int, step_sizes: tuple[float, float],
                     inactivity_threshold: float = 0.0) -> dict:
    """RELION's gradient labels of optimiser_general (MlOptimiser::write) for a gradient run's iteration (`plan`;
    None: iteration 0, before the first step, where RELION's optimiser has taken no gradient step yet and no
    mini-batch: rlnDoStochasticGradientDescent and rlnSgdSubsetSize 0); `step_sizes`: (the final step size, the
    first)."""
    iteration = 0 if plan is None else plan.iteration
    n_batch = 0 if plan is None else sum(unit.members.size for unit in plan.units)
    final_step, first_step = step_sizes
    return {
        "rlnDoGradientRefine": 1, "rlnDoStochasticGradientDescent": int(plan is not None),
        "rlnTau2FudgeScheme": f"{config.tau2_fudge:.6f}-step",
        "rlnGradEmIters": 0, "rlnGradHasConverged": 0,
        "rlnGradCurrentStepsize": f"{step_size(iteration, phases, final_step, first_step):.6f}",
        "rlnSgdInitialIterationsFraction": f"{INITIAL_FRACTION:.6f}",
        "rlnSgdFinalIterationsFraction": f"{FINAL_FRACTION:.6f}",
        "rlnSgdInitialSubsetSize": subset_sizes[0], "rlnSgdFinalSubsetSize": subset_sizes[1],
        "rlnSgdMuFactor": f"{MOMENTUM:.6f}",
        "rlnSgdClassInactivityThreshold": f"{inactivity_threshold:.6f}",
        "rlnSgdSubsetSize": n_batch if plan is None or n_batch < n_particles else -1,
        "rlnSgdWriteEverySubset": int(config.grad_write_iter),
        "rlnSgdStepsize": f"{final_step:.6f}",
        "rlnSgdStepsizeScheme": f"{first_step / final_step:.6f}-step",
    }
