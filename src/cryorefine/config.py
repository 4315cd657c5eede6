"""Options of `cryorefine refine` (relion_refine's names and defaults), one frozen dataclass.

Saved beside the outputs with the version and the command line, and read back by --continue.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryorefine.errors import InputError

MAX_HEALPIX_ORDER = 8  # RELION's finest angular sampling, 0.23° (order 0: 60°)
MAX_OVERSAMPLING = 4
MAX_PADDING_FACTOR = 4.0
# particles per E-step batch when --batch is not given (RELION's --pool is not a batch: see `pooled_particles`): on
# the CPU a fixed count; on the GPU as many
# images as hold this many pixels (1,024 of 360 px), between the two bounds. Per-batch work (launches, host tables,
# transfers) is then a small share of an iteration: the converged auto-refine of 10,000 particles of 360 px took
# 204 s with batches of 128 and 152 s with 512 on the H100, and its iterations 70.9 s with 512, 52.7–53.0 s with
# 1,024 and 49.8 s with 2,048 on the H200 (benchmarks/README.md); the two pinned read-ahead buffers of the images
# stay at ~1 GB whatever the box
CPU_BATCH_PARTICLES = 128
GPU_BATCH_PIXELS = 1024 * 360 * 360
GPU_BATCH_PARTICLES = (32, 1024)


@dataclass(frozen=True)
class RefineConfig:
    """Every option of a refinement. Lengths in Å unless the name says px; angles in degrees."""

    input_star: str
    output_root: str
    reference_map: str
    particle_diameter_angstrom: float | None = None  # None: the whole box
    ini_high_angstrom: float | None = None  # low-pass of the initial reference
    symmetry: str = "C1"
    do_ctf: bool = False
    ctf_intact_first_peak: bool = False
    firstiter_cc: bool = False
    flatten_solvent: bool = False
    zero_mask: bool = False
    solvent_mask: str | None = None  # --solvent_mask: the references' mask (with --flatten_solvent)
    solvent_mask2: str | None = None  # --solvent_mask2: a region set to its own average density
    trust_ref_size: bool = False  # --trust_ref_size: a reference of another size re-scaled and re-boxed
    solvent_correct_fsc: bool = False  # --solvent_correct_fsc: the half maps' FSC masked, corrected for the mask
    skip_align: bool = False  # --skip_align (classify): the poses of the STAR file, only the class is searched
    sigma_ang_deg: float | None = None  # --sigma_ang (classify): local searches of ±3σ around the STAR poses
    sigma_psi_deg: float | None = None  # --sigma_psi: σ of psi in those searches (default: --sigma_ang)
    sigma_rot_deg: float | None = None  # --sigma_rot (classify): with --sigma_tilt, the directions' local search
    sigma_tilt_deg: float | None = None  # --sigma_tilt (classify): (σ the larger of the two, RELION's rule)
    relion_oversampling: bool = False  # --relion_oversampling (classify): --oversampling throughout
    fast_subsets: bool = False  # --fast_subsets (classify): iterations 1–15 on random subsets (RELION's sizes)
    allow_coarser_sampling: bool = False  # --allow_coarser_sampling (classify, K > 1): steps of the accuracy
    psi_step_deg: float | None = None  # --psi_step (class2d): the coarse in-plane step; None: RELION's 10° in 2D
    center_classes: bool = False  # --center_classes (class2d): class averages moved to their centre of mass
    grad: bool = False  # --grad (class2d): VDAM, RELION's gradient refinement on mini-batches, instead of EM
    class_inactivity_threshold: float = 0.0  # --class_inactivity_threshold (class2d --grad): inactive classes replaced
    grad_write_iter: int = 10  # --grad_write_iter: a gradient run writes its files every this many iterations
    auto_ignore_angles: bool = False  # --auto_ignore_angles: angle changes do not hold the sampling back
    auto_resol_angles: bool = False  # --auto_resol_angles: finer angles as soon as the resolution asks for them
    auto_sampling: bool = False  # --auto_sampling (initial_model): RELION's sampling updates every 10 iterations
    padding_factor: float = 2.0
    healpix_order: int = 2
    auto_local_healpix_order: int = 4
    offset_range_px: float = 6.0
    offset_step_px: float = 2.0
    oversampling: int = 1
    tau2_fudge: float = 1.0
    max_iterations: int = 50
    adaptive_fraction: float = 0.999
    max_significants: int = -1  # --maxsig; -1: no limit
    # --strict_highres_exp: the E-step's likelihood up to this resolution; ≤ 0: none
    strict_highres_exp_angstrom: float = -1.0
    max_coarse_size_px: int = -1  # --coarse_size: RELION's largest image size of the coarse (first) pass; ≤ 0: none
    do_norm: bool = False
    do_scale: bool = False
    auto_refine: bool = True  # gold-standard halves with RELION's auto-sampling
    low_resol_join_halves_angstrom: float = 40.0
    random_seed: int = 0
    n_classes: int = 1
    width_mask_edge_px: float = 5.0
    incr_size_px: int = 10  # RELION's --incr_size
    batch_size: int | None = None  # --batch; None: `batch_size_for`'s rule
    # --pool: RELION's images a CPU thread takes at once, written to the optimiser file as RELION does; the E-step's
    # batches never follow it (RELION's GUI writes 3, its tutorial 30: as GPU batches they made four GPUs 3x slower
    # than one), the GPU's come from the memory plan and the CPU engine's threads share each batch's particles
    pooled_particles: int = 1
    preread_images: bool = False  # --preread_images: read the images once into memory
    scratch_dir: str | None = None  # --scratch_dir: the stacks copied to this (local) disk for the run
    engine: str = "numpy"  # "numpy" or "cuda"
    gpu_ids: tuple = ()  # --gpu "0:1": the devices, one per worker (empty: device 0; under MPI, `device_of_worker`)
    free_gpu_memory_mb: float = 2048.0  # --free_gpu_memory: device memory left outside the arena
    dtype: str = "float32"  # numpy engine precision: float32 (as the GPU), or float64 (the oracle's)
    threads: int | None = None  # --j: the CPU engine's threads (None: this machine's cores, shared among its ranks)

    def batch_size_for(self, box_px: int, on_gpu: bool | None = None) -> int:
        """Particles per E-step batch for images of `box_px`: --batch as given, else the default
        (`default_batch_size`) of the GPU or the CPU (`on_gpu`; None: this config's engine)."""
        if self.batch_size is not None:
            return self.batch_size
        return default_batch_size(box_px, self.engine == "cuda" if on_gpu is None else on_gpu)

    def check(self):
        """This config, or an InputError naming the first option out of RELION's range and what to give."""
        rules = [
            ("--healpix_order", self.healpix_order, 0 <= self.healpix_order <= MAX_HEALPIX_ORDER,
             f"an order from 0 (60°) to {MAX_HEALPIX_ORDER} (0.23°)"),
            ("--auto_local_healpix_order", self.auto_local_healpix_order,
             0 <= self.auto_local_healpix_order <= MAX_HEALPIX_ORDER, f"an order from 0 to {MAX_HEALPIX_ORDER}"),
            ("--offset_range", self.offset_range_px, self.offset_range_px >= 0, "0 pixels or more"),
            ("--offset_step", self.offset_step_px, self.offset_step_px > 0, "more than 0 pixels"),
            ("--oversampling", self.oversampling, 0 <= self.oversampling <= MAX_OVERSAMPLING,
             f"0 to {MAX_OVERSAMPLING}"),
            ("--tau2_fudge", self.tau2_fudge, self.tau2_fudge > 0, "more than 0 (RELION's T: 1 to 4 usually)"),
            ("--iter", self.max_iterations, self.max_iterations >= 1, "1 or more"),
            ("--adaptive_fraction", self.adaptive_fraction, 0 < self.adaptive_fraction <= 1,
             "a fraction above 0 and at most 1 (RELION: 0.999)"),
            ("--particle_diameter", self.particle_diameter_angstrom,
             self.particle_diameter_angstrom is None or self.particle_diameter_angstrom > 0, "more than 0 Å"),
            ("--ini_high", self.ini_high_angstrom, self.ini_high_angstrom is None or self.ini_high_angstrom > 0,
             "more than 0 Å"),
            ("--pad", self.padding_factor, 1 <= self.padding_factor <= MAX_PADDING_FACTOR,
             f"1 to {MAX_PADDING_FACTOR:g} (RELION: 2)"),
            ("--batch", self.batch_size, self.batch_size is None or self.batch_size >= 1, "1 or more particles"),
            ("--pool", self.pooled_particles, self.pooled_particles >= 1, "1 or more particles"),
            ("--free_gpu_memory", self.free_gpu_memory_mb, self.free_gpu_memory_mb >= 0, "0 MB or more"),
            ("--K", self.n_classes, self.n_classes >= 1, "1 class or more"),
            ("--random_seed", self.random_seed, self.random_seed >= 0, "0 or more, or -1 for a seed from the clock"),
            ("--j", self.threads, self.threads is None or self.threads >= 1, "1 thread or more"),
            ("--sigma_ang", self.sigma_ang_deg, self.sigma_ang_deg is None or self.sigma_ang_deg > 0,
             "more than 0 degrees (the σ of local searches, ±3σ around the poses)"),
            ("--sigma_psi", self.sigma_psi_deg, self.sigma_psi_deg is None or self.sigma_psi_deg > 0,
             "more than 0 degrees"),
            ("--sigma_rot", self.sigma_rot_deg, self.sigma_rot_deg is None or self.sigma_rot_deg > 0,
             "more than 0 degrees"),
            ("--sigma_tilt", self.sigma_tilt_deg, self.sigma_tilt_deg is None or self.sigma_tilt_deg > 0,
             "more than 0 degrees"),
            ("--psi_step", self.psi_step_deg, self.psi_step_deg is None or 0 < self.psi_step_deg <= 180,
             "more than 0 and at most 180 degrees (RELION's GUI: 12, 6° after oversampling)"),
            ("--class_inactivity_threshold", self.class_inactivity_threshold, 0 <= self.class_inactivity_threshold < 1,
             "a fraction from 0 (none replaced) to below 1 (RELION's GUI: 0.1)"),
            ("--grad_write_iter", self.grad_write_iter, self.grad_write_iter >= 1, "1 iteration or more (RELION: 10)"),
            ("--coarse_size", self.max_coarse_size_px, self.max_coarse_size_px <= 0 or self.max_coarse_size_px % 2 == 0,
             "an even number of pixels, or -1 for none (RELION's default)"),
        ]
        for option, value, ok, wanted in rules:
            if not ok:
                raise InputError(f"{option} {value:g}: out of range; give {wanted}")
        self._check_symmetry()
        for option, path in (("--i", self.input_star), ("--ref", self.reference_map),
                             ("--solvent_mask", self.solvent_mask), ("--solvent_mask2", self.solvent_mask2)):
            if path and not Path(path).is_file():
                raise InputError(f"{option} {path}: file not found; check the path (relative paths start from "
                                 f"{Path.cwd()})")
        if self.output_root:
            check_output_folder("--o", Path(self.output_root).parent)
        if self.scratch_dir:
            check_output_folder("--scratch_dir", self.scratch_dir)
        return self

    def check_for_box(self, box_px):
        """This config against the particles' box, or an InputError: a translation of more than half the box moves
        the particle's centre out of its image (and the search's translations would fill the device for nothing)."""
        half = int(box_px) // 2
        if self.offset_range_px > half:
            raise InputError(f"--offset_range {self.offset_range_px:g}: more than half the particles' box "
                             f"({box_px} px); give at most {half} pixels")
        return self

    def _check_symmetry(self):
        """--sym: a group RELION knows, whose asymmetric unit holds a direction at --healpix_order."""
        from cryorefine.core.sampling import Sampling
        from cryorefine.core.symmetry import symmetry_group

        if "," in str(self.symmetry):
            raise InputError(f"--sym {self.symmetry}: one point group per class is not implemented; give one group "
                             f"for all classes, e.g. --sym C1")
        try:
            group = symmetry_group(self.symmetry)
        except ValueError as exc:
            raise InputError(f"--sym {self.symmetry}: {exc}") from None
        if group.order > 1 and Sampling(self.healpix_order, 1.0, 1.0, group.name).n_directions == 0:
            least = next(order for order in range(self.healpix_order + 1, MAX_HEALPIX_ORDER + 1)
                         if Sampling(order, 1.0, 1.0, group.name).n_directions > 0)
            raise InputError(f"--healpix_order {self.healpix_order}: no direction of that sampling lies in the "
                             f"asymmetric unit of {group.name}; give --healpix_order {least} or more")

    def to_json(self):
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text):
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in json.loads(text).items() if k in known}
        if "gpu_ids" in values:
            values["gpu_ids"] = tuple(values["gpu_ids"])
        return cls(**values)


def default_batch_size(box_px: int, on_gpu: bool) -> int:
    """Particles per E-step batch when none is given: CPU_BATCH_PARTICLES on the CPU; on the GPU the images that hold
    GPU_BATCH_PIXELS pixels, within GPU_BATCH_PARTICLES (1,024 at 360 px, 506 at 512 px, 207 at 800 px)."""
    if not on_gpu:
        return CPU_BATCH_PARTICLES
    low, high = GPU_BATCH_PARTICLES
    return int(min(high, max(low, GPU_BATCH_PIXELS // max(int(box_px), 1) ** 2)))


def nearest_existing(path):
    """`path`, or the nearest place above it that exists (None where none does: a relative path under a working
    folder that was removed)."""
    return next((p for p in (Path(path), *Path(path).parents) if p.exists()), None)


def check_output_folder(option, folder):
    """InputError when `folder` (where outputs go) cannot be made: it, or a folder above it, is a file, or the nearest
    folder that exists takes no new folder (no permission, a read-only file system, /proc), which a folder made and
    removed there at once finds out."""
    place = nearest_existing(folder)
    if place is None:
        return
    if not place.is_dir():
        raise InputError(f"{option}: {place} is a file, not a folder; choose another output path")
    try:
        probe = tempfile.mkdtemp(prefix=".cryorefine_probe_", dir=place)
    except OSError as exc:
        raise InputError(f"{option}: no folder can be made in {place} ({exc.strerror}); choose a folder you "
                         f"can write in") from None
    os.rmdir(probe)
