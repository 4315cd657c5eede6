"""`cryorefine reconstruct`: a map from particle images at the poses in their STAR file.

The job of relion_reconstruct (src/reconstructor.cpp in 3dem/relion): every image is read,
moved by +origin (RELION's sign: the particle centre lies at N//2 − origin, see
`cryorefine.jobs.simulate`), Fourier transformed, its zero frequency set to 0, windowed to the
frequencies that --maxres keeps, and with --ctf multiplied by its CTF while CTF² goes into the
weights (images whose optics group says rlnCtfDataAreCtfPremultiplied = 1 are not multiplied
again). Slices are back-projected at the STAR poses into padded Fourier sums
(`core.projector.BackProjector`); with a symmetry group every image is back-projected once per
group operator R, at pose A·Rᵀ (RELION symmetrises the sums, which is the same up to
interpolation). The map is data / max(weight, 1/1000 of the shell's mean weight), inverse
transformed, gridding-corrected (`BackProjector.reconstruct`, RELION's defaults).

--angpix is the pixel size of the output map, as in relion_reconstruct: when it differs from
the particles' pixel size the poses are scaled (RELION's ObservationModel::applyScaleDifference)
and the map keeps the particles' box size.

With --half_maps the particles are split by rlnRandomSubset (or a seeded random split when
that column is incomplete), each half is reconstructed on its own, the full map is the
reconstruction from both halves' sums, and the FSC between the two half maps is written as a
STAR table `<output stem>_fsc.star`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cryorefine.errors import InputError

ANGLE_COLUMNS = ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi")
ORIGIN_COLUMNS = ("rlnOriginXAngst", "rlnOriginYAngst")


@dataclass(frozen=True)
class ReconstructOptions:
    do_ctf: bool = False
    symmetry: str = "C1"
    maxres_angstrom: float | None = None
    half_maps: bool = False
    pixel_size_angstrom: float | None = None  # output pixel size; None: the particles'
    padding_factor: float = 2.0
    batch_size: int = 256
    seed: int = 0  # for the half-set split when rlnRandomSubset is incomplete


def half_map_paths(out_path):
    """(half 1, half 2, FSC table) paths beside the output map: map.mrc -> map_half1.mrc, map_fsc.star."""
    out = Path(out_path)
    suffix = out.suffix or ".mrc"
    return (out.with_name(f"{out.stem}_half1{suffix}"), out.with_name(f"{out.stem}_half2{suffix}"),
            out.with_name(f"{out.stem}_fsc.star"))


class _Job:
    """Everything the batch loop needs, worked out once from the particles and the options."""

    def __init__(self, particles, options, log):
        from cryorefine.core import symmetry as symmetry_module

        self.particles = particles
        self.options = options
        self.log = log
        self.box_px, self.data_pixel_angstrom = particles.geometry()
        self.pixel_angstrom = (self.data_pixel_angstrom if options.pixel_size_angstrom is None
                               else float(options.pixel_size_angstrom))
        # Image frequency k lands on map frequency k·scale (RELION's applyScaleDifference, equal boxes).
        self.scale = self.pixel_angstrom / self.data_pixel_angstrom
        nyquist = self.box_px // 2
        if options.maxres_angstrom is None:
            self.r_max_px = nyquist
        else:
            self.r_max_px = max(1, min(nyquist, math.ceil(self.box_px * self.pixel_angstrom / options.maxres_angstrom)))
        image_r_max = math.ceil(self.r_max_px / self.scale)
        self.window_px = self.box_px if image_r_max >= nyquist else min(self.box_px, 2 * (image_r_max + 1))
        try:
            self.group = symmetry_module.symmetry_group(options.symmetry)
        except ValueError as exc:
            raise InputError(f"--sym {options.symmetry}: {exc}") from None
        self.premultiplied = _premultiplied_per_particle(particles)

    def backproject(self, backprojector, indices, reader, done, total, start_time):
        from cryorefine.core import ctf as ctf_module
        from cryorefine.core import euler, fourier

        p = self.particles
        n = self.window_px
        for batch in p.batches(self.options.batch_size, indices):
            images = p.read_images(batch, reader).astype(np.float64)
            ft = fourier.rfft2_centered(images)
            pixel = p.pixel_size_per_particle_angstrom[batch]
            ft = fourier.phase_shift_2d(ft, p.origin_x_angstrom[batch] / pixel, p.origin_y_angstrom[batch] / pixel,
                                        self.box_px)
            if n < self.box_px:
                ft = fourier.window_ft_2d(ft, n)
            ft[:, 0, 0] = 0.0  # as relion_reconstruct: the images' mean does not enter the map
            weights = None
            if self.options.do_ctf:
                ctf = ctf_module.ctf_2d(n, p.ctf_parameters(batch, pixel * self.box_px / n), dtype=np.float64)
                multiply = ~self.premultiplied[batch]
                ft = np.where(multiply[:, None, None], ft * ctf, ft)
                weights = ctf * ctf
            matrices = euler.euler_to_matrix(p.rot_deg[batch], p.tilt_deg[batch], p.psi_deg[batch]) * self.scale
            for op in self.group.matrices:
                backprojector.backproject(ft, weights, matrices @ op.T)
            done += batch.size
            self.log(f"reconstruct: {done}/{total} particles back-projected ({time.monotonic() - start_time:.1f} s)")
        return done


def _premultiplied_per_particle(particles):
    optics = particles.star.optics
    column = "rlnCtfDataAreCtfPremultiplied"
    if column not in optics.columns:
        return np.zeros(len(particles), dtype=bool)
    flags = optics[column].fillna(0).astype(int).to_numpy() != 0
    return flags[particles.optics_index]


def _require_poses(particles, star_path, log):
    columns = particles.star.particles.columns
    for column in ANGLE_COLUMNS:
        if column not in columns:
            raise InputError(f"{star_path}: column {column} is missing from the particle table; reconstruct needs "
                             f"the poses (rlnAngleRot, rlnAngleTilt, rlnAnglePsi) of every particle")
    missing = [c for c in ORIGIN_COLUMNS if c not in columns]
    if missing:
        log(f"reconstruct: {', '.join(missing)} not in {star_path}; taken as 0")


def _validate(options):
    if options.maxres_angstrom is not None and not options.maxres_angstrom > 0:
        raise InputError(f"--maxres {options.maxres_angstrom}: give a resolution in Å (> 0)")
    if options.pixel_size_angstrom is not None and not options.pixel_size_angstrom > 0:
        raise InputError(f"--angpix {options.pixel_size_angstrom}: give the pixel size in Å (> 0)")
    if not options.padding_factor >= 1:
        raise InputError(f"--pad {options.padding_factor}: give a padding factor ≥ 1")
    if options.batch_size < 1:
        raise InputError(f"--batch {options.batch_size}: give a batch size ≥ 1")


def fsc_table(fsc, box_px, pixel_size_angstrom):
    """RELION's FSC table columns (as in a postprocess.star) as a DataFrame."""
    import pandas as pd

    shells = np.arange(len(fsc))
    with np.errstate(divide="ignore"):
        resolution = shells / (box_px * pixel_size_angstrom)
        angstrom = np.where(shells > 0, 1.0 / np.where(shells > 0, resolution, 1.0), 999.0)
    return pd.DataFrame({"rlnSpectralIndex": shells, "rlnResolution": resolution,
                         "rlnAngstromResolution": angstrom, "rlnFourierShellCorrelation": np.asarray(fsc)})


def reconstruct(star_path, out_path, options, log=None):
    """Reconstruct and write the map (and half maps + FSC table); returns a summary dict.

    Nothing is written unless every particle was back-projected.
    """
    from cryorefine.core import fsc as fsc_module
    from cryorefine.core.projector import BackProjector
    from cryorefine.data import load_particles
    from cryorefine.io import mrc
    from cryorefine.io.star import write_star

    log = log or (lambda message: None)
    _validate(options)
    particles = load_particles(star_path)
    _require_poses(particles, star_path, log)
    if options.do_ctf:
        particles.require_ctf()
    if len(particles) == 0:
        raise InputError(f"{star_path}: the particle table is empty")
    job = _Job(particles, options, log)

    def new_backprojector():
        return BackProjector(job.box_px, padding_factor=options.padding_factor, r_max_px=job.r_max_px)

    start_time = time.monotonic()
    total = len(particles)
    summary = {"n_particles": total, "box_px": job.box_px, "pixel_size_angstrom": job.pixel_angstrom,
               "r_max_px": job.r_max_px, "symmetry": job.group.name}
    with mrc.StackReader() as reader:
        if options.half_maps:
            halves = particles.half_sets(options.seed)
            sums = []
            done = 0
            for h in (1, 2):
                members = np.flatnonzero(halves == h)
                if members.size == 0:
                    raise InputError(f"{star_path}: half set {h} is empty (rlnRandomSubset); --half_maps needs "
                                     f"particles in both halves")
                bp = new_backprojector()
                done = job.backproject(bp, members, reader, done, total, start_time)
                sums.append(bp)
            full = new_backprojector()
            full.data = sums[0].data + sums[1].data
            full.weight = sums[0].weight + sums[1].weight
            half_volumes = [bp.reconstruct() for bp in sums]
        else:
            full = new_backprojector()
            job.backproject(full, np.arange(total), reader, 0, total, start_time)
            half_volumes = None
    volume = full.reconstruct()

    out_path = Path(out_path)
    if half_volumes is not None:
        fsc = fsc_module.fsc_volumes(half_volumes[0].astype(np.float64), half_volumes[1].astype(np.float64))
        resolution = fsc_module.resolution_at_threshold(fsc, job.box_px, job.pixel_angstrom, 0.143)
        half1_path, half2_path, fsc_path = half_map_paths(out_path)
        mrc.write_volume(half1_path, half_volumes[0], job.pixel_angstrom)
        mrc.write_volume(half2_path, half_volumes[1], job.pixel_angstrom)
        write_star({"fsc": fsc_table(fsc, job.box_px, job.pixel_angstrom)}, fsc_path)
        summary.update(half1=str(half1_path), half2=str(half2_path), fsc_star=str(fsc_path),
                       resolution_fsc0143_angstrom=resolution, fsc=fsc)
    mrc.write_volume(out_path, volume, job.pixel_angstrom)
    summary.update(map=str(out_path), seconds=time.monotonic() - start_time)
    return summary
