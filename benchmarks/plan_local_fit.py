"""`cryorefine plan`'s E-step estimate for local searches, against measured auto-refines, and its constants fitted again.

`plan` estimates a local-search iteration's E-step as a fixed cost, plus one per particle, plus one per trilinear
interpolation of the coarse pass (particles × classes × neighbourhood orientations × coarse coefficients), plus one
per coefficient at the current size (`jobs.plan.local_estep_terms`). This script reads the JSONs of
`empiar10028.py --jobs refine` runs, takes every local-search iteration of each (the neighbourhood at its HEALPix
order as `plan` counts it, the sizes the run logged), prints the estimate with the constants in `jobs/plan.py`
against the measured E-step, then fits the last three constants to all the runs given at once (least squares on
the relative error; the fixed cost stays, as runs of one particle count cannot tell it from the per-particle one)
and prints the estimate with those:

    python benchmarks/plan_local_fit.py benchmarks/results/refine_10k_h200_532ba37.json [more JSONs] [--json F]

The constants in jobs/plan.py are this script's fit to two runs on the H100 SXM of the reference (2026-11-26; 62
local iterations; estimate / measured 0.90–1.14 there, 0.85–1.21 on the H200 runs 532ba37 and local_warmup):

    python benchmarks/plan_local_fit.py benchmarks/results/refine_10k_h100_8d39878.json \
        benchmarks/results/refine_10k_h100_project_chunk_barriers.json

--skip_first_local leaves out each run's first local iteration (where a run on a fresh machine still meets
first-use costs). --tflops: the FP32 peak of the runs' card as `GpuSpec.detect` reckons it (by default the
fit's reference card, so that the constants come out for it).
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

CONSTANT_NAMES = ("LOCAL_ESTEP_FIXED_SECONDS", "LOCAL_ESTEP_SECONDS_PER_PARTICLE",
                  "LOCAL_ESTEP_SECONDS_PER_INTERPOLATION", "LOCAL_ESTEP_SECONDS_PER_FINE_COEFFICIENT")


def local_iterations(run, tflops, offset_range_px=5.0, offset_step_px=2.0, oversampling=1, skip_first=False):
    """(label, measured E-step s, terms) of each local-search iteration of one benchmark JSON's refine job."""
    job = run["jobs"]["refine"]
    n = int(run["n_particles"])
    counts = {}
    rows = []
    for it in job["iterations"]:
        if not it.get("local_searches"):
            continue
        if skip_first and not rows and not counts.get("skipped"):
            counts["skipped"] = True
            continue
        order = int(it["healpix_order"])
        if order not in counts:
            sampling = Sampling(healpix_order=order, offset_range_px=offset_range_px, offset_step_px=offset_step_px)
            counts[order] = plan.local_neighbourhood_orientations(sampling, oversampling)
        kc, kf = plan.coefficients(int(it["coarse_size_px"])), plan.coefficients(int(it["current_size_px"]))
        label = f"it {it['iteration']} order {order} {it['coarse_size_px']}/{it['current_size_px']} px"
        rows.append((label, float(it["seconds"]["expectation"]), plan.local_estep_terms(n, 1, counts[order], kc, kf,
                                                                                        tflops)))
    return rows


def fit_constants(terms, measured, fixed_seconds):
    """The constants c ≥ 0, c[0] = fixed_seconds, minimising Σ((terms·c − measured) / measured)²: least squares on
    the relative error; a constant that comes out negative is set to 0 and the others fitted again."""
    measured = np.asarray(measured, dtype=float)
    a = np.asarray(terms, dtype=float) / measured[:, None]
    target = 1.0 - fixed_seconds * a[:, 0]
    free = np.ones(a.shape[1], dtype=bool)
    free[0] = False
    while True:
        c = np.zeros(a.shape[1])
        c[0] = fixed_seconds
        scale = np.abs(a[:, free]).max(axis=0)  # columns of very different magnitudes: solve on unit columns
        c[free] = np.linalg.lstsq(a[:, free] / scale, target, rcond=None)[0] / scale
        if (c >= 0).all():
            return c
        free &= c > 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="empiar10028.py JSONs with a refine job")
    parser.add_argument("--tflops", type=float, default=plan.REFERENCE_TFLOPS,
                        help="FP32 peak of the runs' card, as GpuSpec.detect reckons it [default: %(default)s]")
    parser.add_argument("--skip_first_local", action="store_true",
                        help="leave out each run's first local-search iteration")
    parser.add_argument("--json", type=Path, default=None, help="write the table and the fitted constants here")
    args = parser.parse_args(argv)

    rows = []
    for path in args.runs:
        run = json.loads(path.read_text())
        rows += [(f"{path.stem}: {label}", e, t) for label, e, t in
                 local_iterations(run, args.tflops, skip_first=args.skip_first_local)]
    if len(rows) < 3:
        parser.error("fewer than 3 local-search iterations in the runs given: nothing to fit")
    terms = np.array([t for _, _, t in rows])
    measured = np.array([e for _, e, _ in rows])
    now = np.array([getattr(plan, name) for name in CONSTANT_NAMES])
    fitted = fit_constants(terms, measured, plan.LOCAL_ESTEP_FIXED_SECONDS)
    table = []
    print(f"{'iteration':60s} {'measured s':>10s} {'plan now':>9s} {'ratio':>6s} {'refit':>7s} {'ratio':>6s}")
    for (label, e, t), before, after in zip(rows, terms @ now, terms @ fitted):
        print(f"{label:60s} {e:10.2f} {before:9.2f} {before / e:6.2f} {after:7.2f} {after / e:6.2f}")
        table.append({"iteration": label, "measured_seconds": e, "plan_seconds": before, "refit_seconds": after})
    for name, before, after in zip(CONSTANT_NAMES, now, fitted):
        print(f"{name} = {after:.3g}  (now {before:.3g})")
    for name, est in (("plan now", terms @ now), ("refit", terms @ fitted)):
        r = est / measured
        print(f"{name}: estimate / measured {r.min():.2f}–{r.max():.2f}")
    if args.json:
        args.json.write_text(json.dumps({"runs": [str(p) for p in args.runs], "tflops": args.tflops,
                                         "iterations": table,
                                         "constants_now": dict(zip(CONSTANT_NAMES, now.tolist())),
                                         "constants_fitted": dict(zip(CONSTANT_NAMES, fitted.tolist()))}, indent=1))


if __name__ == "__main__":
    main()
