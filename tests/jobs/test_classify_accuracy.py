"""3D classification accuracy on a two-state set with known states, run by benchmarks/classify_accuracy.py.

Set A: state A is the example ribosome map (64 px, relabelled 4.57 Å/px), state B the same with a 55 Å ball of
density erased (13.5 % of the mass); the particles are drawn half and half, simulated with CTF and noise, and
classified with K = 2 from A low-passed to 40 Å with the RELION-like options of the script. Set B: the same with
state A the density of PDB 7P6Z at 10 Å (examples/ribosome_7p6z_10A_64px.mrc), at SNR 0.2, the set on which the
classes fell apart late (benchmarks/README.md, classification accuracy). The share of particles in the class of
their true state is read from every iteration's run_itNNN_data.star by the script, which writes it to a JSON
file; these tests read that file.

CPU, set A (CI-sized): 400 particles, 8 iterations. Measured at the commit that added this test (2 cores): final
99.2 / 99.8 / 85.5 % for seeds 1–3 (seed 3 still climbing: 65.8, 71.3, 74.0, 80.0, 85.5 % over iterations 4–8),
about 20 s a seed. The suite runs seeds 1 and 2 (the three run in the benchmark). The bound, 80 %, is the worst of
the three less 5 points; a classification that separates nothing scores ~50 % and one that puts everything in one
class ~51 %, so the test fails when the classes stop separating the states. With the fine pass one order finer from
iteration 2 (2026-11-30, code 6b8d137, 2 idle cores): 98.5 / 99.5 % for seeds 1 and 2, 203 s for the test alone
(269 s in the whole suite).

CPU, set B: 1,000 particles, 10 iterations, seed 2, at least 94 %; fails on the code that kept RELION's sampling
throughout and on the code that sampled finer only once the classes stalled (seed 2 was below the bound on both;
the three seeds, about 200 s each on 2 cores, run in the benchmark: benchmarks/classify_accuracy.py).

GPU, set B, 15 iterations, seeds 1–3: the issue's bound, at least 94 % at the last iteration in every seed and
never more than 2 points below that run's best iteration. With the finer pass from iteration 2 the GPU (an H200)
gives the CPU's figures to the tenth: 99.1 / 96.0 / 97.9 % final, best 99.4 / 97.1 / 98.2, about 110 s for the three.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cupy_or_skip

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "classify_accuracy.py"
SEEDS = (1, 2, 3)


def classify_accuracy(work, *options, seeds=SEEDS):
    """Run the benchmark script on this checkout's code in `work` for `seeds`; its JSON report."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])))
    out = work / "results.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--work", str(work), "--json", str(out),
                           "--seeds", *(str(s) for s in seeds), *(str(o) for o in options)],
                          capture_output=True, text=True, env=env, timeout=3600)
    print(done.stdout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def per_seed(report, seeds=SEEDS):
    """{seed: (accuracy per iteration, final, best)} of the report's runs, printed."""
    runs = {r["seed"]: r for r in report["runs"]}
    assert sorted(runs) == list(seeds)
    for seed, r in runs.items():
        assert len(r["accuracy_per_iteration"]) == report["iterations"], f"seed {seed}: iterations missing"
        print(f"seed {seed}: " + " ".join(f"{100 * a:.1f}" for a in r["accuracy_per_iteration"])
              + f"; final {100 * r['final']:.1f} %, best {100 * r['best']:.1f} %")
    return runs


def test_cpu_classification_separates_the_two_states(tmp_path):
    report = classify_accuracy(tmp_path, "--cpu", "--n", 400, "--iter", 8, seeds=(1, 2))
    for seed, r in per_seed(report, seeds=(1, 2)).items():
        assert r["final"] >= 0.80, f"seed {seed}: {100 * r['final']:.1f} % in the right class at the last iteration"


#: state A of set B: the density of PDB 7P6Z at 10 Å, 64 px of 4.57 Å (examples/make_ribosome_map.py)
SET_B_MAP = REPO / "examples" / "ribosome_7p6z_10A_64px.mrc"


def test_cpu_classification_of_set_b_holds_its_classes_to_the_tenth_iteration(tmp_path):
    """Set B at SNR 0.2, 600 particles, 10 iterations, seed 2: 97.3 % in the right class at iteration 10, and
    88.0 % with RELION's sampling kept (--relion_oversampling), which this bound (the issue's, 94 %) fails (74 and
    44 s on 2 cores, `benchmarks/classify_accuracy.py --seeds 2 --cpu --map examples/ribosome_7p6z_10A_64px.mrc
    --snr 0.2 --iter 10 --n 600 [-- --relion_oversampling]`); 97.5 % and 171 s for the test alone on 2 idle cores
    (2026-11-30, code 6b8d137; 236 s in the whole suite). At the benchmark's 1,000 particles seeds 1–3 had
    98.5 / 70.7 / 75.1 % with RELION's sampling, 99.0 / 92.5 / 92.9 % with the fine pass one order finer once the
    classes stalled, 99.4 / 96.9 / 97.5 % with it from iteration 2 (benchmarks/README.md)."""
    report = classify_accuracy(tmp_path, "--cpu", "--map", SET_B_MAP, "--snr", 0.2, "--iter", 10, "--n", 600,
                               seeds=(2,))
    for seed, r in per_seed(report, seeds=(2,)).items():
        assert r["final"] >= 0.94, f"seed {seed}: {100 * r['final']:.1f} % in the right class at iteration 10"


@pytest.mark.gpu
def test_gpu_full_set_stays_accurate_to_the_last_iteration(tmp_path):
    """Set B: with RELION's sampling throughout the three seeds ended at 93.4 / 62.8 / 57.3 %, 5–30 points below
    their best (benchmarks/README.md, classification accuracy); with the finer pass from the stall, 98.8 / 91.5 /
    89.7 %; with it from iteration 2 (while the resolution can grow) 99.1 / 96.0 / 97.9 %, 0.3 / 1.1 / 0.3 points
    below the best, on an H200 as on the CPU."""
    cupy_or_skip()
    report = classify_accuracy(tmp_path, "--gpu", "--map", SET_B_MAP, "--snr", 0.2)
    for seed, r in per_seed(report).items():
        assert r["final"] >= 0.94, f"seed {seed}: {100 * r['final']:.1f} % at the last iteration"
        below = 100 * (r["best"] - r["final"])
        assert r["final"] >= r["best"] - 0.02, f"seed {seed}: {below:.1f} points below its best"
