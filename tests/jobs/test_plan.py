"""`cryorefine plan`: predictions that follow the sizes, and a refusal with the option that would fit."""

import json
from pathlib import Path

import numpy as np
import pytest

from cryorefine.cli import main
from cryorefine.core.grid import PaddedGrid

EXAMPLE_MAP = Path(__file__).resolve().parents[2] / "examples" / "ribosome_64px.mrc"


def run_cli(capsys, *args):
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def particles(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plan")
    main_args = ["simulate", "--ref", str(EXAMPLE_MAP), "--n", "10", "--o", str(folder / "sim")]
    try:
        main(main_args)
    except SystemExit as exc:
        assert exc.code == 0
    return folder / "sim" / "particles.star"


def plan_json(capsys, star, *extra):
    code, out, err = run_cli(capsys, "plan", "--i", star, "--json", "--gpu_memory", 80, *extra)
    assert code == 0, err
    return json.loads(out)


def test_three_moments_with_sizes_from_the_schedule(capsys, particles):
    plan = plan_json(capsys, particles, "--ini_high", 40)
    labels = [m["label"] for m in plan["moments"]]
    assert labels[0] == "first" and labels[-1] == "final"
    first, final = plan["moments"][0], plan["moments"][-1]
    # 64 px at 6 Å/px from 40 Å: shell round(384/40) = 10, + incr_size 10 → 40 px; the final is the box
    assert first["current_size_px"] == 40
    assert final["current_size_px"] == 64
    assert first["n_orientations"] == 4608  # HEALPix order 2, global
    assert final["n_orientations"] < first["n_orientations"]  # local searches
    # the final iteration joins the halves in place: its M-step needs no more than a late one of its size
    assert final["maximization_bytes"] >= plan["moments"][1]["maximization_bytes"]


def test_padding_and_batch_change_the_prediction(capsys, particles):
    base = plan_json(capsys, particles, "--ini_high", 40)["moments"][0]
    pad1 = plan_json(capsys, particles, "--ini_high", 40, "--pad", 1)["moments"][0]
    small_batch = plan_json(capsys, particles, "--ini_high", 40, "--batch", 2)["moments"][0]
    assert pad1["iteration_bytes"] < base["iteration_bytes"] / 3  # padded volumes 8× smaller; slices the same
    assert small_batch["particles_per_batch"] == 2
    assert small_batch["particle_bytes"] < base["particle_bytes"]


def test_a_run_that_cannot_fit_is_refused_with_what_to_change(capsys, particles):
    code, out, err = run_cli(capsys, "plan", "--i", particles, "--gpu_memory", 2.1)
    assert code == 2
    assert err.count("\n") == 1 and "--free_gpu_memory" in err and "GB" in err
    code, out, err = run_cli(capsys, "plan", "--i", particles, "--gpu_memory", 0.01, "--free_gpu_memory", 0)
    assert code == 2 and "use a GPU with at least" in err


def test_a_classification_refused_at_its_assumed_late_resolution_names_resolution(capsys, particles):
    """A classification's late iteration is planned at three quarters of Nyquist unless --resolution says
    otherwise (classifications often end far coarser): a refusal there names the assumption and the option;
    one planned at a given resolution does not."""
    code, out, err = run_cli(capsys, "plan", "--i", particles, "--K", 4, "--gpu_memory", 0.01, "--free_gpu_memory", 0)
    assert code == 2 and err.count("\n") == 1
    assert "the late" in err and "three quarters of Nyquist" in err and "--resolution" in err
    code, out, err = run_cli(capsys, "plan", "--i", particles, "--K", 4, "--resolution", 20, "--gpu_memory", 0.01,
                             "--free_gpu_memory", 0)
    assert code == 2 and "three quarters of Nyquist" not in err


def test_symmetry_counts_the_orientations_of_the_asymmetric_unit(capsys, particles):
    c1 = plan_json(capsys, particles)["moments"]
    d2 = plan_json(capsys, particles, "--sym", "D2")["moments"]
    o = plan_json(capsys, particles, "--sym", "O")["moments"]
    # global search at HEALPix order 2: 192 directions × 24 psi; D2 keeps a quarter of the directions, O 1/24
    assert c1[0]["n_orientations"] == 192 * 24
    assert d2[0]["n_orientations"] == 48 * 24
    assert abs(o[0]["n_orientations"] / (192 * 24 / 24) - 1) < 0.15
    # on a slow GPU the operations, not the floor per particle, set the time beyond the fixed cost of an iteration:
    # a quarter of the orientations
    from cryorefine.jobs.plan import GLOBAL_ESTEP_FIXED_SECONDS

    slow_c1 = plan_json(capsys, particles, "--gpu_tflops", 0.001)["moments"]
    slow_d2 = plan_json(capsys, particles, "--sym", "D2", "--gpu_tflops", 0.001)["moments"]
    fixed = GLOBAL_ESTEP_FIXED_SECONDS
    assert slow_d2[0]["estep_seconds"] - fixed < 0.3 * (slow_c1[0]["estep_seconds"] - fixed)


def test_a_classification_is_planned_as_one_unit_of_k_classes_with_global_searches(capsys, particles):
    refine = plan_json(capsys, particles, "--ini_high", 40)["moments"]
    one = plan_json(capsys, particles, "--ini_high", 40, "--K", 1, "--resolution", 15)["moments"]
    six = plan_json(capsys, particles, "--ini_high", 40, "--K", 6, "--resolution", 15)["moments"]
    assert [m["label"] for m in six] == ["first", "late (15.0 Å)"]  # no final iteration at the whole box
    # 64 px at 6 Å/px, 15 Å: shell round(384/15) = 26, + incr_size 10 → 72 px, at most the box
    assert six[1]["current_size_px"] == 64
    assert six[1]["n_orientations"] == 192 * 24  # global searches every iteration
    # K=1: one unit's sums where a refinement keeps two half sets; the references are those of one class either way
    assert refine[0]["iteration_bytes"] > one[0]["iteration_bytes"]
    # six classes: five more classes' sums and references (complex64 each) than one
    volume = float(np.prod(PaddedGrid.create(64, 2, 32).shape))
    assert six[1]["iteration_bytes"] - one[1]["iteration_bytes"] >= 5 * volume * (12 + 8)
    assert six[1]["maximization_bytes"] > one[1]["maximization_bytes"]


def test_a_late_resolution_beyond_nyquist_is_refused(capsys, particles):
    code, out, err = run_cli(capsys, "plan", "--i", particles, "--resolution", 5)  # Nyquist is 12 Å at 6 Å/px
    assert code == 2 and "--resolution 5" in err and "Nyquist" in err


def test_the_arena_is_the_card_less_free_gpu_memory(capsys, particles):
    default = plan_json(capsys, particles)["arena_bytes"]
    none_kept = plan_json(capsys, particles, "--free_gpu_memory", 0)["arena_bytes"]
    assert none_kept == 80e9 and default == 80e9 - 2048 * 2 ** 20


def test_a_local_search_is_estimated_from_its_interpolations_not_its_translations(capsys, particles):
    """local_diff2 projects each particle's slices itself: the local moments' E-step follows classes × orientations ×
    coarse coefficients (and the current size), not the translations searched, while a global search's follows its
    products' operations; on a slower card the size-dependent part takes longer, the fixed part does not."""
    base = plan_json(capsys, particles)["moments"]
    wide = plan_json(capsys, particles, "--offset_range", 8, "--offset_step", 1)["moments"]
    assert base[1]["label"].startswith("late (local")
    assert wide[1]["n_translations"] > 5 * base[1]["n_translations"]
    assert wide[1]["estep_seconds"] == pytest.approx(base[1]["estep_seconds"])
    # the first, global, iteration (on a card slow enough that its products, not its fixed cost, set the time)
    slow_base = plan_json(capsys, particles, "--gpu_tflops", 0.001)["moments"]
    slow_wide = plan_json(capsys, particles, "--offset_range", 8, "--offset_step", 1, "--gpu_tflops", 0.001)["moments"]
    assert slow_wide[0]["estep_seconds"] > 5 * slow_base[0]["estep_seconds"]
    slow = plan_json(capsys, particles, "--gpu_tflops", 5)["moments"]
    fast = plan_json(capsys, particles, "--gpu_tflops", 500)["moments"]
    assert fast[1]["estep_seconds"] < base[1]["estep_seconds"] < slow[1]["estep_seconds"]
    assert fast[1]["estep_seconds"] > 0.5 * base[1]["estep_seconds"]  # the fixed costs stay


def test_a_batch_holds_no_more_than_a_unit_of_particles(capsys, particles):
    """10 particles: a refinement's half sets hold 5 each, a classification's one unit all 10, however many the
    GPU's default batch would take (512 at 64 px); the prediction is for what the engine is handed."""
    refine = plan_json(capsys, particles, "--ini_high", 40)["moments"][0]
    classify = plan_json(capsys, particles, "--ini_high", 40, "--K", 2)["moments"][0]
    assert refine["particles_per_batch"] == 5
    assert classify["particles_per_batch"] == 10


@pytest.mark.parametrize("pool", [3, 30])
def test_relion_s_pool_does_not_change_the_gpu_batches(capsys, particles, pool):
    """RELION's GUI writes --pool 3 (its tutorial 30): images a CPU thread takes at once, not the GPU's batch. The
    plan of a line with it is the plan without it, batches and all (as a batch, --pool 3 gave 3 of the 5)."""
    without = plan_json(capsys, particles, "--ini_high", 40)
    with_pool = plan_json(capsys, particles, "--ini_high", 40, "--pool", pool)
    assert [m["particles_per_batch"] for m in with_pool["moments"]] == [m["particles_per_batch"]
                                                                          for m in without["moments"]]
    assert with_pool == without


def test_the_upload_buffers_are_planned_in_the_stack_s_own_precision(capsys, particles, tmp_path):
    """The overlapped uploads' two device buffers hold the images as they travel: a float16 stack's take half the
    bytes of a float32 one's, and `plan`'s ITERATION scope is smaller by that half (the rest of the plan is the
    same)."""
    from cryorefine.gpu.staging import UploadSlots

    try:
        main(["simulate", "--ref", str(EXAMPLE_MAP), "--n", "10", "--float16", "--o", str(tmp_path / "sim")])
    except SystemExit as exc:
        assert exc.code == 0
    capsys.readouterr()  # the simulation's own output
    half = plan_json(capsys, tmp_path / "sim" / "particles.star", "--ini_high", 40)["moments"][0]
    full = plan_json(capsys, particles, "--ini_high", 40)["moments"][0]
    batch = full["particles_per_batch"]
    saved = UploadSlots.nbytes(batch, (64, 64), 4) - UploadSlots.nbytes(batch, (64, 64), 2)
    assert saved > 0
    assert full["iteration_bytes"] - half["iteration_bytes"] == pytest.approx(saved)
    assert full["particle_bytes"] == pytest.approx(half["particle_bytes"])



def test_the_images_kept_on_the_gpu_are_in_every_peak(capsys, particles):
    """The 10 float32 images of 64 px are kept on an 80 GB card: in every moment's peak, and said in the table."""
    image_bytes = 64 * 64 * 4
    plan = plan_json(capsys, particles)
    assert plan["kept_images"] == 10 and plan["kept_images_bytes"] == 10 * image_bytes
    for m in plan["moments"]:
        assert m["kept_images_bytes"] == 10 * image_bytes
        assert m["peak_bytes"] >= m["kept_images_bytes"] + m["maximization_bytes"]
    code, out, _ = run_cli(capsys, "plan", "--i", particles, "--gpu_memory", 80)
    assert code == 0 and "images kept on the GPU from one iteration to the next (in one process): 10 of 10" in out


def test_a_process_keeps_on_the_gpu_the_images_its_share_of_the_free_memory_holds():
    from cryorefine.em.memory import KEPT_IMAGES_SHARE, kept_images_capacity, whole_box_iteration_bytes

    free = 1e9
    each = int(KEPT_IMAGES_SHARE * free / 4.5)  # room for 4
    assert kept_images_capacity(free, each, 100) == 4
    assert kept_images_capacity(free, each, 3) == 3  # no more than it owns
    assert kept_images_capacity(free, int(KEPT_IMAGES_SHARE * free) + 1, 100) == 0
    assert kept_images_capacity(None, each, 100) == 0  # on the host
    # no more than leaves a whole-box iteration its room: a 600 px refinement's on a 24 GB card leaves none
    assert kept_images_capacity(free, each, 100, reserve_bytes=free - 2.5 * each) == 2
    need = whole_box_iteration_bytes(600, 2.0, 2)
    assert 24e9 < need and kept_images_capacity(22e9, 600 * 600 * 2, 10 ** 6, need) == 0
    assert kept_images_capacity(135e9, 360 * 360 * 2, 105247, whole_box_iteration_bytes(360, 2.0, 6)) == 105247
