"""The GPU engine's batch and chunk sizes, chosen from the free device memory (pure arithmetic).

`CupyEngine.setup` plans every iteration with `plan_batches`; `cryorefine plan` (jobs.plan) predicts a
run's device memory with the same functions. Importing this module imports neither CuPy nor the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from cryorefine.estep.common import FINE_SAMPLES_PER_PARTICLE
from cryorefine.estep.kernels import GEMM_BK, GEMM_BN, local_tile, round_up

# fine samples (children) per group of particles, at most (≈ 5.4 GB): broad posteriors (Class3D's early iterations) meet
# most (class, orientation) pairs in every group, so a group's fixed work (projecting and back-projecting the pairs'
# slices, the per-particle reductions) falls with its size; 1 << 22 made the iteration at pmax 0.22 of the Class3D
# stand-in 1.8× slower (benchmarks/README.md). A group holds at least one particle, whose fine samples the coarse pass
# keeps within the same number (common.fine_pass_limit).
FINE_SAMPLES_PER_GROUP_MAX = FINE_SAMPLES_PER_PARTICLE
FINE_SAMPLE_BYTES = 160  # device bytes per fine sample at the fine pass's peak
# a fine slice row of a (class, coarse orientation) pair, bytes per coefficient: its projection (complex64) while the
# fine diff2 reads it; projection, data (complex64) and weight (float32) while the weighted sums fill the row
SLICE_BYTES_PER_COEF = 8
SLICE_ROW_BYTES_PER_COEF = SLICE_BYTES_PER_COEF + 12
# a (class, coarse orientation) pair's slices are projected once for its blocks when a group of the fine pass has at
# least this many blocks per pair on average (each block projects its own otherwise)
FINE_BLOCKS_PER_PAIR_PROJECTED_ONCE = 2


@dataclass(frozen=True)
class BatchPlan:
    """Sizes of one iteration's device work, chosen from the free device memory."""

    particles_per_batch: int  # particles per sub-batch on the device
    orientations_per_chunk: int  # coarse orientations projected and compared at once
    cache_coarse_slices: bool  # the coarse slices of all orientations kept for the iteration
    fine_samples_per_group: int  # fine samples (children) per group of particles
    slice_rows_per_chunk: int  # fine slice rows (projections, data and weights) of one chunk of the fine pass

    def describe(self) -> str:
        return (f"{self.particles_per_batch} particles per batch, {self.orientations_per_chunk} orientations "
                f"per chunk{' (coarse slices cached)' if self.cache_coarse_slices else ''}, "
                f"{self.fine_samples_per_group} fine samples per group, {self.slice_rows_per_chunk} slices "
                f"per back-projection")


def per_particle_bytes(n_coarse_coef: int, n_fine_coef: int, n_orientations: int, n_translations: int,
                       n_classes: int) -> int:
    """Device bytes one particle of a sub-batch takes: shifted images 2·Kc·T·4, coarse weights
    36·K·R·T (diff2 float32, and where every sample is a candidate its packed candidates, weight float64
    and index int32, their sorted copy and cumulative sums float64: `estep.cuda.coarse_significant`), its
    images, CTF and their uploaded half transforms about 120·Kf, fine-pass tables about 24·Kf."""
    return (2 * n_coarse_coef * n_translations * 4 + 36 * n_classes * n_orientations * n_translations
            + 144 * n_fine_coef)


def local_per_particle_bytes(n_coarse_coef: int, n_fine_coef: int, n_orientations: int, n_translations: int,
                             n_classes: int) -> int:
    """Device bytes one particle of a local search's sub-batch takes: its images moved by every
    translation 8·Kc·T (complex, T padded to local_diff2's tile, `local_tile`), their coarse gathers about 32·Kc,
    the coarse weights 36·K·R·T as in a global search, and its images about 144·Kf. Its slices are
    projected inside the kernel and take no device memory."""
    return (8 * n_coarse_coef * round_up(n_translations, local_tile(n_translations)[1]) + 32 * n_coarse_coef
            + 36 * n_classes * n_orientations * n_translations + 144 * n_fine_coef)


def plan_batches(free_bytes: float, n_coarse_coef: int, n_fine_coef: int, n_orientations: int, n_translations: int,
                 n_classes: int, batch_size: int, children_per_block: int, local: bool = False) -> BatchPlan:
    """Batch and chunk sizes that keep the E-step of one batch within `free_bytes`.

    The dominant buffers, in bytes: the coarse slices 3·Kc·4 per orientation; per particle
    the shifted images 2·Kc·T·4 and the coarse weights 36·K·R·T (`per_particle_bytes`); per fine
    sample about FINE_SAMPLE_BYTES; per slice row SLICE_ROW_BYTES_PER_COEF·Kf (projection, data and
    weight). A quarter of the space goes to cached slices when they fit.
    In a local search (`local`) R is one particle's neighbourhood (its widest in a batch), its slices
    are projected inside the diff2 kernel (`local_per_particle_bytes`) and nothing is cached.
    """
    free = max(int(free_bytes), 1 << 20)
    kc, kf = int(n_coarse_coef), int(n_fine_coef)
    slice_bytes = 3 * round_up(2 * kc, GEMM_BK) * 4 // 2
    all_slices = 0 if local else slice_bytes * n_orientations * n_classes
    cache = not local and all_slices <= free // 4
    budget = free - (all_slices if cache else 0)
    chunk = n_orientations if cache else max(GEMM_BN, min(n_orientations, (budget // 8) // max(slice_bytes, 1)))
    chunk = min(chunk, n_orientations)
    per_particle = (local_per_particle_bytes if local else per_particle_bytes)(kc, kf, n_orientations, n_translations,
                                                                               n_classes)
    particles = max(1, min(batch_size, (budget // 2) // max(per_particle, 1)))
    # FINE_SAMPLE_BYTES per fine sample at peak; at most FINE_SAMPLES_PER_GROUP_MAX per group
    fine_samples = max(children_per_block, min(FINE_SAMPLES_PER_GROUP_MAX, (budget // 4) // FINE_SAMPLE_BYTES))
    rows = max(8, min(1 << 16, (budget // 8) // max(SLICE_ROW_BYTES_PER_COEF * kf, 1)))
    return BatchPlan(int(particles), int(chunk), bool(cache), int(fine_samples), int(rows))
