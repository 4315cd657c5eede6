"""benchmarks/class2d_accuracy.py and the Class2D job of benchmarks/empiar10028.py: the lines are RELION 5's GUI
lines, the measures give the known answers of hand-made cases, the simulated set holds the views, in-plane angles and
origins its truth file says, and a tiny run on the CPU measures both programs alike (cryorefine's own relion_refine
standing in for RELION, so that both runs must measure the same)."""

import itertools
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import BENCHMARKS, benchmark_modules

GUI_LINES_FILE = Path(__file__).resolve().parent / "data" / "relion5_class2d_gui_lines.txt"


@pytest.fixture(scope="module")
def scripts():
    with benchmark_modules("class2d_accuracy", "empiar10028") as modules:
        yield modules


def gui_words(setting):
    """The GUI line of `setting` in the recorded file, without the program, --o and --pipeline_control."""
    lines = GUI_LINES_FILE.read_text().splitlines()
    words = shlex.split(lines[lines.index(f"# Class2D: {setting}") + 1])[2:]  # after `which relion_refine`
    for option in ("--o", "--pipeline_control"):
        at = words.index(option)
        del words[at:at + 2]
    return words


def test_the_accuracy_lines_are_relion5s_gui_lines(scripts):
    accuracy, _ = scripts
    star = "Extract/job018/particles.star"
    assert accuracy.gui_line("em", star, 1, 200, 25) == gui_words("do_em Yes")
    assert accuracy.gui_line("vdam", star, 1, 200, 200) == gui_words("every default")
    relion = accuracy.gui_line("em", star, 24, 346, 25, threads=4, pool=30)
    assert relion[relion.index("--j") + 1] == "4" and relion[relion.index("--pool") + 1] == "30"
    assert relion[relion.index("--K") + 1] == "24" and relion[relion.index("--particle_diameter") + 1] == "346"


def test_the_stand_in_class2d_job_is_the_gui_em_line_with_k_100_and_no_reference(scripts):
    _, empiar = scripts
    command, arguments = empiar.job_arguments("class2d", "p.star", "ref.mrc", "out/run")
    assert command == "class2d" and "--ref" not in arguments and arguments[:4] == ["--i", "p.star", "--o", "out/run"]

    def pairs(words):  # option -> value (None for a flag), RELION's program settings left out
        out, i = {}, 0
        while i < len(words):
            value = words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else None
            out[words[i]] = value
            i += 1 if value is None else 2
        return out

    gui = pairs(gui_words("do_em Yes"))
    for option in ("--i", "--dont_combine_weights_via_disc", "--pool", "--pad", "--j"):
        gui.pop(option)
    gui.update({"--K": "100", "--particle_diameter": "360"})
    assert pairs(arguments[4:]) == gui
    assert empiar.job_arguments("class3d", "p.star", "ref.mrc", "out/run")[1][:4] == ["--i", "p.star", "--ref",
                                                                                        "ref.mrc"]
    assert empiar.with_iterations(["--K", "3", "--iter", "25", "--ctf"], 4) == ["--K", "3", "--iter", "4", "--ctf"]
    assert empiar.with_iterations(["--ctf"], 4) == ["--ctf", "--iter", "4"]


def test_best_pairing_finds_the_largest_one_to_one_sum(scripts):
    accuracy, _ = scripts
    rng = np.random.default_rng(3)
    for rows, columns in ((4, 4), (3, 5), (5, 3), (1, 4), (6, 6)):
        values = rng.integers(0, 20, (rows, columns))
        pairs = accuracy.best_pairing(values)
        assert len(pairs) == min(rows, columns)
        assert len({r for r, _ in pairs}) == len({c for _, c in pairs}) == len(pairs)
        if rows <= columns:
            best = max(sum(values[r, c] for r, c in enumerate(p)) for p in itertools.permutations(range(columns), rows))
        else:
            best = max(sum(values[r, c] for c, r in enumerate(p)) for p in itertools.permutations(range(rows), columns))
        assert sum(values[r, c] for r, c in pairs) == best


def test_shares_of_a_hand_made_classification(scripts):
    """Classes 0 and 1 both mostly view 0, class 2 view 2: by majority 50 + 40 + 45 of 150 particles; one to one
    the best pairing holds 95 (50 + 0 + 45, or 10 + 40 + 45); views 0 and 2 found."""
    accuracy, _ = scripts
    classes = np.repeat([0, 0, 1, 2, 2], [50, 10, 40, 5, 45])
    views = np.repeat([0, 1, 0, 1, 2], [50, 10, 40, 5, 45])
    counts = accuracy.class_view_counts(classes, views, 3, 3)
    assert counts.tolist() == [[50, 10, 0], [40, 0, 0], [0, 5, 45]]
    shares = accuracy.class_shares(counts)
    assert shares["majority"] == pytest.approx(135 / 150)
    assert shares["one_to_one"] == pytest.approx(95 / 150)
    assert shares["views_found"] == 2
    assert accuracy.majority_views([[0, 0], [3, 3], [1, 2]]).tolist() == [-1, 0, 1]  # empty; a tie: the lower


@pytest.fixture(scope="module")
def views(scripts):
    accuracy, _ = scripts
    maps, pixel = accuracy.load_maps(["ribosome", "blobs"], 32)
    return accuracy.true_views(maps, 3), pixel


def test_a_class_average_turned_and_moved_has_frc_one_with_its_view_and_less_with_another(scripts, views):
    """An average that is view 0 turned a quarter turn (np.rot90) and rolled by whole pixels: in its best frame the
    FRC is 1 at every shell, the angle a quarter turn; another view of the same map correlates less."""
    accuracy, _ = scripts
    (_, images), pixel = views
    average = np.roll(np.rot90(images[0]), (2, -3), axis=(0, 1))
    same = accuracy.class_frc(average, images[0], pixel)
    assert min(same["frc"][1:]) > 0.99 and same["mean_frc"] > 0.995
    assert min(abs(same["angle_deg"] - a) for a in (90.0, 270.0)) <= 0.5
    assert same["frc05_angstrom"] == pytest.approx(2 * pixel)
    other = accuracy.class_frc(average, images[1], pixel)
    assert other["mean_frc"] < same["mean_frc"] - 0.1


def test_the_simulated_particles_hold_their_true_views_psi_and_origins(scripts, views, tmp_path):
    """At a very high SNR each image, un-shifted by its origin, correlates with its view's truth turned by its psi
    (a 2D rotation of the psi-0 projection, not the 3D projection the image was made by) times its CTF; the same
    with psi off by 90° or another particle's view does not. The noise outside the particle circle has σ 1."""
    accuracy, _ = scripts
    from cryorefine.core import fourier
    from cryorefine.core.ctf import CtfParameters, ctf_2d
    from cryorefine.io.mrc import read_stack
    from cryorefine.io.star import read_star

    options, _ = accuracy.parse_args(["--work", str(tmp_path), "--cpu", "--n", "40", "--box", "32",
                                      "--views_per_map", "3", "--maps", "ribosome", "blobs", "--snr", "1e6"])
    (_, truths), pixel = views
    _, images_truth, view_of, got_pixel = accuracy.simulate_set(tmp_path, options)
    assert got_pixel == pixel and np.allclose(images_truth, truths)
    table = read_star(tmp_path / "truth.star")["particles"]
    images = read_stack(tmp_path / "particles.mrcs")
    n = images.shape[-1]

    def correlation(i, view, psi):
        ft = fourier.phase_shift_2d(fourier.rfft2_centered(images[i].astype(np.float64)),
                                    table["rlnOriginXAngst"][i] / pixel, table["rlnOriginYAngst"][i] / pixel, n)
        ctf = ctf_2d(n, CtfParameters(pixel, table["rlnDefocusU"][i], table["rlnDefocusV"][i],
                                      table["rlnDefocusAngle"][i], 300.0, 2.7, 0.1))
        model = accuracy.rotated_transforms(truths[view], [psi])[0] * ctf
        return float(np.real(np.vdot(model, ft)) / np.sqrt(np.vdot(model, model).real * np.vdot(ft, ft).real))

    for i in range(5):
        view, psi = int(view_of[i]), float(table["rlnAnglePsi"][i])
        assert table["rlnClassNumber"][i] == view + 1
        assert correlation(i, view, psi) > 0.95
        assert correlation(i, view, psi + 90.0) < 0.9
        assert correlation(i, (view + 1) % len(truths), psi) < 0.9
    options.snr, options.data_seed = 0.05, 8
    accuracy.simulate_set(tmp_path, options)
    noisy = read_stack(tmp_path / "particles.mrcs")
    outside = np.hypot(*(np.mgrid[:n, :n] - n // 2)) > n // 2
    assert np.std(noisy[:, outside]) == pytest.approx(1.0, abs=0.05)


def test_seconds_between_iteration_files(tmp_path):
    with benchmark_modules("bench_common") as (bench_common,):
        seconds_per_iteration = bench_common.seconds_per_iteration
    for iteration, seconds in ((0, 100.0), (1, 105.0), (2, 108.0), (10, 128.0)):
        path = tmp_path / f"run_it{iteration:03d}_model.star"
        path.write_text("")
        os.utime(path, (seconds, seconds))
    (tmp_path / "run_it003_data.star").write_text("")  # no model.star: not an iteration's files
    assert seconds_per_iteration(tmp_path) == {1: 5.0, 2: 3.0, 10: 2.5}


def test_relion_and_cryorefine_are_compared_over_the_same_iterations_after_the_first(scripts, tmp_path):
    """cryorefine's files 1 s apart, RELION's 20 s apart from 70 s after its launch (iteration 0 at 50 s), RELION
    stopped in iteration 4: iterations 2-3 compared, 2 s against 40 s."""
    _, empiar = scripts
    (tmp_path / "class2d").mkdir()
    for iteration in (1, 2, 3, 4):
        path = tmp_path / "class2d" / f"run_it{iteration:03d}_model.star"
        path.write_text("")
        os.utime(path, (1000.0 + iteration, 1000.0 + iteration))
    relion = {"seconds_from_launch": {0: 50.0, 1: 70.0, 2: 90.0, 3: 110.0}}
    compared = empiar.compare_with_relion("class2d", tmp_path, relion)
    assert compared["compared_iterations"] == [2, 3]
    assert compared["cryorefine_seconds"] == pytest.approx(2.0) and compared["relion_seconds"] == pytest.approx(40.0)
    assert compared["ratio"] == pytest.approx(20.0) and compared["relion_start_seconds"] == 50.0
    rows = {r["iteration"]: r for r in compared["iterations"]}
    assert rows[1]["relion_seconds"] == 20.0 and rows[1]["cryorefine_seconds"] is None
    assert rows[4]["relion_seconds"] is None and rows[4]["cryorefine_seconds"] == pytest.approx(1.0)


def test_the_scripts_answer_help():
    for script, words in (("class2d_accuracy.py", ("--relion_launcher", "--grad_iter", "--algorithms")),
                          ("empiar10028.py", ("class2d", "--relion_only", "--relion_iterations"))):
        done = subprocess.run([sys.executable, str(BENCHMARKS / script), "--help"], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        assert all(word in done.stdout for word in words), script


def test_a_tiny_cpu_run_measures_both_programs_alike(tmp_path):
    """60 particles of 6 views in a 24 px box, the EM line for 2 iterations, cryorefine class2d and (as "RELION")
    cryorefine's relion_refine on the same line and seed: the same program, so the same measures; each iteration
    measured."""
    relion = f"{shlex.quote(sys.executable)} -m cryorefine relion_refine"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "class2d_accuracy.py"), "--work", str(tmp_path), "--cpu",
                           "--n", "60", "--box", "24", "--views_per_map", "2", "--snr", "1", "--iter", "2",
                           "--algorithms", "em", "--relion", relion, "--relion_extra=--cpu", "--relion_j", "1",
                           "--json", str(tmp_path / "out.json")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "out.json").read_text())
    assert results["K"] == 6 and len(results["views"]) == 6 and sum(results["particles_per_view"]) == 60
    ours, theirs = results["runs"]
    assert (ours["program"], theirs["program"]) == ("cryorefine", "relion")
    assert "--iter 2 --i particles.star" in ours["command"] and "--j 1" in theirs["command"]
    assert [it["iteration"] for it in ours["iterations"]] == [it["iteration"] for it in theirs["iterations"]] == [1, 2]
    for a, b in zip(ours["iterations"], theirs["iterations"]):
        for key in ("majority", "one_to_one", "views_found", "mean_frc", "resolution_angstrom", "image_size_px",
                    "ave_pmax", "sigma_offset_angstrom"):
            assert a[key] == pytest.approx(b[key]), key
        assert 0 < a["one_to_one"] <= a["majority"] <= 1
        assert 0 < a["ave_pmax"] <= 1 and 0 < a["image_size_px"] <= 24 and a["resolution_angstrom"] > 0
    assert ours["iterations"][1]["seconds_per_iteration"] > 0
    assert "| em | cryorefine | 1 | 2 of 2 |" in done.stdout and "| em | relion | 1 | 2 of 2 |" in done.stdout
