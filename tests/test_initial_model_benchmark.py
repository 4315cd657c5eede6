"""benchmarks/initial_model_accuracy.py: its line is RELION 5's InitialModel GUI line, given alike to both programs;
its alignment puts a truth turned, moved and mirrored by known amounts back onto the truth; and a tiny run on the CPU
measures both programs alike (cryorefine's own relion_refine standing in for RELION, so that both runs must measure
the same) and refines from the aligned map and from the truth low-passed to 40 Å."""

import json
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import BENCHMARKS, benchmark_modules

GUI_LINES_FILE = Path(__file__).resolve().parent / "data" / "relion5_initial_model_gui_lines.txt"


@pytest.fixture(scope="module")
def bench():
    with benchmark_modules("initial_model_accuracy") as (module,):
        yield module


def test_the_line_is_relion5s_initial_model_gui_line(bench):
    lines = GUI_LINES_FILE.read_text().splitlines()
    words = shlex.split(lines[lines.index("# InitialModel: every default") + 1])[2:]  # after `which relion_refine`
    for option in ("--o", "--pipeline_control"):
        at = words.index(option)
        del words[at:at + 2]
    assert bench.gui_line("Extract/job018/particles.star", 200, 200) == words


def test_both_programs_get_the_same_line_and_seed(bench, tmp_path):
    """cryorefine initial_model and RELION (its launcher first, its --j and --pool, --relion_extra last): the same
    words otherwise; the refines start from the aligned map or the truth at 40 Å with RELION 5 GUI's Refine3D
    options."""
    relion = tmp_path / "relion_refine"
    relion.write_text("")
    options, extra = bench.parse_args(["--work", str(tmp_path), "--gpu", "--relion", str(relion), "--relion_launcher",
                                       "taskset -c 0-7", "--relion_extra", "--gpu 0", "--iter", "150", "--", "--batch",
                                       "64"])
    ours, never = bench.initial_model_command("cryorefine_seed2", "cryorefine", 2, options, extra, 346)
    theirs, _ = bench.initial_model_command("relion_seed2", "relion", 2, options, extra, 346)
    assert never is None
    assert ours[:4] == [sys.executable, "-m", "cryorefine", "initial_model"]
    assert theirs[:4] == ["taskset", "-c", "0-7", str(relion.resolve())]
    line = bench.gui_line("particles.star", 346, 150)
    assert ours[4:] == ["--o", "cryorefine_seed2/run", *line, "--random_seed", "2", "--gpu", "0", "--batch", "64"]
    relion_line = bench.gui_line("particles.star", 346, 150, threads=4, pool=30)
    assert theirs[4:] == ["--o", "relion_seed2/run", *relion_line, "--random_seed", "2", "--gpu", "0"]
    differ = [(a, b) for a, b in zip(line, relion_line) if a != b]
    assert differ == [("3", "30"), ("1", "4")]  # --pool and --j alone
    folder, refine = bench.refine_command("cryorefine_seed2", 2, options, 346)
    assert folder == "refine_from_cryorefine_seed2"
    text = shlex.join(refine)
    assert "refine --i particles.star --ref cryorefine_seed2/aligned.mrc --o refine_from_cryorefine_seed2/run --ctf " \
           "--particle_diameter 346 --ini_high 40 --auto_refine --split_random_halves" in text
    assert text.endswith("--sym C1 --low_resol_join_halves 40 --norm --scale --random_seed 2 --gpu 0")
    folder, refine = bench.refine_command("truth40", 1, options, 346)
    assert folder == "refine_from_truth40_seed1" and refine[refine.index("--ref") + 1] == "reference_40A.mrc"


@pytest.fixture(scope="module")
def ribosome(bench):
    from class2d_accuracy import load_maps

    maps, pixel = load_maps(["ribosome", "rod"], 32)
    return maps, pixel, bench.prepare_truth(maps["ribosome"])


@pytest.mark.parametrize("hand, angles_deg, shift_px", [("mirrored", (37.0, 71.0, -122.0), (2.5, -1.25, 3.0)),
                                                        ("as is", (-150.0, 128.0, 20.0), (-1.0, 2.0, 0.5))])
def test_a_truth_turned_moved_and_mirrored_is_put_back(bench, ribosome, hand, angles_deg, shift_px):
    """The truth turned by Q (on a finer grid), moved by s and, in one case, mirrored: found in that hand, the turn
    Qᵀ within one step of the global grid, the shift −Qᵀs within half a pixel, and then an FSC with the truth of
    about 1 to Nyquist; the other hand correlates less."""
    from bench_common import rotation_angles_deg

    from cryorefine.core import euler

    maps, pixel, prepared = ribosome
    truth = maps["ribosome"]
    q = euler.euler_to_matrix(*angles_deg)
    made = bench.shift_volume(bench.turned_finely(truth, q), shift_px)
    made = bench.mirrored(made) if hand == "mirrored" else made
    found = bench.align_to_truth(made, prepared)
    assert found.hand == hand
    assert rotation_angles_deg(found.matrix, q.T) < bench.COARSE_STEP_DEG
    expected = bench.turned_shift(q.T, tuple(-s for s in shift_px))
    assert np.allclose(found.shift_px, expected, atol=0.5)
    other = next(h for h in bench.HANDS if h != hand)
    assert found.scores[other] < found.scores[hand] - 0.05
    fsc = bench.fsc_figures(found.aligned, truth, pixel)
    assert fsc["fsc_0.5_angstrom"] == pytest.approx(2 * pixel)  # Nyquist
    assert np.mean(fsc["fsc"][1:]) > 0.98


def test_another_shape_does_not_align_to_the_truth(bench, ribosome):
    """The rod put onto the ribosome: its best frame still gives a low FSC (the measure can fail)."""
    maps, pixel, prepared = ribosome
    found = bench.align_to_truth(maps["rod"], prepared)
    fsc = bench.fsc_figures(found.aligned, maps["ribosome"], pixel)
    assert np.mean(fsc["fsc"][1:]) < 0.6 and fsc["fsc_0.5_angstrom"] > 4 * pixel


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """60 particles of the rod in a 16 px box, the GUI line for 2 iterations: cryorefine initial_model and (as
    "RELION") cryorefine's relion_refine on the same line and seed; then, reusing cryorefine's, the refines for one
    iteration (HEALPix order 1: seconds)."""
    work = tmp_path_factory.mktemp("initial_model_accuracy")
    relion = f"{shlex.quote(sys.executable)} -m cryorefine relion_refine"
    common = [sys.executable, str(BENCHMARKS / "initial_model_accuracy.py"), "--work", str(work), "--cpu", "--n", "60",
              "--box", "16", "--iter", "2", "--maps", "rod", "--measure_every", "1"]
    first = subprocess.run([*common, "--relion", relion, "--relion_extra=--cpu", "--relion_j", "1", "--json",
                            str(work / "first.json")], capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    second = subprocess.run([*common, "--reuse", "--follow_refine", "--refine_iter", "1", "--refine_extra",
                             "--healpix_order 1", "--json", str(work / "second.json")], capture_output=True, text=True,
                            timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    return (work, first.stdout, json.loads((work / "first.json").read_text()), second.stdout,
            json.loads((work / "second.json").read_text()))


def test_a_tiny_cpu_run_measures_both_programs_alike(tiny):
    work, stdout, results, _, _ = tiny
    assert results["n"] == 60 and results["maps"] == ["rod"] and results["box_px"] == 16
    ours, theirs = results["runs"]
    assert (ours["program"], theirs["program"]) == ("cryorefine", "relion")
    assert "--iter 2 --grad --denovo_3dref --i particles.star" in ours["command"]
    assert "--j 1" in theirs["command"] and "--random_seed 1" in theirs["command"]
    assert ours["last_iteration"] == theirs["last_iteration"] == 2
    for key in ("hand", "fsc_0.5_angstrom", "fsc_0.143_angstrom", "scores"):
        assert ours["final"][key] == theirs["final"][key], key
    assert [it["iteration"] for it in ours["iterations"]] == [1]  # 60 particles: every iteration is written
    assert (work / "rod" / "cryorefine_seed1" / "aligned.mrc").is_file()
    assert "| rod | cryorefine | 1 | 2 of 2 |" in stdout and "| rod | relion | 1 | 2 of 2 |" in stdout


def test_the_refines_start_from_the_aligned_map_and_the_truth(tiny):
    work, _, first, stdout, results = tiny
    assert [r["program"] for r in results["runs"]] == ["cryorefine"]
    assert results["runs"][0]["wall_seconds"] == first["runs"][0]["wall_seconds"]  # reused, not run again
    refines = {r["start"]: r for r in results["refines"]}
    assert set(refines) == {"cryorefine_seed1", "truth40"}
    for r in refines.values():
        assert r["returncode"] == 0 and r["iterations"] == 1 and not r["converged"]
        assert r["reported_resolution_angstrom"] > 0 and r["vs_truth"]["hand"] == "as is"
    assert "--ref reference_40A.mrc" in refines["truth40"]["command"]
    assert refines["truth40"]["command"].endswith("--random_seed 1 --cpu --iter 1 --healpix_order 1")
    assert "| rod | truth40 | 1 | 1 (not converged) |" in stdout


def test_the_script_answers_help():
    done = subprocess.run([sys.executable, str(BENCHMARKS / "initial_model_accuracy.py"), "--help"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert all(word in done.stdout for word in ("--relion_only", "--follow_refine", "--reuse", "--measure_every"))
