"""benchmarks/plan_estep_fit.py: the constants of `plan`'s E-step estimates (local and global searches) come back from
runs made to follow them, and the no-GPU plan is for the card those constants refer to."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cryorefine.core.sampling import Sampling
from cryorefine.jobs import plan

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "plan_estep_fit.py"
TRUE = (0.3, 4e-5, 2e-11, 8e-9)  # fixed (held at plan's), per particle, per interpolation, per fine coefficient
SIZES = [(4, 50, 190), (4, 100, 204), (5, 198, 210), (6, 214, 214), (8, 214, 214), (8, 360, 360)]


def synthetic_run(n_particles, noise, rng):
    """An empiar10028.py JSON whose local iterations take what the TRUE constants say, times 1 ± noise."""
    iterations = [{"iteration": 1, "healpix_order": 2, "coarse_size_px": 50, "current_size_px": 50,
                   "local_searches": False, "seconds": {"expectation": 9.0}}]
    for i, (order, coarse, current) in enumerate(SIZES, start=2):
        sampling = Sampling(healpix_order=order, offset_range_px=5.0, offset_step_px=2.0)
        terms = plan.local_estep_terms(n_particles, 1, plan.local_neighbourhood_orientations(sampling, 1),
                                       plan.coefficients(coarse), plan.coefficients(current), plan.REFERENCE_TFLOPS)
        seconds = float(np.dot(TRUE, terms)) * (1 + noise * rng.uniform(-1, 1))
        iterations.append({"iteration": i, "healpix_order": order, "coarse_size_px": coarse,
                           "current_size_px": current, "local_searches": True, "seconds": {"expectation": seconds}})
    return {"n_particles": n_particles, "jobs": {"refine": {"iterations": iterations}}}


def fit(tmp_path, runs, *extra):
    paths = []
    for i, run in enumerate(runs):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(run))
    out = tmp_path / "fit.json"
    done = subprocess.run([sys.executable, str(SCRIPT), *map(str, paths), "--json", str(out), *extra],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(out.read_text()), done.stdout


def test_the_constants_come_back_from_runs_that_follow_them(tmp_path):
    rng = np.random.default_rng(3)
    result, stdout = fit(tmp_path, [synthetic_run(10_000, 0.0, rng), synthetic_run(2_000, 0.0, rng)])
    fitted = result["local"]["constants_fitted"]
    for name, want in zip(("LOCAL_ESTEP_FIXED_SECONDS", "LOCAL_ESTEP_SECONDS_PER_PARTICLE",
                           "LOCAL_ESTEP_SECONDS_PER_INTERPOLATION", "LOCAL_ESTEP_SECONDS_PER_FINE_COEFFICIENT"), TRUE):
        assert fitted[name] == pytest.approx(want, rel=1e-6), name
    assert len(result["local"]["iterations"]) == 2 * len(SIZES)  # the global iteration is left out
    assert "global" not in result  # no class3d job
    for row in result["local"]["iterations"]:
        assert row["refit_seconds"] == pytest.approx(row["measured_seconds"], rel=1e-6)
    assert "refit: estimate / measured 1.00–1.00" in stdout


def test_noisy_runs_are_fitted_within_their_noise_and_no_constant_goes_negative(tmp_path):
    rng = np.random.default_rng(4)
    result, _ = fit(tmp_path, [synthetic_run(10_000, 0.1, rng) for _ in range(3)])
    assert all(v >= 0 for v in result["local"]["constants_fitted"].values())
    ratios = [r["refit_seconds"] / r["measured_seconds"] for r in result["local"]["iterations"]]
    assert 0.8 < min(ratios) and max(ratios) < 1.2


def test_too_few_local_iterations_is_a_usage_error(tmp_path):
    run = synthetic_run(1000, 0.0, np.random.default_rng(0))
    run["jobs"]["refine"]["iterations"] = run["jobs"]["refine"]["iterations"][:3]
    path = tmp_path / "short.json"
    path.write_text(json.dumps(run))
    done = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "nothing to fit" in done.stderr


def class3d_run(n_particles, fixed, per_particle, rng, noise=0.0):
    """An empiar10028.py JSON of a class3d job at coarse size 26 px whose E-steps take fixed + n·per_particle."""
    its = [{"iteration": i, "healpix_order": 2, "coarse_size_px": 26, "current_size_px": 100,
            "seconds": {"expectation": (fixed + n_particles * per_particle) * (1 + noise * rng.uniform(-1, 1))
                        * (3.0 if i < 6 else 1.0)}} for i in range(1, 26)]
    return {"n_particles": n_particles, "jobs": {"class3d": {"iterations": its}}}


def test_the_global_fixed_cost_and_floor_come_back_from_two_particle_counts(tmp_path):
    """Iterations before --class3d_from (here three times as long) are left out; one particle count alone cannot
    tell the fixed cost from the floor and is not fitted."""
    rng = np.random.default_rng(5)
    result, _ = fit(tmp_path, [class3d_run(10_000, 0.7, 1.2e-4, rng), class3d_run(100_000, 0.7, 1.2e-4, rng)])
    fitted = result["global"]["constants_fitted"]
    assert fitted["GLOBAL_ESTEP_FIXED_SECONDS"] == pytest.approx(0.7, rel=1e-6)
    assert fitted["MIN_GLOBAL_ESTEP_SECONDS_PER_PARTICLE"] == pytest.approx(1.2e-4, rel=1e-6)
    assert len(result["global"]["iterations"]) == 2 * 20
    one = tmp_path / "one"
    one.mkdir()
    path = one / "run.json"
    path.write_text(json.dumps(class3d_run(10_000, 0.7, 1.2e-4, rng)))
    done = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "nothing to fit" in done.stderr


def test_the_plan_uses_the_fitted_global_terms():
    """A global search's estimate is the fixed cost plus the particles times the larger of the coarse share and the
    floor."""
    small = plan.global_estep_seconds(1000, 6, 4608, 21, 300, plan.REFERENCE_TFLOPS)
    large = plan.global_estep_seconds(101_000, 6, 4608, 21, 300, plan.REFERENCE_TFLOPS)
    floor = max(plan.MIN_GLOBAL_ESTEP_SECONDS_PER_PARTICLE,
                plan.global_coarse_seconds_per_particle(6, 4608, 21, 300, plan.REFERENCE_TFLOPS))
    assert large - small == pytest.approx(100_000 * floor)
    assert small == pytest.approx(plan.GLOBAL_ESTEP_FIXED_SECONDS + 1000 * floor)
    slow = plan.global_estep_seconds(1000, 6, 4608, 21, 300, plan.REFERENCE_TFLOPS / 1000)
    assert slow > small  # a slower card: the coarse pass's share above the floor


def test_without_a_gpu_the_plan_is_for_the_card_the_constants_refer_to():
    gpu = plan.GpuSpec.detect()
    if "assumed" not in gpu.name:
        pytest.skip("a GPU is visible here: the plan is for it")
    assert gpu.fp32_tflops == plan.REFERENCE_TFLOPS
