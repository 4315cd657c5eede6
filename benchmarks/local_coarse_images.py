"""Where a local search's coarse image preparation goes (stage `coarse_images` of `estep.cuda.CupyEngine`): each step
that `_local_coarse_pass` takes before its kernel, on 1,024 random particles at coarse sizes of 360, 214 and 100 px
with 9 translations padded to the kernel's tile of 16, milliseconds per batch (CUDA events, the mean of 5 after a warm
one); and the images moved by the translations two ways, CuPy's ElementwiseKernel with broadcast inputs (the form
before `local_shift_images`) and the package's raw kernel, with whether they agree bit for bit.

    python benchmarks/local_coarse_images.py > benchmarks/results/local_coarse_images_h100.txt
"""

from __future__ import annotations

import numpy as np
from bench_common import half_plane_coefficients, launch_ms

BATCH, N_TRANSLATIONS, PADDED_TRANSLATIONS, ORI_SIZE_PX = 1024, 9, 16, 360
SIZES_PX = (360, 214, 100)
REPEATS = 5


def timed(cp, label, fn):
    """fn's result; prints the mean milliseconds of REPEATS calls after a warm one (`bench_common.launch_ms`)."""
    out = fn()
    print(f"{label:40s} {launch_ms(cp, fn, (), REPEATS):8.3f} ms", flush=True)
    return out


def broadcast_shift_kernel(cp):
    """The moved images as an ElementwiseKernel over broadcast inputs, float64 phase (the form before)."""
    return cp.ElementwiseKernel(
        "float32 xr, float32 xi, float64 sx, float64 sy, float32 kx, float32 ky, float64 scale", "complex64 out",
        "double s, c; sincos(scale * (sx * (double)kx + sy * (double)ky), &s, &c); "
        "out = complex<float>((float)(xr * c - xi * s), (float)(xr * s + xi * c))", "bench_shift_images")


def one_size(cp, size_px, rng):
    from cryorefine.estep.kernels import kernel_module

    kx, ky = half_plane_coefficients(size_px, cp)
    kc = kx.size
    x = (cp.asarray(rng.normal(size=(BATCH, kc)), cp.float32)
         + 1j * cp.asarray(rng.normal(size=(BATCH, kc)), cp.float32)).astype(cp.complex64)
    ctf = cp.asarray(rng.uniform(-1, 1, size=(BATCH, kc)), cp.float32)
    minv = cp.asarray(rng.uniform(0.5, 2, size=(1, kc)), cp.float32)
    optics = cp.zeros(BATCH, cp.int32)
    selection = np.arange(kc)
    residual = cp.asarray(rng.uniform(-0.5, 0.5, size=(BATCH, 2)))
    translations = cp.asarray(rng.uniform(-3, 3, size=(N_TRANSLATIONS, 2)))
    print(f"--- coarse {size_px} px, {kc} coefficients, {BATCH} particles", flush=True)
    sel = timed(cp, "selection uploaded", lambda: cp.asarray(selection))
    x_c = timed(cp, "images' coarse coefficients", lambda: x[:, sel])
    ctf_c = timed(cp, "CTFs' coarse coefficients", lambda: ctf[:, sel])
    minv_c = timed(cp, "1/σ² of each particle", lambda: minv[optics])
    scale = timed(cp, "minv·CTF", lambda: minv_c * ctf_c)
    timed(cp, "½·minv·CTF²", lambda: 0.5 * minv_c * ctf_c * ctf_c)
    timed(cp, "½·Σ minv·|X|² (float64)",
          lambda: 0.5 * cp.sum(minv_c.astype(cp.float64) * (x_c.real ** 2 + x_c.imag ** 2), axis=1))
    x_s = timed(cp, "X·minv·CTF", lambda: cp.ascontiguousarray(x_c * scale, dtype=cp.complex64))
    shifts = timed(cp, "shifts", lambda: cp.ascontiguousarray(residual[:, None, :] + translations[None, :, :]))
    moved = timed(cp, "moved images zeroed (the form before)",
                  lambda: cp.zeros((BATCH, kc, PADDED_TRANSLATIONS), dtype=cp.complex64))
    kernel = broadcast_shift_kernel(cp)
    scale_arg = -2.0 * np.pi / ORI_SIZE_PX

    def before():
        kernel(x_s.real[:, :, None], x_s.imag[:, :, None], shifts[:, None, :, 0], shifts[:, None, :, 1],
               kx[None, :, None], ky[None, :, None], scale_arg, moved[:, :, :N_TRANSLATIONS])
        return moved

    want = timed(cp, "moved: broadcast ElementwiseKernel", before).copy()
    fn = kernel_module().get_function("local_shift_images")
    got = cp.empty((BATCH, kc, PADDED_TRANSLATIONS), dtype=cp.complex64)

    def now():
        fn(((kc * PADDED_TRANSLATIONS + 255) // 256, BATCH), (256,),
           (x_s, shifts, kx, ky, np.float64(scale_arg), np.int32(N_TRANSLATIONS), np.int32(PADDED_TRANSLATIONS),
            np.int32(kc), got))
        return got

    timed(cp, "moved: local_shift_images (with padding)", now)
    same = bool(cp.all(got[:, :, :N_TRANSLATIONS].view(cp.float32) == want[:, :, :N_TRANSLATIONS].view(cp.float32)))
    zeros = bool(cp.all(got[:, :, N_TRANSLATIONS:] == 0))
    print(f"bit for bit the same: {same}; padding zeros: {zeros}", flush=True)


def main():
    import cupy as cp

    rng = np.random.default_rng(0)
    for size in SIZES_PX:
        one_size(cp, size, rng)


if __name__ == "__main__":
    main()
