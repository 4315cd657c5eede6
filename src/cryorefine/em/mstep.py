"""The M-step pieces every job shares: weighted sums into a back-projector, a map reconstructed
from it (τ² regularised, solvent-flattened), RELION's joining of two halves at low resolution, and
maximizationOtherParameters (noise spectra, σ of the offsets, norm and scale corrections).

Everything runs with the array module of the sums it is given and in their precision (the GPU
engine's float32 sums stay float32; float64 only in per-shell sums and one slab's temporaries): CuPy
FFTs and reductions on the device for the GPU engine's sums, numpy otherwise; nothing the size of the
sums is copied (`core.reconstruct` works in slabs); the maps come back to the host as float32, in
page-locked memory (their next uploads run at the bus's speed).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from cryorefine.core import reconstruct
from cryorefine.core.arrays import Array, ArrayModule, to_host, to_host_pinned
from cryorefine.core.grid import PaddedGrid, relion_round
from cryorefine.core.projector import BackProjector
from cryorefine.core.symmetry import symmetry_group
from cryorefine.em import memory
from cryorefine.em.schedule import MINRES_MAP_SHELL
from cryorefine.images import coefficients_per_shell

if TYPE_CHECKING:  # for annotations only
    from cryorefine.config import RefineConfig
    from cryorefine.em.solvent import SolventMasks
    from cryorefine.em.state import ModelState
    from cryorefine.estep.backend import Backend
    from cryorefine.estep.engine import WeightedSums

MIN_SIGMA2_OFFSET_ANGSTROM2 = 2.0  # RELION's --min_sigma2_offset


@contextlib.contextmanager
def timed_part(parts: dict[str, float] | None, name: str, xp: ArrayModule) -> Iterator[None]:
    """Adds the seconds of the block to `parts[name]` (a job's M-step parts, `em.loop.StepOutcome
    .maximization_parts`; nothing when `parts` is None). With CuPy the device is waited for at the block's end, so
    that the kernels it queued count in it."""
    if parts is None:
        yield
        return
    tic = time.perf_counter()
    yield
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()
    parts[name] = parts.get(name, 0.0) + time.perf_counter() - tic


#: a job's M-step seconds in none of its timed parts (`parts_with_rest`)
REST_PART = "the rest"


def parts_with_rest(parts: dict[str, float], total_seconds: float) -> dict[str, float]:
    """A job's M-step `parts` (`timed_part`) with, where there are any, the seconds of the whole M-step
    (`total_seconds`, as its runner timed it) that none of them holds, as REST_PART: the log then accounts for every
    second of the M-step. No parts: none."""
    if not parts:
        return dict(parts)
    return {**parts, REST_PART: max(0.0, total_seconds - sum(parts.values()))}


def backprojector(data: Array, weight: Array, model: ModelState, config: RefineConfig, current_size_px: int,
                  xp: ArrayModule) -> BackProjector:
    """A BackProjector over the padded sums `data` (complex) and `weight` (real) of one class, symmetrised
    with --sym (RELION's symmetriseReconstructions, right after the sums are combined: the FSC, the noise
    spectra and the reconstruction all see the symmetrised sums). The sums are changed in place."""
    bp = BackProjector.from_arrays(data, weight, model.ori_size_px, config.padding_factor, current_size_px // 2,
                                   xp=xp)
    bp.symmetrise(symmetry_group(config.symmetry))
    return bp


def joined_backprojector(bp: BackProjector, others: Iterable[tuple[Array, Array]]) -> BackProjector:
    """`bp` holding the sums of several (the two halves'), not symmetrised again: the `others`' sums ((data, weight)
    pairs, on the device or waiting on the host) are added into `bp`'s in place, one slab of planes at a time (no
    third copy of the sums: make what needs `bp`'s own sums before)."""
    for data, weight in others:
        for planes in bp.grid.slabs():
            bp.data[planes] += bp.xp.asarray(data[planes])
            bp.weight[planes] += bp.xp.asarray(weight[planes])
    return bp


def half_sets_fsc(first: tuple[Array, Array] | Array | reconstruct.CroppedAverage,
                  second: tuple[Array, Array] | Array | reconstruct.CroppedAverage, grid: PaddedGrid,
                  xp: ArrayModule) -> np.ndarray:
    """The FSC (N//2+1,) on the host between the downsampled averages of two halves' sums (RELION's
    getDownsampledAverage and getFSC), summed a run of planes at a time. Each half is its (data, weight) on the
    device, or either may be its `downsampled_average` already made (a half that waits on the host, or that
    another MPI worker holds)."""
    return to_host(reconstruct.half_sets_fsc(first, second, grid, xp))


def downsampled_average(bp: BackProjector) -> reconstruct.CroppedAverage:
    """A back-projector's downsampled average on the host, only where it can be non-zero
    (`reconstruct.CroppedAverage`): what the FSC needs of a half that then waits on the host, or that another MPI
    worker holds."""
    return reconstruct.CroppedAverage(bp.data, bp.weight, bp.grid, xp=bp.xp)


def reconstruct_map(bp: BackProjector, tau2: npt.ArrayLike, model: ModelState, config: RefineConfig, xp: ArrayModule,
                    masks: SolventMasks) -> np.ndarray:
    """The map of a back-projector regularised by `tau2` (per shell, host) from shell 5 on (RELION's
    --minres_map: the lowest shells are not regularised), solvent-flattened as
    `masks` (em.solvent.SolventMasks) says (with --flatten_solvent: times --solvent_mask or the soft sphere of
    the particle diameter, then --solvent_mask2's region at its average); a host float32 volume (the maps go
    on as they are written, so a continued run sees exactly the same)."""
    volume = bp.reconstruct(tau2=xp.asarray(tau2), tau2_fudge=config.tau2_fudge, minres_map_px=MINRES_MAP_SHELL)
    return to_host_pinned(masks.apply(volume, xp).astype(np.float32, copy=False))  # made float32 where it is


def unregularised_map(bp: BackProjector, xp: ArrayModule) -> Array:
    """The half map without τ² and without masks (RELION's _unfil.mrc: data / max(weight, mean/1000), the
    same gridding correction), as --solvent_correct_fsc compares them; on the sums' device."""
    return bp.reconstruct(tau2=None)


def low_resolution_join_shell(resolution_angstrom: float, model: ModelState) -> int:
    """The last Fourier shell (px of the original box) at which RELION's joinTwoHalvesAtLowResolution joins the
    halves: ceil(N·pixel / r), r the larger (coarser) of --low_resol_join_halves and the model's current resolution
    (the previous iteration's; ignored while it is not finite)."""
    current = model.current_resolution_angstrom
    limit = max(resolution_angstrom, current) if math.isfinite(current) else resolution_angstrom
    return int(math.ceil(model.ori_size_px * model.pixel_size_angstrom / limit))


def _low_resolution_box(grid, resolution_angstrom, model, xp):
    # RELION's getLowResDataAndWeight: padded frequencies with |k|² ≤ round(pf · shell)²
    radius = relion_round(grid.padding_factor * low_resolution_join_shell(resolution_angstrom, model))
    limit2 = radius * radius
    reach = min(radius, grid.origin)
    o = grid.origin
    box = (slice(o - reach, o + reach + 1), slice(o - reach, o + reach + 1), slice(0, reach + 1))
    kz, ky, kx = grid.frequencies(xp)
    return box, (kz[box[0]] ** 2 + ky[:, box[1]] ** 2 + kx[:, :, box[2]] ** 2) <= limit2


def low_resolution_sums(bp: BackProjector, resolution_angstrom: float,
                        model: ModelState) -> tuple[np.ndarray, np.ndarray]:
    """Host copies of (data, weight) of a back-projector in the small box around the origin that holds the
    frequencies up to `low_resolution_join_shell` (what RELION's joinTwoHalvesAtLowResolution averages)."""
    box, _ = _low_resolution_box(bp.grid, resolution_angstrom, model, bp.xp)
    return np.array(to_host(bp.data[box])), np.array(to_host(bp.weight[box]))  # copies, also of host sums


def averaged_low_resolution_sums(first: tuple[np.ndarray, np.ndarray],
                                 second: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The two halves' `low_resolution_sums` averaged, data and weights (RELION's joinTwoHalvesAtLowResolution)."""
    return 0.5 * (first[0] + second[0]), 0.5 * (first[1] + second[1])


def join_at_low_resolution(bp: BackProjector, joined: tuple[np.ndarray, np.ndarray], resolution_angstrom: float,
                           model: ModelState) -> None:
    """RELION's joinTwoHalvesAtLowResolution for one half: its sums up to `low_resolution_join_shell` replaced by
    `joined`, the average of both halves' `low_resolution_sums` (only that small box is touched)."""
    xp = bp.xp
    box, low = _low_resolution_box(bp.grid, resolution_angstrom, model, xp)
    bp.data[box] = xp.where(low, xp.asarray(joined[0]), bp.data[box])
    bp.weight[box] = xp.where(low, xp.asarray(joined[1]), bp.weight[box])


class Peers(Protocol):
    """The processes that make an M-step's maps together: `Alone`, or an MPI runner's `runners.mpi.WorkerPeers`."""

    def gather_all(self, mine: Any) -> list[Any]:
        """Every peer's `mine`, in peer order."""


class Alone:
    """The peers of a process that makes every map of the M-step itself (one process, or an MPI worker that holds
    every unit's sums): `gather_all` gives back what it is given. An MPI runner's peers
    (`runners.mpi.WorkerPeers`) share out what each gives among all of them."""

    @staticmethod
    def gather_all(mine: Any) -> list[Any]:
        """Every peer's `mine`, in peer order: here, only this one's."""
        return [mine]


ALONE = Alone()


def gathered(peers: Peers, mine: dict) -> dict:
    """The union of the dicts the peers give (`mine` this one's), in peer order."""
    merged = {}
    for part in peers.gather_all(mine):
        merged.update(part)
    return merged


def class_maps_and_spectra(made: dict, previous_maps: Sequence[np.ndarray], spectra: tuple[np.ndarray, ...],
                           tau2_fudge: float, r_max: int) -> list[np.ndarray]:
    """The new map of each class from `made` ({class: (map, τ², σ² of the reference)}, gathered from the
    workers that made them); a class none made (empty) gets zeros shaped as its previous map. Each made class's
    τ², reference σ² and SSNR (tau2_fudge·τ²/σ², zero beyond shell `r_max`) are written into its row of
    `spectra` = (tau2, reference_sigma2, ssnr), arrays (1, K, shells)."""
    tau2, reference_sigma2, ssnr = spectra
    maps = []
    for k, previous in enumerate(previous_maps):
        if k not in made:
            maps.append(np.zeros(np.shape(previous), dtype=np.float32))  # zero pages, not written: free until read
            continue
        new, t2, sigma2 = made[k]
        maps.append(new)
        tau2[0, k, : t2.size] = t2
        reference_sigma2[0, k, : sigma2.size] = sigma2
        with np.errstate(divide="ignore", invalid="ignore"):
            s = np.where(sigma2 > 0, tau2_fudge * t2[: sigma2.size] / sigma2, 0.0)
        s[r_max + 1:] = 0.0
        ssnr[0, k, : s.size] = s
    return maps


def volumes_here(sums: WeightedSums, index: int) -> bool:
    """Whether a unit's WeightedSums hold class `index`'s volumes here (MPI: made by this worker, else None)."""
    return index < len(sums.data) and sums.data[index] is not None


class HalfSums:
    """The half sets' sums (`WeightedSums` of one class each) through a refinement's M-step, each half here on the
    device while it is worked on (`backprojector`); under MPI a worker may hold one half only (`here`), the other
    half's volumes are None. Where the device cannot hold a half that waits on the host beside the other and a
    reconstruction (`em.memory`), they take turns: the half not worked on waits on the host (`parking`), so that
    one half's sums at most are on the device, as on each of RELION's MPI ranks. The sums' volumes are moved and
    let go in place: after the M-step they are not there any more."""

    def __init__(self, sums: list[WeightedSums], backend: Backend, model: ModelState, config: RefineConfig,
                 current_size_px: int) -> None:
        self.sums, self.backend = sums, backend
        self.model, self.config, self.current_size_px = model, config, current_size_px
        self.grid = PaddedGrid.create(model.ori_size_px, config.padding_factor, current_size_px // 2)
        self.here = [h for h, s in enumerate(sums) if volumes_here(s, 0)]
        self.resident = [h in self.here and backend.on_device(s.data[0]) for h, s in enumerate(sums)]
        self.hermitian = [None] * len(sums)  # per half: None until symmetrised, then its Hermitian flag
        away = sum(memory.sums_bytes(self.grid.shape, 1) for h in self.here if not self.resident[h])
        free = backend.free_device_bytes()
        self.parking = len(self.here) > 1 and free is not None and memory.halves_take_turns(
            free, away, memory.reconstruction_bytes(self.grid.shape, model.ori_size_px, self.grid.padded_size_px))
        if not self.parking:
            for h in self.here:
                self._move(h, True)

    def order(self) -> list[int]:
        """The halves here, those on the device first (the fewest bytes moved)."""
        return sorted(self.here, key=lambda h: not self.resident[h])

    def backprojector(self, h: int) -> BackProjector:
        """Half h's BackProjector on the device, symmetrised with --sym the first time (`backprojector`); when
        parking, the other half is moved to the host first. Drop it before asking for the other half."""
        if self.parking:
            for other in self.here:
                if other != h and self.resident[other]:
                    self._move(other, False)
            self.backend.release_cached()
        self._move(h, True)
        s = self.sums[h]
        bp = BackProjector.from_arrays(s.data[0], s.weight[0], self.model.ori_size_px, self.config.padding_factor,
                                       self.current_size_px // 2, xp=self.backend.array_module,
                                       hermitian_enforced=bool(self.hermitian[h]))
        if self.hermitian[h] is None:  # first time on the device: --sym as `backprojector` applies it
            bp.symmetrise(symmetry_group(self.config.symmetry))
            self.hermitian[h] = bp.hermitian_enforced
        return bp

    def release(self, h: int) -> None:
        """Half h's sums are not needed any more: their memory goes."""
        self.sums[h].data[0] = self.sums[h].weight[0] = None
        self.resident[h] = False
        self.here.remove(h)

    def joined(self) -> BackProjector:
        """A BackProjector of both halves' sums (the final iteration's map; both must be here): the other half's
        added into those of the half on the device (half 1 when both are), from the host one slab at a time if it
        waits there."""
        h = self.resident.index(True) if any(self.resident) else 0
        bp = self.backprojector(h)
        return joined_backprojector(bp, [(s.data[0], s.weight[0]) for g, s in enumerate(self.sums) if g != h])

    def _move(self, h, to_device):
        s = self.sums[h]
        move = self.backend.to_device if to_device else self.backend.to_host
        if s.data[0] is not None and self.resident[h] != to_device:
            s.data[0] = move(s.data[0])
            s.weight[0] = move(s.weight[0])
        self.resident[h] = to_device


def maximize_other_parameters(model: ModelState, config: RefineConfig, sums: Sequence[WeightedSums],
                              do_cc: bool) -> None:
    """RELION's maximizationOtherParameters from a list of WeightedSums (two halves, or one set):
    noise spectra, σ offsets (at least 2 Å²), average norm (--norm) and scales (--scale). With CC
    (--firstiter_cc) the noise spectra and scales stay, as in RELION; the σ offsets and the average norm are
    updated all the same (the particles' own norm corrections are, and the next iteration divides by their
    average). Changes `model`."""
    box = model.ori_size_px
    total = sum(s.n_particles for s in sums)
    offset2 = sum(s.sigma2_offset_angstrom2 for s in sums) / (2.0 * total)
    model.sigma_offset_angstrom = math.sqrt(max(offset2, MIN_SIGMA2_OFFSET_ANGSTROM2))
    if config.do_norm:
        model.avg_norm_correction = sum(s.norm_correction for s in sums) / total
    if not do_cc:
        sigma2_sum = sum(s.sigma2_noise for s in sums)
        sumw = sum(s.sumw_group for s in sums)
        per_shell = coefficients_per_shell(box)
        new = sigma2_sum / (2.0 * np.maximum(sumw, 1e-300)[:, None] * np.maximum(per_shell, 1.0)[None, :])
        keep = new > 1e-14
        model.sigma2_noise = np.where(keep, new, model.sigma2_noise)
        if config.do_scale and sums[0].scale_aa is not None:
            xa = sum(s.scale_xa for s in sums)
            aa = sum(s.scale_aa for s in sums)
            scale = np.where(aa > 0, xa / np.maximum(aa, 1e-300), 1.0)
            median = np.sort(scale)[scale.size // 2]  # RELION's: the upper of the two middle values
            scale = np.clip(scale, median / 5, median * 5)
            counts = model.particles_per_scale_group
            counts = (np.ones(scale.size) if counts is None or np.size(counts) != scale.size
                      else np.asarray(counts, dtype=np.float64))
            # the scales' mean over the particles, as RELION normalises them, not over the groups
            model.scale_correction = scale / (np.sum(counts * scale) / max(float(np.sum(counts)), 1.0))
    model.log_likelihood = sum(s.log_likelihood for s in sums)
    model.ave_pmax = sum(s.sum_pmax for s in sums) / total
