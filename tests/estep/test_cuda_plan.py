"""The GPU engine's batch and chunk sizes, chosen from free device memory (pure arithmetic: runs on the CPU)."""

from cryorefine.estep.cuda_plan import plan_batches


def sizes(free_gb, box=360):
    kc = int(3.1416 * (box / 2) ** 2 / 2)
    return plan_batches(int(free_gb * 2**30), kc, kc, 4608, 21, 1, 1 << 30, 32)


def test_more_memory_gives_larger_batches_and_chunks():
    small, large = sizes(2), sizes(60)
    assert 1 <= small.particles_per_batch < large.particles_per_batch
    assert small.slice_rows_per_chunk <= large.slice_rows_per_chunk
    assert large.cache_coarse_slices and not small.cache_coarse_slices
    assert small.orientations_per_chunk < 4608 and large.orientations_per_chunk == 4608


def test_chosen_sizes_fit_the_budget():
    for free_gb in (1, 4, 16, 64):
        kc = int(3.1416 * 180 ** 2 / 2)
        plan = sizes(free_gb)
        slices = 3 * 2 * kc * 4 // 2 * (4608 if plan.cache_coarse_slices else plan.orientations_per_chunk)
        per_particle = 2 * kc * 21 * 4 + 36 * 4608 * 21 + 144 * kc
        assert slices + plan.particles_per_batch * per_particle <= free_gb * 2**30 or plan.particles_per_batch == 1


def test_small_images_need_little():
    plan = plan_batches(8 * 2**30, 400, 800, 4608, 21, 1, 256, 32)
    assert plan.particles_per_batch == 256  # capped by the requested batch
    assert plan.cache_coarse_slices


def test_a_local_search_plans_from_its_neighbourhood_not_the_grid():
    """Local searches: each particle's moved images and weights (about 178 orientations at any order), nothing
    cached, no slices in memory (local_diff2 projects them in the kernel); the sub-batch fits the budget, and a
    neighbourhood ten times wider takes (nearly) no more room per particle than the moved images do."""
    kc = int(3.1416 * 145 ** 2 / 2)
    free = 16 * 2**30
    plan = plan_batches(free, kc, kc, 178, 29, 1, 1 << 30, 32, local=True)
    assert not plan.cache_coarse_slices
    moved = 8 * kc * 32  # complex, 29 translations padded to the kernel's 32
    per_particle = moved + 36 * 178 * 29 + 144 * kc
    assert plan.particles_per_batch * per_particle <= free // 2
    assert plan.particles_per_batch > 100
    wide = plan_batches(free, kc, kc, 1780, 29, 1, 1 << 30, 32, local=True)
    assert wide.particles_per_batch >= 0.8 * plan.particles_per_batch


def test_a_global_search_s_classes_share_coarse_products_up_to_the_column_limit():
    """`CupyEngine._class_groups` (host arithmetic, no GPU): every class in one product, in order; a 2D
    classification's 100 classes of 30 in-plane rotations in one product, a 3D class of 4,608 orientations alone,
    never more columns than COARSE_COLUMNS_PER_PRODUCT unless one class has more."""
    from types import SimpleNamespace

    from cryorefine.estep.cuda import COARSE_COLUMNS_PER_PRODUCT, CupyEngine

    for n_orient, n_classes, expected in ((30, 100, [(0, 100)]), (4608, 6, [(k, k + 1) for k in range(6)]),
                                          (576, 10, [(0, 7), (7, 10)]), (30, 1, [(0, 1)])):
        groups = CupyEngine._class_groups(SimpleNamespace(n_orient=n_orient, n_classes=n_classes))
        assert groups == expected
        assert [k for k0, k1 in groups for k in range(k0, k1)] == list(range(n_classes))
        assert all((k1 - k0) * n_orient <= max(COARSE_COLUMNS_PER_PRODUCT, n_orient) for k0, k1 in groups)
