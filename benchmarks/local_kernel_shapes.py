"""Probe: the local searches' coarse kernel (estep/kernels/local.cu) built with other block sizes, launch bounds and
chunks of coefficients, at the shapes of a 10k auto-refine's local iterations: particles with a width of 25 × --psi
orientations each (a 5 × 5 grid of directions × --psi psi angles, one HEALPix step apart) around random priors sorted
by direction, 9 translations, a random padded reference of the 360 px box. Per shape and variant: ms per launch (the
mean of 5), and the largest relative difference from the first variant (the package's: 32 coefficients a chunk, 256
threads, no minimum of blocks per multiprocessor).

    python benchmarks/local_kernel_shapes.py [--particles 1000] [--psi 4]

Needs CuPy and a CUDA device. Results of 2026-11-27 in benchmarks/README.md ("Batches of 1,024 merged ...").
"""

from __future__ import annotations

import argparse

import numpy as np

# (chunk of coefficients, threads a block, minimum blocks a multiprocessor or None); the first is the package's
VARIANTS = [(32, 256, None), (32, 128, None), (32, 128, 8), (32, 128, 6), (32, 128, 10), (32, 256, 5),
            (32, 256, None)]
R_PAD, PADDING = 360, 2.0  # the padded reference of the 360 px box
N_TRANSLATIONS, TRANSLATION_TILE = 9, 16  # a late local search's translations, and local_diff2_t16's tile


def rotation(axis, angle):
    c, s = np.cos(angle), np.sin(angle)
    m = np.eye(3)
    i, j = [(1, 2), (0, 2), (0, 1)][axis]
    m[i, i] = m[j, j] = c
    m[i, j], m[j, i] = -s, s
    return m


def quaternion_matrix(q):
    a, b, c, d = q
    return np.array([[a * a + b * b - c * c - d * d, 2 * (b * c - a * d), 2 * (b * d + a * c)],
                     [2 * (b * c + a * d), a * a - b * b + c * c - d * d, 2 * (c * d - a * b)],
                     [2 * (b * d - a * c), 2 * (c * d + a * b), a * a - b * b - c * c + d * d]])


def make_shape(n_particles, r_max, step_deg, n_psi, seed):
    """The kernel's operands for particles whose coarse images reach radius `r_max` px, neighbourhoods `step_deg`
    apart."""
    import cupy as cp

    rng = np.random.default_rng(seed)
    d, w = 2 * R_PAD + 3, R_PAD + 2
    vol = (cp.random.standard_normal((d, d, w), dtype=cp.float32)
           + 1j * cp.random.standard_normal((d, d, w), dtype=cp.float32)).astype(cp.complex64)
    ky, kx = np.mgrid[-r_max:r_max + 1, 0:r_max + 1]
    keep = (kx * kx + ky * ky <= r_max * r_max) & ~((kx == 0) & (ky < 0))
    q = rng.standard_normal((n_particles, 4))
    priors = np.array([quaternion_matrix(x / np.linalg.norm(x)) for x in q])
    view = priors[:, 2, :]
    tilt, phi = np.arccos(np.clip(view[:, 2], -1, 1)), np.arctan2(view[:, 1], view[:, 0])
    priors = priors[np.lexsort((np.round(phi / 0.2), np.round(tilt / 0.2)))]
    step = np.deg2rad(step_deg)
    grid = [(i, j, k) for i in range(-2, 3) for j in range(-2, 3) for k in range(-(n_psi // 2), n_psi - n_psi // 2)]
    mats = np.array([[(p @ rotation(0, i * step) @ rotation(1, j * step) @ rotation(2, k * step)).reshape(9)
                      for i, j, k in grid] for p in priors], dtype=np.float32)
    n_coef = int(keep.sum())
    moved = (cp.random.standard_normal((n_particles, n_coef, TRANSLATION_TILE), dtype=cp.float32)
             + 1j * cp.random.standard_normal((n_particles, n_coef, TRANSLATION_TILE), dtype=cp.float32))
    return dict(vol=vol, kx=cp.asarray(kx[keep], dtype=cp.float32), ky=cp.asarray(ky[keep], dtype=cp.float32),
                n_coef=n_coef, mats=cp.asarray(mats.reshape(-1, 9)), width=len(grid), n_particles=n_particles,
                moved=moved.astype(cp.complex64), pair=cp.random.random((n_particles, n_coef), dtype=cp.float32),
                row=cp.random.random(n_particles, dtype=cp.float64) * 1e5)


def variant_source(chunk, threads, min_blocks):
    from cryorefine.estep.kernels import KERNEL_DIR

    bounds = f"__launch_bounds__(LOCAL_THREADS{', ' + str(min_blocks) if min_blocks else ''})"
    local = (KERNEL_DIR / "local.cu").read_text().replace("__launch_bounds__(LOCAL_THREADS)", bounds)
    return (f"#define LOCAL_CK {chunk}\n#define LOCAL_THREADS {threads}\n" + (KERNEL_DIR / "project.cu").read_text()
            + local)


def time_variant(module, threads, s, repeats=5):
    """(ms a launch, the output on the host, registers a thread) of local_diff2_t16 of `module` on shape `s`."""
    import cupy as cp

    from cryorefine.estep.kernels import local_tiles

    tile_orientations = 4 * threads // TRANSLATION_TILE
    tiles = local_tiles(np.full(s["n_particles"], s["width"]), tile_orientations, xp=cp)
    kernel = module.get_function(f"local_diff2_t{TRANSLATION_TILE}")
    out = cp.empty((s["n_particles"], 1, s["width"], N_TRANSLATIONS), cp.float32)
    d, w, origin = 2 * R_PAD + 3, R_PAD + 2, R_PAD + 1
    args = (s["vol"], np.int32(d), np.int32(w), np.int32(origin), np.float32(PADDING),
            np.float32(R_PAD ** 2 * (1 + 1e-5)), s["mats"], *tiles, s["kx"], s["ky"], np.int32(s["n_coef"]),
            s["moved"], np.int32(TRANSLATION_TILE), s["pair"], s["row"], np.int32(s["width"]),
            np.int32(N_TRANSLATIONS), np.int32(0), np.int32(1), np.int32(0), out)
    grid = (int(tiles[0].size), 1, 1)
    kernel(grid, (threads,), args)
    cp.cuda.Device().synchronize()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(repeats):
        kernel(grid, (threads,), args)
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / repeats, out.get(), int(getattr(kernel, "num_regs", -1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--particles", type=int, default=1000)
    parser.add_argument("--psi", type=int, default=4, help="psi angles per direction (width 25 × psi)")
    args = parser.parse_args()
    import cupy as cp

    from cryorefine.estep.kernels import COMPILE_OPTIONS

    n, p = args.particles, args.psi
    # (coarse radius px, HEALPix step °): the final iteration, and order-8 … order-5 iterations of the 10k refine
    shapes = {"final_o8_360px": make_shape(n, 180, 0.235, p, 0), "o8_214px": make_shape(n, 107, 0.235, p, 1),
              "o7_214px": make_shape(n, 107, 0.47, p, 2), "o6_214px": make_shape(n, 107, 0.94, p, 3),
              "o5_198px": make_shape(n, 99, 1.875, p, 4)}
    first = {}
    for chunk, threads, min_blocks in VARIANTS:
        module = cp.RawModule(code=variant_source(chunk, threads, min_blocks), options=COMPILE_OPTIONS)
        for name, s in shapes.items():
            ms, out, registers = time_variant(module, threads, s)
            base_ms, base = first.setdefault(name, (ms, out))
            rel = np.max(np.abs(out.astype(np.float64) - base) / (np.abs(base) + 1e-30))
            print(f"{name:15s} CK {chunk:3d} threads {threads:3d} minblocks {min_blocks} regs {registers:3d}: "
                  f"{ms:8.2f} ms ({base_ms / ms:.2f}× the first); max rel diff {rel:.2e} "
                  f"identical {np.array_equal(out, base)}", flush=True)


if __name__ == "__main__":
    main()
