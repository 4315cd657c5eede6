"""The CuPy engine: the E-step of `estep.reference.NumpyEngine` on one GPU, with RawKernels.

Same contract (`estep.engine`), the same set-up tables (`estep.common.IterationTables`) and the same
arithmetic as the numpy engine at float32, stage by stage (the kernels live in `estep/kernels/*.cu`,
each with its numpy twin, compiled per device by `estep.kernels.kernel_module`):

1. coarse pass: the projected slices of every orientation (`project_slices_planar`), the images
   moved by every coarse translation (`shift_images_planar`), and diff2 of all (particle,
   translation) × orientation pairs as one tiled matrix product per orientation chunk
   (`coarse_diff2_wgmma` on the warp-group tensor-core products of compute capability 9.0,
   `coarse_diff2_tf32` on the tensor cores of the others from 8.0, `coarse_diff2` on CUDA cores before;
   numpy twin `NumpyEngine._diff2_dense`). A local search gives each particle its own orientations
   (`core.sampling.LocalOrientations`), each particle in tiles of its own (`local_tiles`):
   `local_diff2_t*` projects their slices inside the kernel and meets them with the particle's moved
   images there (no slice reaches device memory); nothing the size of the whole grid is made;
2. weights and significance on the device without a weights array: one CUDA block per particle
   recomputes its row's weights from diff2 and the priors in each of three passes (row maximum; total
   and a bound on the candidates; the candidates packed: `coarse_weight_stats`, `coarse_candidates`;
   numpy twin `common.significant_samples`), and the cut sorts the candidates alone; only the
   per-particle counts come to the host;
3. fine pass over compressed blocks of NFO × NFT children (`fine_diff2`; the likelihood's on tensor cores,
   `fine_diff2_tc`, at 64 × 16 children on 8.0 and later), grouped by (class, coarse orientation)
   pair: where a pair has many blocks its NFO slices are projected once, every class's pairs in one launch
   (`project_slices_of_classes`), and read by all of them, else each block projects its own;
   per-particle weights with segment reductions (`segment_reduce`);
4. weighted sums per block (`fine_sums`: noise spectra, scale sums, per-orientation slices)
   and atomic back-projection of the slices into float32 padded volumes (`backproject_slices`), as RELION's
   GPU build keeps them.

2D references (`IterationSetup.ref_dim` 2, a 2D classification): the same stages and launches on the module
compiled for them (`estep.kernels.kernel_module`'s `ref_dim`), whose slices are the classes' padded 2D transforms
read at in-plane rotations (bilinear) and whose back-projection adds into padded 2D sums: `project.cu` and
`backproject.cu` switch on REF_DIM, and everything after the slices is the same code.

Device memory comes from the stack arena (`gpu.allocator`) when one is given: the loop opens
the ITERATION scope, every sub-batch of particles a PARTICLE scope and every orientation or
block chunk an ORIENTATION scope. Sub-batch and chunk sizes follow from the arena's free
space and the current image sizes (`estep.cuda_plan.plan_batches`); the choices are logged.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from cryorefine.core.arrays import Array, ArrayModule, add_rows_at
from cryorefine.core.projector import PaddedGrid, Projector
from cryorefine.core.sampling import LocalOrientations, offset_log_prior
from cryorefine.estep.common import (
    FineBlocks,
    IterationTables,
    groups_by_size,
    local_orientations,
    significance_cut,
    significant_mask,
    significants_limit,
)
from cryorefine.estep.cuda_plan import (
    FINE_BLOCKS_PER_PAIR_PROJECTED_ONCE,
    SLICE_BYTES_PER_COEF,
    SLICE_ROW_BYTES_PER_COEF,
    plan_batches,
)
from cryorefine.estep.engine import Batch, BatchResult, IterationSetup, WeightedSums
from cryorefine.estep.kernels import (
    FINE_THREADS,
    GEMM_BK,
    GEMM_BM,
    GEMM_BN,
    GEMM_THREADS,
    LOCAL_THREADS,
    MAX_GRID_Y,
    SEG_THREADS,
    WEIGHT_THREADS,
    coarse_shared_bytes,
    device_coarse_kernel,
    fine_diff2_launch,
    fine_groups,
    fine_kernel_names,
    fine_tiles,
    kernel_module,
    local_tile,
    local_tiles,
    round_up,
)
from cryorefine.gpu.allocator import DeviceArena, free_device_bytes

log = logging.getLogger(__name__)


_NULL = np.uint64(0)  # a null pointer argument of a kernel
#: the most (class, orientation) columns of one coarse product of a global search, classes side by side
#: (`CupyEngine._class_groups`): a 3D class's thousands of orientations make a product of their own; a 2D
#: classification's classes, a few dozen in-plane rotations each, share one (its `pair` temporary, particles × columns
#: float32, as large as one 3D class's)
COARSE_COLUMNS_PER_PRODUCT = 4096
# A global search's fine matrices (every coarse orientation's children, 36 bytes each) are kept in a table on the
# device where it takes at most this many bytes and a sixteenth of the free memory (e.g. a Class3D at HEALPix order 2
# or 3 in its finer pass: 10.6 or 85 MB); beyond it each batch uploads its own from the host's table
FINE_MATRIX_TABLE_BYTES_MAX = 128 << 20


def _one_stack(cp, arrays):
    """`arrays` (K transforms of one shape) as one (K, …) complex64 device array: the array they are the classes of,
    in order, where they are (no copy of gigabytes), else a stacked copy."""
    base = getattr(arrays[0], "base", None)
    if (isinstance(base, cp.ndarray) and base.dtype == cp.complex64 and base.flags.c_contiguous
            and base.shape == (len(arrays),) + tuple(arrays[0].shape)
            and all(isinstance(a, cp.ndarray) and a.data.ptr == base[k].data.ptr for k, a in enumerate(arrays))):
        return base
    return cp.stack([cp.asarray(a, dtype=cp.complex64) for a in arrays])


def padded_transforms(cp: ArrayModule, maps: Sequence[Array], padding_factor: float, r_max_px: int,
                      arena: DeviceArena | None, made_here: Callable[[int], bool] | None = None
                      ) -> tuple[Array, PaddedGrid]:
    """The padded transforms of `maps` (K maps of one shape) in one (K, …) complex64 device array, and their grid:
    the array is taken first and each class's transform (temporaries of the padded box, gigabytes at 360 px) is
    computed in a deeper scope of `arena` that ends once it is copied in. On the arena's stack, temporaries freed
    below a surviving array could not be reused until the iteration ends; inside the scope a caching pool serves
    the transform's slabs (`core.padded_transforms`), whose temporaries are freed in any order. Only the classes
    `made_here(k)` are transformed (all by default); the others are left for the caller to fill."""
    from cryorefine.gpu.allocator import Scope

    grid = PaddedGrid.create(np.shape(maps[0])[0], padding_factor, r_max_px, ndim=np.ndim(maps[0]))
    stack = cp.empty((len(maps),) + grid.shape, dtype=cp.complex64)
    for k, volume in enumerate(maps):
        if made_here is not None and not made_here(k):
            continue
        scope = contextlib.nullcontext() if arena is None else arena.scope(Scope.PARTICLE)
        pooled = contextlib.nullcontext() if arena is None else arena.pooled()
        with scope, pooled:
            Projector(cp.asarray(volume), padding_factor, r_max_px, dtype=np.float32, xp=cp, out=stack[k])
    return stack, grid


def _i32(v):
    return np.int32(v)


def _f32(v):
    return np.float32(v)


def coarse_significant(cp: ArrayModule, d2: Array, prior_ko: Array, prior_t: Array, adaptive_fraction: float,
                       max_significants: int, device_id: int,
                       ref_dim: int = 3) -> tuple[Array, Array, np.ndarray, Array]:
    """The significant samples of coarse diff2 (B, K, R, T) under log priors broadcasting as (B or 1, K, R, 1) and
    (B, 1, 1, T), without a (B, K·R·T) float64 weights array: weights.cu recomputes a row's weights in each of its
    three passes (maximum; total and a bound on the candidates; the candidates packed), and the cut
    (`common.significance_cut`) sorts the candidates alone. Returns (particle, sample index in its row) of each
    significant sample, by particle then sample as `cp.nonzero` orders them, the count per particle (host) and the
    cut's count (device): what `common.significant_samples` gives for the weights exp(lw − max lw), lw = priors −
    diff2. `ref_dim`: the module (`estep.kernels.kernel_module`) of the calling engine's references, whose weights
    kernels are the same in either."""
    b_count, n_cls, n_sel, n_t = d2.shape
    n_samples = n_cls * n_sel * n_t
    if n_samples >= 1 << 31:
        raise ValueError(f"{n_samples} coarse samples per particle: more than the GPU engine indexes (2^31)")
    if b_count == 0:
        empty = cp.zeros(0, dtype=cp.int64)
        return empty, empty, np.zeros(0, dtype=np.int64), empty
    d2 = cp.ascontiguousarray(d2, dtype=cp.float32)
    rows_ko = prior_ko.shape[0]
    ko = cp.ascontiguousarray(cp.broadcast_to(prior_ko, (rows_ko, n_cls, n_sel, 1)), dtype=cp.float64)
    pt = cp.ascontiguousarray(cp.broadcast_to(prior_t, (b_count, 1, 1, n_t)), dtype=cp.float64)
    row_max = cp.empty(b_count, dtype=cp.float64)
    total = cp.empty(b_count, dtype=cp.float64)
    bound = cp.empty(b_count, dtype=cp.int64)
    counts = cp.empty(b_count, dtype=cp.int64)
    module = kernel_module(device_id=device_id, ref_dim=ref_dim)  # the engine's module (the kernels are alike)
    # samples a load: as float4 where every row starts 16-byte aligned
    q = next((q for q in (8, 4) if n_samples % q == 0), 1) if d2.data.ptr % 16 == 0 else 1
    args = (d2, ko, np.int64(0 if rows_ko == 1 else n_cls * n_sel), pt, np.int64(n_samples), _i32(n_t),
            np.float64(adaptive_fraction), _i32(q))
    module.get_function("coarse_weight_stats")((b_count,), (WEIGHT_THREADS,), (*args, row_max, total, bound))
    width = max(1, int(bound.max()))
    packed_w = cp.zeros((b_count, width), dtype=cp.float64)
    packed_s = cp.zeros((b_count, width), dtype=cp.int32)
    module.get_function("coarse_candidates")((b_count,), (WEIGHT_THREADS,),
                                             (*args, row_max, total, np.int64(width), packed_w, packed_s, counts))
    del d2, ko, pt, row_max, bound
    # the cut sorts the candidates' own width, not the bound's (many times wider in rows of middling breadth)
    width = max(1, int(counts.max()))
    packed_w, packed_s = packed_w[:, :width], packed_s[:, :width]
    threshold, n_sig = significance_cut(packed_w, counts, total, adaptive_fraction, max_significants, cp)
    keep = significant_mask(packed_w, threshold[:, None])
    del packed_w, threshold
    per_particle = cp.asnumpy(keep.astype(cp.int64).sum(axis=1))  # int64 sums: see `significance_cut`
    b_idx, at = cp.nonzero(keep)
    return b_idx, packed_s[b_idx, at].astype(cp.int64), per_particle, n_sig


class _PairGroups:
    """The fine pass's blocks grouped by (class, coarse orientation) pair, pair = class·n_unique + u (u indexes the
    batch's unique coarse orientations): the blocks sorted by pair (`order`), the sorted distinct pairs (device and
    host), and each block's rank among them. `project_once`: the pairs have FINE_BLOCKS_PER_PAIR_PROJECTED_ONCE blocks
    or more on average (broad posteriors of a global search), so each pair's slices are projected once for all its
    blocks; else (a local search's neighbourhoods share few blocks a pair) every block projects its own."""

    def __init__(self, cp, k_blk, u_blk, n_unique, nfo):
        self.cp, self.n_unique, self.nfo = cp, int(n_unique), int(nfo)
        self.pair = k_blk.astype(cp.int64) * self.n_unique + u_blk
        self.order = cp.argsort(self.pair)
        self.unique_d, rank = cp.unique(self.pair[self.order], return_inverse=True)
        self.rank = rank.reshape(-1)  # of the blocks in `order`
        self.unique = cp.asnumpy(self.unique_d)
        self.n_pairs = int(self.unique.size)
        self.project_once = int(k_blk.size) >= FINE_BLOCKS_PER_PAIR_PROJECTED_ONCE * max(self.n_pairs, 1)

    def chunk(self, first: int, count: int) -> tuple[Array, np.ndarray, Array]:
        """Pairs first … first + count − 1: (their blocks sorted by pair, as indices into all blocks; the pairs (host);
        each of those blocks' first slice row, NFO rows per pair, int32)."""
        cp = self.cp
        if first == 0 and count >= self.n_pairs:
            in_chunk = self.order
        else:
            in_chunk = self.order[(self.rank >= first) & (self.rank < first + count)]
        local = cp.searchsorted(self.unique_d[first:first + count], self.pair[in_chunk])
        return in_chunk, self.unique[first:first + count], (local * self.nfo).astype(cp.int32)


class CupyEngine:
    """The GPU engine for one half set (all classes); `arena` is a gpu.allocator.DeviceArena or None."""

    def __init__(self, device_id: int = 0, arena: DeviceArena | None = None, keep_blocks: bool = False,
                 coarse_kernel: str | None = None) -> None:
        import cupy

        self.cp = cupy
        self.array_module = cupy  # batches are prepared on the device (images.prepare_batch)
        self.device_id = int(device_id)
        self.compute_capability = int(cupy.cuda.Device(self.device_id).compute_capability)
        # the global search's coarse product, one of COARSE_KERNELS: by default the device's (`device_coarse_kernel`,
        # chosen at set-up, when the references' module is known)
        self.coarse_kernel_asked = coarse_kernel
        self.coarse_kernel = coarse_kernel
        self.ref_dim = 3  # the references' dimensionality (IterationSetup.ref_dim): which module's kernels run
        self.arena = arena
        self.keep_blocks = keep_blocks  # copy FineBlocks and diff2 to the host (tests, diagnostics)
        self.last_blocks = []
        self.last_coarse_diff2 = []  # with keep_blocks: per sub-batch, coarse diff2 (B, K·R·T)
        self.last_fine = []  # with keep_blocks: per particle group, (coarse index per block, diff2 (n_blocks, NF))
        self.stage_seconds = {"upload": 0.0, "orientations": 0.0, "coarse_images": 0.0, "coarse": 0.0,
                              "weights": 0.0, "fine_setup": 0.0, "fine_slices": 0.0, "fine": 0.0, "fine_weights": 0.0,
                              "sums": 0.0, "backproject": 0.0, "results": 0.0}
        # useful floating-point operations per stage: the coarse matrix products (2 per real multiply-add of
        # the cross term and of the CTF²|P|² term), the fine pass's cross terms (8 per orientation, translation
        # and complex coefficient, the coarse pass's count)
        self.stage_flops = {"coarse": 0.0, "fine": 0.0}
        self.plan = None  # estep.cuda_plan.BatchPlan of the iteration
        self.setup_ = None
        self.compiled_ahead = {}  # fine kernels' names -> the thread compiling them (`_compile_ahead`)
        self.tables = None  # estep.common.IterationTables of the iteration
        self.pdf_class_d = self.pdf_direction_d = None  # the class and direction sums of the half, on the device

    # ------------------------------------------------------------------ helpers
    def _scope(self, level):
        if self.arena is None:
            return contextlib.nullcontext()
        return self.arena.scope(level)

    def _pooled(self):
        return contextlib.nullcontext() if self.arena is None else self.arena.pooled()

    def _tick(self, stage, tic):
        self.cp.cuda.get_current_stream().synchronize()
        now = time.perf_counter()
        self.stage_seconds[stage] += now - tic
        return now

    def _free_bytes(self):
        return free_device_bytes(self.arena)

    def _module(self, name_expressions=()):
        """The kernels (with the template instances `name_expressions`) of this engine's device and references."""
        return kernel_module(name_expressions, self.device_id, self.ref_dim)

    def _compile_ahead(self, setup):
        """Compile on background threads (once per engine and set of kernels) the fine kernels of this iteration,
        which its fine pass asks for only after the coarse pass and the weights, and with `setup.next_oversampling`
        those of that order, so that a later switch does not wait for the compiler: each set is several seconds
        of compiling on a machine that never compiled it (the first run of a version), and nothing to wait for
        once CuPy's cache holds it. `kernel_module` makes a caller asking for a set being compiled wait for it."""
        wanted = [(self.n_fo, self.n_ft)]
        k = setup.next_oversampling
        if k is not None and not setup.local_searches:
            wanted.append((setup.sampling.n_fine_orientations(int(k)), setup.sampling.n_fine_translations(int(k))))
        for nfo, nft in wanted:
            names = fine_kernel_names(nfo, nft)
            if names not in self.compiled_ahead:
                self.compiled_ahead[names] = threading.Thread(
                    target=kernel_module, args=(names, self.device_id, self.ref_dim), daemon=True,
                    name=f"compile fine kernels of {nfo} orientations x {nft} translations")
                self.compiled_ahead[names].start()

    # ------------------------------------------------------------------ iteration set-up
    def setup(self, setup: IterationSetup) -> None:
        cp = self.cp
        s = self.setup_ = setup
        t = self.tables = IterationTables.create(s)
        self.ref_dim = int(s.ref_dim)
        with cp.cuda.Device(self.device_id):
            self.coarse_kernel = self.coarse_kernel_asked or device_coarse_kernel(self.device_id, self.ref_dim)
            # host tables (float64, as the numpy engine's), and their device copies the kernels read
            self.n_classes = t.n_classes
            self.fine, self.coarse = t.fine, t.coarse
            self.coarse_sel = t.coarse_selection
            self.logsigma2 = t.logsigma2
            self.n_orient, self.n_trans, self.n_psi = t.n_orientations, t.n_translations, t.n_psi
            self.n_fo, self.n_ft, self.children = t.n_fine_orientations, t.n_fine_translations, t.children_per_block
            # a global search compares every orientation: their matrices once; a local one makes its own from
            # the direction table, kept on the device for the iteration
            self.matrices_host = None if s.local_searches else t.orientation_matrices().reshape(-1, 9)
            self.directions_d = s.sampling.directions_deg(cp) if s.local_searches else None
            self.translations, self.fine_translations = t.translations, t.fine_translations  # (T, 2), (T, nft, 2)
            self.scale = t.scale
            self.log_pdf_class = cp.asarray(s.log_pdf_class, dtype=cp.float64)
            self.log_pdf_direction = (None if s.log_pdf_direction is None
                                      else cp.asarray(s.log_pdf_direction, dtype=cp.float64))
            # children of the coarse orientations, filled in as batches meet them (a global search): angles
            # (n_orient, NFO, 3) on the host, matrices (n_orient, NFO, 9) in the kernels' float32 on the device
            # where they fit (FINE_MATRIX_TABLE_BYTES_MAX), else on the host; and which are filled
            self._fine_known = np.zeros(0 if s.local_searches else self.n_orient, dtype=bool)
            self._fine_angles = np.empty((self._fine_known.size, self.n_fo, 3))
            table_bytes = self._fine_known.size * self.n_fo * 9 * 4
            on_device = table_bytes <= min(FINE_MATRIX_TABLE_BYTES_MAX, self._free_bytes() / 16)
            self._fine_matrices = (cp if on_device else np).empty((self._fine_known.size, self.n_fo, 9),
                                                                  dtype=np.float32)

            self.minv_fine = cp.asarray(t.minv_fine, dtype=cp.float32)
            self.minv_store = cp.asarray(t.minv_store, dtype=cp.float32)
            self.minv_coarse = cp.asarray(t.minv_coarse, dtype=cp.float32)
            self.fine_positions_d = cp.asarray(self.fine.positions)
            self.kx_f = cp.asarray(self.fine.kx, dtype=cp.float32)
            self.ky_f = cp.asarray(self.fine.ky, dtype=cp.float32)
            self.kx_c = cp.asarray(self.coarse.kx, dtype=cp.float32)
            self.ky_c = cp.asarray(self.coarse.ky, dtype=cp.float32)
            self.shell_f = cp.asarray(np.minimum(self.fine.shell, 2 ** 31 - 1), dtype=cp.int32)
            self.trans_d = cp.asarray(self.translations, dtype=cp.float32)
            self.fine_trans_d = cp.asarray(self.fine_translations, dtype=cp.float32)
            self.fine_trans_d64 = cp.asarray(self.fine_translations, dtype=cp.float64)
            self.scale_use = None if t.scale_use is None else cp.asarray(t.scale_use, dtype=cp.float32)

            # back-projection sums first (they outlive this half's E-step), then the references
            grid = PaddedGrid.create(s.ori_size_px, s.padding_factor, s.current_size_px // 2, ndim=self.ref_dim)
            self.bp_grid = grid
            self.bp_data = cp.zeros((self.n_classes,) + grid.shape, dtype=cp.complex64)
            self.bp_weight = cp.zeros((self.n_classes,) + grid.shape, dtype=cp.float32)
            self.pdf_class_d = cp.zeros(self.n_classes, dtype=cp.float64)
            self.pdf_direction_d = cp.zeros((self.n_classes, s.sampling.n_directions), dtype=cp.float64)
            self._upload_references(s)
            self.n_shells = t.n_shells
            self.sums_ = WeightedSums.zeros(None, self.n_classes, t.n_optics, t.n_shells, s.sampling.n_directions,
                                            data=[self.bp_data[k] for k in range(self.n_classes)],
                                            weight=[self.bp_weight[k] for k in range(self.n_classes)],
                                            n_scale_groups=s.n_scale_groups)
            # a local search plans each batch again from its particles' neighbourhoods (`_local_batch_size`)
            self.plan = plan_batches(self._free_bytes(), self.coarse.positions.size, self.fine.positions.size,
                                     1 if s.local_searches else self.n_orient, self.n_trans, self.n_classes, 1 << 30,
                                     self.children, local=s.local_searches)
            self.coarse_cache = None  # [(first class, end class, slices B, |slices|² P2)] of `_class_groups`
            if not s.local_searches and self.plan.cache_coarse_slices:
                every = np.arange(self.n_orient)
                self.coarse_cache = [(k0, k1, *self._project_planar(k0, every, k1)[:2])
                                     for k0, k1 in self._class_groups()]
            log.debug("GPU engine plan: %s", self.plan.describe())
        self._compile_ahead(s)

    def _upload_references(self, s):
        """The classes' padded transforms in one (K, …) complex64 array (`padded_transforms`), or a runner's
        (`CudaBackend.shared_projectors`): the classes of one array, taken as they are."""
        cp = self.cp
        if s.maps is not None:
            self.ref_volumes, grid = padded_transforms(cp, s.maps, s.padding_factor, s.current_size_px // 2,
                                                       self.arena)
            assert grid == PaddedGrid.create(s.ori_size_px, s.padding_factor, s.current_size_px // 2,
                                             ndim=self.ref_dim)
        else:
            grid = s.projectors[0].grid
            self.ref_volumes = _one_stack(cp, [p.data for p in s.projectors])
        self.ref_grid = grid
        # the kernels' geometry: the grid's first and last sizes (d, d, w) or, of 2D references, (d, w)
        d, w = grid.shape[0], grid.shape[-1]
        pf = np.float32(grid.padding_factor)
        r_pad = grid.r_max_padded
        self.geometry = (_i32(d), _i32(w), _i32(grid.origin), _f32(pf), _f32(r_pad * r_pad * (1.0 + 1e-5)))
        self.class_stride = np.int64(np.prod(grid.shape))
        bp = self.bp_grid
        bd, bw = bp.shape[0], bp.shape[-1]
        br = bp.r_max_padded
        self.bp_geometry = (_i32(bd), _i32(bw), _i32(bp.origin), _f32(bp.padding_factor),
                            _f32(br * br * (1.0 + 1e-5)))

    def _class_groups(self) -> list[tuple[int, int]]:
        """(first, end) classes of each coarse product of a global search: consecutive classes whose orientations
        together make at most COARSE_COLUMNS_PER_PRODUCT columns (one class where its own are more), so that a 2D
        classification's few in-plane rotations a class (30 of K = 100) fill the product's column tiles of
        GEMM_BN instead of one mostly empty tile a class."""
        per_group = max(1, COARSE_COLUMNS_PER_PRODUCT // max(self.n_orient, 1))
        return [(k, min(self.n_classes, k + per_group)) for k in range(0, self.n_classes, per_group)]

    def _project_planar(self, k, orientations, end=None):
        """Planar, coefficient-major slices (B, P2) of classes k … end − 1 (k alone by default) at `orientations`
        for the coarse product: column (class − k)·len(orientations) + r, class-major as the diff2 rows are."""
        cp = self.cp
        kc = self.coarse.positions.size
        n = orientations.size
        end = k + 1 if end is None else end
        ldb = round_up(max(n * (end - k), 1), GEMM_BN)
        kd = round_up(2 * kc, GEMM_BK)
        b = cp.zeros((kd, ldb), dtype=cp.float32)
        p2 = cp.zeros((round_up(kc, GEMM_BK), ldb), dtype=cp.float32)
        mats = cp.asarray(self.matrices_host[orientations], dtype=cp.float32)
        fn = self._module().get_function("project_slices_planar")
        flat_b, flat_p2 = b.reshape(-1), p2.reshape(-1)
        for c in range(k, end):  # each class's columns from its first, the rows' stride the whole width
            first = (c - k) * n
            fn(((n + 31) // 32, min((kc + 7) // 8, MAX_GRID_Y)), (32, 8),
               (self.ref_volumes[c], *self.geometry, mats, self.kx_c, self.ky_c, _i32(kc), _i32(n), _i32(ldb),
                flat_b[first:], flat_p2[first:]))
        return b, p2, n * (end - k)

    # ------------------------------------------------------------------ one batch
    def run(self, batch: Batch, local: LocalOrientations | None = None) -> BatchResult:
        """The E-step of one batch (`estep.engine.Engine.run`); `local`: its local-search neighbourhoods when the
        caller computed them ahead, else they are computed here."""
        from cryorefine.gpu.allocator import Scope

        cp = self.cp
        self.last_coarse_diff2, self.last_fine = [], []
        n = batch.indices.size
        parts = []
        blocks = []
        with cp.cuda.Device(self.device_id):
            tic = time.perf_counter()
            if local is None:
                local = local_orientations(self.setup_, batch.prior_rot_deg, batch.prior_tilt_deg,
                                           batch.prior_psi_deg)
            self.stage_seconds["orientations"] += time.perf_counter() - tic
            step = max(1, self.plan.particles_per_batch if local is None else self._local_batch_size(local))
            for start in range(0, n, step):
                rows = np.arange(start, min(n, start + step))
                with self._scope(Scope.PARTICLE):
                    part_local = None if local is None else local.rows(start, rows[-1] + 1)
                    parts.append(self._run_rows(batch, rows, part_local))
                blocks.extend(self.last_blocks)
        tic = time.perf_counter()
        self.last_blocks = blocks
        merged = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
        self.sums_.log_likelihood += float(merged["log_likelihood"].sum())
        self.sums_.sum_pmax += float(merged["pmax"].sum())
        self.sums_.n_particles += n
        self.stage_seconds["results"] += time.perf_counter() - tic
        return BatchResult(**merged)

    def _local_batch_size(self, local):
        """Particles per sub-batch of a local search: the set-up's plan, and what the widest neighbourhood
        leaves room for."""
        plan = plan_batches(self._free_bytes(), self.coarse.positions.size, self.fine.positions.size,
                            int(local.counts().max(initial=1)), self.n_trans, self.n_classes, 1 << 30, self.children,
                            local=True)
        return min(self.plan.particles_per_batch, plan.particles_per_batch)

    def _run_rows(self, batch, rows, local):
        cp = self.cp
        tic = time.perf_counter()
        optics = np.asarray(batch.optics_index)[rows]
        groups = np.asarray(batch.scale_group_index)[rows]
        b_count = rows.size
        # rows are consecutive: slice (no host copy), send the half transforms as they are, gather on the device
        take = slice(int(rows[0]), int(rows[-1]) + 1)
        pos = self.fine_positions_d

        def coefficients(array: Array, dtype: npt.DTypeLike) -> Array:
            device = cp.asarray(array[take])  # numpy (uploaded) or already on the device
            return device.reshape(b_count, -1)[:, pos].astype(dtype)

        ctf = coefficients(batch.ctf, cp.float32)
        pre = {
            "x": coefficients(batch.images_ft, cp.complex64),
            "x_nomask": coefficients(batch.images_ft_unmasked, cp.complex64),
            "ctf": ctf if self.scale is None else ctf * cp.asarray(self.scale[groups][:, None], dtype=cp.float32),
            "optics": optics,
            "group": groups,
            "optics_d": cp.asarray(optics, dtype=cp.int32),
            "residual": np.asarray(batch.residual_origin_px, dtype=np.float64)[rows],
            "old": np.asarray(batch.old_origin_px, dtype=np.float64)[rows],
            "prior": np.asarray(batch.origin_prior_px, dtype=np.float64)[rows],  # the offsets' prior centre
            "norm": np.asarray(batch.norm_correction, dtype=np.float64)[rows],
            "power_beyond": np.asarray(batch.power_beyond_current, dtype=np.float64)[rows],
        }
        pre["residual_d"] = cp.asarray(pre["residual"], dtype=cp.float32)
        self._tick("upload", tic)
        # blocks of significant coarse samples (particle, class, orientation, translation and the orientation's
        # log prior), per particle in order (as numpy's nonzero), kept on the device
        if local is None:
            b_idx, k_idx, o_idx, t_idx, olp, per_particle, n_sig = self._coarse_pass(pre)
        else:
            b_idx, k_idx, o_idx, t_idx, olp, per_particle, n_sig = self._local_coarse_pass(pre, local)
        if self.arena is not None:
            # the coarse pass's weights are released but lie under these blocks on the arena's stack: the blocks go
            # to the host and back, so that the fine pass has that memory (broad posteriors need it there)
            tic = time.perf_counter()
            host = [cp.asnumpy(a) for a in (b_idx, k_idx, o_idx, t_idx, olp)]
            del b_idx, k_idx, o_idx, t_idx, olp
            b_idx, k_idx, o_idx, t_idx, olp = (cp.asarray(a) for a in host)
            del host
            self._tick("weights", tic)
        # the fine pass in groups of particles so that memory stays bounded however broad the weights
        results, blocks = [], []
        starts = np.r_[0, np.cumsum(per_particle)]
        for group in groups_by_size(per_particle * self.children, self.plan.fine_samples_per_group):
            sel = slice(int(starts[group[0]]), int(starts[group[-1] + 1]))
            sub = {name: (value[group] if name not in ("x", "x_nomask", "ctf", "optics_d", "residual_d")
                          else value[int(group[0]):int(group[-1]) + 1]) for name, value in pre.items()}
            results.append(self._fine_pass(sub, b_idx[sel] - int(group[0]), k_idx[sel], o_idx[sel], t_idx[sel],
                                           olp[sel]))
            blocks.extend(self.last_blocks)
        self.last_blocks = blocks
        merged = {name: np.concatenate([r[name] for r in results]) for name in results[0]}
        merged["n_significant"] = n_sig
        return merged

    # ------------------------------------------------------------------ coarse pass
    def _coarse_pass(self, pre):
        """A global search: diff2 of all coarse samples, weights and significance. Returns the significant
        samples (`_significant_blocks`) and their counts."""
        from cryorefine.gpu.allocator import Scope

        cp = self.cp
        s = self.setup_
        tic = time.perf_counter()
        b_count = pre["x"].shape[0]
        kc = self.coarse.positions.size
        sel = cp.asarray(self.coarse_sel)
        x_c = pre["x"][:, sel]
        ctf_c = pre["ctf"][:, sel]
        minv_c = self.minv_coarse[pre["optics_d"]]
        n_t = self.n_trans
        m = b_count * n_t
        lda = round_up(m, GEMM_BM)
        kd = round_up(2 * kc, GEMM_BK)
        kp = round_up(kc, GEMM_BK)
        if s.do_cc:
            scale_a = ctf_c
            pair_a = ctf_c * ctf_c
            row_term = cp.sqrt(cp.maximum(cp.sum(x_c.real ** 2 + x_c.imag ** 2, axis=1), 1e-30)).astype(cp.float32)
            mode = 1
        else:
            scale_a = minv_c * ctf_c
            pair_a = 0.5 * minv_c * ctf_c * ctf_c
            row_term = (0.5 * cp.sum(minv_c * (x_c.real ** 2 + x_c.imag ** 2), axis=1)).astype(cp.float32)
            mode = 0
        a_mat = cp.zeros((kd, lda), dtype=cp.float32)
        module = self._module()
        module.get_function("shift_images_planar")(
            ((m + 127) // 128, min(kc, MAX_GRID_Y)), (128,),
            (x_c, scale_a.astype(cp.float32), self.kx_c, self.ky_c, pre["residual_d"], self.trans_d,
             _i32(b_count), _i32(n_t), _i32(kc), _f32(2.0 / s.ori_size_px), _i32(lda), a_mat))
        ldp = round_up(b_count, GEMM_BM)
        pair_mat = cp.zeros((kp, ldp), dtype=cp.float32)
        pair_mat[:kc, :b_count] = pair_a.T
        tic = self._tick("coarse_images", tic)
        n_sel = self.n_orient
        diff2 = cp.empty((b_count, self.n_classes * n_sel * n_t), dtype=cp.float32)
        gemm = module.get_function(self.coarse_kernel)
        gemm_shared = coarse_shared_bytes(self.coarse_kernel)
        # (classes, orientations) of each product: the cached groups of classes with all their orientations, or
        # each class's orientations in chunks, projected as they come
        products = ([(k0, k1, 0, n_sel) for k0, k1, _, _ in self.coarse_cache] if self.coarse_cache is not None
                    else [(k, k + 1, start, min(n_sel, start + self.plan.orientations_per_chunk))
                          for k in range(self.n_classes)
                          for start in range(0, n_sel, self.plan.orientations_per_chunk)])
        for i, (k, end, start, stop) in enumerate(products):
            with self._scope(Scope.ORIENTATION):
                if self.coarse_cache is not None:
                    _, _, b_mat, p2_mat = self.coarse_cache[i]
                else:
                    b_mat, p2_mat, _ = self._project_planar(k, np.arange(start, stop))
                nc = (stop - start) * (end - k)  # columns: class-major within the product
                ldb = b_mat.shape[1]
                pair = cp.empty((b_count, nc), dtype=cp.float32)
                grid = (ldb // GEMM_BN, ldp // GEMM_BM)
                gemm(grid, (GEMM_THREADS,), (pair_mat, p2_mat, _i32(ldp), _i32(ldb), _i32(kp), _i32(b_count),
                                             _i32(nc), _i32(1), row_term, pair, _i32(2), _i32(nc), _i32(0), pair),
                     shared_mem=gemm_shared)
                grid = (ldb // GEMM_BN, lda // GEMM_BM)
                gemm(grid, (GEMM_THREADS,), (a_mat, b_mat, _i32(lda), _i32(ldb), _i32(kd), _i32(m), _i32(nc),
                                             _i32(n_t), row_term, pair, _i32(mode), _i32(self.n_classes * n_sel),
                                             _i32(k * n_sel + start), diff2), shared_mem=gemm_shared)
                self.stage_flops["coarse"] += 2.0 * m * nc * 2 * kc + 2.0 * b_count * nc * kc
        del a_mat, pair_mat
        tic = self._tick("coarse", tic)
        if self.keep_blocks:
            self.last_coarse_diff2.append(cp.asnumpy(diff2))

        # weights: priors + (min diff2 − diff2), exponentiated; CC keeps the best sample alone
        # the priors of orientations and classes and those of the offsets broadcast over (B, K, R, T) in one
        # pass with diff2 (no (B, K·R·T) prior array spelt out): (prior_orientation + prior_offset) − diff2
        orientation, orientation_prior = cp.arange(n_sel)[None, :], cp.zeros((1, n_sel))  # all, flat
        prior_ko, prior_t = self._coarse_log_prior(pre, orientation, orientation_prior)
        d2 = diff2.reshape(b_count, self.n_classes, n_sel, n_t)
        del diff2
        return self._significant_blocks(d2, prior_ko, prior_t, orientation, orientation_prior, tic)

    def _significant_blocks(self, d2, prior_ko, prior_t, orientation, orientation_prior, tic):
        """Weights and significance of coarse diff2 (B, K, R, T) under priors that broadcast to it, R the
        columns of `orientation` (global indices, (B or 1, R)) whose log priors are `orientation_prior`.
        Returns the significant samples as device arrays of particle, class, orientation, translation
        and orientation log prior, by particle then (class, column, translation), their count per
        particle and the count of significant samples per particle (host)."""
        cp = self.cp
        s = self.setup_
        b_count, _, n_sel, n_t = d2.shape
        if s.do_cc:
            # one sample per particle, the best allowed one (the first, or sample 0 where none is allowed): what
            # `significant_samples` keeps of one-hot weights whatever the fraction
            allowed = cp.isfinite(prior_ko) & cp.isfinite(prior_t)
            flat_idx = cp.argmin(cp.where(allowed, d2, cp.inf).reshape(b_count, -1), axis=1)
            del allowed, d2, prior_ko, prior_t
            b_idx = cp.arange(b_count, dtype=cp.int64)
            per_particle = np.ones(b_count, dtype=np.int64)
            n_sig = cp.ones(b_count, dtype=cp.int64)
        else:
            b_idx, flat_idx, per_particle, n_sig = coarse_significant(cp, d2, prior_ko, prior_t, s.adaptive_fraction,
                                                                      significants_limit(s), self.device_id,
                                                                      self.ref_dim)
            del d2, prior_ko, prior_t
        t_idx = flat_idx % n_t
        rest = flat_idx // n_t
        col = rest % n_sel
        k_idx = rest // n_sel
        row = b_idx if orientation.shape[0] > 1 else cp.zeros_like(b_idx)
        o_idx, olp = orientation[row, col], orientation_prior[row, col]
        self._tick("weights", tic)
        return b_idx, k_idx, o_idx, t_idx, olp, per_particle, cp.asnumpy(n_sig).astype(np.int64)

    def _coarse_log_prior(self, pre, orientation, orientation_prior):
        """Log priors of the coarse samples as two broadcasting parts: classes and orientations (`orientation`,
        (B or 1, R) global indices with log priors `orientation_prior`), and offsets."""
        cp = self.cp
        s = self.setup_
        lp = self.log_pdf_class[None, :, None, None] + cp.asarray(orientation_prior)[:, None, :, None]
        if self.log_pdf_direction is not None:
            lp = lp + self.log_pdf_direction[:, orientation // self.n_psi].transpose(1, 0, 2)[..., None]
        # centred on the particles' priors in local searches as in global ones (RELION's), not on the previous offsets
        off = offset_log_prior(self.translations, pre["old"], s.sigma_offset_px, pre["prior"],
                               translation_scale=s.offset_prior_translation_scale)  # (B, T)
        return lp, cp.asarray(off)[:, None, None, :]  # (B or 1, K, R, 1) and (B, 1, 1, T), float64

    def _local_coarse_pass(self, pre, local):
        """A local search: each particle against its own orientations (`local`, padded to the widest; the
        padding has log prior −inf), as `_coarse_pass` returns them. diff2 as the numpy engine's
        `_diff2_dense`: a + ½Σ minv·CTF²|P|² − Re Σ (minv·CTF·X_t)·conj(P), with X_t the image moved
        by translation t, in one launch per class of the `local_tile` kernel, which projects the slices P itself
        (each particle in its own tiles, `local_tiles`: the padding is neither projected nor compared)."""
        cp = self.cp
        s = self.setup_
        tic = time.perf_counter()
        b_count = pre["x"].shape[0]
        orientation, orientation_prior = local.padded(xp=cp)
        width = orientation.shape[1]
        sel = cp.asarray(self.coarse_sel)
        x_c = pre["x"][:, sel]
        ctf_c = pre["ctf"][:, sel]
        minv_c = self.minv_coarse[pre["optics_d"]]
        n_t, kc = self.n_trans, self.coarse.positions.size
        if s.do_cc:
            scale_a, pair_a = ctf_c, ctf_c * ctf_c
            row_term = cp.sqrt(cp.maximum(cp.sum(x_c.real ** 2 + x_c.imag ** 2, axis=1, dtype=cp.float64), 1e-300))
        else:
            scale_a, pair_a = minv_c * ctf_c, 0.5 * minv_c * ctf_c * ctf_c
            row_term = 0.5 * cp.sum(minv_c.astype(cp.float64) * (x_c.real ** 2 + x_c.imag ** 2), axis=1)
        x_s = cp.ascontiguousarray(x_c * scale_a, dtype=cp.complex64)
        shifts = cp.asarray(pre["residual"])[:, None, :] + cp.asarray(self.translations)[None, :, :]  # (B, T, 2)
        shifts = cp.ascontiguousarray(shifts, dtype=cp.float64)
        # the moved images coefficient-major, translations padded to the kernel's tile: (B, Kc, ldt)
        tile_r, tile_t, name = local_tile(n_t)
        ldt = round_up(n_t, tile_t)
        moved = cp.empty((b_count, kc, ldt), dtype=cp.complex64)
        module = self._module()
        for b0 in range(0, b_count, MAX_GRID_Y):  # a particle a grid row, in parts of the grid's y limit
            b1 = min(b0 + MAX_GRID_Y, b_count)
            module.get_function("local_shift_images")(
                ((kc * ldt + 255) // 256, b1 - b0), (256,),
                (x_s[b0:b1], shifts[b0:b1], self.kx_c, self.ky_c, np.float64(-2.0 * np.pi / s.ori_size_px), _i32(n_t),
                 _i32(ldt), _i32(kc), moved[b0:b1]))
        pair_a = cp.ascontiguousarray(pair_a, dtype=cp.float32)
        row_term = cp.ascontiguousarray(row_term, dtype=cp.float64)
        del x_s, shifts
        mats = s.sampling.orientation_matrices(cp, orientation.reshape(-1), self.directions_d)
        mats = mats.reshape(-1, 9).astype(cp.float32)
        tic = self._tick("coarse_images", tic)
        # each particle's own tiles; the padding rows stay 0 (finite, under their −inf log prior)
        counts = local.counts()
        tiles = local_tiles(counts, tile_r, xp=cp)
        diff2 = cp.zeros((b_count, self.n_classes, width, n_t), dtype=cp.float32)
        kernel = module.get_function(name)
        grid = (int(tiles[0].size), ldt // tile_t, 1)
        n_orient = int(counts.sum())
        for k in range(self.n_classes):
            kernel(grid, (LOCAL_THREADS,),
                   (self.ref_volumes[k], *self.geometry, mats, *tiles, self.kx_c, self.ky_c, _i32(kc), moved,
                    _i32(ldt), pair_a, row_term, _i32(width), _i32(n_t), _i32(1 if s.do_cc else 0),
                    _i32(self.n_classes), _i32(k), diff2))
            self.stage_flops["coarse"] += 2.0 * n_orient * n_t * 2 * kc + 2.0 * n_orient * kc
        del moved
        tic = self._tick("coarse", tic)
        if self.keep_blocks:
            self.last_coarse_diff2.append(cp.asnumpy(diff2))
        prior_ko, prior_t = self._coarse_log_prior(pre, orientation, orientation_prior)
        return self._significant_blocks(diff2, prior_ko, prior_t, orientation, orientation_prior, tic)

    # ------------------------------------------------------------------ fine pass
    def _fine_pass(self, pre, b_blk, k_blk, o_blk, t_blk, olp_blk):
        """Fine samples of the significant blocks (device arrays, sorted by particle; `olp_blk` the log prior
        of each block's orientation), weights, sums, results."""
        from cryorefine.gpu.allocator import Scope

        cp = self.cp
        s = self.setup_
        tic = time.perf_counter()
        b_count = pre["x"].shape[0]
        n_blocks = int(b_blk.size)
        nfo, nft, nf = self.n_fo, self.n_ft, self.children
        unique_o_d, u_blk = cp.unique(o_blk, return_inverse=True)
        u_blk = u_blk.reshape(-1)
        unique_o = cp.asnumpy(unique_o_d)
        angles, angle_rows, fine_mats_d = self._fine_orientations(unique_o, unique_o_d)
        blk = {"b": b_blk.astype(cp.int32), "k": k_blk.astype(cp.int32), "u": u_blk.astype(cp.int32),
               "t": t_blk.astype(cp.int32)}
        n_coef = self.fine.positions.size
        name, tiles, group_blocks = fine_diff2_launch(nfo, nft, s.do_cc, self.compute_capability)
        fn = self._module(fine_kernel_names(nfo, nft)).get_function(name)
        x_norm2 = cp.sum(pre["x"].real ** 2 + pre["x"].imag ** 2, axis=1).astype(cp.float32)
        diff2 = cp.empty((n_blocks, nf), dtype=cp.float64)
        self.stage_flops["fine"] += 8.0 * n_blocks * nf * n_coef
        pairs = _PairGroups(cp, blk["k"], blk["u"], unique_o.size, nfo)
        geometry = (self.ref_volumes, *self.geometry, self.class_stride, fine_mats_d)
        tail = (self.fine_trans_d, pre["x"], pre["ctf"], self.minv_fine, pre["optics_d"], pre["residual_d"], x_norm2,
                self.kx_f, self.ky_f, _i32(n_coef), _f32(2.0 / s.ori_size_px), diff2)

        def launch(index, slices=_NULL, row0=None):
            """fine diff2 of the blocks `index` (all, in order, if None), each block's first slice row `row0`"""
            if group_blocks:  # blocks of one particle, class and coarse orientation together (`fine_groups`)
                key = (blk["b"].astype(cp.int64) * self.n_classes + blk["k"]) * unique_o.size + blk["u"]
                order, first = fine_groups(key if index is None else key[index], group_blocks, xp=cp)
                index, row0 = (order if index is None else index[order]), (None if row0 is None else row0[order])
                grid, extra = int(first.size) - 1, (first,)
            else:
                grid, extra = (n_blocks if index is None else int(index.size)), ()
            if not grid:
                return
            chosen = (blk[a] if index is None else blk[a][index] for a in "bkut")
            fn((grid, tiles), (FINE_THREADS,),
               (*geometry, slices, _NULL if row0 is None else row0,
                _NULL if index is None else index.astype(cp.int32), *chosen, *tail, *extra))

        tic = self._tick("fine_setup", tic)  # the blocks' orientations, matrices and (class, orientation) pairs
        if not pairs.project_once:
            launch(None)
            tic = self._tick("fine", tic)
        else:
            per_chunk = self._pairs_per_chunk(SLICE_BYTES_PER_COEF)
            for first in range(0, pairs.n_pairs, per_chunk):
                with self._scope(Scope.ORIENTATION):
                    in_chunk, chunk_pairs, row0 = pairs.chunk(first, per_chunk)
                    slices = self._project_pairs(chunk_pairs, pairs.n_unique,
                                                 self._pair_matrices(chunk_pairs, pairs.n_unique, fine_mats_d))
                    tic = self._tick("fine_slices", tic)
                    launch(in_chunk, slices, row0)
                    tic = self._tick("fine", tic)
                    del slices, in_chunk, row0
        # priors of every child: class, parent orientation (and direction), child offset
        parent = self.log_pdf_class[k_blk] + olp_blk
        if self.log_pdf_direction is not None:
            parent = parent + self.log_pdf_direction[k_blk, o_blk // self.n_psi]
        # |offset − prior centre|² of the children (the σ_offset sums) and of their coarse translation, whose offset
        # prior each child has (RELION computes pdf_offset at the coarse sampling only)
        from_centre = cp.asarray(pre["old"] - pre["prior"])[b_blk]  # (n_blocks, 2)
        off = from_centre[:, None, :] + self.fine_trans_d64[t_blk]  # (n_blocks, nft, 2)
        d2_off = cp.sum(off * off, axis=2)  # (n_blocks, nft)
        off = from_centre + s.offset_prior_translation_scale * cp.asarray(self.translations)[t_blk]  # (n_blocks, 2)
        off_prior = -cp.sum(off * off, axis=1) / (2.0 * max(s.sigma_offset_px, 1e-6) ** 2)  # (n_blocks,)
        del off, from_centre
        prior = cp.broadcast_to((parent + off_prior)[:, None, None], (n_blocks, nfo, nft)).reshape(-1)
        del parent, off_prior
        d2 = diff2.reshape(-1)
        b_of = cp.repeat(blk["b"], nf)
        starts = cp.searchsorted(b_blk, cp.arange(b_count + 1)).astype(cp.int64) * nf
        score = cp.where(cp.isfinite(prior), d2, cp.inf)
        min_d2, arg_min = self._segment(score, starts, 0)
        del score
        if s.do_cc:
            w = cp.zeros_like(d2)
            valid = arg_min < d2.size
            w[arg_min[valid]] = 1.0
            sum_w = cp.ones(b_count)
            top = cp.zeros(b_count)
        else:
            log_w = prior - (d2 - min_d2[b_of])
            top, _ = self._segment(log_w, starts, 1)
            w = cp.exp(log_w - top[b_of])
            del log_w
            sum_w, _ = self._segment(w, starts, 2)
        del prior
        kept = self._significant_samples(w, b_of, starts, b_count)
        w_norm = cp.where(kept, w / sum_w[b_of], 0.0)
        del w, kept, b_of
        pmax, best = self._segment(w_norm, starts, 1)
        tic = self._tick("fine_weights", tic)

        if self.keep_blocks:
            hb, hk, ho, ht = (cp.asnumpy(a) for a in (b_blk, k_blk, o_blk, t_blk))
            wn = cp.asnumpy(w_norm).reshape(n_blocks, nf)
            coarse_index = (hk * self.n_orient + ho) * self.n_trans + ht
            self.last_fine.append((hb, hk, ho, ht, cp.asnumpy(diff2)))
            self.last_blocks = [FineBlocks(coarse_index[hb == b], wn[hb == b]) for b in range(b_count)]
        else:
            self.last_blocks = []
        del diff2

        new_norm = self._weighted_sums(pre, w_norm, blk, k_blk, o_blk, pairs, fine_mats_d, d2_off, tic)
        tic = time.perf_counter()
        best = cp.asnumpy(best)
        bb, f = best // nf, best % nf
        io, it = f // nft, f % nft
        u_best, t_best, k_best = (cp.asnumpy(a[cp.asarray(bb)]) for a in (u_blk, t_blk, k_blk))
        origin = pre["old"] + self.fine_translations[t_best, it]
        min_d2 = cp.asnumpy(min_d2)
        if s.do_cc:
            log_likelihood = -min_d2
        else:
            log_likelihood = (np.log(cp.asnumpy(sum_w)) + cp.asnumpy(top) - min_d2
                              - self.logsigma2[pre["optics"]])
        # the best children's angles (a local search keeps its children on the device)
        if isinstance(angles, cp.ndarray):
            best_angles = cp.asnumpy(angles[cp.asarray(u_best), cp.asarray(io)])
        else:
            best_angles = angles[angle_rows[u_best], io]
        rot, tilt, psi = best_angles[:, 0], best_angles[:, 1], best_angles[:, 2]
        result = {"rot_deg": rot, "tilt_deg": tilt,
                  "psi_deg": psi, "origin_x_px": origin[:, 0], "origin_y_px": origin[:, 1],
                  "class_index": k_best.astype(np.int64), "pmax": cp.asnumpy(pmax), "log_likelihood": log_likelihood,
                  "norm_correction": new_norm}
        self.stage_seconds["results"] += time.perf_counter() - tic
        return result

    def _fine_orientations(self, orientations, orientations_d):
        """The children of coarse orientations (sorted, unique; on the host and the device): their angles as
        (table, rows), child io of orientations[u] at table[rows[u], io] (rows None: at table[u, io]), and their
        matrices (U·NFO, 9) float32 on the device.

        A global search meets the same coarse orientations in every batch: their children are computed once per
        iteration on the host, each into its row of a table of the whole grid as a batch first meets it, the
        matrices into the same row of a table on the device where it fits (no batch copies, re-sorts or uploads a
        table; rows never met are never computed; a table too large for the device stays on the host, and each
        batch uploads its own rows). A local search's neighbourhoods move with the particles, so a batch's children
        are computed for it alone (keeping them would copy a growing table in every batch), on the device but for
        the HEALPix directions (healpy): the angles' table is then a device array (U, NFO, 3)."""
        cp = self.cp
        if self.setup_.local_searches:
            rot, tilt, psi, matrices = self.setup_.sampling.fine_orientations(orientations, xp=cp)
            return cp.stack([rot, tilt, psi], axis=-1), None, matrices.reshape(-1, 9).astype(cp.float32)
        missing = orientations[~self._fine_known[orientations]]
        if missing.size:
            rot, tilt, psi, matrices = self.setup_.sampling.fine_orientations(missing)
            self._fine_angles[missing] = np.stack([rot, tilt, psi], axis=-1)
            matrices = matrices.reshape(missing.size, self.n_fo, 9).astype(np.float32)
            if isinstance(self._fine_matrices, np.ndarray):
                self._fine_matrices[missing] = matrices
            else:
                self._fine_matrices[cp.asarray(missing)] = cp.asarray(matrices)
            self._fine_known[missing] = True
        if isinstance(self._fine_matrices, np.ndarray):  # a table too large for the device: this batch's rows
            return self._fine_angles, orientations, cp.asarray(self._fine_matrices[orientations].reshape(-1, 9))
        return self._fine_angles, orientations, self._fine_matrices[orientations_d].reshape(-1, 9)

    def _segment(self, values, starts, op):
        """Per-segment min (op 0), max (1) or sum (2) of float64 `values`, and the first arg of the extreme."""
        cp = self.cp
        n_seg = starts.size - 1
        out = cp.empty(n_seg, dtype=cp.float64)
        arg = cp.empty(n_seg, dtype=cp.int64)
        if n_seg:
            self._module().get_function("segment_reduce")(
                (n_seg,), (SEG_THREADS,), (cp.ascontiguousarray(values, dtype=cp.float64), starts, _i32(op), out,
                                           arg))
        return out, arg

    def _significant_samples(self, w, b_of, starts, b_count):
        """Per particle, the fewest fine samples holding adaptive_fraction of the mass (as the numpy twin)."""
        cp = self.cp
        frac = self.setup_.adaptive_fraction
        key = b_of.astype(cp.float64) * 4.0 + (1.0 - w)  # particle ascending, weight descending
        order = cp.argsort(key)
        wb = w[order]
        total, _ = self._segment(w, starts, 2)
        cum = cp.cumsum(wb)
        before = cp.where(starts[:-1] > 0, cum[cp.maximum(starts[:-1] - 1, 0)], 0.0)
        cum_in = cum - before[b_of]  # b_of is sorted, so b_of equals the particle of wb's positions
        not_over = (cum_in < frac * total[b_of]).astype(cp.float64)
        count, _ = self._segment(not_over, starts, 2)
        pos = starts[:-1] + count.astype(cp.int64)
        has = pos < starts[1:]
        threshold = cp.where(has, wb[cp.minimum(pos, max(wb.size - 1, 0))], 0.0)
        return significant_mask(w, threshold[b_of])

    # ------------------------------------------------------------------ fine slices, pair by pair
    def _pairs_per_chunk(self, bytes_per_coef):
        """(Class, coarse orientation) pairs per chunk of the fine pass when each of a pair's NFO slice rows takes
        `bytes_per_coef` per coefficient: in at most half of what is free, and no more rows than the plan's (the
        plan assumed the batch's other buffers kept to their share, which broad posteriors overrun)."""
        rows_free = int(0.5 * self._free_bytes()) // (bytes_per_coef * self.fine.positions.size)
        return max(1, min(self.plan.slice_rows_per_chunk, rows_free) // self.n_fo)

    def _pair_matrices(self, chunk_pairs, n_unique, fine_mats_d):
        """(pairs·NFO, 9) float32 on the device: the child matrices of each (class, coarse orientation) pair of
        `chunk_pairs` (host, pair = class·n_unique + unique orientation), in the pairs' slice rows."""
        return fine_mats_d.reshape(-1, self.n_fo, 9)[self.cp.asarray(chunk_pairs % n_unique)].reshape(-1, 9)

    def _project_pairs(self, chunk_pairs, n_unique, mats):
        """(pairs·NFO, Kf) complex64: the NFO fine slices of each (class, coarse orientation) pair of `chunk_pairs`
        (host, sorted, pair = class·n_unique + unique orientation), pair by pair, projected once for all its blocks,
        every class's in one launch; `mats` their rows' matrices (`_pair_matrices`)."""
        cp = self.cp
        nfo, n_coef = self.n_fo, self.fine.positions.size
        n_rows = chunk_pairs.size * nfo
        row_class = cp.asarray(np.repeat(chunk_pairs // n_unique, nfo), dtype=cp.int32)
        out = cp.empty((n_rows, n_coef), dtype=cp.complex64)
        if n_rows:
            self._module().get_function("project_slices_of_classes")(
                ((n_coef + 127) // 128, min(n_rows, MAX_GRID_Y)), (128,),
                (self.ref_volumes, *self.geometry, self.class_stride, row_class, mats, self.kx_f, self.ky_f,
                 _i32(n_coef), _i32(n_rows), out))
        return out

    # ------------------------------------------------------------------ weighted sums
    def _weighted_sums(self, pre, w_norm, blk, k_blk, o_blk, pairs, fine_mats_d, d2_off, tic):
        """Noise, scale, slices (then back-projected), offsets, class and direction sums of the kept children."""
        from cryorefine.gpu.allocator import Scope

        cp = self.cp
        s = self.setup_
        sums = self.sums_
        b_count = pre["x"].shape[0]
        nfo, nft, nf = self.n_fo, self.n_ft, self.children
        n_coef = self.fine.positions.size
        n_shells = self.n_shells
        noise = cp.zeros((b_count, n_shells), dtype=cp.float64)
        xa = cp.zeros(b_count, dtype=cp.float64)
        aa = cp.zeros(b_count, dtype=cp.float64)
        w_blocks = w_norm.reshape(-1, nf)
        names = fine_kernel_names(nfo, nft)
        fn = self._module(names).get_function(names[2])
        bp_fn = self._module().get_function("backproject_slices")
        # a chunk of (class, coarse orientation) pairs at a time: their slices, and the rows' data and weights
        per_chunk = self._pairs_per_chunk(SLICE_ROW_BYTES_PER_COEF if pairs.project_once
                                          else SLICE_ROW_BYTES_PER_COEF - SLICE_BYTES_PER_COEF)
        for first in range(0, pairs.n_pairs, per_chunk):
            with self._scope(Scope.ORIENTATION):
                in_chunk, chunk_pairs, row0 = pairs.chunk(first, per_chunk)
                row_mats = self._pair_matrices(chunk_pairs, pairs.n_unique, fine_mats_d)
                slices = self._project_pairs(chunk_pairs, pairs.n_unique, row_mats) if pairs.project_once else _NULL
                n_rows = chunk_pairs.size * nfo
                slice_data = cp.zeros((n_rows, n_coef), dtype=cp.complex64)
                slice_weight = cp.zeros((n_rows, n_coef), dtype=cp.float32)
                fn((int(in_chunk.size), fine_tiles(nfo, nft)), (FINE_THREADS,),
                   (self.ref_volumes, *self.geometry, self.class_stride, fine_mats_d, slices, row0, blk["b"][in_chunk],
                    blk["k"][in_chunk], blk["u"][in_chunk], blk["t"][in_chunk], self.fine_trans_d,
                    pre["x"], pre["x_nomask"], pre["ctf"], self.minv_store, pre["optics_d"], pre["residual_d"],
                    cp.ascontiguousarray(w_blocks[in_chunk]), self.shell_f, _i32(n_shells),
                    self.scale_use if self.scale_use is not None else noise, _i32(self.scale_use is not None),
                    self.kx_f, self.ky_f, _i32(n_coef), _f32(2.0 / s.ori_size_px), slice_data, slice_weight, noise,
                    xa, aa),
                   shared_mem=4 * n_shells)
                del slices
                tic = self._tick("sums", tic)
                row_class = np.repeat(chunk_pairs // pairs.n_unique, nfo)
                # a pair's NFO rows are one group: a coefficient that stays in one voxel cube from child to child
                # goes to memory once
                bp_fn(((n_coef + 127) // 128, min(n_rows // nfo, MAX_GRID_Y)), (128,),
                      (slice_data, slice_weight, row_mats, cp.asarray(row_class, dtype=cp.int32), _i32(n_rows),
                       _i32(nfo), self.kx_f, self.ky_f, _i32(n_coef),
                       *self.bp_geometry, np.int64(self.bp_data[0].size), self.bp_data.view(cp.float32),
                       self.bp_weight))
                del slice_data, slice_weight, row_mats, in_chunk, row0
                tic = self._tick("backproject", tic)
        optics = pre["optics"]
        noise_h = cp.asnumpy(noise)
        beyond = pre["power_beyond"][:, :n_shells]
        add_rows_at(sums.sigma2_noise, optics, noise_h + beyond)
        wdiff_total = noise_h.sum(axis=1) + beyond.sum(axis=1)
        sums.sumw_group += np.bincount(optics, minlength=sums.sumw_group.size)
        if self.scale_use is not None:
            groups = pre["group"]
            scale = self.scale[groups]
            sums.scale_xa += np.bincount(groups, weights=cp.asnumpy(xa) / scale, minlength=sums.scale_xa.size)
            sums.scale_aa += np.bincount(groups, weights=cp.asnumpy(aa) / scale ** 2, minlength=sums.scale_aa.size)
        w3 = w_blocks.reshape(-1, nfo, nft)
        sums.sigma2_offset_angstrom2 += float(cp.sum(w3 * d2_off[:, None, :])) * s.pixel_size_angstrom ** 2
        w_per_block = w3.sum(axis=(1, 2))
        # class and direction sums stay on the device until the half ends (`sums`): the direction table has the
        # grid's directions (786,432 at order 8), too many to copy for every batch
        cp.add.at(self.pdf_class_d, k_blk, w_per_block)
        n_dir = self.pdf_direction_d.shape[1]
        cp.add.at(self.pdf_direction_d.reshape(-1), k_blk * n_dir + o_blk // self.n_psi, w_per_block)
        new_norm = pre["norm"] / s.avg_norm_correction * np.sqrt(2.0 * wdiff_total)
        sums.norm_correction += float(new_norm.sum())
        self._tick("sums", tic)
        return new_norm

    def sums(self) -> WeightedSums:
        """The accumulated sums; the references and cached slices are let go (their memory returns)."""
        self.ref_volumes = None
        self.coarse_cache = None
        if self.pdf_class_d is not None:
            self.sums_.pdf_class += self.cp.asnumpy(self.pdf_class_d)
            self.sums_.pdf_direction += self.cp.asnumpy(self.pdf_direction_d).reshape(self.sums_.pdf_direction.shape)
            self.pdf_class_d = self.pdf_direction_d = None
        return self.sums_
