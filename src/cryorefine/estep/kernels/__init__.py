"""The CUDA kernels of the GPU engine (`estep.cuda`): their sources beside this file, the compile-time
constants the kernels and the host code must agree on, and the loader.

The tile and block sizes below are the one place these numbers live: they are passed to the compiler
as `#define`s (the `#ifndef` defaults in the .cu files only serve a file compiled on its own), the
engine launches with them, and the batch planner (`estep.cuda_plan`) pads its buffers to them.
The kernels are compiled once per dimensionality of the references, `ref_dim` (a `#define REF_DIM`): 3 for
maps (central slices by trilinear interpolation, 3D back-projection), 2 for the 2D references of a 2D
classification (rotated 2D transforms by bilinear interpolation, 2D back-projection; project.cu says how); the
two modules' kernels take the same arguments. Importing this module does not import CuPy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from cryorefine.core.arrays import Array, ArrayModule

log = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).resolve().parent
KERNEL_FILES = ("atomics.cu", "reductions.cu", "project.cu", "coarse.cu", "coarse_tf32.cu", "coarse_wgmma.cu",
                "local.cu", "fine.cu", "fine_tc.cu", "backproject.cu", "segments.cu", "weights.cu")
COMPILE_OPTIONS = ("-std=c++17",)

# coarse_diff2 (coarse.cu): one thread block computes a GEMM_BM × GEMM_BN tile of the (particle, translation)
# × orientation product, K staged GEMM_BK at a time; its operands are padded to these multiples (`round_up`)
GEMM_BM, GEMM_BN, GEMM_BK = 128, 128, 8
GEMM_THREADS = 256  # threads per coarse_diff2 block (its __launch_bounds__)
# the three kernels of the global search's coarse product, same arguments and tiles: on Hopper's warp-group tensor-core
# products, three TF32 products per FP32 one (coarse_wgmma.cu, compute capability 9.0 only: sm_90a); the same split
# with `mma.sync` (coarse_tf32.cu, 8.0 and later); on CUDA cores in FP32 (coarse.cu)
COARSE_KERNELS = ("coarse_diff2_wgmma", "coarse_diff2_tf32", "coarse_diff2")
WGMMA_BK = 32  # coefficients a slab of coarse_diff2_wgmma, its tensor cores' sums flushed to FP32 once a slab
# coarse_diff2_wgmma's dynamic shared memory: two slabs of four TF32 parts (A hi, A lo, B hi, B lo) of 128 rows each,
# 16 bytes after each 8-row group (coarse_wgmma.cu checks the figure against its layout)
WGMMA_SHARED_BYTES = 2 * 4 * (GEMM_BM // 8) * (8 * WGMMA_BK * 4 + 16)
WGMMA_COMPUTE_CAPABILITY = "90"  # the one architecture whose accelerated features (sm_90a) the kernel uses
FINE_THREADS = 128  # threads per block of fine_diff2 / fine_sums (fine.cu)
# fine_diff2 / fine_sums take a block's children in tiles of at most FINE_TILE_CHILDREN (at most FINE_TILE_TRANSLATIONS
# translations), one tile per CUDA block, so a thread's sums stay in registers: 8 × 4 (one tile) at oversampling 1
FINE_TILE_CHILDREN, FINE_TILE_TRANSLATIONS = 64, 16
# fine_diff2_tc (fine_tc.cu), the likelihood's fine diff2 on tensor cores where a block's children allow it: one CUDA
# block takes FINE_TC_ORIENTATIONS child orientations (4 warps × two m16n8k8 tiles of 8) and every translation, in
# row tiles of FINE_TC_TRANSLATIONS
FINE_TC_ORIENTATIONS, FINE_TC_TRANSLATIONS = 64, 16
# and one CUDA block takes the blocks of one particle, class and coarse orientation at several coarse translations,
# FINE_TC_GROUP_ROWS translations at most (`fine_groups`): their children's slices are projected once for all of them
# (two blocks at oversampling 2; four took more registers than they saved: docs/benchmark-conclusions.md)
FINE_TC_GROUP_ROWS = 32
SEG_THREADS = 256  # threads per segment of segment_reduce (segments.cu)
WEIGHT_THREADS = 1024  # threads per particle of coarse_weight_stats / coarse_candidates (weights.cu)
# local_diff2_t* (local.cu): one block takes a tile of orientations × translations of one particle (`local_tile`),
# slices projected LOCAL_CK coefficients at a time; the moved images' translations are padded to the tile's multiple
LOCAL_CK, LOCAL_THREADS = 32, 256
LOCAL_TRANSLATION_TILES = (16, 32, 64)  # the instances of local.cu's kernel, local_diff2_t16 ...
MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y; kernels loop over what lies beyond

REF_DIMS = (2, 3)  # the dimensionalities of the references a module is compiled for (REF_DIM)

DEFINES = {"GEMM_BM": GEMM_BM, "GEMM_BN": GEMM_BN, "GEMM_BK": GEMM_BK, "FINE_THREADS": FINE_THREADS,
           "SEG_THREADS": SEG_THREADS, "WEIGHT_THREADS": WEIGHT_THREADS, "LOCAL_CK": LOCAL_CK,
           "LOCAL_THREADS": LOCAL_THREADS, "WGMMA_BK": WGMMA_BK, "WGMMA_SHARED_BYTES": WGMMA_SHARED_BYTES,
           "FTC_OT": FINE_TC_ORIENTATIONS, "FTC_GROUP_ROWS": FINE_TC_GROUP_ROWS}

COMPILE_NOTICE_SECONDS = 2.0  # a compilation that takes longer is announced (a cached one takes well under this)

_modules = {}  # (device id, name expressions) -> cupy.RawModule
_key_locks = {}  # (device id, name expressions) -> the lock its compilation holds
_lock = threading.Lock()  # guards _key_locks
_sm90a_refused = set()  # devices whose compiler did not take -arch=sm_90a: their modules are compiled without it


def round_up(value: int, multiple: int) -> int:
    """`value` rounded up to a multiple of `multiple` (the padded sizes of the kernels' operands)."""
    return (int(value) + multiple - 1) // multiple * multiple


def fine_tile(nfo: int, nft: int) -> tuple[int, int]:
    """(orientations, translations) of the tile of children one CUDA block of the fine kernels takes, for NFO × NFT
    children per block (powers of two): all translations up to FINE_TILE_TRANSLATIONS, then as many orientations as
    keep the tile within FINE_TILE_CHILDREN."""
    tt = min(int(nft), FINE_TILE_TRANSLATIONS)
    return max(1, min(int(nfo), FINE_TILE_CHILDREN // tt)), tt


def fine_tiles(nfo: int, nft: int) -> int:
    """Tiles per block of NFO × NFT children: the fine kernels' grid is (blocks, tiles)."""
    to, tt = fine_tile(nfo, nft)
    return (int(nfo) // to) * (int(nft) // tt)


def local_tile(n_translations: int) -> tuple[int, int, str]:
    """(orientations, translations) one block of a local search's coarse kernel takes, and the kernel's name: the
    smallest translation tile of LOCAL_TRANSLATION_TILES that holds `n_translations` (the largest, in several grid
    layers, beyond it), and as many orientations as fill LOCAL_THREADS threads with 2 × 2 outputs each. A late local
    search has 9 or 13 translations: a tile of 16 computes 16 products for them where a tile of 32 computes 32."""
    tt = next((t for t in LOCAL_TRANSLATION_TILES if t >= int(n_translations)), LOCAL_TRANSLATION_TILES[-1])
    return 4 * LOCAL_THREADS // tt, tt, f"local_diff2_t{tt}"


def coarse_kernel_name(compute_capability: str | int) -> str:
    """The coarse product's kernel for a device of `compute_capability` ("90", as CuPy gives it): warp-group products
    on 9.0 (H100, H200), `mma.sync` on the tensor cores of the others with TF32 (8.0 and later), CUDA cores before."""
    if str(compute_capability) == WGMMA_COMPUTE_CAPABILITY:
        return COARSE_KERNELS[0]
    return COARSE_KERNELS[1] if int(compute_capability) >= 80 else COARSE_KERNELS[2]


def coarse_shared_bytes(kernel_name: str) -> int:
    """The dynamic shared memory a launch of the coarse kernel `kernel_name` takes (bytes)."""
    return WGMMA_SHARED_BYTES if kernel_name == COARSE_KERNELS[0] else 0


def compile_options(compute_capability: str | int) -> tuple[str, ...]:
    """The compiler options of the module for a device of `compute_capability`: sm_90a on 9.0, where
    coarse_diff2_wgmma needs its warp-group products. CuPy gives its own architecture option first, and NVRTC 13
    takes the last; `kernel_module` checks which one a compiler took (coarse_wgmma.cu's cr_wgmma_compiled)."""
    if str(compute_capability) == WGMMA_COMPUTE_CAPABILITY:
        return COMPILE_OPTIONS + ("-arch=sm_90a",)
    return COMPILE_OPTIONS


def device_coarse_kernel(device_id: int, ref_dim: int = 3) -> str:
    """The coarse product's kernel for device `device_id`, as its compiled module (of references of `ref_dim`)
    holds it: `coarse_kernel_name`'s, or the `mma.sync` kernel on a 9.0 device whose compiler did not take sm_90a."""
    import cupy

    kernel_module(device_id=device_id, ref_dim=ref_dim)  # compiled (or loaded) first: whether sm_90a was taken
    name = coarse_kernel_name(cupy.cuda.Device(int(device_id)).compute_capability)
    if name == COARSE_KERNELS[0] and int(device_id) in _sm90a_refused:
        return COARSE_KERNELS[1]
    return name


def local_tiles(counts: npt.ArrayLike, tile_orientations: int, xp: ArrayModule = np) -> tuple[Array, Array, Array]:
    """The tile arguments of a local search's coarse kernel for particles with `counts` orientations each (host,
    (B,)), as arrays of `xp` (numpy, or CuPy for the kernel): for each block, its particle and the first of its
    `tile_orientations` orientations ((n_tiles,) each), and the counts ((B,)); int32. A particle has
    ceil(count / tile_orientations) tiles, so a narrow neighbourhood is not padded to the widest."""
    counts = np.asarray(counts, dtype=np.int64)
    per_particle = (counts + int(tile_orientations) - 1) // int(tile_orientations)
    particle = np.repeat(np.arange(counts.size), per_particle)
    first_tile = np.cumsum(per_particle) - per_particle
    first = (np.arange(particle.size) - first_tile[particle]) * int(tile_orientations)
    return tuple(xp.asarray(a, dtype=np.int32) for a in (particle, first, counts))


def fine_tensor_core_shape(nfo: int, nft: int) -> bool:
    """Whether blocks of NFO × NFT children take fine_diff2_tc: a multiple of 64 orientations and 16 translations,
    one row tile (a 3D search at oversampling 2). The kernel's several row tiles (oversampling 3, 512 × 64) compile
    but have not run on a GPU, so those blocks stay on fine.cu's kernel."""
    return int(nfo) % FINE_TC_ORIENTATIONS == 0 and int(nft) == FINE_TC_TRANSLATIONS


def fine_kernel_names(nfo: int, nft: int) -> tuple[str, ...]:
    """The template instances of fine.cu and fine_tc.cu for NFO child orientations × NFT child translations (tiled
    by `fine_tile`): the fine diff2 (likelihood, then cross-correlation), the fine sums, and where
    `fine_tensor_core_shape` allows, the likelihood's diff2 on tensor cores; pass them to `kernel_module` as name
    expressions."""
    to, tt = fine_tile(nfo, nft)
    names = (f"fine_diff2<{nfo}, {nft}, {to}, {tt}, false>", f"fine_diff2<{nfo}, {nft}, {to}, {tt}, true>",
             f"fine_sums<{nfo}, {nft}, {to}, {tt}>")
    return names + ((f"fine_diff2_tc<{nfo}, {nft}>",) if fine_tensor_core_shape(nfo, nft) else ())


def fine_diff2_launch(nfo: int, nft: int, do_cc: bool, compute_capability: str | int) -> tuple[str, int, int]:
    """The fine diff2 kernel (one of `fine_kernel_names(nfo, nft)`) for a device of `compute_capability`, its grid's
    second size (the first is the blocks, or their groups) and the blocks a CUDA block takes at most (0: one, and
    the kernel takes no `group_first`): on tensor cores (8.0 and later) for the likelihood where the children's shape
    allows, one CUDA block per FINE_TC_ORIENTATIONS child orientations of a group of blocks (`fine_groups`); else
    fine.cu's, one per `fine_tile`."""
    names = fine_kernel_names(nfo, nft)
    if not do_cc and fine_tensor_core_shape(nfo, nft) and int(compute_capability) >= 80:
        return names[3], int(nfo) // FINE_TC_ORIENTATIONS, fine_group_blocks(nft)
    return names[1] if do_cc else names[0], fine_tiles(nfo, nft), 0


def fine_group_blocks(nft: int) -> int:
    """Blocks of NFT child translations one CUDA block of fine_diff2_tc takes at most (fine_tc.cu's GB)."""
    return 1 if int(nft) >= FINE_TC_GROUP_ROWS else FINE_TC_GROUP_ROWS // int(nft)


def fine_groups(keys: Array, group_blocks: int, xp: ArrayModule = np) -> tuple[Array, Array]:
    """fine_diff2_tc's groups of blocks: those with equal `keys` (a block's particle, class and coarse orientation as
    one integer; (n,)) together, at most `group_blocks` a group. Returns the blocks' order (indices into `keys`, equal
    keys adjacent) and, int32 ((groups + 1,)), each group's first position in that order, then n."""
    keys = xp.asarray(keys)
    n = int(keys.size)
    if n == 0:
        return xp.zeros(0, dtype=np.int64), xp.zeros(1, dtype=np.int32)
    order = xp.argsort(keys)
    ordered = keys[order]
    starts = xp.ones(n, dtype=bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    run_first = xp.flatnonzero(starts)
    in_run = xp.arange(n) - run_first[xp.cumsum(starts) - 1]
    first = xp.flatnonzero(in_run % int(group_blocks) == 0)
    return order, xp.concatenate([first, xp.asarray([n])]).astype(np.int32)


def kernel_source(ref_dim: int = 3) -> str:
    """The kernels of KERNEL_FILES as one compilation unit for references of `ref_dim` (2 or 3): the DEFINES and
    REF_DIM first, then every file after a `#line 1 "file.cu"` directive, so compiler messages name the .cu file
    and its line."""
    if int(ref_dim) not in REF_DIMS:
        raise ValueError(f"the GPU kernels take 2D or 3D references, not {ref_dim}D")
    parts = [f"#define {k} {v}" for k, v in DEFINES.items()] + [f"#define REF_DIM {int(ref_dim)}"]
    for name in KERNEL_FILES:
        path = KERNEL_DIR / name
        parts.append(f'#line 1 "{path}"')
        parts.append(path.read_text())
    return "\n".join(parts)


def kernel_module(name_expressions: Sequence[str] = (), device_id: int | None = None, ref_dim: int = 3) -> Any:
    """The kernels compiled for device `device_id` (default: CuPy's current device), once per device, set
    of template instances (`name_expressions`, e.g. `fine_kernel_names(8, 4)`) and dimensionality of the
    references (`ref_dim`: 3 for maps, 2 for a 2D classification's references; `kernel_source`).

    A loaded module belongs to the CUDA context of the device it was loaded on, so several GPUs in one
    process each get their own; launch its functions with that device current. Threads asking for one key wait
    for its one compilation; those asking for another do not wait behind it.
    """
    import cupy

    if device_id is None:
        device_id = cupy.cuda.runtime.getDevice()
    key = (int(device_id), tuple(name_expressions), int(ref_dim))
    module = _modules.get(key)
    if module is None:
        with _lock:
            key_lock = _key_locks.setdefault(key, threading.Lock())
        with key_lock:  # one compilation per key; other keys compile (or load) meanwhile
            module = _modules.get(key)
            if module is None:
                what = f"the GPU kernels{' of 2D references' if key[2] == 2 else ''}"
                with cupy.cuda.Device(key[0]), compile_notice(f"{what}{' ' if key[1] else ''}{', '.join(key[1])}"):
                    module = _compile(cupy, key[0], key[1], key[2])
                _modules[key] = module
    return module


def _compile(cupy, device_id, name_expressions, ref_dim=3):
    """The module for the current device `device_id` (references of `ref_dim`), compiled (or read from CuPy's
    cache) here: with sm_90a on a 9.0 device unless its compiler did not take it, then without
    (coarse_diff2_wgmma's body empty, and `device_coarse_kernel` names the `mma.sync` kernel)."""
    capability = cupy.cuda.Device(device_id).compute_capability
    options = COMPILE_OPTIONS if device_id in _sm90a_refused else compile_options(capability)
    source = kernel_source(ref_dim)

    def build(options: tuple[str, ...]) -> Any:
        module = cupy.RawModule(code=source, options=options, name_expressions=name_expressions)
        module.get_function("segment_reduce")  # compiles here (RawModule compiles on first use)
        return module

    def refused(why: str) -> None:
        log.warning("GPU %d: the CUDA compiler did not build the kernels for sm_90a (%s); the coarse product runs "
                    "with mma.sync instead of Hopper's warp-group products", device_id, why)
        _sm90a_refused.add(device_id)

    try:
        module = build(options)
    except cupy.cuda.compiler.CompileException as exc:
        if options == COMPILE_OPTIONS:
            raise
        refused(str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__)
        return build(COMPILE_OPTIONS)
    if options == COMPILE_OPTIONS:
        return module
    flag = cupy.ndarray((1,), dtype=cupy.int32, memptr=module.get_global("cr_wgmma_compiled"))
    if int(flag.get()[0]) != 1:
        refused("it took another architecture than -arch=sm_90a")
        return module  # coarse_diff2_wgmma's body is empty here; the others are whole
    kernel = coarse_kernel_name(capability)
    module.get_function(kernel).max_dynamic_shared_size_bytes = coarse_shared_bytes(kernel)  # beyond 48 KB
    return module


def kernel_cache_dir() -> Path:
    """Where CuPy keeps compiled kernels ($CUPY_CACHE_DIR, else ~/.cupy/kernel_cache)."""
    return Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache"))


@contextlib.contextmanager
def compile_notice(what: str) -> Iterator[None]:
    """Say so when the work inside takes longer than COMPILE_NOTICE_SECONDS (a compilation, not a cache hit):
    one line when it has taken that long, one with its time when it ends."""
    tic = time.perf_counter()
    announced = threading.Event()

    def announce() -> None:
        announced.set()
        log.info("compiling %s for this GPU (once per machine and version; cached in %s) ...", what,
                 kernel_cache_dir())

    timer = threading.Timer(COMPILE_NOTICE_SECONDS, announce)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if announced.is_set():
            log.info("compiled %s in %.0f s", what, time.perf_counter() - tic)


def warm_marker() -> Path:
    """The file a run of this version leaves in CuPy's kernel cache once its iterations have ended: named by a
    digest of the package's version and its kernels' source, so a new version is announced again."""
    import hashlib

    from cryorefine import __version__

    digest = hashlib.sha1(f"{__version__}\n{kernel_source()}".encode()).hexdigest()[:16]
    return kernel_cache_dir() / f"cryorefine-{digest}.warm"


def first_use_notice() -> None:
    """One line when no run of this version has ended on this machine (no `warm_marker`): its first iterations
    compile the kernels they use, CuPy's own (which it compiles without a word) with the package's. An empty cache
    or one that other programs filled says nothing about that."""
    marker = warm_marker()
    if not marker.exists():
        log.info("first GPU run of this cryorefine on this machine (no %s): the first iterations also compile the "
                 "GPU kernels they use, about a minute in all; later runs read them from %s", marker.name,
                 marker.parent)


def mark_kernels_warm() -> None:
    """Leave `warm_marker` (a run's iterations have ended: the kernels they used are in the cache); a cache that
    cannot be written is left as it is."""
    try:
        marker = warm_marker()
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:
        pass
