"""The particle set: per-particle arrays (struct of arrays) merged from a particle STAR file.

Optics values (voltage, Cs, amplitude contrast, pixel size, box) are looked up per particle
through its optics group. Images are not read up front: `read_images` reads only a batch's images
from their stacks (`mrc.StackReader`), `read_ahead` the next batch's while the current one is worked on;
`KeptImages` holds a GPU process's images on its device from one iteration to the next.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd

from cryorefine.core import arrays
from cryorefine.core.arrays import Array, ArrayModule
from cryorefine.core.ctf import CtfParameters
from cryorefine.errors import InputError
from cryorefine.io import mrc
from cryorefine.io.star import ParticleStar, read_particle_star

POSE_COLUMNS = ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi", "rlnOriginXAngst", "rlnOriginYAngst")
CTF_COLUMNS = ("rlnDefocusU", "rlnDefocusV", "rlnDefocusAngle")
# --preread_images holds the images in memory only where they take at most this share of the memory the machine has
# available (the rest for the run's own tables, read-ahead buffers and maps); the option's help and README say 80 %
PREREAD_SHARE_OF_AVAILABLE_MEMORY = 0.8


@dataclass
class OpticsGroup:
    number: int
    name: str
    pixel_size_angstrom: float
    box_px: int | None
    voltage_kv: float | None
    cs_mm: float | None
    amplitude_contrast: float | None


@dataclass
class ParticleSet:
    """Particles as parallel arrays; `star` keeps the original tables for writing back."""

    star: ParticleStar
    optics_groups: list  # of OpticsGroup, index = optics_index
    optics_index: np.ndarray  # (n,) int, 0-based into optics_groups
    stack_paths: np.ndarray  # (n,) str, resolved paths
    stack_indices: np.ndarray  # (n,) int, 1-based
    defocus_u_angstrom: np.ndarray
    defocus_v_angstrom: np.ndarray
    defocus_angle_deg: np.ndarray
    phase_shift_deg: np.ndarray
    ctf_bfactor: np.ndarray
    ctf_scale: np.ndarray
    rot_deg: np.ndarray
    tilt_deg: np.ndarray
    psi_deg: np.ndarray
    origin_x_angstrom: np.ndarray
    origin_y_angstrom: np.ndarray
    # the centre of the offsets' prior (rlnOriginX/YPriorAngst, RELION's sign and meaning of the origins); (0, 0)
    # where the file has none, as RELION takes it
    origin_prior_x_angstrom: np.ndarray
    origin_prior_y_angstrom: np.ndarray
    norm_correction: np.ndarray
    random_subset: np.ndarray  # 0 where the file has none
    class_number: np.ndarray
    # RELION's groups of the intensity scale (--scale): one per rlnGroupName, else per micrograph, else per optics
    # group (`scale_groups_of`); names in order of first appearance, and each particle's, 0-based
    scale_group_names: list = field(default_factory=list)
    scale_group_index: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    preread: object = field(default=None, init=False, repr=False)  # mrc.PrereadImages once read
    preread_indices: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), init=False, repr=False)
    preread_refused: bool = field(default=False, init=False, repr=False)  # the images would not fit the memory

    def __len__(self):
        return int(self.optics_index.size)

    # Per-particle views of the optics table.
    def _optics_array(self, attr):
        values = np.array([np.nan if getattr(g, attr) is None else getattr(g, attr) for g in self.optics_groups],
                          dtype=np.float64)
        return values[self.optics_index]

    @property
    def pixel_size_per_particle_angstrom(self) -> np.ndarray:
        return self._optics_array("pixel_size_angstrom")

    @property
    def voltage_kv(self) -> np.ndarray:
        return self._optics_array("voltage_kv")

    @property
    def cs_mm(self) -> np.ndarray:
        return self._optics_array("cs_mm")

    @property
    def amplitude_contrast(self) -> np.ndarray:
        return self._optics_array("amplitude_contrast")

    @property
    def pose_columns(self) -> list[str]:
        return [c for c in POSE_COLUMNS if c in self.star.particles.columns]

    @property
    def stacks(self) -> list[str]:
        return sorted(set(self.stack_paths.tolist()))

    def geometry(self) -> tuple[int, float]:
        """(box in px, pixel size in Å) shared by all particles; InputError if they differ."""
        boxes = {g.box_px for g in self.optics_groups}
        if None in boxes:
            raise InputError(f"{self.star.path}: the image size is unknown (no rlnImageSize and the stack "
                             f"{self.stack_paths[0]} cannot be opened); check the image paths")
        if len(boxes) > 1:
            raise InputError(f"{self.star.path}: optics groups have different box sizes {sorted(boxes)} px; "
                             f"re-extract the particles with one box size")
        sizes = sorted({round(g.pixel_size_angstrom, 4) for g in self.optics_groups})
        if sizes[-1] - sizes[0] > 1e-3 * sizes[0]:
            raise InputError(f"{self.star.path}: optics groups have different pixel sizes {sizes} Å; "
                             f"rescale the particles to one pixel size before refining them together")
        return boxes.pop(), float(self.optics_groups[0].pixel_size_angstrom)

    def optics_names_and_counts(self) -> tuple[list[str], list[int]]:
        """The optics groups' names and their numbers of particles, in group order."""
        names = [g.name for g in self.optics_groups]
        return names, [int((self.optics_index == i).sum()) for i in range(len(names))]

    @property
    def n_scale_groups(self) -> int:
        return len(self.scale_group_names)

    def scale_group_names_and_counts(self, members: np.ndarray | None = None) -> tuple[list[str], list[int]]:
        """The intensity groups' names and their numbers of particles, in group order (model.star's model_groups);
        with `members` (particle indices, e.g. a half set's) the numbers of those particles alone."""
        index = self.scale_group_index if members is None else self.scale_group_index[np.asarray(members)]
        counts = np.bincount(index, minlength=self.n_scale_groups)
        return list(self.scale_group_names), [int(c) for c in counts]

    def ctf_parameters(self, indices: np.ndarray, pixel_size_angstrom: npt.ArrayLike | None = None) -> CtfParameters:
        """The CTF values of the particles at `indices`, at their own pixel sizes unless `pixel_size_angstrom` is
        given (a transform windowed to another size has another)."""
        pixel = self.pixel_size_per_particle_angstrom[indices] if pixel_size_angstrom is None else pixel_size_angstrom
        return CtfParameters(pixel, self.defocus_u_angstrom[indices], self.defocus_v_angstrom[indices],
                             self.defocus_angle_deg[indices], self.voltage_kv[indices], self.cs_mm[indices],
                             self.amplitude_contrast[indices], self.phase_shift_deg[indices],
                             self.ctf_bfactor[indices], self.ctf_scale[indices])

    def require_ctf(self) -> None:
        missing = [] if "rlnDefocusU" in self.star.particles.columns else ["rlnDefocusU"]
        for group in self.optics_groups:
            for attr, col in (("voltage_kv", "rlnVoltage"), ("cs_mm", "rlnSphericalAberration"),
                              ("amplitude_contrast", "rlnAmplitudeContrast")):
                if getattr(group, attr) is None:
                    missing.append(col)
        if missing:
            raise InputError(f"{self.star.path}: column {missing[0]} is missing, needed for --ctf; add it or run "
                             f"without --ctf")

    def half_sets(self, seed: int = 0) -> np.ndarray:
        """Half set (1 or 2) per particle: rlnRandomSubset where it gives every particle a half and
        both halves are used, else a seeded random split."""
        if len(self) and np.isin(self.random_subset, (1, 2)).all() and np.unique(self.random_subset).size == 2:
            return self.random_subset.astype(np.int64)
        order = np.random.default_rng(seed).permutation(len(self))
        halves = np.empty(len(self), dtype=np.int64)
        halves[order[0::2]] = 1
        halves[order[1::2]] = 2
        return halves

    def batches(self, batch_size: int, indices: npt.ArrayLike | None = None) -> Iterator[np.ndarray]:
        """Index arrays of at most `batch_size` particles, consecutive runs of `indices` (default all) in their
        order, each batch's indices ascending (the order of the stacks, which reads them as blocks)."""
        idx = np.arange(len(self)) if indices is None else np.asarray(indices)
        for start in range(0, idx.size, batch_size):
            yield np.sort(idx[start:start + batch_size])

    def image_reader(self, preread_indices: npt.ArrayLike | None = None,
                     sharers: int = 1) -> mrc.StackReader | mrc.PrereadImages:
        """What batches read their images through: a fresh `mrc.StackReader`, or, once `preread_indices`
        were given, an `mrc.PrereadImages` of those particles (read once into the host's memory, as the system's
        cache of their stacks, which the processes of the host share), kept for the following calls (made again,
        for all particles asked for so far, when a call asks for particles it lacks). Images that with those of the
        other `sharers` (the MPI workers of this node, each asking for its own share) would take more than
        PREREAD_SHARE_OF_AVAILABLE_MEMORY of the available memory are not asked for: a warning, and a
        StackReader."""
        if preread_indices is not None and not self.preread_refused:
            wanted = np.unique(np.asarray(preread_indices, dtype=np.int64))
            if not np.isin(wanted, self.preread_indices).all():
                held = np.union1d(self.preread_indices, wanted)
                self.preread = None
                need = mrc.PrereadImages.held_bytes(self.stack_paths[held])
                available = arrays.available_memory_bytes()
                if available is not None and need * sharers > PREREAD_SHARE_OF_AVAILABLE_MEMORY * available:
                    # not fatal: the run goes on, reading each batch from the stacks as without the option
                    each = f" for each of this node's {sharers} workers" if sharers > 1 else ""  # their shares
                    logging.getLogger("cryorefine").warning(
                        "--preread_images: the %d images take %.3g GB%s but this machine has %.3g GB of memory "
                        "available; they are read from their stacks batch by batch instead", held.size, need / 1e9,
                        each, available / 1e9)
                    self.preread_refused = True
                    self.preread_indices = np.zeros(0, np.int64)
                else:
                    # the system asked to read them in while the first iteration's batches read them (no pause)
                    self.preread = mrc.PrereadImages(self.stack_paths[held], self.stack_indices[held])
                    self.preread_indices = held
        return self.preread if self.preread is not None else mrc.StackReader()

    def read_images(self, indices: npt.ArrayLike, reader: mrc.StackReader | mrc.PrereadImages,
                    out: np.ndarray | None = None, check_finite: bool = True,
                    dtype: npt.DTypeLike = np.float32) -> np.ndarray:
        """float32 (or `dtype`) images (B, box, box) of the given particles, read through a `mrc.StackReader`
        (into `out` when given; `check_finite=False` leaves the NaN/Inf check to the caller, as
        `images.prepare_batch` does)."""
        indices = np.asarray(indices)
        return reader.read(self.stack_paths[indices], self.stack_indices[indices], out=out, check_finite=check_finite,
                           dtype=dtype)

    def read_ahead(self, batches: Iterable[np.ndarray], reader: mrc.StackReader | mrc.PrereadImages,
                   xp: ArrayModule = np, device_bytes: int = 0,
                   kept: KeptImages | None = None) -> Iterator[tuple[np.ndarray, Array]]:
        """(indices, images) for each batch of indices in turn; the next batch's images are read on a
        thread while the caller works on the current one (reading overlaps the GPU's work).

        `batches` is consumed one batch ahead, in the caller's thread (an MPI worker's batches come
        from the master on request). Images come into two host buffers used in turn (pinned memory
        when `xp` is CuPy: uploads at the bus's speed), so a batch's images are valid until the caller
        asks for the next batch. They are not checked for NaN/Inf here: `images.prepare_batch` checks
        them where they are prepared. For the GPU, float16 stacks (MRC mode 12) come as float16, made
        float32 on the device: half the bytes on the bus and no conversion on the host.

        With CuPy and `device_bytes` room for two device buffers of the first batch's images
        (`gpu.staging.UploadSlots`), the thread uploads them too, while the caller's GPU work goes on: from
        the first batch on, images come as device arrays that the caller's stream waits for on the GPU; a
        batch larger than the first comes on the host. The first batch is read into a host buffer too: pinned
        memory that CuPy's pool keeps from one iteration to the next, its pages already mapped, where a new array
        would take its pages one fault at a time and upload from pageable memory.

        With `kept` (`KeptImages` of `xp`), a batch whose images are all held there comes from there (neither read
        nor uploaded: a view, or a gather where the batch is not one run of its slots), and a batch read from the
        stacks is copied in while it has room for it.
        """
        from concurrent.futures import ThreadPoolExecutor

        from cryorefine.core.arrays import host_buffer

        buffers = [None, None]
        dtype = np.float32 if xp is np else reader.wire_dtype(self.stack_paths)
        slots = None

        def read(i: int, indices: np.ndarray) -> tuple[Array, bool]:
            slot = i % 2
            buffer = buffers[slot]
            if buffer is None or buffer.shape[0] < indices.size:
                return self.read_images(indices, reader, check_finite=False, dtype=dtype), False
            if slots is not None:
                slots.wait_uploaded(slot)  # the copy out of this host buffer two batches ago has ended
            images = self.read_images(indices, reader, out=buffer, check_finite=False)
            if slots is None or not slots.holds(slot, indices.size):
                return images, False
            return slots.upload(slot, images), True

        source = iter(batches)
        current = next(source, None)
        if current is None:
            return
        if kept is not None and kept.images.dtype != np.dtype(dtype):
            kept = None  # held in another dtype than these stacks are read in: not used
        box = self.geometry()[0]
        buffers[0] = host_buffer((current.size, box, box), dtype, xp)
        if xp is not np and device_bytes:
            from cryorefine.gpu.staging import UploadSlots

            if UploadSlots.nbytes(current.size, (box, box), np.dtype(dtype).itemsize) <= device_bytes:
                slots = UploadSlots(current.size, (box, box), dtype)
        with ThreadPoolExecutor(1, thread_name_prefix="read-ahead") as pool:

            def fetch(i: int, indices: np.ndarray) -> Any:
                """The read of batch i on the thread, or None where `kept` holds its images."""
                return None if kept is not None and kept.holds(indices) else pool.submit(read, i, indices)

            pending = fetch(0, current)
            i = 0
            while current is not None:
                if pending is None:
                    images, on_device = kept.take(current), False
                else:
                    images, on_device = pending.result()
                    if on_device:
                        slots.take(i % 2)
                    if kept is not None:
                        kept.keep(current, images)
                following = next(source, None)
                if following is not None:
                    slot = (i + 1) % 2
                    if buffers[slot] is None or buffers[slot].shape[0] < following.size:
                        if slots is not None:
                            slots.wait_uploaded(slot)  # the host buffer let go here is no copy's source any more
                        size = max(following.size, current.size)
                        buffers[slot] = host_buffer((size, box, box), dtype, xp)
                    pending = fetch(i + 1, following)
                yield current, images
                del images
                if slots is not None and on_device:
                    slots.release(i % 2)  # the caller has queued its work on this batch's images
                current = following
                i += 1



class KeptImages:
    """Particle images kept where the engine works (a GPU's memory) from one iteration to the next, so that they are
    read from their stacks and uploaded once.

    `owned` are the particles this process is handed from one iteration to the next (all of them in one process, an
    MPI worker's share of its work unit): `capacity` slots of `image_shape` and `dtype` are allocated with `xp` now
    (on the GPU, in the arena's scope that is current: the run's). `ParticleSet.read_ahead` copies each batch it
    reads in (`keep`), while the batch is all owned and there is room for it all, into the next free slots; a batch
    whose particles are all held comes from here (`take`), as a view where its slots follow each other (a batch
    cut as in the iteration that kept it), else gathered."""

    def __init__(self, owned: npt.ArrayLike, n_particles: int, capacity: int, image_shape: tuple[int, ...],
                 dtype: npt.DTypeLike, xp: ArrayModule = np) -> None:
        self.xp = xp
        self.images = xp.empty((int(capacity), *image_shape), dtype=dtype)
        self.owned = np.zeros(int(n_particles), bool)
        self.owned[np.asarray(owned, dtype=np.int64)] = True
        self.slot_of = np.full(int(n_particles), -1, np.int64)
        self.filled = 0

    def own(self, owned: npt.ArrayLike) -> None:
        """The particles handed to this process from now on: where they are not those owned so far, the slots are
        emptied and kept again from the next batch (an MPI worker's share after its first E-step's)."""
        mask = np.zeros_like(self.owned)
        mask[np.asarray(owned, dtype=np.int64)] = True
        if not np.array_equal(mask, self.owned):
            self.owned = mask
            self.slot_of[:] = -1
            self.filled = 0

    @staticmethod
    def image_bytes(image_shape: tuple[int, ...], dtype: npt.DTypeLike) -> int:
        """Bytes of one image."""
        return int(np.prod(image_shape)) * np.dtype(dtype).itemsize

    @property
    def capacity(self) -> int:
        return int(self.images.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.images.nbytes)

    def holds(self, indices: npt.ArrayLike) -> bool:
        """Whether `indices` are some particles and every one has its image here."""
        slots = self.slot_of[np.asarray(indices)]
        return bool(slots.size and (slots >= 0).all())

    def take(self, indices: npt.ArrayLike) -> Array:
        """The images of `indices` (all held), in their order: a view of the slots, or a gathered copy. A view is
        the caller's to read, not to write."""
        slots = self.slot_of[np.asarray(indices)]
        first = int(slots[0])
        if np.array_equal(slots, np.arange(first, first + slots.size)):
            return self.images[first:first + slots.size]
        return self.images[self.xp.asarray(slots)]

    def keep(self, indices: npt.ArrayLike, images: Array) -> bool:
        """Copies `images` (of `indices`, on the host or on this device) into the next free slots, where every
        particle is owned and none held yet and they all fit; returns whether it did. A copy from the host has
        ended on return (its buffer may be refilled); one on the device is queued on the current stream."""
        indices = np.asarray(indices)
        n = indices.size
        if n == 0 or self.filled + n > self.capacity or not self.owned[indices].all() \
                or (self.slot_of[indices] >= 0).any():
            return False
        view = self.images[self.filled:self.filled + n]
        if self.xp is not np and isinstance(images, np.ndarray):
            view.set(images)
            self.xp.cuda.get_current_stream().synchronize()
        else:
            view[...] = images
        self.slot_of[indices] = np.arange(self.filled, self.filled + n)
        self.filled += n
        return True


@contextlib.contextmanager
def scratch_copy(particles: ParticleSet, scratch_dir: Path | str | None, log: logging.Logger,
                 share: Any = None) -> Iterator[ParticleSet]:
    """--scratch_dir: the particles' stacks copied once into a new folder under `scratch_dir`, and their images read
    from there until the block ends; then the copies are removed. When the stacks do not fit in the free space
    (with 10 % to spare), a warning says so and the images are read where they are, as RELION does.

    `share` (an MPI communicator of the processes of one node) makes its first process copy for all of them.
    """
    if not scratch_dir:
        yield particles
        return
    first = share is None or share.Get_rank() == 0
    folder = None
    if first:
        stacks = sorted(set(particles.stack_paths.tolist()))
        need = sum(os.path.getsize(path) for path in stacks)
        Path(scratch_dir).mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(scratch_dir).free
        if need * 1.1 > free:
            log.warning("--scratch_dir %s: the stacks need %.1f GB but %.1f GB are free; images are read where they "
                        "are", scratch_dir, need / 1e9, free / 1e9)
        else:
            folder = tempfile.mkdtemp(prefix="cryorefine_", dir=scratch_dir)
            for i, path in enumerate(stacks):
                shutil.copyfile(path, Path(folder) / f"{i:05d}_{Path(path).name}")
            log.info("--scratch_dir: %d stacks (%.1f GB) copied to %s", len(stacks), need / 1e9, folder)
    if share is not None:
        folder = share.bcast(folder, root=0)
    if folder is None:
        yield particles
        return
    stacks = sorted(set(particles.stack_paths.tolist()))
    copies = {path: str(Path(folder) / f"{i:05d}_{Path(path).name}") for i, path in enumerate(stacks)}
    original = particles.stack_paths
    particles.stack_paths = np.array([copies[path] for path in original.tolist()])
    try:
        yield particles
    except BaseException:
        particles.stack_paths = original
        if share is None:  # under MPI a failure aborts the job: the others are not waited for
            shutil.rmtree(folder, ignore_errors=True)
        raise
    particles.stack_paths = original
    if share is not None:
        share.Barrier()  # every process of the node is done reading
    if first:
        shutil.rmtree(folder, ignore_errors=True)


def load_particles(star_path: Path | str, check_stacks: bool = True) -> ParticleSet:
    """Read a particle STAR file (any RELION version) into a ParticleSet.

    With `check_stacks`, every stack must exist, every `N@stack` index must lie inside its stack
    and all stacks must have the same box as the optics table.
    """
    star = read_particle_star(star_path)
    table = star.particles
    star_dir = Path(star_path).parent
    if "rlnImageName" not in table.columns:
        raise InputError(f"{star_path}: column rlnImageName is missing from the particle table; add it")
    try:
        parsed = [mrc.parse_image_name(name) for name in table["rlnImageName"].astype(str)]
    except InputError as exc:
        raise InputError(f"{star_path}: {exc}; fix the STAR file") from None
    indices = np.array([p[0] for p in parsed], dtype=np.int64)
    resolved = {}  # each stack's path resolved once, not once per particle (a stat or two each)
    for _, stack in parsed:
        if stack not in resolved:
            resolved[stack] = str(mrc.resolve_stack_path(stack, star_dir))
    paths = np.array([resolved[p[1]] for p in parsed], dtype=object)
    if check_stacks:
        _check_stacks(star_path, paths, indices)
    _names_from_project_directory(table, parsed, resolved)

    optics = star.optics
    group_numbers = optics["rlnOpticsGroup"].to_numpy()
    lookup = {int(g): i for i, g in enumerate(group_numbers)}
    optics_index = np.array([lookup[int(g)] for g in table["rlnOpticsGroup"]], dtype=np.int64)
    groups = []
    for i, row in optics.reset_index(drop=True).iterrows():
        box = _optional(row, "rlnImageSize", int)
        first = np.flatnonzero(optics_index == i)
        stack_box = _stack_box(paths[first[0]]) if first.size else None
        if box is None:
            box = stack_box
        elif stack_box is not None and stack_box != box:
            raise InputError(f"{paths[first[0]]}: images are {stack_box} px but data_optics rlnImageSize of group "
                             f"{int(row['rlnOpticsGroup'])} says {box} px; fix rlnImageSize or re-extract")
        groups.append(OpticsGroup(
            number=int(row["rlnOpticsGroup"]),
            name=str(row.get("rlnOpticsGroupName", f"opticsGroup{int(row['rlnOpticsGroup'])}")),
            pixel_size_angstrom=float(row["rlnImagePixelSize"]),
            box_px=box,
            voltage_kv=_optional(row, "rlnVoltage", float),
            cs_mm=_optional(row, "rlnSphericalAberration", float),
            amplitude_contrast=_optional(row, "rlnAmplitudeContrast", float)))
    if check_stacks:
        _check_header_pixel_sizes(star_path, groups, paths, optics_index)

    n = len(table)

    def col(name: str, default: float) -> np.ndarray:
        return table[name].to_numpy(np.float64) if name in table.columns else np.full(n, default, np.float64)

    defocus_u = col("rlnDefocusU", np.nan)
    return ParticleSet(
        star=star, optics_groups=groups, optics_index=optics_index,
        stack_paths=paths.astype(str), stack_indices=indices,
        defocus_u_angstrom=defocus_u,
        defocus_v_angstrom=(table["rlnDefocusV"].to_numpy(np.float64) if "rlnDefocusV" in table.columns
                            else defocus_u.copy()),
        defocus_angle_deg=col("rlnDefocusAngle", 0.0), phase_shift_deg=col("rlnPhaseShift", 0.0),
        ctf_bfactor=col("rlnCtfBfactor", 0.0), ctf_scale=col("rlnCtfScalefactor", 1.0),
        rot_deg=col("rlnAngleRot", 0.0), tilt_deg=col("rlnAngleTilt", 0.0), psi_deg=col("rlnAnglePsi", 0.0),
        origin_x_angstrom=col("rlnOriginXAngst", 0.0), origin_y_angstrom=col("rlnOriginYAngst", 0.0),
        origin_prior_x_angstrom=col("rlnOriginXPriorAngst", 0.0),
        origin_prior_y_angstrom=col("rlnOriginYPriorAngst", 0.0),
        norm_correction=col("rlnNormCorrection", 1.0),
        random_subset=col("rlnRandomSubset", 0).astype(np.int64),
        class_number=col("rlnClassNumber", 1).astype(np.int64),
        **scale_groups_of(table, [g.name for g in groups], optics_index))


def scale_groups_of(table: pd.DataFrame, optics_names: Sequence[str], optics_index: np.ndarray) -> dict[str, Any]:
    """RELION's intensity groups (Experiment::read): a group per rlnGroupName where the table has it, else per
    micrograph (rlnMicrographName less its pipeline prefix, `Dir/jobNNN/`); without either, a group per optics
    group. Returns ParticleSet's `scale_group_names` and `scale_group_index` (numbered in order of appearance)."""
    if "rlnGroupName" in table.columns:
        keys = table["rlnGroupName"].astype(str).tolist()
    elif "rlnMicrographName" in table.columns:
        keys = [_without_pipeline_prefix(name) for name in table["rlnMicrographName"].astype(str)]
    else:
        keys = [optics_names[i] for i in optics_index]
    names, index = {}, np.empty(len(keys), dtype=np.int64)
    for i, key in enumerate(keys):
        index[i] = names.setdefault(key, len(names))
    return {"scale_group_names": list(names), "scale_group_index": index}


def _without_pipeline_prefix(name):
    """`MotionCorr/job002/Movies/a.mrc` -> `Movies/a.mrc` (RELION's decomposePipelineFileName); other names as they
    are."""
    parts = name.split("/")
    for i, part in enumerate(parts[:-1]):
        if len(part) >= 6 and part.startswith("job") and part[3:6].isdigit():
            return "/".join(parts[i + 1:])
    return name


def _names_from_project_directory(table, parsed, resolved):
    """rlnImageName of the particles whose stacks were found beside the STAR file rather than from the project (the
    current) directory, rewritten with the path that was found, so that the STAR files a run writes elsewhere name
    images RELION finds from the project directory, as its own do. The image numbers keep their text."""
    moved = {stack: path for stack, path in resolved.items() if Path(path) != Path(stack)}
    if not moved:
        return
    names = table["rlnImageName"].astype(str).tolist()
    table["rlnImageName"] = [name if stack not in moved else
                             (f"{name.partition('@')[0]}@{moved[stack]}" if "@" in name else moved[stack])
                             for name, (_, stack) in zip(names, parsed)]


def _optional(row, column, kind):
    if column not in row.index or row[column] is None:
        return None
    try:
        value = float(row[column])
    except (TypeError, ValueError):
        return None
    return None if not np.isfinite(value) else kind(value)


def _stack_box(path):
    try:
        info = mrc.mrc_info(path)
    except InputError:
        return None
    return info.shape[-1]


def _check_stacks(star_path, paths, indices):
    for path in dict.fromkeys(paths.tolist()):
        if not Path(path).is_file():
            raise InputError(f"{star_path}: image stack {path} not found (looked relative to {Path.cwd()} and to "
                             f"{Path(star_path).parent}); run from the RELION project directory or fix rlnImageName")
        info = mrc.mrc_info(path)
        n_images = 1 if len(info.shape) == 2 else info.shape[0]
        beyond = indices[(paths == path) & (indices > n_images)]
        if beyond.size:
            raise InputError(f"{star_path}: rlnImageName {beyond[0]}@{path} is beyond the stack, which holds "
                             f"{n_images} images; fix the STAR file or re-extract")
        if info.shape[-1] != info.shape[-2]:
            raise InputError(f"{path}: images are {info.shape[-1]}×{info.shape[-2]} px, not square; re-extract")


def _check_header_pixel_sizes(star_path, groups, paths, optics_index):
    for i, group in enumerate(groups):
        members = np.flatnonzero(optics_index == i)
        if not members.size:
            continue
        header = mrc.mrc_info(paths[members[0]]).header_pixel_size_angstrom
        if header is not None and abs(header - group.pixel_size_angstrom) > 0.01 * group.pixel_size_angstrom:
            raise InputError(f"{paths[members[0]]}: conflicting pixel sizes, the MRC header says {header:g} Å but "
                             f"{star_path} says {group.pixel_size_angstrom:g} Å for optics group {group.number}; "
                             f"fix rlnImagePixelSize or the stack header")
