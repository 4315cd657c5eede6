"""Probe: the local searches' coarse kernel (estep/kernels/local.cu) at the final iteration's 360 px shapes, reading
the padded reference (a) from linear memory (the package's kernel), (b) from a 3D texture with point sampling and
the same trilinear arithmetic (bit for bit the same), (c) from a 3D texture with the hardware's trilinear filter
(8-bit interpolation weights, as RELION's GPU projector). Variants (b) and (c) are made from local.cu's source here.

    python benchmarks/reference_texture_probe.py --b=500          # times, and the differences of (b), (c) from (a)
    ncu --clock-control none -k regex:local_ --metrics ... python benchmarks/reference_texture_probe.py --once --b=200

Needs CuPy and a CUDA device. Results of 2026-11-26 in benchmarks/README.md ("the reference as a texture, probed").
"""

from __future__ import annotations

import sys

import numpy as np


def main():
    import cupy as cp
    from cupy.cuda import runtime, texture

    from cryorefine.estep.kernels import (
        COMPILE_OPTIONS,
        KERNEL_DIR,
        LOCAL_THREADS,
        kernel_source,
        local_tile,
        local_tiles,
    )

    once = "--once" in sys.argv
    B = int(next((a.split("=")[1] for a in sys.argv if a.startswith("--b=")), 500))
    r_max, pf = 180, 2.0
    r_pad = 360
    d, w, origin = 2 * r_pad + 3, r_pad + 2, r_pad + 1
    rng = np.random.default_rng(0)
    # a smooth-ish volume: random noise filtered, to mimic an oversampled (padded) transform
    vol = (cp.random.standard_normal((d, d, w), dtype=cp.float32)
           + 1j * cp.random.standard_normal((d, d, w), dtype=cp.float32)).astype(cp.complex64)
    ky, kx = np.mgrid[-r_max:r_max + 1, 0:r_max + 1]
    keep = (kx * kx + ky * ky <= r_max * r_max) & ~((kx == 0) & (ky < 0))
    kx = cp.asarray(kx[keep].astype(np.float32)); ky = cp.asarray(ky[keep].astype(np.float32))
    kc = int(kx.size)

    def rot(axis, ang):
        c, s = np.cos(ang), np.sin(ang)
        m = np.eye(3)
        i, j = [(1, 2), (0, 2), (0, 1)][axis]
        m[i, i] = c; m[j, j] = c; m[i, j] = -s; m[j, i] = s
        return m

    # priors: random rotations sorted by viewing direction (coarse tilt/rot bins)
    q = rng.standard_normal((B, 4)); q /= np.linalg.norm(q, axis=1, keepdims=True)
    def qmat(q):
        a, b, c, dd = q
        return np.array([[a*a+b*b-c*c-dd*dd, 2*(b*c-a*dd), 2*(b*dd+a*c)],
                         [2*(b*c+a*dd), a*a-b*b+c*c-dd*dd, 2*(c*dd-a*b)],
                         [2*(b*dd-a*c), 2*(c*dd+a*b), a*a-b*b-c*c+dd*dd]])
    priors = np.array([qmat(x) for x in q])
    view = priors[:, 2, :]
    tilt = np.arccos(np.clip(view[:, 2], -1, 1)); phi = np.arctan2(view[:, 1], view[:, 0])
    order = np.lexsort((np.round(phi / 0.2), np.round(tilt / 0.2)))
    priors = priors[order]
    step = np.deg2rad(0.235)
    grid = [(i, j, k) for i in range(-2, 3) for j in range(-2, 3) for k in range(-3, 3)]
    W = len(grid)
    mats = np.empty((B, W, 9), np.float32)
    for b in range(B):
        for r, (i, j, k) in enumerate(grid):
            mats[b, r] = (priors[b] @ rot(0, i * step) @ rot(1, j * step) @ rot(2, k * step)).reshape(9)
    mats = cp.asarray(mats.reshape(-1, 9))
    n_t = 9
    tile_r, tile_t, name = local_tile(n_t)
    ldt = tile_t
    moved = (cp.random.standard_normal((B, kc, ldt), dtype=cp.float32)
             + 1j * cp.random.standard_normal((B, kc, ldt), dtype=cp.float32)).astype(cp.complex64)
    pair = cp.random.random((B, kc), dtype=cp.float32)
    row_term = cp.random.random(B, dtype=cp.float64) * 1e5

    extra = r'''
    __device__ __forceinline__ float2 cr_slice_value_texlin(cudaTextureObject_t tex, int d, int w, int origin,
                                                     float pf, float r_pad_sq, const float* a, float kx, float ky)
    {
        float qx = pf * (kx * a[0] + ky * a[3]);
        float qy = pf * (kx * a[1] + ky * a[4]);
        float qz = pf * (kx * a[2] + ky * a[5]);
        if (qx * qx + qy * qy + qz * qz > r_pad_sq) return make_float2(0.f, 0.f);
        bool neg = qx < 0.f;
        if (neg) { qx = -qx; qy = -qy; qz = -qz; }
        float2 v = tex3D<float2>(tex, qx + 0.5f, qy + origin + 0.5f, qz + origin + 0.5f);
        if (neg) v.y = -v.y;
        return v;
    }
    __device__ __forceinline__ float2 cr_slice_value_texpt(cudaTextureObject_t tex, int d, int w, int origin,
                                                     float pf, float r_pad_sq, const float* a, float kx, float ky)
    {
        float qx = pf * (kx * a[0] + ky * a[3]);
        float qy = pf * (kx * a[1] + ky * a[4]);
        float qz = pf * (kx * a[2] + ky * a[5]);
        if (qx * qx + qy * qy + qz * qz > r_pad_sq) return make_float2(0.f, 0.f);
        bool neg = qx < 0.f;
        if (neg) { qx = -qx; qy = -qy; qz = -qz; }
        float x0 = floorf(qx), y0 = floorf(qy), z0 = floorf(qz);
        float fx = qx - x0, fy = qy - y0, fz = qz - z0;
        float ix = min(max((int)x0, 0), w - 2) + 0.5f;
        float iy = min(max((int)y0 + origin, 0), d - 2) + 0.5f;
        float iz = min(max((int)z0 + origin, 0), d - 2) + 0.5f;
        float2 c00 = cr_lerp2(tex3D<float2>(tex, ix, iy, iz), tex3D<float2>(tex, ix + 1.f, iy, iz), fx);
        float2 c01 = cr_lerp2(tex3D<float2>(tex, ix, iy + 1.f, iz), tex3D<float2>(tex, ix + 1.f, iy + 1.f, iz), fx);
        float2 c10 = cr_lerp2(tex3D<float2>(tex, ix, iy, iz + 1.f), tex3D<float2>(tex, ix + 1.f, iy, iz + 1.f), fx);
        float2 c11 = cr_lerp2(tex3D<float2>(tex, ix, iy + 1.f, iz + 1.f), tex3D<float2>(tex, ix + 1.f, iy + 1.f, iz + 1.f), fx);
        float2 v = cr_lerp2(cr_lerp2(c00, c01, fy), cr_lerp2(c10, c11, fy), fz);
        if (neg) v.y = -v.y;
        return v;
    }
    '''
    local_src = (KERNEL_DIR / "local.cu").read_text()
    body = local_src[local_src.index("template <int TT>"):local_src.index("#define LOCAL_DIFF2_INSTANCE")]
    variants = ""
    for tag in ("texlin", "texpt"):
        v = body.replace("local_diff2_tile(", f"local_diff2_tile_{tag}(")
        v = v.replace("const float2* __restrict__ vol, int d", "cudaTextureObject_t vol, int d")
        v = v.replace("cr_slice_value(vol,", f"cr_slice_value_{tag}(vol,")
        variants += v + f'''
    extern "C" __global__ void __launch_bounds__(LOCAL_THREADS) local_{tag}_t16(
        cudaTextureObject_t vol, int d, int w, int origin, float pf, float r_pad_sq,
        const float* __restrict__ mats, const int* __restrict__ tile_particle, const int* __restrict__ tile_first,
        const int* __restrict__ count, const float* __restrict__ kx, const float* __restrict__ ky, int n_coef,
        const float2* __restrict__ moved, int ldt, const float* __restrict__ pair,
        const double* __restrict__ row_term, int width, int n_t, int mode, int n_class, int k, float* __restrict__ out)
    {{ local_diff2_tile_{tag}<16>(vol, d, w, origin, pf, r_pad_sq, mats, tile_particle, tile_first, count, kx, ky,
                                 n_coef, moved, ldt, pair, row_term, width, n_t, mode, n_class, k, out); }}
    '''
    mod = cp.RawModule(code=kernel_source() + extra + variants, options=COMPILE_OPTIONS)
    ch = texture.ChannelFormatDescriptor(32, 32, 0, 0, runtime.cudaChannelFormatKindFloat)
    arr = texture.CUDAarray(ch, w, d, d)
    arr.copy_from(vol.view(cp.float32).reshape(d, d, 2 * w))
    res = texture.ResourceDescriptor(runtime.cudaResourceTypeArray, cuArr=arr)
    clamp = (runtime.cudaAddressModeClamp,) * 3
    tex_lin = texture.TextureObject(res, texture.TextureDescriptor(clamp, runtime.cudaFilterModeLinear, runtime.cudaReadModeElementType))
    tex_pt = texture.TextureObject(res, texture.TextureDescriptor(clamp, runtime.cudaFilterModePoint, runtime.cudaReadModeElementType))
    geom = (np.int32(d), np.int32(w), np.int32(origin), np.float32(pf), np.float32(r_pad * r_pad * (1 + 1e-5)))
    tiles = local_tiles(np.full(B, W), tile_r, xp=cp)
    grid_ = (tiles[0].size, ldt // tile_t, 1)
    outs = {}
    for label, fname, src in (("linear", name, vol), ("texpt", "local_texpt_t16", tex_pt), ("texlin", "local_texlin_t16", tex_lin)):
        f = mod.get_function(fname)
        out = cp.empty((B, 1, W, n_t), cp.float32)
        args = (src, *geom, mats, *tiles, kx, ky, np.int32(kc), moved, np.int32(ldt), pair, row_term, np.int32(W),
                np.int32(n_t), np.int32(0), np.int32(1), np.int32(0), out)
        f(grid_, (LOCAL_THREADS,), args)
        cp.cuda.Device().synchronize()
        if not once:
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            reps = 5
            e0.record()
            for _ in range(reps):
                f(grid_, (LOCAL_THREADS,), args)
            e1.record(); e1.synchronize()
            ms = cp.cuda.get_elapsed_time(e0, e1) / reps
            proj = B * W * kc
            print(f"{label:7s} {ms:8.2f} ms  {proj / ms / 1e6:8.2f} G projections/s  (B {B}, width {W}, n_coef {kc})", flush=True)
        outs[label] = out.get()
    ref = outs["linear"].astype(np.float64)
    for label in ("texpt", "texlin"):
        dlt = np.abs(outs[label] - ref)
        # diff2 differences relative to the spread of diff2 over a particle's orientations
        spread = ref.max(axis=(1, 2, 3)) - ref.min(axis=(1, 2, 3))
        print(f"{label}: max |Δ| {dlt.max():.4g}, max |Δ| / per-particle spread {np.max(dlt.max(axis=(1,2,3)) / spread):.3g}, "
              f"identical {np.array_equal(outs[label], outs['linear'])}; argmin same {np.mean(outs[label].reshape(B,-1).argmin(1)==ref.reshape(B,-1).argmin(1)):.3f}")


if __name__ == "__main__":
    main()
