"""The auto-refine schedule against RELION's rules, with expected numbers worked out by hand."""

import dataclasses
import math

import numpy as np
import pytest

from cryorefine.config import RefineConfig
from cryorefine.core.symmetry import symmetry_group
from cryorefine.em import schedule as sch
from cryorefine.em.state import ModelState, OptimiserState

BOX = 64
PIXEL = 6.0  # Å; the box is 64·6 = 384 Å
DIAMETER = 300.0


def make_config(**kw):
    base = dict(input_star="p.star", output_root="out/run", reference_map="ref.mrc",
                particle_diameter_angstrom=DIAMETER, healpix_order=2, auto_local_healpix_order=4,
                offset_range_px=6.0, offset_step_px=2.0, oversampling=1, ini_high_angstrom=40.0)
    base.update(kw)
    return RefineConfig(**base)


def fsc_crossing_half_at(shell_half, n=BOX // 2 + 1, width=1.5):
    """A smooth FSC that falls through 0.5 between shells floor(shell_half) and ceil(shell_half)."""
    r = np.arange(n, dtype=np.float64)
    return 1.0 / (1.0 + np.exp((r - shell_half) / width))


# ------------------------------------------------------------------ resolution


def test_resolution_where_half_map_ssnr_drops_below_one():
    fsc = 1.0 - np.arange(BOX // 2 + 1) / 21.0  # 0.5238 at shell 10, 0.4762 at shell 11
    res = sch.current_resolution(BOX, PIXEL, fsc_halves=fsc, check_high_res_side=False)
    # SNR = fsc/(1 − fsc) < 1 first at shell 11; one shell back: 10 -> 384/10 Å
    assert res.shell == 10
    assert res.resolution_angstrom == pytest.approx(38.4)
    assert res.resolution_inv_angstrom == pytest.approx(10 / 384)
    # tau2_fudge 2: 2·fsc/(1 − fsc) < 1 <=> fsc < 1/3 <=> r > 14: first at 15, back to 14
    res2 = sch.current_resolution(BOX, PIXEL, fsc_halves=fsc, tau2_fudge=2.0, check_high_res_side=False)
    assert res2.shell == 14
    # halves joined: sqrt(2f/(f+1)) < 0.5 <=> f < 1/7 ≈ 0.143 <=> r > 18: first at 19, back to 18
    res3 = sch.current_resolution(BOX, PIXEL, fsc_halves=fsc, halves_joined=True, check_high_res_side=False)
    assert res3.shell == 18
    assert res3.resolution_angstrom == pytest.approx(384 / 18)


def test_resolution_from_data_vs_prior_and_classes():
    snr = np.full((2, BOX // 2 + 1), 5.0)
    snr[0, 9:] = 0.5  # class 1: first below 1 at 9 -> shell 8
    snr[1, 13:] = 0.5  # class 2: first below 1 at 13 -> shell 12; the best class wins
    res = sch.current_resolution(BOX, PIXEL, data_vs_prior=snr)
    assert res.shell == 12
    assert res.resolution_angstrom == pytest.approx(32.0)


def test_resolution_takes_high_res_side_after_a_dip_and_respects_minres():
    snr = np.full(BOX // 2 + 1, 0.2)
    snr[:20] = 3.0
    snr[7] = 0.5  # a dip: walking out stops at 7 -> 6; walking in finds SNR > 1 at 19 > 6 + 3
    assert sch.current_resolution(BOX, PIXEL, data_vs_prior=snr).shell == 19
    assert sch.current_resolution(BOX, PIXEL, data_vs_prior=snr, check_high_res_side=False).shell == 6
    snr[8:10] = 0.5  # dip wider but the high side is still > 3 shells further out
    assert sch.current_resolution(BOX, PIXEL, data_vs_prior=snr).shell == 19
    low = np.full(BOX // 2 + 1, 0.1)
    low[:3] = 4.0  # would be shell 2; --minres_map keeps it at 5
    assert sch.current_resolution(BOX, PIXEL, data_vs_prior=low).shell == 5


def test_resolution_from_ini_high_at_start():
    # round(384 / 40) = round(9.6) = 10 shells -> 38.4 Å, whatever the FSC says
    res = sch.current_resolution(BOX, PIXEL, iteration=0, ini_high_angstrom=40.0)
    assert res.shell == 10 and res.resolution_angstrom == pytest.approx(38.4)
    fsc = fsc_crossing_half_at(20.5)
    assert sch.current_resolution(BOX, PIXEL, fsc_halves=fsc, iteration=1, ini_high_angstrom=40.0,
                                  firstiter_cc=True).shell == 10
    assert sch.current_resolution(BOX, PIXEL, fsc_halves=fsc, iteration=1, ini_high_angstrom=40.0).shell == 20
    with pytest.raises(ValueError):
        sch.current_resolution(BOX, PIXEL, iteration=2)


def test_resolution_gain_counter():
    opt = OptimiserState()
    opt = sch.update_resolution_counter(opt, 24.0, 32.0)
    assert opt.nr_iter_wo_resol_gain == 0
    opt = sch.update_resolution_counter(opt, 24.0, 24.0)
    assert opt.nr_iter_wo_resol_gain == 1
    # 1/23.99 − 1/24 = 1.7e-5 < 1e-4: not a gain
    opt = sch.update_resolution_counter(opt, 23.99, 24.0)
    assert opt.nr_iter_wo_resol_gain == 2
    # worse resolution: no gain either
    opt = sch.update_resolution_counter(opt, 30.0, 24.0)
    assert opt.nr_iter_wo_resol_gain == 3
    opt = sch.update_resolution_counter(opt, 20.0, 30.0)
    assert opt.nr_iter_wo_resol_gain == 0
    assert opt.best_resolution_so_far_inv_angstrom == pytest.approx(1 / 20.0)
    opt = sch.update_resolution_counter(opt, 20.0, math.inf)  # from "no resolution yet" is a gain
    assert opt.nr_iter_wo_resol_gain == 0


# ------------------------------------------------------------------ image sizes


def test_image_sizes_worked_example():
    # 64 px at 6 Å/px, diameter 300 Å, resolution 24 Å, incr_size 10:
    #   current: round(384/24) = 16 shells + 10 = 26 -> 52 px
    #   coarse at order 2 (coarse step 360/(6·4) = 15°, before oversampling):
    #     rotated distance = 15/360·π·300 = 39.27 Å; / 1.2 = 32.72 Å; 2·ceil(384/32.72) = 2·ceil(11.73) = 24
    sizes = sch.image_sizes(24.0, 2, DIAMETER, BOX, PIXEL, 10, False, False, ave_pmax=0.5)
    assert sizes == (52, 24)
    #   order 3 (7.5°): 19.63 Å / 1.2 = 16.36 Å; 2·ceil(23.47) = 48
    assert sch.image_sizes(24.0, 3, DIAMETER, BOX, PIXEL, 10, False, False, ave_pmax=0.5) == (52, 48)
    #   order 4 (3.75°): 2·ceil(46.9) = 94 > current -> the current size
    assert sch.image_sizes(24.0, 4, DIAMETER, BOX, PIXEL, 10, False, False, ave_pmax=0.5) == (52, 52)
    #   high FSC at the limit and Pmax > 0.1: 16 + round(0.25·64/2) = 16 + 8 = 24 shells -> 48
    assert sch.image_sizes(24.0, 3, DIAMETER, BOX, PIXEL, 10, True, False, ave_pmax=0.5) == (48, 48)
    #   ... but not with a low Pmax
    assert sch.image_sizes(24.0, 3, DIAMETER, BOX, PIXEL, 10, True, False, ave_pmax=0.05) == (52, 48)
    #   no oversampling: coarse = current
    assert sch.image_sizes(24.0, 2, DIAMETER, BOX, PIXEL, 10, False, False, ave_pmax=0.5, oversampling=0) == (52, 52)
    #   --coarse_size 20 caps it; --strict_highres_exp 32 Å: 2·round(384/32) = 24
    assert sch.image_sizes(24.0, 3, DIAMETER, BOX, PIXEL, 10, False, False, ave_pmax=0.5,
                           max_coarse_size_px=20) == (52, 20)
    assert sch.image_sizes(24.0, 3, DIAMETER, BOX, PIXEL, 10, False, False, ave_pmax=0.5,
                           strict_highres_exp_angstrom=32.0) == (52, 24)
    #   8 Å: 48 + 10 = 58 shells -> 116 > 64 -> 64
    assert sch.image_sizes(8.0, 2, DIAMETER, BOX, PIXEL, 10, False, False, ave_pmax=0.5).current_size_px == 64


@pytest.mark.parametrize("order", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("incr", [4, 10])
def test_image_sizes_are_even_and_ordered(order, incr):
    previous = 0
    for res in [400.0, 96.0, 48.0, 32.0, 24.0, 19.2, 16.0, 12.8, 12.0]:  # improving
        for final in (False, True):
            cur, coarse = sch.image_sizes(res, order, DIAMETER, BOX, PIXEL, incr, False, final, ave_pmax=0.5)
            assert cur % 2 == 0 and coarse % 2 == 0
            assert 0 < coarse <= cur <= BOX
            if final:
                assert cur == BOX
        cur = sch.image_sizes(res, order, DIAMETER, BOX, PIXEL, incr, False, False, ave_pmax=0.5).current_size_px
        assert cur >= previous
        previous = cur
    assert previous == BOX  # 12 Å: 32 + incr shells, beyond Nyquist


def test_coarse_size_shrinks_for_coarser_sampling():
    sizes = [sch.image_sizes(12.0, order, DIAMETER, 128, 3.0, 10, False, False, ave_pmax=0.5).coarse_size_px
             for order in (5, 4, 3, 2, 1, 0)]
    assert all(a >= b for a, b in zip(sizes, sizes[1:]))
    assert sizes[0] > sizes[-1]


def test_size_flags_from_fsc():
    opt = OptimiserState()
    state = sch.ScheduleState(incr_size_px=10)
    fsc = 1.0 - np.arange(BOX // 2 + 1) / 21.0  # < 0.5 first at 11 (0.476), < 0.143 first at 18 (1/7 = 0.1429)
    opt2, state2 = sch.update_size_flags_from_fsc(opt, state, fsc, current_size_px=52)
    # incr = max(10, 18 − 11 + 5 = 12); FSC at shell 52/2 − 1 = 25 is 1 − 25/21 < 0.2
    assert state2.incr_size_px == 12
    assert not opt2.has_high_fsc_at_resol_limit
    # At size 30 the FSC at shell 14 is 0.333 > 0.2; the flag then stays set
    opt3, _ = sch.update_size_flags_from_fsc(opt2, state2, fsc, current_size_px=30)
    assert opt3.has_high_fsc_at_resol_limit
    opt4, state4 = sch.update_size_flags_from_fsc(opt3, state2, fsc, current_size_px=52)
    assert opt4.has_high_fsc_at_resol_limit and state4.incr_size_px == 12
    # incr_size never shrinks
    _, state5 = sch.update_size_flags_from_fsc(opt, sch.ScheduleState(incr_size_px=20), fsc, 52)
    assert state5.incr_size_px == 20


# ------------------------------------------------------------------ hidden-variable changes


def test_changes_from_sums():
    # 4 particles: orientation changes summing to 10°, offsets |Δ|² summing to 32 Å², one class change
    ch = sch.hidden_variable_changes_from_sums(10.0, 32.0, 1, 4)
    assert ch.orientations_deg == pytest.approx(2.5)
    assert ch.offsets_angstrom == pytest.approx(2.0)  # sqrt(32 / (2·4))
    assert ch.classes == pytest.approx(0.25)
    assert sch.hidden_variable_changes_from_sums(0, 0, 0, 0) == (0.0, 0.0, 0.0)


def test_angular_distance():
    assert sch.angular_distance_deg(10, 20, 30, 10, 20, 30) == pytest.approx(0.0, abs=1e-6)
    # psi + 9°: the first two rows of the matrix turn by 9°, the third stays: mean 6°
    assert sch.angular_distance_deg(10, 20, 30, 10, 20, 39) == pytest.approx(6.0)
    # rot + 180° with tilt 0 is the same as psi + 180°; C2 about z makes it no change
    d_c1 = sch.angular_distance_deg(0, 0, 0, 180, 0, 0)
    d_c2 = sch.angular_distance_deg(0, 0, 0, 180, 0, 0, symmetry_group("C2").matrices)
    assert d_c1 == pytest.approx(120.0)  # two rows reversed (180°), one unchanged
    assert d_c2 == pytest.approx(0.0, abs=1e-6)
    out = sch.angular_distance_deg(np.zeros(3), np.zeros(3), np.zeros(3), np.zeros(3), np.zeros(3),
                                   np.array([0.0, 3.0, 6.0]))
    assert np.allclose(out, [0.0, 2.0, 4.0])


def test_hidden_variable_counter_rules():
    # oversampled steps: 360/(6·2^(2+1)) = 7.5° and 12 Å/2 = 6 Å; 40 % of them: 3° and 2.4 Å
    opt = OptimiserState(healpix_order=2, offset_step_px=2.0)
    kw = dict(pixel_size_angstrom=PIXEL, oversampling=1)
    opt = sch.update_hidden_variable_counters(opt, 20.0, 8.0, 0.0, **kw)
    assert opt.nr_iter_wo_large_hidden_variable_changes == 0  # 1.03·0 < 999 smallest so far
    assert (opt.smallest_changes_orientations_deg, opt.smallest_changes_offsets_angstrom,
            opt.smallest_changes_classes) == (20.0, 8.0, 0.0)
    # orientations 1.03·19.5 = 20.09 ≥ 20; offsets 1.03·7.8 = 8.03 ≥ 8: not large
    opt = sch.update_hidden_variable_counters(opt, 19.5, 7.8, 0.0, **kw)
    assert opt.nr_iter_wo_large_hidden_variable_changes == 1
    # orientations 1.03·18 = 18.54 < 19.5 and 18/7.5 ≥ 0.4: a large change resets
    opt = sch.update_hidden_variable_counters(opt, 18.0, 7.8, 0.0, **kw)
    assert opt.nr_iter_wo_large_hidden_variable_changes == 0
    # changes below 40 % of the step are never large: 2.9° < 3°, 2.3 Å < 2.4 Å
    opt = sch.update_hidden_variable_counters(opt, 2.9, 2.3, 0.0, **kw)
    assert opt.nr_iter_wo_large_hidden_variable_changes == 1
    opt = sch.update_hidden_variable_counters(opt, 2.0, 2.0, 0.0, **kw)
    assert opt.nr_iter_wo_large_hidden_variable_changes == 2
    # 3.2° ≥ 3° but 1.03·3.2 ≥ 2.0, the smallest so far: not large (it grew)
    opt = sch.update_hidden_variable_counters(opt, 3.2, 2.0, 0.0, **kw)
    assert opt.nr_iter_wo_large_hidden_variable_changes == 3
    # 2.5 Å ≥ 2.4 Å and 1.03·2.5 ≥ 2.0: not large; a class change of 10 % (1.03·0.1 ≥ 0): not large
    opt = sch.update_hidden_variable_counters(opt, 3.2, 2.5, 0.1, **kw)
    assert opt.nr_iter_wo_large_hidden_variable_changes == 4
    assert opt.changes_optimal_orientations_deg == 3.2 and opt.changes_optimal_classes == 0.1
    assert opt.smallest_changes_orientations_deg == 2.0 and opt.smallest_changes_offsets_angstrom == 2.0
    # RELION stores the smallest class change rounded to an integer: after 40 % (-> 0) a first time
    # (1.03·0.4 < 999: large), 30 % is no longer large (1.03·0.3 ≥ 0)
    fresh = OptimiserState(healpix_order=2, offset_step_px=2.0)
    fresh = sch.update_hidden_variable_counters(fresh, 1.0, 1.0, 0.4, **kw)
    assert fresh.nr_iter_wo_large_hidden_variable_changes == 0 and fresh.smallest_changes_classes == 0.0
    fresh = sch.update_hidden_variable_counters(fresh, 1.0, 1.0, 0.3, **kw)
    assert fresh.nr_iter_wo_large_hidden_variable_changes == 1


def test_changes_are_counted_against_the_steps_relion_mpi_s_leader_keeps():
    """relion_refine_mpi's leader counts the changes against the sampling the run started with (order 2, 2 px: 40 %
    of 7.5° and of 6 Å are 3° and 2.4 Å), not the current one (order 4, 0.5 px: 0.75° and 0.6 Å): in the second
    iteration at an order, the first's changes (3.0°, 1.2 Å) the smallest so far, 2.5° and 1.0 Å are small against
    the first and large against the second (below the smallest by more than 3 %); a --continue counts from the
    sampling it continues with."""
    kw = dict(pixel_size_angstrom=PIXEL, oversampling=1)
    now = OptimiserState(healpix_order=4, offset_step_px=0.5, nr_iter_wo_large_hidden_variable_changes=0,
                         smallest_changes_orientations_deg=3.0, smallest_changes_offsets_angstrom=1.2,
                         smallest_changes_classes=0.0)
    start = sch.ScheduleState().counted_from(OptimiserState(healpix_order=2, offset_step_px=2.0))
    assert (start.counted_healpix_order, start.counted_offset_step_px) == (2, 2.0)
    leader = sch.update_hidden_variable_counters(now, 2.5, 1.0, 0.0, step_healpix_order=start.counted_healpix_order,
                                                 step_offset_px=start.counted_offset_step_px, **kw)
    current = sch.update_hidden_variable_counters(now, 2.5, 1.0, 0.0, **kw)
    assert leader.nr_iter_wo_large_hidden_variable_changes == 1
    assert current.nr_iter_wo_large_hidden_variable_changes == 0
    # a change above 40 % of the first steps and below the smallest by more than 3 % is large against either:
    # 5° ≥ 3° after a first iteration's 10°
    shaken = dataclasses.replace(now, smallest_changes_orientations_deg=10.0)
    assert sch.update_hidden_variable_counters(shaken, 5.0, 1.0, 0.0, step_healpix_order=2, step_offset_px=2.0,
                                               **kw).nr_iter_wo_large_hidden_variable_changes == 0
    continued = start.counted_from(now)
    assert (continued.counted_healpix_order, continued.counted_offset_step_px) == (4, 0.5)
    same = sch.update_change_counters(now, 2.5, 1.0, 0.0, 10.0, previous_resolution_angstrom=10.0, counted=continued,
                                      **kw)
    assert same.nr_iter_wo_large_hidden_variable_changes == 0


# ------------------------------------------------------------------ sampling updates


def test_initial_schedule_and_local_start():
    opt, state = sch.initial_schedule(make_config(), np.random.default_rng(0))
    assert (opt.healpix_order, opt.offset_range_px, opt.offset_step_px) == (2, 6.0, 2.0)
    assert not opt.local_searches and state.incr_size_px == 10
    opt, _ = sch.initial_schedule(make_config(healpix_order=4), np.random.default_rng(0))
    # σ = 2 × 360/(6·2^(4+1)) = 2 × 1.875 = 3.75°
    assert opt.local_searches
    assert (opt.sigma_rot_deg, opt.sigma_tilt_deg, opt.sigma_psi_deg) == (3.75, 3.75, 3.75)
    s = sch.sampling_from_optimiser(opt, make_config(healpix_order=4, symmetry="C2"))
    assert s.healpix_order == 4 and s.symmetry == "C2" and s.angular_sampling_deg() == pytest.approx(1.875)


def test_iteration_1_searches_at_the_second_step_of_relions_random_perturbation():
    """RELION draws the sampling's perturbation once as it sets the sampling up (HealpixSampling::initialise) and
    once more before each iteration's search (expectationSetup): iteration 1 searches at the sum of two draws of
    U(0.25, 0.5), wrapped into [-0.5, 0.5), so in [-0.5, 0]; iteration 0's files carry the first, in [0.25, 0.5].
    --skip_align keeps its poses: nothing is drawn."""
    from cryorefine.core.sampling import PERTURBATION_FACTOR, next_perturbation

    firsts, seconds = [], []
    for seed in range(200):
        rng = np.random.default_rng(seed)
        opt, _ = sch.initial_schedule(make_config(), rng)
        firsts.append(opt.perturbation)
        seconds.append(next_perturbation(opt.perturbation, PERTURBATION_FACTOR, rng))  # the jobs' plan of iteration 1
    assert 0.25 <= min(firsts) and max(firsts) <= 0.5
    assert -0.5 <= min(seconds) and max(seconds) <= 0.0
    opt, _ = sch.initial_schedule(make_config(skip_align=True), np.random.default_rng(0))
    assert opt.perturbation == 0.0


def test_update_sampling_waits_for_both_counters():
    config = make_config()
    model = ModelState(ori_size_px=BOX, pixel_size_angstrom=PIXEL)
    opt, state = sch.initial_schedule(config, np.random.default_rng(0))
    opt = dataclasses.replace(opt, acc_rot_deg=2.0, acc_trans_angstrom=3.0, changes_optimal_offsets_angstrom=4.8)
    for res_c, hv_c in [(0, 0), (1, 0), (0, 1)]:
        o = dataclasses.replace(opt, nr_iter_wo_resol_gain=res_c, nr_iter_wo_large_hidden_variable_changes=hv_c)
        assert sch.update_sampling(o, model, config, state) == (o, state)
    # --auto_ignore_angles lifts the hidden-variable condition
    o = dataclasses.replace(opt, nr_iter_wo_resol_gain=1)
    assert sch.update_sampling(o, model, config, state, auto_ignore_angle_changes=True)[0].healpix_order == 3


def test_update_sampling_step_worked_example():
    config = make_config()
    model = ModelState(ori_size_px=BOX, pixel_size_angstrom=PIXEL)
    opt, state = sch.initial_schedule(config, np.random.default_rng(0))
    opt = dataclasses.replace(opt, acc_rot_deg=2.0, acc_trans_angstrom=3.0, changes_optimal_offsets_angstrom=4.8,
                              nr_iter_wo_resol_gain=1, nr_iter_wo_large_hidden_variable_changes=2,
                              smallest_changes_orientations_deg=3.0)
    new, state2 = sch.update_sampling(opt, model, config, state)
    # oversampled step 360/(6·2^3) = 7.5° ≥ 0.75·2.0 = 1.5°: not fine enough, order 2 -> 3
    # offsets (Å): step = min(1.5, 0.75·3.0)·2 = 3; range = 5·4.8 = 24, ≤ 1.3·36, ≥ 1.5·3;
    #   24 > 4·3 -> 12; 12 > 12 no. In px (6 Å): step 0.5, range 2
    assert new.healpix_order == 3
    assert new.offset_step_px == pytest.approx(0.5)
    assert new.offset_range_px == pytest.approx(2.0)
    assert (new.nr_iter_wo_resol_gain, new.nr_iter_wo_large_hidden_variable_changes) == (0, 0)
    assert new.smallest_changes_orientations_deg == 999.0
    assert not new.local_searches and not state2.has_fine_enough_angular_sampling
    # Large offset changes: range 5·20 = 100 -> min(1.3·36 = 46.8) -> /2 = 23.4 > 12 -> step 23.4/4 = 5.85 Å
    o = dataclasses.replace(opt, changes_optimal_offsets_angstrom=20.0)
    new = sch.update_sampling(o, model, config, state)[0]
    assert new.offset_range_px * PIXEL == pytest.approx(23.4)
    assert new.offset_step_px * PIXEL == pytest.approx(5.85)
    # A proposed step coarser than the current one keeps step and range: acc_trans 3 Å, current step 2 Å
    o = dataclasses.replace(opt, offset_step_px=2.0 / PIXEL, offset_range_px=10.0 / PIXEL)
    new = sch.update_sampling(o, model, config, state)[0]
    assert new.offset_step_px * PIXEL == pytest.approx(2.0) and new.offset_range_px * PIXEL == pytest.approx(10.0)
    # Fine enough: step 7.5° < 0.75·12° = 9°: nothing changes but the flag
    o = dataclasses.replace(opt, acc_rot_deg=12.0)
    new, state3 = sch.update_sampling(o, model, config, state)
    assert new == o and state3.has_fine_enough_angular_sampling
    # --minimum_angular_sampling 2°: 7.5° is still too coarse, keep refining
    new, state4 = sch.update_sampling(o, model, config, state, minimum_angular_sampling_deg=2.0)
    assert new.healpix_order == 3 and not state4.has_fine_enough_angular_sampling


def test_check_convergence_needs_all_three():
    opt = OptimiserState(nr_iter_wo_resol_gain=1, nr_iter_wo_large_hidden_variable_changes=1)
    fine = sch.ScheduleState(has_fine_enough_angular_sampling=True)
    assert not sch.check_convergence(opt, sch.ScheduleState()).has_converged
    assert not sch.check_convergence(dataclasses.replace(opt, nr_iter_wo_resol_gain=0), fine).has_converged
    assert not sch.check_convergence(dataclasses.replace(opt, nr_iter_wo_large_hidden_variable_changes=0),
                                     fine).has_converged
    assert sch.check_convergence(dataclasses.replace(opt, nr_iter_wo_large_hidden_variable_changes=0), fine,
                                 auto_ignore_angle_changes=True).has_converged
    done = sch.check_convergence(opt, fine)
    assert done.has_converged and done.do_join_halves


# ------------------------------------------------------------------ a scripted refinement


def run_script(script, acc_rot_deg=4.0, acc_trans_angstrom=3.0):
    """Drive the schedule as the refine loop does. script: per iteration (resolution shell,
    orientation change °, offset change Å). Returns a per-iteration log and the last state."""
    config = make_config()
    model = ModelState(ori_size_px=BOX, pixel_size_angstrom=PIXEL)
    opt, state = sch.initial_schedule(config, np.random.default_rng(0))
    model.current_resolution_angstrom = sch.current_resolution(
        BOX, PIXEL, iteration=0, ini_high_angstrom=config.ini_high_angstrom).resolution_angstrom
    log = []
    for it, (shell, d_orient, d_offset) in enumerate(script, start=1):
        opt = dataclasses.replace(opt, iteration=it)
        opt = sch.check_convergence(opt, state)
        sizes = sch.image_sizes(model.current_resolution_angstrom, opt.healpix_order, DIAMETER, BOX, PIXEL,
                                state.incr_size_px, opt.has_high_fsc_at_resol_limit, opt.do_join_halves,
                                ave_pmax=0.5)
        opt = dataclasses.replace(opt, acc_rot_deg=acc_rot_deg, acc_trans_angstrom=acc_trans_angstrom)
        if it > 1:
            opt, state = sch.update_sampling(opt, model, config, state)
        log.append(dict(iteration=it, order=opt.healpix_order, local=opt.local_searches,
                        sigma=opt.sigma_rot_deg, step_angstrom=opt.offset_step_px * PIXEL,
                        range_angstrom=opt.offset_range_px * PIXEL, final=opt.do_join_halves,
                        sizes=sizes))
        fsc = fsc_crossing_half_at(shell + 0.5)
        res = sch.current_resolution(BOX, PIXEL, fsc_halves=fsc, halves_joined=opt.do_join_halves, iteration=it,
                                     ini_high_angstrom=config.ini_high_angstrom)
        log[-1]["resolution_shell"] = res.shell
        opt = sch.update_change_counters(opt, d_orient, d_offset, 0.0, res.resolution_angstrom,
                                         previous_resolution_angstrom=model.current_resolution_angstrom,
                                         pixel_size_angstrom=PIXEL, oversampling=config.oversampling)
        model.current_resolution_angstrom = res.resolution_angstrom
        if opt.has_converged:
            break
    return log, opt, state


# Resolution shells improve then stall after each sampling change; changes shrink.
SCRIPT = [
    # oversampled steps: order 2 7.5°, 3 3.75°, 4 1.875°; acc_rot 4° -> fine enough below 3°
    (12, 20.0, 8.0),  # 1: gain over ini_high (shell 10)
    (16, 10.0, 4.9),  # 2: gain
    (16, 9.9, 4.8),   # 3: no gain; 1.03·9.9 ≥ 10, 1.03·4.8 ≥ 4.9: no large change -> both counters 1
    (17, 3.0, 1.0),   # 4: order 2 -> 3 before the E-step; gain
    (17, 2.95, 0.98),  # 5: no gain; 1.03·2.95 ≥ 3, 1.03·0.98 ≥ 1
    (19, 1.0, 0.5),   # 6: order 3 -> 4, local searches on; gain
    (19, 0.99, 0.49),  # 7: no gain; 1.03·0.99 ≥ 1, 0.49 Å < 0.4·1.5 Å
    (19, 0.98, 0.48),  # 8: 1.875° < 0.75·4° = 3°: fine enough
    (19, 0.98, 0.48),  # 9: converged at the start: the final iteration
    (19, 0.98, 0.48),  # (never reached)
]


def test_scripted_refinement_goes_2_3_4_local_then_converges():
    log, opt, state = run_script(SCRIPT)
    orders = [e["order"] for e in log]
    assert orders == [2, 2, 2, 3, 3, 4, 4, 4, 4]
    # local searches exactly from order 4 (--auto_local_healpix_order), σ = 2·360/(6·2^5) = 3.75°
    assert [e["local"] for e in log] == [o >= 4 for o in orders]
    assert all(e["sigma"] == pytest.approx(3.75) for e in log if e["local"])
    # offsets: 12 Å step / 36 Å range; at iteration 4 step min(1.5, 0.75·3)·2 = 3 Å, range 5·4.8 = 24 -> 12;
    # at 6 step 3 Å, range 5·0.98 = 4.9 Å (≥ 1.5·3 = 4.5)
    assert [e["step_angstrom"] for e in log[:3]] == pytest.approx([12.0] * 3)
    assert log[3]["step_angstrom"] == pytest.approx(3.0) and log[3]["range_angstrom"] == pytest.approx(12.0)
    assert log[5]["step_angstrom"] == pytest.approx(3.0) and log[5]["range_angstrom"] == pytest.approx(4.9)
    # convergence checked at the start of iteration 9: that iteration is the final, joined one
    assert [e["final"] for e in log] == [False] * 8 + [True]
    assert len(log) == 9 and opt.has_converged and opt.do_join_halves
    assert state.has_fine_enough_angular_sampling
    # full box in the final iteration; before it 2·(19 + 10) = 58
    assert log[-1]["sizes"].current_size_px == BOX
    assert log[-2]["sizes"].current_size_px == 58
    # the final resolution is read at FSC 0.143: 1/(1 + exp((r − 19.5)/1.5)) < 1/7 <=> r > 19.5 + 1.5·ln 6
    # = 22.19: first at r = 23, one shell back -> 22 (at FSC 0.5 it stays 19)
    assert log[-1]["resolution_shell"] == 22
    assert log[-2]["resolution_shell"] == 19


def test_no_convergence_while_resolution_improves():
    # same changes as the script, but the resolution keeps improving by a shell each iteration
    script = [(12 + i, c[1], c[2]) for i, c in enumerate(SCRIPT)] + [(22 + i, 0.98, 0.48) for i in range(6)]
    log, opt, _ = run_script(script)
    assert not opt.has_converged and not any(e["final"] for e in log)
    assert all(e["order"] == 2 for e in log)  # the sampling never gets finer either


def test_no_convergence_before_sampling_is_fine_enough():
    # accuracy 0.5°: 0.75·0.5 = 0.375° is finer than order 4's 1.875°, so refine on to 5, 6
    script = SCRIPT[:8] + [(19, 0.98, 0.48)] * 8
    log, opt, _ = run_script(script, acc_rot_deg=0.5)
    assert not log[8]["final"]
    assert max(e["order"] for e in log) >= 5


# ------------------------------------------------------------------ estimated accuracy


def half_plane_shell_count(size, shell):
    """Coefficients in a shell on RELION's half plane, counted one by one."""
    n = 0
    for kx in range(size // 2 + 1):
        for ky in range(-size // 2, size // 2):
            if kx == 0 and ky < 0:
                continue
            if math.floor(math.sqrt(kx * kx + ky * ky) + 0.5) == shell:
                n += 1
    return n


def single_shell(shell, term, n=BOX // 2 + 1):
    """Spectra with CTF²·P/(2σ²) = term in one shell, no signal elsewhere (σ² = 1)."""
    p = np.zeros(n)
    p[shell] = 2.0 * term
    return p, np.ones(n)


def test_translation_accuracy_single_shell_by_hand():
    # Shell 1 of the half plane: (0,1), (1,0), (1,±1). A shift s along x changes a coefficient by
    # |1 − e^{2πi·kx·s/64}|² = 4·sin²(π·kx·s/64) times its power; averaged over x and y shifts,
    # Σ (4 sin²(a·kx) + 4 sin²(a·ky))/2 = 2·(1 + 1 + 2 + 2)·sin²(a) = 12·sin²(a), a = π·s/64,
    # so SNR = 12·term·sin²(π·s/64).
    # Put the ln 100 crossing at s* = 0.51 px: RELION's trials ... 0.5, 0.6 -> 0.6 px = 3.6 Å.
    # (Counting (0, −1) as well would give 14·sin² and a crossing at 0.47 px -> 0.5 px.)
    assert half_plane_shell_count(32, 1) == 4
    term = 4.60517 / (12.0 * math.sin(math.pi * 0.51 / BOX) ** 2)
    p, s2 = single_shell(1, term)
    acc = sch.estimated_accuracy(p, s2, ori_size_px=BOX, pixel_size_angstrom=PIXEL, current_size_px=32,
                                 particle_diameter_angstrom=DIAMETER)
    assert acc.translations_angstrom == pytest.approx(0.6 * PIXEL)
    # Crossing at 2.3 px: RELION's trials run ..., 1.9, 2.1 (0.2 steps below 2), 2.6 (0.5 steps) -> 2.6 px
    term = 4.60517 / (12.0 * math.sin(math.pi * 2.3 / BOX) ** 2)
    p, s2 = single_shell(1, term)
    acc = sch.estimated_accuracy(p, s2, ori_size_px=BOX, pixel_size_angstrom=PIXEL, current_size_px=32,
                                 particle_diameter_angstrom=DIAMETER)
    assert acc.translations_angstrom == pytest.approx(2.6 * PIXEL)


def test_translation_trial_ladder_matches_relion_steps():
    seen = []
    sch.shift_error_px_from_snr(lambda s: seen.append(s) or 0.0)
    # 0.1 steps to 1 (10 of them), 0.2 to 2, 0.5 to 5, 1 to 10, then 2: cap at the first > 10
    expect = [0.1 * i for i in range(1, 11)] + [1.1, 1.3, 1.5, 1.7, 1.9, 2.1, 2.6, 3.1, 3.6, 4.1, 4.6, 5.1,
                                                   6.1, 7.1, 8.1, 9.1, 10.1]
    assert seen == pytest.approx(expect)
    assert sch.shift_error_px_from_snr(lambda s: 0.0) == pytest.approx(10.1)
    seen = []
    assert sch.rotation_error_deg_from_snr(lambda d: seen.append(d) or 0.0) == pytest.approx(30.1)
    assert seen[:5] == pytest.approx([0.05, 0.1, 0.15, 0.2, 0.3])
    assert sch.rotation_error_deg_from_snr(lambda d: 10.0 * d) == pytest.approx(0.5)  # 10·0.5 > 4.605


def test_rotation_accuracy_small_angle_by_hand():
    # One shell r0 = 10; for small errors 1 − ρ(u) ≈ u²/10 with u = 2π·R·Δ/N, Δ = 2·sin(δ/2)·r0·g.
    # Over rot/tilt/psi: <g²> = (1 [psi] + 1/2 [tilt, in-plane axis] + 2/3 [rot, axis at a uniform tilt]) / 3 = 13/18.
    # SNR(δ) ≈ n(r0)·term·2·(2π·R·2 sin(δ/2)·r0/N)²/10·13/18 (next term relatively u²/28 < 10⁻³ here).
    # Crossing at δ* = 0.196°: trials 0.15 < δ* < 0.2 -> 0.2°; at δ* = 0.205°: 0.2 < δ* < 0.3 -> 0.3°.
    r0, size = 10, 48
    n_r0 = half_plane_shell_count(size, r0)
    radius_px = DIAMETER / 2 / PIXEL
    for crossing, expected in [(0.196, 0.2), (0.205, 0.3)]:
        u2 = (2 * math.pi * radius_px * 2 * math.sin(math.radians(crossing) / 2) * r0 / BOX) ** 2
        term = 4.60517 / (n_r0 * 2 * u2 / 10 * 13 / 18)
        p, s2 = single_shell(r0, term)
        acc = sch.estimated_accuracy(p, s2, ori_size_px=BOX, pixel_size_angstrom=PIXEL, current_size_px=size,
                                     particle_diameter_angstrom=DIAMETER)
        assert acc.rotations_deg == pytest.approx(expected)
    # the same signal beyond the current size is not seen at all: 999 -> RELION's 30.1° cap
    acc = sch.estimated_accuracy(p, s2, ori_size_px=BOX, pixel_size_angstrom=PIXEL, current_size_px=16,
                                 particle_diameter_angstrom=DIAMETER)
    assert acc.rotations_deg == pytest.approx(30.1) and acc.translations_angstrom == pytest.approx(10.1 * PIXEL)


def test_accuracy_improves_with_signal_size_and_diameter():
    r = np.arange(BOX // 2 + 1)
    tau2 = 2.0 * np.exp(-r / 6.0)
    s2 = np.ones_like(tau2)
    kw = dict(ori_size_px=BOX, pixel_size_angstrom=PIXEL)

    def acc(power=tau2, size=32, diameter=DIAMETER, ctf2=1.0):
        return sch.estimated_accuracy(power, s2, current_size_px=size, particle_diameter_angstrom=diameter,
                                      mean_ctf2_per_shell=ctf2, **kw)

    base = acc()
    assert 0.05 < base.rotations_deg < 30 and 0.1 * PIXEL < base.translations_angstrom < 10 * PIXEL
    stronger = acc(power=10 * tau2)
    assert stronger.rotations_deg < base.rotations_deg and stronger.translations_angstrom < base.translations_angstrom
    assert acc(size=16).rotations_deg > base.rotations_deg
    assert acc(diameter=150.0).rotations_deg > base.rotations_deg
    assert acc(diameter=150.0).translations_angstrom == base.translations_angstrom  # shifts ignore the size
    assert acc(ctf2=0.5).rotations_deg > base.rotations_deg


def test_accuracy_from_model_uses_half_one_and_populated_classes():
    r = np.arange(BOX // 2 + 1)
    weak, strong = 2.0 * np.exp(-r / 6.0), 20.0 * np.exp(-r / 6.0)
    model = ModelState(ori_size_px=BOX, pixel_size_angstrom=PIXEL, n_classes=2)
    model.tau2 = np.stack([np.stack([weak, strong]), np.stack([strong, strong])])  # (2 halves, 2 classes, n)
    model.sigma2_noise = np.ones((1, r.size))
    model.pdf_class = np.array([0.995, 0.005])
    direct_weak = sch.estimated_accuracy(weak, np.ones(r.size), ori_size_px=BOX, pixel_size_angstrom=PIXEL,
                                         current_size_px=32, particle_diameter_angstrom=DIAMETER)
    direct_strong = sch.estimated_accuracy(strong, np.ones(r.size), ori_size_px=BOX, pixel_size_angstrom=PIXEL,
                                           current_size_px=32, particle_diameter_angstrom=DIAMETER)
    assert direct_strong.rotations_deg < direct_weak.rotations_deg
    # class 2 holds 0.5 % of the particles (< 1 %): ignored, and half 2 is not used
    assert sch.estimated_accuracy_from_model(model, 32, DIAMETER) == direct_weak
    model.pdf_class = np.array([0.5, 0.5])  # both count: the best class wins
    assert sch.estimated_accuracy_from_model(model, 32, DIAMETER) == direct_strong
    # with the SSNR the projected power is τ²·SSNR/(1 + SSNR): SSNR 1 halves it
    model.ssnr = np.ones_like(model.tau2)
    halved = sch.estimated_accuracy(strong / 2, np.ones(r.size), ori_size_px=BOX, pixel_size_angstrom=PIXEL,
                                    current_size_px=32, particle_diameter_angstrom=DIAMETER)
    assert sch.estimated_accuracy_from_model(model, 32, DIAMETER) == halved
    # CTFs without a spectrum: CTF² 0.5, the same as halving the power
    model.ssnr = None
    assert sch.estimated_accuracy_from_model(model, 32, DIAMETER, do_ctf=True) == halved
    assert sch.estimated_accuracy_from_model(ModelState(ori_size_px=BOX, pixel_size_angstrom=PIXEL), 32,
                                             DIAMETER) == (999.0, 999.0)


def test_relion_constants():
    assert sch.MAX_NR_ITER_WO_RESOL_GAIN == 1
    assert sch.MAX_NR_ITER_WO_LARGE_HIDDEN_VARIABLE_CHANGES == 1
    assert sch.ACCURACY_NEG_LOG_P == pytest.approx(math.log(100), abs=1e-5)
    assert sch.angular_step_deg(2) == 15.0 and sch.angular_step_deg(2, 1) == 7.5
    assert sch.local_search_sigma_deg(4, 1) == 3.75


def test_the_fine_step_is_measured_against_the_detail_the_e_step_compares():
    """Order 2 with oversampling 1 steps 7.5°: at the edge of a 270 Å particle that is 7.5/360·π·270 = 17.67 Å,
    resolving 17.67 / 1.2 = 14.73 Å (RELION's keep-safe factor). A 64 px box of 4.57 Å compares 64·4.57/20 =
    14.62 Å at 40 px (too coarse) and 15.39 Å at 38 px; oversampling 2 halves the step."""
    at40 = sch.fine_step(2, 1, 270.0, 40, 64, 4.57)
    assert at40.step_deg == pytest.approx(7.5)
    assert at40.resolves_angstrom == pytest.approx(7.5 / 360 * np.pi * 270 / 1.2)
    assert at40.compared_angstrom == pytest.approx(14.624)
    assert at40.too_coarse
    assert not sch.fine_step(2, 1, 270.0, 38, 64, 4.57).too_coarse
    assert not sch.fine_step(2, 2, 270.0, 40, 64, 4.57).too_coarse


def test_a_classification_samples_finer_once_its_classes_stall_and_the_step_is_too_coarse():
    """Where the E-step already compares the whole box: the first change (against the starting classes) is left
    out; a stall is a change no smaller than every one after it so far; a step fine enough, or a pmax below 0.5,
    keeps RELION's sampling."""
    coarse = sch.fine_step(2, 1, 270.0, 40, 40, 4.57)  # 40 px of a 40 px box
    fine = sch.fine_step(3, 1, 270.0, 40, 40, 4.57)  # 3.75° resolves 7.4 Å
    assert coarse.too_coarse and not fine.too_coarse

    def raised(changes, pmax, step):
        return sch.classification_sampling_raised(changes, pmax, step, step)  # compares all it may

    assert raised([0.5, 0.2, 0.25], 0.9, coarse) == sch.RAISED_AT_STALL
    assert raised([0.5, 0.2, 0.2], 0.9, coarse) == sch.RAISED_AT_STALL
    assert raised([0.5, 0.2, 0.15], 0.9, coarse) is None  # still falling
    assert raised([0.0, 0.8], 0.9, coarse) is None  # one change after the first: nothing to compare
    assert raised([0.0, 0.8, 0.7], 0.9, coarse) is None  # the first (0.0) is not a stall's reference
    assert raised([0.5, 0.2, 0.25], 0.9, fine) is None
    assert raised([0.5, 0.2, 0.25], 0.4, coarse) is None
    assert raised([0.5, 0.2, 0.25], sch.RAISED_SAMPLING_MIN_AVE_PMAX, coarse) == sch.RAISED_AT_STALL


def test_a_classification_samples_finer_early_while_its_resolution_can_still_grow():
    """Set B's geometry (64 px of 4.57 Å, 270 Å particle, --healpix_order 2): RELION's 7.5° resolves 14.7 Å at the
    edge, fine for the 36.6 Å compared at 34 px but not for the box's 9.1 Å; so from the second iteration, once a
    pmax of 0.5 is known, whatever the class changes; not at a pmax below it, not in the first iteration, not with a
    step fine enough for the box, and not once the E-step compares all it may (then only at a stall)."""
    now = sch.fine_step(2, 1, 270.0, 34, 64, 4.57)
    box = sch.fine_step(2, 1, 270.0, 64, 64, 4.57)
    assert not now.too_coarse and box.too_coarse
    raised = sch.classification_sampling_raised
    assert raised([0.49], 0.65, now, box) == sch.RAISED_WHILE_RESOLUTION_GROWS
    assert raised([0.49, 0.1], 0.65, now, box) == sch.RAISED_WHILE_RESOLUTION_GROWS  # falling changes: no matter
    assert raised([], 0.65, now, box) is None  # the first iteration: no pmax measured yet
    assert raised([0.49], 0.45, now, box) is None
    assert raised([0.49], None, now, box) is None  # after a --firstiter_cc iteration
    fine_box = sch.fine_step(4, 1, 270.0, 64, 64, 4.57)  # 1.875° / 2 at order 4: fine enough for 9.1 Å
    assert not fine_box.too_coarse
    assert raised([0.49], 0.65, sch.fine_step(4, 1, 270.0, 34, 64, 4.57), fine_box) is None
    assert raised([0.49], 0.65, box, box) is None  # the whole box compared, classes still changing less


def test_the_likelihood_size_of_strict_highres_exp():
    """2·round(64·4.57 / 20) = 2·round(14.6) = 30 px, at most the current size; none without the limit; and the
    coarse size follows it (RELION: both passes at that size)."""
    assert sch.likelihood_size_px(20.0, 64, 4.57, 40) == 30
    assert sch.likelihood_size_px(20.0, 64, 4.57, 24) == 24
    assert sch.likelihood_size_px(-1.0, 64, 4.57, 40) is None
    sizes = sch.image_sizes(15.0, 2, 270.0, 64, 4.57, 10, False, False, ave_pmax=0.5,
                            strict_highres_exp_angstrom=20.0)
    assert sizes.coarse_size_px == 30 and sizes.current_size_px > 30


# ------------------------------------------------------------------ classification: fast subsets, coarser sampling


@pytest.mark.parametrize("iteration, n_classes, n_particles, expected", [
    (1, 1, 10_000, 1500), (5, 1, 10_000, 1500), (6, 1, 10_000, 4500), (10, 2, 20_000, 9000),
    (11, 1, 100_000, 30_000),  # 30 % of the data, more than 4500
    (15, 1, 10_000, 4500),  # 4500, more than 30 %
    (16, 1, 1_000_000, None),  # all the data from iteration 16 on
    (1, 1, 1500, None), (1, 4, 5000, None),  # a subset no smaller than the data set is the data set
])
def test_fast_subset_sizes_are_relions(iteration, n_classes, n_particles, expected):
    assert sch.fast_subset_size(iteration, n_classes, n_particles) == expected


@pytest.mark.parametrize("acc_rot_deg, order", [
    (5.0, 3),  # 0.8·5 = 4°: order 3 (3.75° oversampled) is the coarsest step below it
    (1.0, 4),  # finer than --healpix_order 4 asks for (1.875°): never finer than the option
    (999.0, 4),  # not estimated yet: --healpix_order
    (100.0, 0),  # coarser than order 0 allows: order 0
])
def test_coarser_sampling_keeps_the_steps_below_the_accuracy(acc_rot_deg, order):
    config = make_config(healpix_order=4, offset_range_px=5.0, offset_step_px=1.0, oversampling=1)
    optimiser = OptimiserState(healpix_order=4, offset_range_px=5.0, offset_step_px=1.0, acc_rot_deg=acc_rot_deg,
                               acc_trans_angstrom=3.0)
    out = sch.coarser_sampling(optimiser, config, particle_diameter_angstrom=200.0, resolution_angstrom=10.0,
                               pixel_size_angstrom=2.0, cc_iteration=False)
    assert out.healpix_order == order
    assert out.offset_step_px == pytest.approx(0.8 * 3.0 / 2.0 * 2)  # 0.8 × 1.5 px × 2^oversampling


def test_coarser_sampling_of_a_cross_correlation_iteration_and_its_offset_bounds():
    config = make_config(healpix_order=4, offset_range_px=5.0, offset_step_px=1.0, oversampling=1)
    optimiser = OptimiserState(healpix_order=4, offset_range_px=5.0, offset_step_px=1.0)  # accuracies unknown (999)
    # 360 / ⌈π·200 / 40⌉ = 22.5°, 0.8 of it 18°: order 1 (15°) is the coarsest below it
    out = sch.coarser_sampling(optimiser, config, particle_diameter_angstrom=200.0, resolution_angstrom=40.0,
                               pixel_size_angstrom=2.0, cc_iteration=True)
    assert out.healpix_order == 1
    assert out.offset_step_px == pytest.approx(0.95 * 5.0)  # RELION's unknown accuracy: the widest step
    fine = dataclasses.replace(optimiser, acc_rot_deg=1.0, acc_trans_angstrom=0.5)
    out = sch.coarser_sampling(fine, config, particle_diameter_angstrom=200.0, resolution_angstrom=10.0,
                               pixel_size_angstrom=2.0, cc_iteration=False)
    assert out.offset_step_px == 1.0  # never finer than --offset_step


@pytest.mark.parametrize("symmetry", ["C1", "D2"])
def test_hidden_variable_changes_are_the_mean_distance_over_every_particle_the_unmoved_at_zero(symmetry):
    from cryorefine.em.state import ParticleState

    rng = np.random.default_rng(11)
    n = 400

    def state(rot, tilt, psi, x, klass):
        return ParticleState(rot, tilt, psi, x, np.zeros(n), klass, np.ones(n), np.zeros(n), np.ones(n, np.int64),
                             np.zeros(n))

    old = state(rng.uniform(-180, 180, n), rng.uniform(0, 180, n), rng.uniform(-180, 180, n), rng.normal(size=n),
                rng.integers(0, 3, n))
    new = old.copy()
    moved = rng.random(n) < 0.3  # a mini-batch's share
    new.rot_deg[moved] += rng.normal(0, 5, moved.sum())
    new.psi_deg[moved] -= rng.normal(0, 5, moved.sum())
    new.origin_x_px[moved] += 0.5
    new.class_index[moved] = (new.class_index[moved] + 1) % 3
    mats = symmetry_group(symmetry).rotations if symmetry != "C1" else None
    every = sch.angular_distance_deg(old.rot_deg, old.tilt_deg, old.psi_deg, new.rot_deg, new.tilt_deg, new.psi_deg,
                                     symmetry_matrices=mats)
    changes = sch.hidden_variable_changes(old, new, 2.0, symmetry)
    assert changes.orientations_deg == pytest.approx(np.mean(every), abs=1e-6)
    assert changes.orientations_deg > 0.5
    assert changes.offsets_angstrom == pytest.approx(math.sqrt(np.sum(moved) * 1.0 / (2 * n)))
    assert changes.classes == pytest.approx(np.mean(moved))
    assert sch.hidden_variable_changes(old, old.copy(), 2.0, symmetry).orientations_deg == 0.0
