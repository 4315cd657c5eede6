"""Where `coarse_diff2_wgmma`'s time goes: the kernel with parts of its work left out, on the order-3 shape.

The kernel (estep/kernels/coarse_wgmma.cu) stages each slab of 32 coefficients (global loads, the TF32 split, shared
memory stores), runs three warp-group products a step of 8 on it, then flushes the tensor cores' sums to FP32.
This script compiles variants of the kernel's source with parts of that left out, by text edits that must each
apply (an edit that no longer matches the kernel stops the script), and times them on the auto-refine's order-3
product (10,752 × 36,864 × 1,962): milliseconds a launch (CUDA events, 5 launches after a warm one) and the TF32
products' TFLOP/s (3 products a step, or 1). The variants compute wrong values on purpose; only the first is the
kernel the engine runs. Compute capability 9.0 only (sm_90a).

    python benchmarks/wgmma_probe.py --json results/wgmma_probe_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

LO_PRODUCTS = ("            cr_wgmma_tf32(part, cr_wg_descriptor(a_lo + o), cr_wg_descriptor(b_hi + o), "
               "s > 0 || PROBE_NO_FLUSH);\n"
               "            cr_wgmma_tf32(part, cr_wg_descriptor(a_hi + o), cr_wg_descriptor(b_lo + o), 1);\n")
EDITS = {  # switch: (the kernel's text, the text with the switch around it)
    "NO_STAGE": [
        ("        if (more) load(k0 + WG_BK);",
         "#if !PROBE_NO_STAGE\n        if (more) load(k0 + WG_BK);\n#endif"),
        ("        if (more) store(buf ^ 1);",
         "#if !PROBE_NO_STAGE\n        if (more) store(buf ^ 1);\n#endif"),
        ("        buf ^= 1;", "#if !PROBE_NO_STAGE\n        buf ^= 1;\n#endif"),
    ],
    "NO_FLUSH": [
        ("cr_wg_descriptor(b_hi + o), s > 0);", "cr_wg_descriptor(b_hi + o), s > 0 || PROBE_NO_FLUSH);"),
        ("        asm volatile(\"wgmma.wait_group.sync.aligned 0;\\n\" ::: \"memory\");\n"
         "        cr_wg_fence_registers(part);\n"
         "#pragma unroll\n"
         "        for (int i = 0; i < 64; ++i) acc[i] += part[i];\n"
         "        __syncthreads();\n",
         "        if (!PROBE_NO_FLUSH || !more) {\n"
         "            asm volatile(\"wgmma.wait_group.sync.aligned 0;\\n\" ::: \"memory\");\n"
         "            cr_wg_fence_registers(part);\n"
         "            for (int i = 0; i < 64; ++i) acc[i] += part[i];\n"
         "        } else if (!PROBE_NO_STAGE) {\n"
         "            asm volatile(\"wgmma.wait_group.sync.aligned 0;\\n\" ::: \"memory\");\n"
         "        }\n"
         "        if (!(PROBE_NO_STAGE && PROBE_NO_FLUSH)) __syncthreads();\n"),
    ],
    "ONE_PRODUCT": [
        (LO_PRODUCTS, "#if !PROBE_ONE_PRODUCT\n" + LO_PRODUCTS + "#endif\n"),
    ],
}
VARIANTS = {  # name: switches on
    "the kernel": (),
    "no staging (one slab, reused)": ("NO_STAGE",),
    "no flush (the wait for restaging kept)": ("NO_FLUSH",),
    "the products alone (no staging, no flush)": ("NO_STAGE", "NO_FLUSH"),
    "the products alone, one a step": ("NO_STAGE", "NO_FLUSH", "ONE_PRODUCT"),
    "one product a step, staged and flushed": ("ONE_PRODUCT",),
}
SHAPE = (10752, 36864, 1962, 21)  # M (512 particles × 21 translations), N, K, T


def probe_source():
    """The kernel's module source (coarse.cu, coarse_tf32.cu for the split, coarse_wgmma.cu) with the switches."""
    from cryorefine.estep.kernels import DEFINES, KERNEL_DIR

    kernel = (KERNEL_DIR / "coarse_wgmma.cu").read_text()
    for switch in ("NO_STAGE", "NO_FLUSH", "ONE_PRODUCT"):  # in this order: ONE_PRODUCT edits NO_FLUSH's text
        for old, new in EDITS[switch]:
            if kernel.count(old) != 1:
                sys.exit(f"wgmma_probe: the kernel changed; this edit ({switch}) no longer applies:\n{old}")
            kernel = kernel.replace(old, new)
    defines = "\n".join(f"#define {k} {v}" for k, v in DEFINES.items())
    return "\n".join((defines, (KERNEL_DIR / "coarse.cu").read_text(), (KERNEL_DIR / "coarse_tf32.cu").read_text(),
                      kernel))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="Write the results here.")
    args = parser.parse_args(argv)
    import cupy as cp

    from cryorefine.estep.kernels import GEMM_BK, GEMM_BM, GEMM_BN, GEMM_THREADS, WGMMA_SHARED_BYTES, round_up

    if str(cp.cuda.Device().compute_capability) != "90":
        sys.exit("wgmma_probe: coarse_diff2_wgmma runs on compute capability 9.0 only")
    source = probe_source()
    m, n, k, t = SHAPE
    lda, ldb, kd = round_up(m, GEMM_BM), round_up(n, GEMM_BN), round_up(k, GEMM_BK)
    rng = np.random.default_rng(0)
    a = cp.asarray(rng.standard_normal((kd, lda), dtype=np.float32))
    b = cp.asarray(rng.standard_normal((kd, ldb), dtype=np.float32))
    row, pair = cp.zeros(m // t, cp.float32), cp.zeros((m // t, n), cp.float32)
    out = cp.empty((m // t, n * t), cp.float32)
    launch_args = (a, b, np.int32(lda), np.int32(ldb), np.int32(kd), np.int32(m), np.int32(n), np.int32(t), row, pair,
                   np.int32(2), np.int32(n), np.int32(0), out)
    grid = (ldb // GEMM_BN, lda // GEMM_BM)
    results = {}
    for name, switches in VARIANTS.items():
        options = ("-std=c++17", "-arch=sm_90a") + tuple(
            f"-DPROBE_{s}={int(s in switches)}" for s in ("NO_STAGE", "NO_FLUSH", "ONE_PRODUCT"))
        fn = cp.RawModule(code=source, options=options).get_function("coarse_diff2_wgmma")
        fn.max_dynamic_shared_size_bytes = WGMMA_SHARED_BYTES
        fn(grid, (GEMM_THREADS,), launch_args, shared_mem=WGMMA_SHARED_BYTES)
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        for _ in range(args.repeats):
            fn(grid, (GEMM_THREADS,), launch_args, shared_mem=WGMMA_SHARED_BYTES)
        stop.record()
        stop.synchronize()
        ms = cp.cuda.get_elapsed_time(start, stop) / args.repeats
        products = 1 if "ONE_PRODUCT" in switches else 3
        tflops = products * 2.0 * lda * ldb * kd / (ms / 1e3) / 1e12
        results[name] = {"ms": ms, "tf32_tflops_of_products": tflops}
        print(f"{name:45s} {ms:8.2f} ms {tflops:7.1f} TFLOP/s of TF32 products", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "shape_m_n_k": [m, n, k],
                       "variants": results}, f, indent=1)


if __name__ == "__main__":
    main()
