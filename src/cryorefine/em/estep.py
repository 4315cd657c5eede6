"""The one batch loop of the E-step, for every job and runner.

An iteration's E-step is a list of work units (`WorkUnit`: the particles of a half set, or of a
set of classes, with the engine set-up they are compared under). Whoever runs the E-step (one
process, or an MPI worker fed by the master) hands `run_batches` a stream of (unit, particle
indices) pairs; for each batch the loop reads the images (the next batch's on a thread while this
one is worked on, which also uploads them where the device has room: `gpu.staging`; a GPU process keeps
the images of the particles it is handed each iteration on its device where they fit, `kept_images`, and
reads and uploads them once), prepares them,
runs the unit's engine and passes the per-particle results on; in a local search the next batch's
neighbourhoods are computed on another thread while the engine runs this one. An engine is set up
when its unit's first batch arrives and its weighted sums are collected when the unit's batches end;
a batch of large images is prepared in parts that fit the device's free memory and handed to the
engine joined (in runs, where even the prepared images are too many); where the device cannot hold
every unit's sums (`sums_wait_on_host`), a finished unit's sums wait on the host while the next unit
is worked on. Every second is added to a named stage:
`setup` (engines), `read_wait` (waiting for the read-ahead thread), `orientations` (waiting for the
neighbourhoods' thread), `images` (preparation), `results` (each batch's per-particle results stored,
progress), `park` (sums moved to the host), then the engine's own stages. The initial noise spectra are
added up one batch at a time (`noise_batch_sums`), so that MPI workers can share the pass out.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from cryorefine.core.arrays import ArrayModule
from cryorefine.core.grid import PaddedGrid
from cryorefine.core.sampling import healpix_pixels
from cryorefine.em import memory
from cryorefine.estep.common import fine_pass_limit, local_orientations
from cryorefine.estep.engine import BatchResult, IterationSetup, WeightedSums
from cryorefine.images import ImageSettings, NoiseEstimate, PreviousValues, prepare_batch, prepare_in_parts
from cryorefine.io import mrc

if TYPE_CHECKING:  # for annotations only
    import logging

    from cryorefine.config import RefineConfig
    from cryorefine.data import KeptImages, ParticleSet
    from cryorefine.em.state import ModelState, ParticleState
    from cryorefine.estep.backend import Backend


@dataclass
class WorkUnit:
    """Particles compared under one engine set-up: `setup.maps` are the references of the classes
    `classes` (their numbers in the model), and results' class indices are mapped through it."""

    name: str
    members: np.ndarray  # particle indices
    classes: np.ndarray  # (len(setup.maps),) class numbers, 0-based
    setup: IterationSetup


@dataclass
class BatchInputs:
    """What preparing an iteration's batches needs beyond the particles and the image settings."""

    iteration: int
    current_size_px: int
    avg_norm_correction: float
    previous: object  # em.state.ParticleState at the start of the iteration (origins, norms, poses, classes)
    use_norms: bool  # --norm: images are scaled by their norm corrections


#: HEALPix order of the NEST curve that a local search's particles are put in order along (`in_direction_order`):
#: 12,582,912 cells, finer than any neighbourhood, so that the order follows the curve
DIRECTION_CURVE_ORDER = 10


def in_direction_order(units: Sequence[WorkUnit], rot_deg: npt.ArrayLike, tilt_deg: npt.ArrayLike) -> list[WorkUnit]:
    """`units`, each local search's members put in order along HEALPix's NEST curve through their previous
    directions (rot_deg, tilt_deg: every particle's); the other units as they are.

    A local search projects each particle's own neighbourhood of the reference, the voxels near one central
    plane. Consecutive batches of particles from one region of the sphere touch nearby planes, which the GPU's
    cache then holds for the particles worked on at once; in the order of the STAR file, each batch's particles
    come from all over the sphere. Each batch still reads its images in the stacks' order (`ParticleSet.batches`).
    """
    out = []
    for unit in units:
        members = np.asarray(unit.members)
        if unit.setup.local_searches and members.size > 1:
            curve = healpix_pixels(DIRECTION_CURVE_ORDER, np.asarray(rot_deg)[members], np.asarray(tilt_deg)[members])
            unit = dataclasses.replace(unit, members=members[np.argsort(curve, kind="stable")])
        out.append(unit)
    return out


@dataclass(frozen=True)
class FinePassLimitReached:
    """Particles of an iteration's units that reached their fine pass's limit (`estep.common.fine_pass_limit`)."""

    limit: int  # significant coarse samples a particle kept at most
    children: int  # fine samples a coarse sample
    raised: bool  # a classification's finer pass (IterationSetup.fine_pass_raised)
    n_reached: int  # particles at the limit
    n_particles: int  # particles of the units with that limit


def fine_pass_limits_reached(units: Sequence[WorkUnit], n_significant: npt.ArrayLike) -> list[FinePassLimitReached]:
    """Where units' fine passes kept fewer significant coarse samples than --maxsig allows
    (`estep.common.fine_pass_limit`) and some particles reached that limit: a FinePassLimitReached per limit.
    `n_significant` holds every particle's count (rlnNrOfSignificantSamples) after the E-step."""
    n_significant = np.asarray(n_significant)
    by_limit = {}
    for unit in units:
        limit = fine_pass_limit(unit.setup)
        if limit <= 0 or 0 < unit.setup.max_significants <= limit:
            continue
        sampling = unit.setup.sampling
        key = (limit, sampling.n_fine_orientations() * sampling.n_fine_translations(), unit.setup.fine_pass_raised)
        reached, members = by_limit.setdefault(key, (set(), set()))
        members.update(np.asarray(unit.members).tolist())
        reached.update(np.asarray(unit.members)[n_significant[unit.members] >= limit].tolist())
    return [FinePassLimitReached(*key, len(reached), len(members))
            for key, (reached, members) in sorted(by_limit.items()) if reached]


def add_seconds(stages: dict[str, float], name: str, tic: float) -> float:
    """Add the seconds since `tic` to stages[name]; returns now (the next stage's tic)."""
    now = time.perf_counter()
    stages[name] = stages.get(name, 0.0) + now - tic
    return now


def add_counts(totals: dict[str, float], counts: Mapping[str, float]) -> None:
    """Add a dict of per-stage numbers into `totals`."""
    for name, value in counts.items():
        totals[name] = totals.get(name, 0.0) + value


def run_batches(backend: Backend, units: Sequence[WorkUnit], work: Iterable[tuple[int, np.ndarray]],
                particles: ParticleSet, settings: ImageSettings, inputs: BatchInputs,
                reader: mrc.StackReader | mrc.PrereadImages, on_result: Callable[[int, np.ndarray, BatchResult], None],
                stages: dict[str, float], flops: dict[str, float],
                park_finished: bool = False, kept: KeptImages | None = None) -> dict[int, WeightedSums]:
    """The E-step over `work`, an iterable of (unit index, particle indices) in which each unit's batches
    come together; `on_result(unit index, indices, BatchResult)` after each batch. Returns the weighted
    sums of each unit that had batches {unit index: WeightedSums}; with `park_finished` those of every unit
    but the last are on the host (moved there as the unit ends, `backend.to_host`; stage `park`). Seconds
    per stage are added to `stages`, the engines' operation counts to `flops`. Images `kept` on the device
    (`kept_images`) are neither read nor uploaded again, and those read are kept there while it has room.

    In a local search the next batch's neighbourhoods (`estep.common.local_orientations` under its unit's
    set-up, from its particles' previous poses) are computed on a thread while the engine runs this batch,
    and handed to `engine.run`; the main thread's wait for them is stage `orientations`."""
    xp = backend.array_module
    previous = inputs.previous
    norms = previous.norm_correction if inputs.use_norms else np.ones_like(previous.norm_correction)
    poses = (previous.rot_deg, previous.tilt_deg, previous.psi_deg)
    previous_values = PreviousValues(previous.origin_x_px, previous.origin_y_px, norms, previous.class_index, *poses)
    queued = deque()  # (unit, indices) of the batches taken from `work` (read_ahead takes one ahead), in order

    def batches() -> Iterator[np.ndarray]:
        for u, indices in work:
            queued.append((u, indices))
            yield indices

    sums = {}
    engine, current = None, None
    references = SharedReferences(backend, units)
    with ThreadPoolExecutor(1, thread_name_prefix="neighbourhoods") as pool:
        # a future of them (None in a global search), computed on the thread
        def neighbourhoods(u: int, indices: np.ndarray) -> Future:
            return pool.submit(local_orientations, units[u].setup, *(p[indices] for p in poses))

        tic = time.perf_counter()
        _make_lazy_tables(units, poses)
        tic_wait = add_seconds(stages, "orientations", tic)
        following = None
        uploads = memory.upload_slots_room(backend.free_device_bytes())
        for indices, images in particles.read_ahead(batches(), reader, xp, device_bytes=uploads, kept=kept):
            u, _ = queued.popleft()
            tic = add_seconds(stages, "read_wait", tic_wait)
            # this batch's neighbourhoods were started while the last batch ran (the first batch's start now);
            # the next batch's start now, under its own unit's set-up
            this = following if following is not None else neighbourhoods(u, indices)
            following = neighbourhoods(*queued[0]) if queued else None
            tic = add_seconds(stages, "orientations", tic)
            if u != current:
                if engine is not None:
                    sums[current] = _collect(engine, stages, flops)  # its seconds go to the engine's own stages
                    engine = None  # its device buffers go before the next engine takes its own
                    tic = time.perf_counter()
                    if park_finished:
                        sums[current].move_volumes(backend.to_host)
                        tic = add_seconds(stages, "park", tic)
                engine = backend.make_engine()
                engine.setup(references.setup_of(u))
                current = u
                tic = add_seconds(stages, "setup", tic)
            prepare = functools.partial(_prepare_part, particles, indices, images, reader, settings, inputs,
                                        previous_values, xp)
            runs = _engine_runs(backend, indices.size, settings.ori_size_px, inputs.current_size_px)
            for parts in runs:
                batch = prepare_in_parts(prepare, parts)
                backend.synchronize()  # the preparation's device work in its own stage, not the engine's upload
                tic = add_seconds(stages, "images", tic)
                # a batch taken in several runs has its neighbourhoods computed by the engine, run by run
                local = this.result() if len(runs) == 1 else None
                add_seconds(stages, "orientations", tic)
                result = engine.run(batch, local=local)
                tic = time.perf_counter()
                del batch, local  # its device arrays go before the next batch's (the arena is a stack)
                result.class_index = np.asarray(units[u].classes)[np.asarray(result.class_index)]
                on_result(u, indices[parts[0].start:parts[-1].stop], result)
                tic = add_seconds(stages, "results", tic)
            del images, prepare, this
            tic_wait = time.perf_counter()
    if engine is not None:
        sums[current] = _collect(engine, stages, flops)
    return sums


class SharedReferences:
    """The engines' set-ups of an iteration's units, where several units would transform the same references (the
    same map objects at the same padding, current size and dimension: a gradient run's two pseudo-half sets, which
    share the model's classes) with those references made once, as projectors (`Backend.shared_projectors`, in the
    current scope), when the first of them is set up, and given to the others as they are. Units with projectors
    of their own (an MPI worker's, shared among the unit's workers) or alone with their maps keep their set-up."""

    def __init__(self, backend: Backend, units: Sequence[WorkUnit]):
        self.backend = backend
        self.units = units
        groups: dict[tuple, list[int]] = {}
        for u, unit in enumerate(units):
            s = unit.setup
            if s.maps is not None and s.projectors is None:
                key = (tuple(id(m) for m in s.maps), float(s.padding_factor), int(s.current_size_px), int(s.ref_dim))
                groups.setdefault(key, []).append(u)
        self.group_of = {u: tuple(members) for members in groups.values() if len(members) > 1 for u in members}
        self.projectors: dict[tuple[int, ...], list] = {}

    def setup_of(self, u: int) -> IterationSetup:
        """Unit `u`'s set-up, its maps replaced by the projectors its group shares (made now if none are yet)."""
        s = self.units[u].setup
        group = self.group_of.get(u)
        if group is None:
            return s
        if group not in self.projectors:
            self.projectors[group] = self.backend.shared_projectors(
                s.maps, s.padding_factor, s.current_size_px // 2, [0] * len(s.maps), 0, _kept_here)
        return dataclasses.replace(s, maps=None, projectors=self.projectors[group])


def kept_images(backend: Backend, particles: ParticleSet, owned: npt.ArrayLike, reserve_bytes: float,
                log: logging.Logger) -> KeptImages | None:
    """Device slots for the images of the `owned` particles (`data.KeptImages`), as many as the free device memory's
    share allows beside `reserve_bytes` (`memory.kept_images_capacity`, `memory.whole_box_iteration_bytes`),
    allocated in the scope that is current (the caller's: the run's, between iterations); None on the host or
    without room for one. Logged either way."""
    from cryorefine.data import KeptImages

    owned = np.asarray(owned)
    free = backend.free_device_bytes()
    if free is None or owned.size == 0:
        return None
    box = particles.geometry()[0]
    with mrc.StackReader() as reader:
        dtype = reader.wire_dtype(particles.stack_paths)
    capacity = memory.kept_images_capacity(free, KeptImages.image_bytes((box, box), dtype), owned.size, reserve_bytes)
    if capacity == 0:
        log.info("%s: no room to keep particle images on the device; every iteration reads them from their stacks",
                 backend.describe())
        return None
    kept = KeptImages(owned, len(particles), capacity, (box, box), dtype, backend.array_module)
    log.info("%s keeps %s of its %s particles' images on the device (%.3g GB, %s): read from their stacks and "
             "uploaded once%s", backend.describe(), f"{capacity:,}", f"{owned.size:,}", kept.nbytes / 1e9,
             np.dtype(dtype).name, "" if capacity == owned.size else "; the others every iteration")
    return kept


def kept_images_reserve_bytes(config: RefineConfig, model: ModelState, box_px: int) -> float:
    """The device memory a run's iteration at the whole box may need beside the kept images
    (`memory.whole_box_iteration_bytes` of its maps: every class of every half, as the model holds them)."""
    maps = [m for row in model.maps if row is not None for m in row if m is not None]
    ndim = np.ndim(maps[0]) if maps else 3
    return memory.whole_box_iteration_bytes(box_px, config.padding_factor, max(1, len(maps)), ndim)


def _kept_here(data, owner: int) -> None:
    """`Backend.shared_projectors`'s `share` within one process: every transform is made here already."""


def _make_lazy_tables(units, poses):
    """The tables a local search's sampling makes on first use (the directions and the pixel -> direction map,
    shared by the iterations at one HEALPix order: `core.sampling.DirectionTables`) made on this thread, by one
    particle's neighbourhood per unit, before the engine and the neighbourhoods' thread share the sampling."""
    for unit in units:
        if unit.setup.local_searches and len(unit.members):
            local_orientations(unit.setup, *(p[unit.members[:1]] for p in poses))


def _prepare_part(particles, indices, images, reader, settings, inputs, previous, xp, part):
    """The images `part` (a slice) of a batch prepared at the iteration's size, from their previous poses."""
    return prepare_batch(particles, indices[part], reader, settings, inputs.current_size_px,
                         inputs.avg_norm_correction, inputs.iteration, previous, xp=xp, images=images[part])


def _engine_runs(backend, n_images, box_px, current_size_px):
    """How a batch of `n_images` goes through the engine: a list of runs, each a list of the slices it is prepared in
    one after the other. As many images per part as the device's free memory leaves room for the preparation's
    temporaries (`em.memory.images_per_preparation`, whole-box images), and as many per run as it leaves room for
    the prepared images (`images_per_engine_run`, at the current size); on the host, the whole batch at once."""
    free = backend.free_device_bytes()
    if free is None:
        return [[slice(0, n_images)]]
    per_part = memory.images_per_preparation(free, box_px)
    per_run = max(per_part, memory.images_per_engine_run(free, current_size_px))
    return [[slice(a, min(b, a + per_part)) for a in range(start, b, per_part)]
            for start in range(0, n_images, per_run) for b in [min(n_images, start + per_run)]]


def sums_wait_on_host(backend: Backend, units: Sequence[WorkUnit]) -> bool:
    """Whether finished units' sums wait on the host in this iteration: when the device's free memory cannot hold
    every unit's sums beside one unit's set-up or a reconstruction (`em.memory.halves_wait_on_host`); never
    for the numpy engine."""
    free = backend.free_device_bytes()
    if free is None or len(units) < 2:
        return False
    sums, setup, reconstruction = [], 0.0, 0.0
    for unit in units:
        s = unit.setup
        grid = PaddedGrid.create(s.ori_size_px, s.padding_factor, s.current_size_px // 2, ndim=s.ref_dim)
        sums.append(memory.sums_bytes(grid.shape, len(unit.classes)))
        setup = max(setup, memory.references_bytes(grid.shape, s.ori_size_px, len(unit.classes)))
        reconstruction = max(reconstruction, memory.reconstruction_bytes(grid.shape, s.ori_size_px,
                                                                         grid.padded_size_px))
    return memory.halves_wait_on_host(free, sums, setup, reconstruction)


def _collect(engine, stages, flops):
    sums = engine.sums()
    add_counts(stages, engine.stage_seconds)
    add_counts(flops, engine.stage_flops)
    return sums


def empty_sums(unit: WorkUnit, xp: ArrayModule = np, real_dtype: npt.DTypeLike = np.float64) -> WeightedSums:
    """Zero WeightedSums of a unit, shaped as its engine's would be (a unit without batches; a template to
    receive sums into), volumes of `real_dtype` (and its complex)."""
    s = unit.setup
    grid = PaddedGrid.create(s.ori_size_px, s.padding_factor, s.current_size_px // 2, ndim=s.ref_dim)
    n_optics, n_shells = np.asarray(s.sigma2_noise).shape
    return WeightedSums.zeros(grid.shape, len(unit.classes), n_optics, n_shells, s.sampling.n_directions, xp=xp,
                              real_dtype=real_dtype, n_scale_groups=s.n_scale_groups)


def initial_noise_spectra(particles: ParticleSet, settings: ImageSettings, n_optics: int, batch_size: int,
                          xp: ArrayModule = np, free_bytes: Callable[[], int | None] | None = None,
                          stages: dict[str, float] | None = None) -> np.ndarray:
    """RELION's initial noise spectra from the masked images at their stored origins (`free_bytes`, `stages`: as
    `noise_batch_sums` takes them)."""
    noise = NoiseEstimate.empty(n_optics, settings.ori_size_px)
    for _, sums in noise_batch_sums(particles, settings, n_optics, enumerate(particles.batches(batch_size)), xp,
                                    free_bytes, stages):
        noise.add_batch_sums(*sums)
    return noise.sigma2()


def noise_batch_sums(particles: ParticleSet, settings: ImageSettings, n_optics: int,
                     numbered_batches: Iterable[tuple[int, np.ndarray]], xp: ArrayModule = np,
                     free_bytes: Callable[[], int | None] | None = None,
                     stages: dict[str, float] | None = None) -> Iterator[tuple[int, tuple[np.ndarray, ...]]]:
    """(batch number, NoiseEstimate.batch_sums) of each (number, particle indices) of `numbered_batches`: what
    the initial noise spectra add up, one batch at a time (batches may be shared out, and added up elsewhere in
    their order). `free_bytes`: a callable giving the device's free bytes (a backend's `free_device_bytes`); a
    batch is then prepared in parts of as many images as they leave room for (`em.memory.images_per_preparation`,
    as the E-step's batches are), its sums joined; None (the host): the whole batch at once. `stages`: a dict to
    which the seconds spent waiting for the image reads ("read_wait") and preparing the images and their sums
    ("images") are added, as the E-step's stages of those names."""
    noise = NoiseEstimate.empty(n_optics, settings.ori_size_px)
    numbers = deque()
    stages = {} if stages is None else stages

    def batches() -> Iterator[np.ndarray]:
        for number, indices in numbered_batches:
            numbers.append(number)
            yield indices

    with mrc.StackReader() as reader:
        tic = time.perf_counter()
        for indices, images in particles.read_ahead(batches(), reader, xp):
            tic = add_seconds(stages, "read_wait", tic)
            free = None if free_bytes is None else free_bytes()
            per_part = indices.size if free is None else memory.images_per_preparation(free, settings.ori_size_px)
            parts = []
            for start in range(0, indices.size, max(1, per_part)):
                part = slice(start, start + per_part)
                batch = prepare_batch(particles, indices[part], reader, settings, settings.ori_size_px, 1.0, 0,
                                      xp=xp, images=images[part])
                parts.append(noise.batch_sums(batch.images_ft, batch.optics_index))
                del batch  # its device arrays go before the next part's (the GPU arena is a stack)
            del images
            sums = _joined_noise_sums(parts)
            add_seconds(stages, "images", tic)
            yield numbers.popleft(), sums
            tic = time.perf_counter()


def _joined_noise_sums(parts):
    """One batch's NoiseEstimate.batch_sums from those of its parts (in order)."""
    if len(parts) == 1:
        return parts[0]
    power, optics, ft_sums = zip(*parts)
    return np.concatenate(power), np.concatenate(optics), functools.reduce(np.add, ft_sums)


def keep_norms_unless_refined(use_norms: bool, previous: ParticleState, state: ParticleState) -> None:
    """Without --norm the particles keep the norm corrections they came with."""
    if not use_norms:
        state.norm_correction[:] = previous.norm_correction
