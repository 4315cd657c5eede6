"""`cryorefine plan`'s E-step estimates against measured jobs, and their constants fitted again. Reads the JSON of
empiar10028.py runs, prints plan's estimate of every local-search iteration (auto-refine) and every late Class3D
iteration against the measured E-step, fits the constants of jobs/plan.py to all the runs given (least squares on
the relative error) and prints the estimates with the fitted constants.

Local searches (auto-refine): `plan` estimates an iteration's E-step as a fixed cost, plus one per particle, plus one
per trilinear interpolation of the coarse pass (particles × classes × neighbourhood orientations × coarse
coefficients), plus one per coefficient at the current size (`jobs.plan.local_estep_terms`). Global searches
(Class3D): a fixed cost plus, per particle, the coarse pass's arithmetic over its share of the E-step or a floor,
whichever is larger (`jobs.plan.global_estep_seconds`).

This script reads the JSONs of `empiar10028.py` runs: every local-search iteration of a refine job (the
neighbourhood at its HEALPix order as `plan` counts it, the sizes the run logged) and every iteration of a class3d
job from --class3d_from on (the earlier ones still sort the particles out and are not what `plan`'s late
iteration stands for). It prints the estimate with the constants in `jobs/plan.py` against the measured E-step,
then fits them to all the runs given at once (least squares on the relative error) and prints the estimate with
those. Local: the last three constants (the fixed cost stays: runs of one particle count cannot tell it from the
per-particle one). Global: the fixed cost and the floor, from iterations where the floor is the larger (runs of
two particle counts or more are needed).

The constants in jobs/plan.py are this script's fits to runs on the H100 SXM of the reference (2026-11-27). Local
searches, with the GPU's default batches of 1,024, runs of two particle counts:

    python benchmarks/plan_estep_fit.py benchmarks/results/refine_10k_h100_local_shift.json \
        benchmarks/results/empiar10028_refine_20k_h100_converged_1ea15a4.json

(46 iterations on two machines, estimate / measured 0.80–1.16; the constants before, fitted on 2026-11-26 to three
10,000-particle runs in batches of 512, gave 1.06–1.56 on them.) Global searches:

    python benchmarks/plan_estep_fit.py benchmarks/results/class3d_10k_h100_weights_fused.json \\
        benchmarks/results/empiar10028_class3d_105k_h100_fused_weights.json

(40 iterations, 10,000 and 105,247 particles; not fitted again: the Class3D runs since are of one particle count.)

--tflops: the FP32 peak of the runs' card as `GpuSpec.detect` reckons it (by default the fit's reference card, so
that the constants come out for it). --skip_first_local leaves out each run's first local iteration (where a run on
a fresh machine still meets first-use costs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from cryorefine.core.sampling import Sampling  # noqa: E402
from cryorefine.jobs import plan  # noqa: E402

LOCAL_CONSTANTS = ("LOCAL_ESTEP_FIXED_SECONDS", "LOCAL_ESTEP_SECONDS_PER_PARTICLE",
                   "LOCAL_ESTEP_SECONDS_PER_INTERPOLATION", "LOCAL_ESTEP_SECONDS_PER_FINE_COEFFICIENT")
GLOBAL_CONSTANTS = ("GLOBAL_ESTEP_FIXED_SECONDS", "MIN_GLOBAL_ESTEP_SECONDS_PER_PARTICLE")
OFFSET_RANGE_PX, OFFSET_STEP_PX = 5.0, 2.0  # the benchmark jobs' --offset_range and --offset_step


def local_iterations(run, tflops, oversampling=1, skip_first=False):
    """(label, measured E-step s, terms) of each local-search iteration of one benchmark JSON's refine job."""
    job = run["jobs"].get("refine")
    if job is None:
        return []
    n = int(run["n_particles"])
    counts = {}
    rows = []
    skipped = not skip_first
    for it in job["iterations"]:
        if not it.get("local_searches"):
            continue
        if not skipped:
            skipped = True
            continue
        order = int(it["healpix_order"])
        if order not in counts:
            sampling = Sampling(healpix_order=order, offset_range_px=OFFSET_RANGE_PX, offset_step_px=OFFSET_STEP_PX)
            counts[order] = plan.local_neighbourhood_orientations(sampling, oversampling)
        kc, kf = plan.coefficients(int(it["coarse_size_px"])), plan.coefficients(int(it["current_size_px"]))
        label = f"it {it['iteration']} order {order} {it['coarse_size_px']}/{it['current_size_px']} px"
        rows.append((label, float(it["seconds"]["expectation"]), plan.local_estep_terms(n, 1, counts[order], kc, kf,
                                                                                        tflops)))
    return rows


def global_iterations(run, tflops, first_iteration, n_classes=6):
    """(label, measured E-step s, terms (1, particles)) of each class3d iteration from `first_iteration` on whose
    estimate is the floor's (those where the coarse pass's share is larger are left out, and said so)."""
    job = run["jobs"].get("class3d")
    if job is None:
        return []
    n = int(run["n_particles"])
    rows = []
    for it in job["iterations"]:
        if it["iteration"] < first_iteration:
            continue
        sampling = Sampling(healpix_order=int(it["healpix_order"]), offset_range_px=OFFSET_RANGE_PX,
                            offset_step_px=OFFSET_STEP_PX)
        coarse = plan.global_coarse_seconds_per_particle(n_classes, sampling.n_orientations, sampling.n_translations,
                                                         plan.coefficients(int(it["coarse_size_px"])), tflops)
        label = f"it {it['iteration']} order {it['healpix_order']} {it['coarse_size_px']} px"
        if coarse > plan.MIN_GLOBAL_ESTEP_SECONDS_PER_PARTICLE:
            print(f"left out: {label}: the coarse pass's share ({coarse:.2e} s a particle) is above the floor")
            continue
        rows.append((label, float(it["seconds"]["expectation"]), (1.0, float(n))))
    return rows


def fit_constants(terms, measured, fixed_seconds=None):
    """The constants c ≥ 0 minimising Σ((terms·c − measured) / measured)²: least squares on the relative error,
    with c[0] = fixed_seconds when given; a constant that comes out negative is set to 0 and the others fitted
    again."""
    measured = np.asarray(measured, dtype=float)
    a = np.asarray(terms, dtype=float) / measured[:, None]
    target = np.ones(len(a)) - (0.0 if fixed_seconds is None else fixed_seconds * a[:, 0])
    free = np.ones(a.shape[1], dtype=bool)
    free[0] = fixed_seconds is None
    while True:
        c = np.zeros(a.shape[1])
        c[0] = 0.0 if fixed_seconds is None else fixed_seconds
        scale = np.abs(a[:, free]).max(axis=0)  # columns of very different magnitudes: solve on unit columns
        c[free] = np.linalg.lstsq(a[:, free] / scale, target, rcond=None)[0] / scale
        if (c >= 0).all():
            return c
        free &= c > 0


def report(kind, rows, names, fixed_seconds):
    """Print the table and the constants of one kind of search; their JSON."""
    terms = np.array([t for _, _, t in rows])
    measured = np.array([e for _, e, _ in rows])
    now = np.array([getattr(plan, name) for name in names])
    fitted = fit_constants(terms, measured, fixed_seconds)
    print(f"\n{kind}\n{'iteration':64s} {'measured s':>10s} {'plan now':>9s} {'ratio':>6s} {'refit':>7s} {'ratio':>6s}")
    table = []
    for (label, e, _), before, after in zip(rows, terms @ now, terms @ fitted):
        print(f"{label:64s} {e:10.2f} {before:9.2f} {before / e:6.2f} {after:7.2f} {after / e:6.2f}")
        table.append({"iteration": label, "measured_seconds": e, "plan_seconds": before, "refit_seconds": after})
    for name, before, after in zip(names, now, fitted):
        print(f"{name} = {after:.3g}  (now {before:.3g})")
    for name, est in (("plan now", terms @ now), ("refit", terms @ fitted)):
        r = est / measured
        print(f"{name}: estimate / measured {r.min():.2f}–{r.max():.2f}")
    return {"iterations": table, "constants_now": dict(zip(names, now.tolist())),
            "constants_fitted": dict(zip(names, fitted.tolist()))}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="empiar10028.py JSONs with a refine or class3d job")
    parser.add_argument("--tflops", type=float, default=plan.REFERENCE_TFLOPS,
                        help="FP32 peak of the runs' card, as GpuSpec.detect reckons it [default: %(default)s]")
    parser.add_argument("--skip_first_local", action="store_true",
                        help="leave out each run's first local-search iteration")
    parser.add_argument("--class3d_from", type=int, default=6, help="the first class3d iteration fitted [6]")
    parser.add_argument("--json", type=Path, default=None, help="write the tables and the fitted constants here")
    args = parser.parse_args(argv)

    local, global_ = [], []
    for path in args.runs:
        run = json.loads(path.read_text())
        local += [(f"{path.stem}: {label}", e, t) for label, e, t in
                  local_iterations(run, args.tflops, skip_first=args.skip_first_local)]
        global_ += [(f"{path.stem}: {label}", e, t) for label, e, t in
                    global_iterations(run, args.tflops, args.class3d_from)]
    if len(local) < 3 and len({t[1] for _, _, t in global_}) < 2:
        parser.error("nothing to fit: fewer than 3 local-search iterations, and class3d iterations of fewer than "
                     "2 particle counts, in the runs given")
    out = {"runs": [str(p) for p in args.runs], "tflops": args.tflops}
    if len(local) >= 3:
        out["local"] = report("local searches", local, LOCAL_CONSTANTS, plan.LOCAL_ESTEP_FIXED_SECONDS)
    if len({t[1] for _, _, t in global_}) >= 2:
        out["global"] = report("global searches", global_, GLOBAL_CONSTANTS, None)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
