"""Stage 1 of an iteration: particle images into masked Fourier transforms, CTFs and noise
statistics (RELION's getFourierTransformsAndCtfs and calculateSumOfPowerSpectraAndAverageImage).

Per particle: the centre of the offsets' prior (its rlnOriginX/YPriorAngst in pixels, `Batch.origin_prior_px`),
norm correction (×avg_norm/norm), an integer shift by the rounded old origin
(so the mask sits on the particle), a soft circular mask of `particle_diameter` with a cosine
edge (outside: zeros with --zero_mask, else Gaussian noise of the background's standard
deviation), the transform, windowed to the current size; the unmasked transform is kept for
back-projection. The remaining sub-pixel part of the origin is applied as a phase shift by
the engine, together with the translations it searches.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from cryorefine.core import fourier
from cryorefine.core.arrays import Array, ArrayModule, add_rows_at, array_module, to_device, to_host
from cryorefine.core.ctf import ctf_2d
from cryorefine.estep.engine import Batch
from cryorefine.io import mrc

if TYPE_CHECKING:  # for annotations only
    from cryorefine.data import ParticleSet


@dataclass(frozen=True)
class ImageSettings:
    ori_size_px: int
    pixel_size_angstrom: float
    particle_diameter_angstrom: float | None
    width_mask_edge_px: float = 5.0
    zero_mask: bool = False
    do_ctf: bool = False
    random_seed: int = 0
    ctf_intact_first_peak: bool = False  # --ctf_intact_first_peak: the CTF is 1 up to its first peak
    # the offsets' prior of a batch is centred on each particle's rlnOriginX/YPriorAngst ((0, 0) where the file has
    # none), as RELION's 3D jobs centre it; False: on (0, 0) (a 2D classification: RELION centres it on the class's
    # mean offset there, whatever the particles' priors)
    per_particle_offset_priors: bool = True

    @property
    def mask_radius_px(self) -> float:
        if self.particle_diameter_angstrom is None:
            return self.ori_size_px / 2 - self.width_mask_edge_px
        return self.particle_diameter_angstrom / (2 * self.pixel_size_angstrom)


def shell_power(ft: Array, ori_size_px: int, n_shells: int, xp: ArrayModule = np,
                beyond_radius_px: float | None = None) -> Array:
    """Σ |F|² per shell over the half transform without the kx = 0, ky < 0 half column: (B, n_shells); with
    `beyond_radius_px` only over the coefficients with |k| > that radius."""
    size = ft.shape[-2]

    def shells() -> Array:
        ky, kx = fourier.frequencies_2d(size, xp)
        use = ~((kx == 0) & (ky < 0))
        if beyond_radius_px is not None:
            use = use & (kx * kx + ky * ky > beyond_radius_px * beyond_radius_px)
        return xp.where(use, xp.rint(xp.sqrt(kx * kx + ky * ky)), n_shells).astype(xp.int64)

    if xp is np:
        return fourier.shell_sum(np.abs(ft) ** 2, shells(), n_shells, xp)
    from cryorefine.gpu.kept import table

    index = table(("shell of each coefficient", size, n_shells, beyond_radius_px), shells)
    return fourier.shell_sum(_power_kernel(xp)(ft), index, n_shells, xp)


def coefficients_per_shell(ori_size_px: int) -> np.ndarray:
    """How many half-transform coefficients each shell 0 … N/2 holds (the denominators of RELION's spectra)."""
    n_shells = ori_size_px // 2 + 1
    return shell_power(np.ones((1, ori_size_px, n_shells)), ori_size_px, n_shells)[0]


def _splitmix64(z, xp):
    """SplitMix64's output function on uint64 arrays (wrapping arithmetic)."""
    z = z + xp.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> xp.uint64(30))) * xp.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> xp.uint64(27))) * xp.uint64(0x94D049BB133111EB)
    return z ^ (z >> xp.uint64(31))


def noise_keys(seed: int, iteration: int, particle_indices: npt.ArrayLike, xp: ArrayModule = np) -> Array:
    """The generator key of each particle's background noise (B,) uint64: SplitMix64 of the seed, the
    iteration and the particle index."""
    key = _splitmix64(xp.full(1, seed, dtype=xp.uint64), xp)
    key = _splitmix64(key ^ xp.uint64(iteration), xp)
    return _splitmix64(key ^ xp.asarray(particle_indices, dtype=xp.uint64), xp)


def background_noise(seed: int, iteration: int, particle_indices: npt.ArrayLike, size_px: int,
                     xp: ArrayModule = np) -> Array:
    """Standard normal noise (B, N, N) that depends only on (seed, iteration, particle, pixel).

    A counter-based generator (SplitMix64 hashes, Box–Muller), so numpy and cupy draw the same
    values and a particle's noise does not depend on its batch, its worker or the rank count.
    """
    key = noise_keys(seed, iteration, particle_indices, xp)  # (B,)
    counter = xp.arange(size_px * size_px, dtype=xp.uint64) * xp.uint64(2)
    bits_a = _splitmix64(key[:, None] ^ counter[None, :], xp)
    bits_b = _splitmix64(key[:, None] ^ (counter[None, :] + xp.uint64(1)), xp)
    scale = 2.0 ** -53
    u_a = 1.0 - (bits_a >> xp.uint64(11)).astype(xp.float64) * scale  # (0, 1]
    u_b = (bits_b >> xp.uint64(11)).astype(xp.float64) * scale
    normal = xp.sqrt(-2.0 * xp.log(u_a)) * xp.cos(2.0 * np.pi * u_b)
    return normal.reshape(-1, size_px, size_px)


def masked_images(images: Array, settings: ImageSettings, particle_indices: npt.ArrayLike, iteration: int,
                  xp: ArrayModule = np) -> Array:
    """Soft-masked copies of real-space images (B, N, N); noise outside unless zero_mask."""
    n = settings.ori_size_px
    mask = fourier.soft_circular_mask(n, settings.mask_radius_px, settings.width_mask_edge_px, xp)
    if settings.zero_mask:
        return images * mask
    outside = mask < 1e-6
    background = images[:, outside]
    std = xp.sqrt(xp.maximum(xp.mean(background ** 2, axis=1) - xp.mean(background, axis=1) ** 2, 0.0))
    noise = background_noise(settings.random_seed, iteration, particle_indices, n, xp)
    return images * mask + (1.0 - mask) * noise * std[:, None, None]


def roll_each(images: Array, shift_x_px: npt.ArrayLike, shift_y_px: npt.ArrayLike, xp: ArrayModule = np) -> Array:
    """images[b] rolled by (shift_y[b], shift_x[b]) pixels, as np.roll on each image: (B, N, N)."""
    n = images.shape[-1]
    pixels = xp.arange(n)
    rows = (pixels[None, :] - xp.asarray(shift_y_px)[:, None]) % n
    cols = (pixels[None, :] - xp.asarray(shift_x_px)[:, None]) % n
    return images[xp.arange(images.shape[0])[:, None, None], rows[:, :, None], cols[:, None, :]]


_SPLITMIX64 = """
__device__ __forceinline__ unsigned long long cr_splitmix64(unsigned long long z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
"""


# i → the image b and the pixel (y, x) of the raw image that element q of its ifftshifted copy takes, rolled by
# (ry[b], rx[b]) (each in [0, N)): (y, x) = (row, col) + N//2 − (ry, rx) mod N. In 32-bit arithmetic where the batch's
# elements allow it (64-bit divisions would take most of the kernel's time).
_PIXEL_OF = """
    const int nn = n * n;
    long long b;
    int q;
    if (i < 2147483647LL) {
        const int ii = (int)i;
        const int b32 = ii / nn;
        b = b32;
        q = ii - b32 * nn;
    } else {
        b = i / nn;
        q = (int)(i - b * nn);
    }
    const int row = q / n, col = q - row * n;
    int y = row + n / 2 - ry[b], x = col + n / 2 - rx[b];
    if (y >= n) y -= n; else if (y < 0) y += n;
    if (x >= n) x -= n; else if (x < 0) x += n;
"""


@functools.cache
def _shifted_kernel(cp, masked: bool):
    """out[b, q] = float32(raw[b, pixel]·factor[b]) (the product in float64), pixel as _PIXEL_OF: norm correction,
    integer re-centring (roll_each) and the transform's ifftshift in one pass; bad[b] = 1 where a raw value of
    image b is not finite. `masked`: also out_masked[b, q] = float32(raw·factor·mask[q]) (--zero_mask's masked
    images)."""
    outputs = "float32 out, float32 out_masked, raw int32 bad" if masked else "float32 out, raw int32 bad"
    return cp.ElementwiseKernel(
        "raw T raw_images, raw int32 ry, raw int32 rx, raw float64 factor, raw float64 mask, int32 n", outputs,
        _PIXEL_OF + """
        const double v = (double)raw_images[b * nn + (long long)y * n + x];
        if (!isfinite(v)) bad[b] = 1;
        const double value = v * factor[b];
        out = (float)value;
        """ + ("out_masked = (float)(value * mask[q]);" if masked else ""),
        "cryorefine_shifted_images_masked" if masked else "cryorefine_shifted_images")


@functools.cache
def _masked_noise_kernel(cp):
    """masked_images on ifftshifted images: v·mask + (1 − mask)·noise·std[b] in float64, stored as float32, the
    noise drawn in place (background_noise's SplitMix64 counters and Box–Muller) at the unshifted pixel."""
    return cp.ElementwiseKernel(
        "float32 v, float64 m, raw float64 std, raw uint64 key, int32 n", "float32 out",
        """
        const long long nn = (long long)n * n;
        const long long b = i / nn;
        const long long q = i - b * nn;
        const int h = n / 2;
        const long long y = ((int)(q / n) + h) % n, x = ((int)(q % n) + h) % n;
        const unsigned long long counter = (unsigned long long)(y * n + x) * 2ull;
        const unsigned long long bits_a = cr_splitmix64(key[b] ^ counter);
        const unsigned long long bits_b = cr_splitmix64(key[b] ^ (counter + 1ull));
        const double u_a = 1.0 - (double)(bits_a >> 11) * 1.1102230246251565e-16;  // 2^-53
        const double u_b = (double)(bits_b >> 11) * 1.1102230246251565e-16;
        const double normal = sqrt(-2.0 * log(u_a)) * cos(6.283185307179586 * u_b);  // 2π
        out = (float)((double)v * m + (1.0 - m) * normal * std[b]);
        """, "cryorefine_masked_noise", preamble=_SPLITMIX64)


@functools.cache
def _power_kernel(cp):
    """|z|² of complex64 coefficients as float32, in one pass."""
    return cp.ElementwiseKernel("complex64 z", "float32 p", "p = z.real() * z.real() + z.imag() * z.imag()",
                                "cryorefine_coefficient_power")


def device_shifted_images(raw_images: Array, factor: np.ndarray, rx: np.ndarray, ry: np.ndarray,
                          settings: ImageSettings, particle_indices: npt.ArrayLike, iteration: int,
                          xp: ArrayModule) -> tuple[Array, Array, np.ndarray]:
    """The device's version of prepare_batch's real-space steps: the norm-corrected, re-centred images and
    their masked copies (`masked_images`), both already moved by ifftshift for the transform and multiplied by
    1/N² (the forward transform's normalisation, so that it can run unnormalised) (B, N, N) float32 (the
    engine's precision; each value computed in float64), and which images hold only finite values (B,) bool on
    the host. One pass over the batch makes both with --zero_mask; otherwise a second adds the background
    noise, whose standard deviation comes from two matrix-vector products over the pixels outside the mask, in
    float64."""
    from cryorefine.gpu.kept import table

    n = settings.ori_size_px
    b = int(raw_images.shape[0])
    radius, edge = settings.mask_radius_px, settings.width_mask_edge_px
    mask = table(("ifftshifted soft circular mask", n, radius, edge),
                 lambda: xp.fft.ifftshift(fourier.soft_circular_mask(n, radius, edge, xp)))
    shifted = xp.empty((b, n, n), dtype=xp.float32)
    bad = xp.zeros(b, dtype=xp.int32)
    args = (raw_images, xp.asarray(np.mod(ry, n), dtype=xp.int32), xp.asarray(np.mod(rx, n), dtype=xp.int32),
            xp.asarray(np.asarray(factor, dtype=np.float64) / (n * n)), mask, np.int32(n))
    if settings.zero_mask:
        masked = xp.empty_like(shifted)
        _shifted_kernel(xp, True)(*args, shifted, masked, bad)
        return shifted, masked, to_host(bad) == 0
    _shifted_kernel(xp, False)(*args, shifted, bad)
    outside = table(("outside the soft circular mask", n, radius, edge),
                    lambda: (mask < 1e-6).reshape(-1).astype(xp.float64))
    flat = shifted.reshape(b, -1).astype(xp.float64)
    count = float(outside.sum())
    mean = flat @ outside / count
    mean_square = (flat * flat) @ outside / count
    std = xp.sqrt(xp.maximum(mean_square - mean ** 2, 0.0))
    keys = xp.asarray(noise_keys(settings.random_seed, iteration, np.asarray(particle_indices)))
    masked = _masked_noise_kernel(xp)(shifted, mask, std, keys, np.int32(n))
    return shifted, masked, to_host(bad) == 0


@dataclass(frozen=True)
class PreviousValues:
    """Every particle's values, as the previous iteration left them, that a batch is prepared from in place of the
    particle set's (a field left None: the set's): origins in pixels, norm corrections, 0-based classes and poses
    in degrees, each an array over all particles (a batch takes its rows)."""

    origin_x_px: np.ndarray | None = None
    origin_y_px: np.ndarray | None = None
    norm_correction: np.ndarray | None = None
    class_index: np.ndarray | None = None
    rot_deg: np.ndarray | None = None
    tilt_deg: np.ndarray | None = None
    psi_deg: np.ndarray | None = None


def prepare_batch(particles: ParticleSet, indices: npt.ArrayLike, reader: mrc.StackReader | mrc.PrereadImages,
                  settings: ImageSettings, current_size_px: int, avg_norm_correction: float, iteration: int,
                  previous: PreviousValues = PreviousValues(), xp: ArrayModule = np,
                  images: Array | None = None) -> Batch:
    """A `Batch` for the engine. Origins, norms, classes and poses are those of `previous` where it has them, else
    the particle set's.

    The images are read on the host (or given, as `ParticleSet.read_ahead` yields them: on the host, or
    already on the device) and checked for NaN/Inf where they are prepared; masks, transforms and CTFs
    are computed with `xp` (cupy for the GPU engine: the batch's image arrays then live on the device).
    The host prepares in float64 (the numpy engine's oracle); the device transforms float32 images
    (complex64 transforms, the precision its engine compares at; each pixel value computed in float64, the
    CTFs in float64).
    """
    indices = np.asarray(indices)
    n = settings.ori_size_px
    ox = (particles.origin_x_angstrom[indices] / settings.pixel_size_angstrom if previous.origin_x_px is None
          else np.asarray(previous.origin_x_px)[indices])
    oy = (particles.origin_y_angstrom[indices] / settings.pixel_size_angstrom if previous.origin_y_px is None
          else np.asarray(previous.origin_y_px)[indices])
    norm = (particles.norm_correction[indices] if previous.norm_correction is None
            else np.asarray(previous.norm_correction)[indices])
    # integer part of the origin in real space, so that the mask is centred on the particle
    rx, ry = np.floor(ox + 0.5).astype(np.int64), np.floor(oy + 0.5).astype(np.int64)
    if images is None:
        images = particles.read_images(indices, reader, check_finite=False)
    images = to_device(images, xp)
    factor = avg_norm_correction / np.asarray(norm, dtype=np.float64)
    if xp is np:
        _require_finite(particles, indices, images, np.isfinite(images).reshape(indices.size, -1).all(axis=1))
        images = images.astype(np.float64) * factor[:, None, None]
        if np.any(rx != 0) or np.any(ry != 0):
            images = roll_each(images, rx, ry)
        ft_nomask = fourier.window_ft_2d(fourier.rfft2_centered(images), current_size_px)
        ft_mask = fourier.rfft2_centered(masked_images(images, settings, indices, iteration))
    else:  # the same arithmetic in one or two fused passes over the batch (`device_shifted_images`)
        shifted, masked, finite = device_shifted_images(images, factor, rx, ry, settings, indices, iteration, xp)
        _require_finite(particles, indices, images, finite)
        # the images come scaled by 1/N²: the transforms run unnormalised
        ft_nomask = fourier.window_ft_2d(fourier.rfft2_of_shifted(shifted, xp, normalised=False), current_size_px,
                                         xp)
        del shifted
        ft_mask = fourier.rfft2_of_shifted(masked, xp, normalised=False)
        del masked
    del images
    n_shells = n // 2 + 1
    # the power of the coefficients the E-step leaves out (|k| > current size / 2), per shell: it counts as noise.
    # Shell current/2 is split by that circle (round |k| = current/2 on both sides of it), as RELION's is, whose
    # projections are 0 beyond the circle
    power = shell_power(ft_mask, n, n_shells, xp, beyond_radius_px=current_size_px / 2)
    ft_mask = fourier.window_ft_2d(ft_mask, current_size_px, xp)
    if settings.do_ctf:
        # the CTF at the current size: the same integer frequencies of the original box
        pixel = settings.pixel_size_angstrom * n / current_size_px
        ctf = ctf_2d(current_size_px, particles.ctf_parameters(indices, pixel),
                     intact_until_first_peak=settings.ctf_intact_first_peak, xp=xp, dtype=np.float64)
    else:
        ctf = xp.ones((indices.size, current_size_px, current_size_px // 2 + 1))
    rot = particles.rot_deg[indices] if previous.rot_deg is None else previous.rot_deg[indices]
    tilt = particles.tilt_deg[indices] if previous.tilt_deg is None else previous.tilt_deg[indices]
    psi = particles.psi_deg[indices] if previous.psi_deg is None else previous.psi_deg[indices]
    klass = ((particles.class_number[indices] - 1) if previous.class_index is None
             else np.asarray(previous.class_index)[indices])
    if settings.per_particle_offset_priors:
        origin_prior = np.stack([particles.origin_prior_x_angstrom[indices],
                                 particles.origin_prior_y_angstrom[indices]], axis=1) / settings.pixel_size_angstrom
    else:
        origin_prior = np.zeros((indices.size, 2))
    return Batch(
        indices=indices,
        images_ft=ft_mask,
        images_ft_unmasked=ft_nomask,
        ctf=ctf,
        optics_index=particles.optics_index[indices],
        scale_group_index=particles.scale_group_index[indices],
        old_origin_px=np.stack([ox, oy], axis=1),
        residual_origin_px=np.stack([ox - rx, oy - ry], axis=1),
        prior_rot_deg=rot, prior_tilt_deg=tilt, prior_psi_deg=psi,
        old_class=klass, norm_correction=norm, power_beyond_current=to_host(power), origin_prior_px=origin_prior)


def _require_finite(particles: ParticleSet, indices: np.ndarray, images: Array, finite: np.ndarray) -> None:
    """The reader's error for the first image of the batch with a NaN or infinite value (`finite`: one flag per
    image, on the host), which names its file and position."""
    if finite.all():
        return
    first = int(np.flatnonzero(~finite)[0])
    i = indices[first]
    mrc.require_finite(to_host(images[first:first + 1]), particles.stack_paths[i], [particles.stack_indices[i]])


def prepare_in_parts(prepare_part: Callable[[slice], Batch], parts: Sequence[slice]) -> Batch:
    """One Batch of the images in `parts` (consecutive slices), each prepared by `prepare_part(slice)` in turn: the
    whole batch's arrays are made once the first part shows their shapes, and each part is copied in and let go, so
    that the preparation's temporaries exist for one part at a time."""
    first = prepare_part(parts[0])
    if len(parts) == 1:
        return first
    start, n = parts[0].start, parts[-1].stop - parts[0].start
    whole = {}
    for f in dataclasses.fields(Batch):
        value = getattr(first, f.name)
        xp = array_module(value)
        whole[f.name] = xp.empty((n, *value.shape[1:]), dtype=value.dtype)
        whole[f.name][: len(value)] = value
    del first, value
    for part in parts[1:]:
        batch = prepare_part(part)
        for name, array in whole.items():
            array[part.start - start: part.stop - start] = getattr(batch, name)
        del batch  # its device arrays go before the next part's (the arena is a stack)
    return Batch(**whole)


@dataclass
class NoiseEstimate:
    """Running sums for RELION's initial noise spectra: mean image power minus the power of the mean image."""

    power_sum: np.ndarray  # (n_optics, n_shells) Σ_images Σ_shell |X|²
    count: np.ndarray  # (n_optics,) images
    ft_sum: np.ndarray  # (N, N//2+1) Σ X over all images
    coefficients_per_shell: np.ndarray  # (n_shells,)

    @classmethod
    def empty(cls, n_optics: int, ori_size_px: int) -> NoiseEstimate:
        n_shells = ori_size_px // 2 + 1
        return cls(np.zeros((n_optics, n_shells)), np.zeros(n_optics),
                   np.zeros((ori_size_px, n_shells), complex), coefficients_per_shell(ori_size_px))

    def add(self, batch_ft_full: Array, optics_index: npt.ArrayLike, power: Array | None = None) -> None:
        """Add a batch's full-size masked transforms (numpy or cupy); `power` per shell if already known."""
        self.add_batch_sums(*self.batch_sums(batch_ft_full, optics_index, power))

    def batch_sums(self, batch_ft_full: Array, optics_index: npt.ArrayLike,
                   power: Array | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What `add` adds for a batch, on the host: (power per image and shell, optics_index, Σ transforms); a
        batch worked on elsewhere (an MPI worker) is added with `add_batch_sums`, bit for bit as `add` would."""
        if power is None:
            power = shell_power(batch_ft_full, batch_ft_full.shape[-2], self.power_sum.shape[1],
                                array_module(batch_ft_full))
        return to_host(power), np.asarray(optics_index), to_host(batch_ft_full.sum(axis=0))

    def add_batch_sums(self, power: np.ndarray, optics_index: np.ndarray, ft_sum: np.ndarray) -> None:
        add_rows_at(self.power_sum, optics_index, power)
        self.count += np.bincount(optics_index, minlength=self.count.size)
        self.ft_sum += ft_sum

    def sigma2(self) -> np.ndarray:
        """Per-component noise variance per shell and optics group (RELION's initial sigma2_noise)."""
        per_coef = np.maximum(self.coefficients_per_shell, 1.0)
        mean_power = self.power_sum / np.maximum(self.count, 1.0)[:, None] / per_coef[None, :]
        avg = self.ft_sum / max(self.count.sum(), 1.0)
        avg_power = shell_power(avg[None], avg.shape[0], self.power_sum.shape[1])[0] / per_coef
        sigma2 = 0.5 * (mean_power - avg_power[None, :])
        for row in sigma2:  # RELION replaces non-positive values by a positive neighbour
            bad = row <= 0
            if bad.all():
                row[:] = 1.0
                continue
            good = np.flatnonzero(~bad)
            row[bad] = row[good[np.searchsorted(good, np.flatnonzero(bad)).clip(0, good.size - 1)]]
        return sigma2
