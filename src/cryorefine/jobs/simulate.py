"""`cryorefine simulate`: particle images with known poses, CTFs and noise from a 3D map.

Every particle gets a pose drawn uniformly on SO(3) (rot and psi uniform in [−180°, 180°),
cos(tilt) uniform in [−1, 1]: the Haar measure in RELION's ZYZ angles), an origin drawn
uniformly in a disc of radius `max_shift_angstrom`, a defocus (mean uniform in the given
range, |U − V| uniform up to the given astigmatism, angle uniform in [0°, 180°)), and a half
set (a random permutation split alternately, so the halves differ by at most one particle).
The image is the projection of the map (`core.projector`, trilinear, padding 2), multiplied by
the RELION CTF (`core.ctf.ctf_2d`) in Fourier space, shifted to its origin, transformed back,
and given Gaussian noise whose variance is the image's signal variance inside the particle
circle divided by `snr` (white, or coloured with a smooth 1/f-like power spectrum; no noise
for snr = inf). The STAR file holds exactly the values the images were made with.

With a symmetry group other than C1 the reference is symmetrised first (real space, the group
average) and written as `reference_symmetrised.mrc` beside the particles: that map is the
ground truth. Poses are still drawn on the whole of SO(3), which is also uniform modulo the
symmetry; no attempt is made to keep them in one asymmetric unit.

Origin convention (RELION's, confirmed in 3dem/relion's source):

* src/reconstructor.cpp, Reconstructor::backprojectImage: the image's transform is passed to
  shiftImageInFourierTransform(F, F, N, +originX/pixel, +originY/pixel). src/fftw.cpp,
  shiftImageInFourierTransform, multiplies coefficient k by exp(−2πi k·s/N), i.e. it moves the
  image content by +s pixels. relion_reconstruct therefore moves every image by +origin before
  back-projecting it with the centre of the map at N//2.
* src/apps/project.cpp (relion_project): a projection computed about the box centre is shifted
  by −origin (XX(shift) = −xoff) before it is written with that origin.
* src/ml_optimiser.cpp, getFourierTransformsAndCtfs: the rounded old offset is applied with
  selfTranslate(img, +offset) before the search, the same direction.
* src/preprocessing.cpp, re-extraction with --recenter: the new box centre is the old
  coordinate minus the origin (xcoord -= ROUND(xoff)).

So a particle whose STAR file says rlnOriginXAngst = ox, rlnOriginYAngst = oy has its centre
(the projection of the map's centre, voxel N//2) at pixel (N//2 − ox/pixel, N//2 − oy/pixel)
of its image, and shifting the image by +origin (`fourier.phase_shift_2d(ft, +ox, +oy)`)
centres it. Here a projection made about N//2 is shifted by −origin.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cryorefine.core import arrays
from cryorefine.errors import InputError

STACK_NAME = "particles.mrcs"
STAR_NAME = "particles.star"
TRUTH_NAME = "reference_symmetrised.mrc"
_COLOURED_CORNER_SHELLS_FRACTION = 1.0 / 16.0  # coloured noise: power ∝ 1/(1 + |k|/k_c), k_c = N/16


@dataclass(frozen=True)
class SimulationOptions:
    n_particles: int
    snr: float = 0.05
    defocus_range_um: tuple = (0.8, 2.5)
    astigmatism_um: float = 0.05
    voltage_kv: float = 300.0
    cs_mm: float = 2.7
    amplitude_contrast: float = 0.1
    pixel_size_angstrom: float | None = None  # None: from the map header
    max_shift_angstrom: float | None = None  # None: 3 pixels
    symmetry: str = "C1"
    noise: str = "white"
    seed: int = 0
    batch_size: int = 256
    particle_diameter_angstrom: float | None = None  # None: the box's inscribed circle
    apply_ctf: bool = True
    float16: bool = False  # the stack in MRC mode 12 (half the disk; RELION 4.0+ reads it)


def parse_defocus_range_um(text):
    """'0.8:2.5' -> (0.8, 2.5) µm; a single number means a fixed defocus."""
    parts = str(text).split(":")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise InputError(f"--defocus '{text}': give a range in µm as LOW:HIGH, e.g. 0.8:2.5") from None
    if len(values) == 1:
        values = values * 2
    if len(values) != 2 or not all(np.isfinite(values)) or values[0] > values[1] or values[0] < 0:
        raise InputError(f"--defocus '{text}': give a range in µm as LOW:HIGH with 0 ≤ LOW ≤ HIGH, e.g. 0.8:2.5")
    return values[0], values[1]


def _as_written(values):
    """The float64 values that a STAR file written with `io.star.FLOAT_FORMAT` gives back."""
    from cryorefine.io.star import FLOAT_FORMAT

    values = np.asarray(values, dtype=np.float64)
    return np.char.mod(FLOAT_FORMAT, values).astype(np.float64)


def draw_parameters(n, options, pixel_size_angstrom, rng):
    """Per-particle ground truth (dict of (n,) arrays), rounded to what the STAR file will hold."""
    rot = rng.uniform(-180.0, 180.0, n)
    tilt = np.rad2deg(np.arccos(rng.uniform(-1.0, 1.0, n)))
    psi = rng.uniform(-180.0, 180.0, n)
    max_shift = 3.0 * pixel_size_angstrom if options.max_shift_angstrom is None else options.max_shift_angstrom
    radius = max_shift * np.sqrt(rng.uniform(0.0, 1.0, n))
    angle = rng.uniform(0.0, 2.0 * np.pi, n)
    origin_x = radius * np.cos(angle)
    origin_y = radius * np.sin(angle)
    lo, hi = options.defocus_range_um
    mean_defocus = rng.uniform(lo, hi, n) * 1e4
    astig = rng.uniform(0.0, options.astigmatism_um, n) * 1e4
    defocus_angle = rng.uniform(0.0, 180.0, n)
    order = rng.permutation(n)
    subset = np.empty(n, dtype=np.int64)
    subset[order[0::2]] = 1
    subset[order[1::2]] = 2
    params = {
        "rot_deg": rot, "tilt_deg": tilt, "psi_deg": psi,
        "origin_x_angstrom": origin_x, "origin_y_angstrom": origin_y,
        "defocus_u_angstrom": mean_defocus + 0.5 * astig, "defocus_v_angstrom": mean_defocus - 0.5 * astig,
        "defocus_angle_deg": defocus_angle,
    }
    params = {k: _as_written(v) for k, v in params.items()}
    params["random_subset"] = subset
    return params


def particle_mask(box_px, radius_px):
    """Boolean (N, N) disc of `radius_px` about pixel N//2."""
    c = box_px // 2
    y, x = np.mgrid[:box_px, :box_px]
    return (x - c) ** 2 + (y - c) ** 2 <= radius_px ** 2


def coloured_noise_filter(box_px):
    """Amplitude filter (N, N//2+1) for coloured noise: power ∝ 1/(1 + |k|/k_c), mean power 1.

    The normalisation is over the full transform, so white noise of variance σ² filtered by it
    keeps variance σ² (Parseval).
    """
    from cryorefine.core import fourier

    k_c = max(1.0, box_px * _COLOURED_CORNER_SHELLS_FRACTION)
    power = 1.0 / (1.0 + fourier.radius_2d(box_px) / k_c)
    mult = fourier.hermitian_weights_2d(box_px)
    power = power / ((power * mult).sum() / box_px ** 2)
    return np.sqrt(power)


def simulate_images(projector, params, index, options, pixel_size_angstrom, box_px, mask, noise_seed,
                    noise_filter=None, xp=np):
    """Images (B, N, N) float32 of the particles `index` (an index array into `params`), as `xp` arrays.

    The noise of particle i depends only on (noise_seed, i) (images.background_noise), so
    numpy and cupy make the same stack and batching does not change it.
    """
    from cryorefine.core import ctf as ctf_module
    from cryorefine.core import euler, fourier
    from cryorefine.images import background_noise

    matrices = euler.euler_to_matrix(params["rot_deg"][index], params["tilt_deg"][index], params["psi_deg"][index])
    ft = projector.project(xp.asarray(matrices), box_px)
    if options.apply_ctf:
        ctf = ctf_module.ctf_2d(box_px, ctf_module.CtfParameters(
            pixel_size_angstrom, params["defocus_u_angstrom"][index], params["defocus_v_angstrom"][index],
            params["defocus_angle_deg"][index], options.voltage_kv, options.cs_mm, options.amplitude_contrast),
            xp=xp, dtype=np.float64)
        ft = ft * ctf
    # RELION's convention: the particle centre lies at N//2 − origin (see the module docstring).
    ft = fourier.phase_shift_2d(ft, xp.asarray(-params["origin_x_angstrom"][index] / pixel_size_angstrom),
                                xp.asarray(-params["origin_y_angstrom"][index] / pixel_size_angstrom), box_px, xp)
    images = fourier.irfft2_centered(ft, box_px, xp)
    if math.isinf(options.snr):
        return images.astype(xp.float32)
    inside = images[:, xp.asarray(mask)]
    signal_var = inside.var(axis=1)
    sigma = xp.sqrt(signal_var / options.snr)
    noise = background_noise(noise_seed, 0, xp.asarray(index), box_px, xp)
    if noise_filter is not None:
        noise = fourier.irfft2_centered(fourier.rfft2_centered(noise, xp) * xp.asarray(noise_filter), box_px, xp)
    images += sigma[:, None, None] * noise
    return images.astype(xp.float32)


def simulate(reference_path, out_dir, options, log=None, xp=np):
    """Write `out_dir`/particles.mrcs and particles.star; returns a summary dict.

    Both files appear under their final names only when everything succeeded. With `xp` cupy
    the images are made on the current GPU (the same images as numpy's, to rounding).
    """
    import mrcfile

    from cryorefine.config import check_output_folder
    from cryorefine.core import symmetry as symmetry_module
    from cryorefine.core.projector import Projector
    from cryorefine.io import mrc
    from cryorefine.io.atomic import atomic_path
    from cryorefine.io.star import star_to_string

    log = log or (lambda message: None)
    _validate(options)
    volume, header_pixel = mrc.read_volume(reference_path)
    pixel = options.pixel_size_angstrom if options.pixel_size_angstrom is not None else header_pixel
    if pixel is None:
        raise InputError(f"{reference_path}: the map header has no pixel size (0 or 1.0 is taken as unset); "
                         f"give it with --angpix")
    box = int(volume.shape[0])
    try:
        group = symmetry_module.symmetry_group(options.symmetry)
    except ValueError as exc:
        raise InputError(f"--sym {options.symmetry}: {exc}") from None
    out_dir = Path(out_dir)
    check_output_folder("--o", out_dir)  # a file where the folder should be, or a place that takes no folder
    _check_room(options, box, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if group.order > 1:
        volume = symmetry_module.symmetrise_volume(volume, group).astype(np.float32)

    seeds = np.random.SeedSequence(options.seed).spawn(2)
    param_rng = np.random.default_rng(seeds[0])
    noise_seed = int(seeds[1].generate_state(1, np.uint64)[0])
    n = options.n_particles
    params = draw_parameters(n, options, pixel, param_rng)
    radius_px = (box / 2.0 if options.particle_diameter_angstrom is None
                 else options.particle_diameter_angstrom / (2.0 * pixel))
    mask = particle_mask(box, radius_px)
    noise_filter = coloured_noise_filter(box) if options.noise == "coloured" else None
    projector = Projector(volume, padding_factor=2.0, xp=xp)

    star_path = out_dir / STAR_NAME
    stack_path = out_dir / STACK_NAME
    start_time = time.monotonic()
    with atomic_path(star_path) as star_tmp:
        with atomic_path(stack_path) as stack_tmp:
            total = total_sq = 0.0
            lo, hi = np.inf, -np.inf
            mode, dtype = (12, np.float16) if options.float16 else (2, np.float32)
            with mrcfile.new_mmap(stack_tmp, shape=(n, box, box), mrc_mode=mode, overwrite=True) as m:
                m.set_image_stack()
                for start in range(0, n, options.batch_size):
                    index = np.arange(start, min(n, start + options.batch_size))
                    images = simulate_images(projector, params, index, options, pixel, box, mask, noise_seed,
                                             noise_filter, xp)
                    with np.errstate(over="ignore"):  # an overflow is refused just below
                        images = images.astype(dtype, copy=False)
                    if options.float16 and not bool(xp.isfinite(images).all()):
                        raise InputError(f"--float16: the images of {reference_path} exceed float16's range "
                                         f"(±65504); write them in float32 (leave out --float16) or scale the map")
                    flat = images.astype(xp.float64)  # the header's statistics where the images are made
                    total += float(flat.sum())
                    total_sq += float((flat * flat).sum())
                    lo, hi = min(lo, float(images.min())), max(hi, float(images.max()))
                    del flat
                    m.data[index[0]:index[-1] + 1] = images.get() if xp is not np else images
                    log(f"simulate: {index[-1] + 1}/{n} particles ({time.monotonic() - start_time:.1f} s)")
                count = float(n) * box * box
                mean = total / count
                m.voxel_size = float(pixel)
                m.header.dmin, m.header.dmax, m.header.dmean = lo, hi, mean
                m.header.rms = math.sqrt(max(total_sq / count - mean * mean, 0.0))
                mrc.set_label(m)
        blocks = {"optics": _optics_table(options, pixel, box), "particles": _particle_table(params, options, n)}
        Path(star_tmp).write_text(star_to_string(blocks))
    if group.order > 1:
        mrc.write_volume(out_dir / TRUTH_NAME, volume, pixel)
        log(f"reference symmetrised with {group.name} (order {group.order}): {out_dir / TRUTH_NAME}")
    return {"star": str(star_path), "stack": str(stack_path), "n_particles": n, "box_px": box,
            "pixel_size_angstrom": float(pixel), "seconds": time.monotonic() - start_time}


def _optics_table(options, pixel, box):
    import pandas as pd

    return pd.DataFrame({
        "rlnOpticsGroup": [1], "rlnOpticsGroupName": ["opticsGroup1"],
        "rlnAmplitudeContrast": [options.amplitude_contrast], "rlnSphericalAberration": [options.cs_mm],
        "rlnVoltage": [options.voltage_kv], "rlnImagePixelSize": [float(pixel)], "rlnImageSize": [box],
        "rlnImageDimensionality": [2], "rlnCtfDataAreCtfPremultiplied": [0],
    })


def _particle_table(params, options, n):
    import pandas as pd

    columns = {"rlnImageName": np.char.add(np.char.zfill(np.arange(1, n + 1).astype(str), 6), "@" + STACK_NAME)}
    if options.apply_ctf:
        columns.update({
            "rlnDefocusU": params["defocus_u_angstrom"], "rlnDefocusV": params["defocus_v_angstrom"],
            "rlnDefocusAngle": params["defocus_angle_deg"], "rlnPhaseShift": np.zeros(n),
            "rlnCtfBfactor": np.zeros(n),
        })
    columns.update({
        "rlnAngleRot": params["rot_deg"], "rlnAngleTilt": params["tilt_deg"], "rlnAnglePsi": params["psi_deg"],
        "rlnOriginXAngst": params["origin_x_angstrom"], "rlnOriginYAngst": params["origin_y_angstrom"],
        "rlnOpticsGroup": np.ones(n, dtype=np.int64), "rlnRandomSubset": params["random_subset"],
        "rlnClassNumber": np.ones(n, dtype=np.int64),
    })
    return pd.DataFrame(columns)


STAR_ROW_BYTES = 250  # about a particle's row of particles.star
# the host memory a particle takes: peak RSS (its parameters, its table and STAR text, and what of the memory-mapped
# stack stays resident) grew by 0.92 KB a particle (float16 stack) and 1.09 KB (float32) between 100,000 and 400,000
# particles of 16 px
HOST_BYTES_PER_PARTICLE = 1100


def _check_room(options, box, out_dir):
    """InputError when the particles would not fit: the stack and STAR file in the free space of the disk that will
    hold `out_dir` (the stack is a memory map of its whole size, and a write past the disk's end would kill the
    process instead of failing cleanly), or their table in the memory available (the kernel's out-of-memory killer
    would end the process without a word)."""
    import shutil

    from cryorefine.config import nearest_existing

    n = int(options.n_particles)
    need = n * (box * box * (2 if options.float16 else 4) + STAR_ROW_BYTES)
    existing = nearest_existing(out_dir)  # check_output_folder has found it, a folder
    free = shutil.disk_usage(existing).free
    if need > free:
        raise InputError(f"--n {n}: {n} particles of {box} px take about {need / 1e9:.3g} GB but {free / 1e9:.3g} GB "
                         f"are free in {existing}; give fewer particles{'' if options.float16 else ' or --float16'}")
    memory = arrays.available_memory_bytes()
    if memory is not None and n * HOST_BYTES_PER_PARTICLE > memory:
        raise InputError(f"--n {n}: the table of {n} particles takes about {n * HOST_BYTES_PER_PARTICLE / 1e9:.3g} GB "
                         f"of memory but {memory / 1e9:.3g} GB are available; give fewer particles")


def _validate(options):
    if options.n_particles < 1:
        raise InputError(f"--n {options.n_particles}: give at least one particle")
    if not options.snr > 0:
        raise InputError(f"--snr {options.snr}: give a signal-to-noise ratio > 0 (inf for no noise)")
    if options.batch_size < 1:
        raise InputError(f"--batch {options.batch_size}: give a batch size ≥ 1")
    if options.noise not in ("white", "coloured"):
        raise InputError(f"--noise {options.noise}: give white or coloured")
    if not 0.0 <= options.amplitude_contrast < 1.0:
        raise InputError(f"--q0 {options.amplitude_contrast}: the amplitude contrast must lie in [0, 1)")
    if options.voltage_kv <= 0:
        raise InputError(f"--voltage {options.voltage_kv}: give the voltage in kV (> 0)")
    if options.astigmatism_um < 0:
        raise InputError(f"--astigmatism {options.astigmatism_um}: give a value ≥ 0 (µm)")
    if options.pixel_size_angstrom is not None and not options.pixel_size_angstrom > 0:
        raise InputError(f"--angpix {options.pixel_size_angstrom}: give the pixel size in Å (> 0)")
    if options.max_shift_angstrom is not None and options.max_shift_angstrom < 0:
        raise InputError(f"--max_shift {options.max_shift_angstrom}: give a value ≥ 0 (Å)")
    if options.particle_diameter_angstrom is not None and not options.particle_diameter_angstrom > 0:
        raise InputError(f"--particle_diameter {options.particle_diameter_angstrom}: give a diameter in Å (> 0)")
    low_um = options.defocus_range_um[0]
    if options.apply_ctf and low_um - options.astigmatism_um / 2 < 0:
        raise InputError(f"--defocus {low_um:g}:…/--astigmatism {options.astigmatism_um:g}: defocus V could be "
                         f"negative (overfocus); raise the lower defocus or lower the astigmatism")
