"""3D classification accuracy on a two-state set with known states, run by benchmarks/classify_accuracy.py.

State A is the example ribosome map (64 px, 4.57 Å/px), state B the same with a 55 Å ball of density erased
(13.5 % of the mass); the particles are drawn half and half, simulated with CTF and noise, and classified
with K = 2 from A low-passed to 40 Å with the RELION-like options of the script. The share of particles in
the class of their true state is read from every iteration's run_itNNN_data.star by the script, which writes
it to a JSON file; these tests read that file.

CPU (CI-sized): 400 particles, 8 iterations, seeds 1–3. Measured at the commit that added this test (2 cores):
final 99.2 / 99.8 / 85.5 % (seed 3 still climbing: 65.8, 71.3, 74.0, 80.0, 85.5 % over iterations 4–8), about 20 s
a seed. The bound, 80 %, is the worst seed less 5 points; a classification that separates nothing scores ~50 %
and one that puts everything in one class ~51 %, so the test fails when the classes stop separating the states.
(On this simulated set the classification as it was before the rework of its rules also reaches 99 % on the full
set, so the test guards the present behaviour; it does not reproduce the loss measured on RELION-made images.)

GPU (the full set: 1,000 particles, 15 iterations, seeds 1–3): at least 94 % at the last iteration in every seed,
and never more than 2 points below that run's best iteration.
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


def classify_accuracy(work, *options):
    """Run the benchmark script on this checkout's code in `work`; its JSON report."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])))
    out = work / "results.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--work", str(work), "--json", str(out),
                           "--seeds", *(str(s) for s in SEEDS), *(str(o) for o in options)],
                          capture_output=True, text=True, env=env, timeout=3600)
    print(done.stdout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def per_seed(report):
    """{seed: (accuracy per iteration, final, best)} of the report's runs, printed."""
    runs = {r["seed"]: r for r in report["runs"]}
    assert sorted(runs) == list(SEEDS)
    for seed, r in runs.items():
        assert len(r["accuracy_per_iteration"]) == report["iterations"], f"seed {seed}: iterations missing"
        print(f"seed {seed}: " + " ".join(f"{100 * a:.1f}" for a in r["accuracy_per_iteration"])
              + f"; final {100 * r['final']:.1f} %, best {100 * r['best']:.1f} %")
    return runs


def test_cpu_classification_separates_the_two_states(tmp_path):
    report = classify_accuracy(tmp_path, "--cpu", "--n", 400, "--iter", 8)
    for seed, r in per_seed(report).items():
        assert r["final"] >= 0.80, f"seed {seed}: {100 * r['final']:.1f} % in the right class at the last iteration"


@pytest.mark.gpu
def test_gpu_full_set_stays_accurate_to_the_last_iteration(tmp_path):
    cupy_or_skip()
    report = classify_accuracy(tmp_path, "--gpu")
    for seed, r in per_seed(report).items():
        assert r["final"] >= 0.94, f"seed {seed}: {100 * r['final']:.1f} % at the last iteration"
        assert r["final"] >= r["best"] - 0.02, f"seed {seed}: {100 * (r['best'] - r['final']):.1f} points below its best"
