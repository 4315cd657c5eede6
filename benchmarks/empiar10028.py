"""The EMPIAR-10028 benchmark on a stand-in of the same geometry: its Class3D K=6 and auto-refine jobs, with
RELION's standard settings, a Class2D K=100 and an InitialModel with RELION's GUI lines, on particles simulated
from the 7P6Z ribosome model at 360 px and 1.34 Å/px (binned, e.g. to 128 px, for the InitialModel). Prints,
and writes as JSON with --json, each job's wall time, the seconds and particle-iterations per second of every
stage, the FLOP/s of the diff2 stages, the GPU arena's high water, and the job time extrapolated to 105,247
particles where all its iterations ran (none from fewer); --engine numpy runs a tiny version on the CPU. With
--relion, RELION runs the same jobs on the same particles for their first --relion_iterations iterations (VDAM
jobs: their whole line, stopped by --relion_seconds), and the seconds per iteration of both programs are set
side by side.

EMPIAR-10028 (Plasmodium falciparum 80S ribosome; 105,247 particles of 360 × 360 px at 1.34 Å/px,
300 kV) is the data set behind the timings of the RELION-2, GeRelion and Zhang 2018 papers. It
cannot be downloaded here, so this script builds a stand-in of the same geometry in --work:

1. reference  a ribosome density at 1.34 Å/px in a 360 px box from an atomic model (--model, by
              default ../shared/data/real/models/7p6z.cif.gz; `cryorefine.density`, gemmi):
              WORK/reference_360px.mrc.
2. particles  --n particles (default 20,000) simulated from it (`cryorefine.jobs.simulate`, on the GPU in
              batches when there is one): uniform poses, origins within 3 px, CTFs with defocus
              0.8–3 µm, 300 kV, Cs 2.7 mm, Q0 0.1, white noise at SNR 0.05 inside the 360 Å particle
              circle. The job is given WORK/sim_N/particles_unaligned.star, without pose and origin
              columns. Both steps are cached in WORK and reused by later runs with the same settings.
3. jobs       (a) Class3D with RELION's standard settings for this benchmark:
                  classify --K 6 --iter 25 --tau2_fudge 4 --particle_diameter 360 --healpix_order 2
                  --offset_range 5 --offset_step 2 --oversampling 1 --ini_high 60 --firstiter_cc --ctf
                  --flatten_solvent --zero_mask --norm --scale
              (b) auto-refine: refine --healpix_order 2 --auto_local_healpix_order 4 --offset_range 5
                  --offset_step 2 --low_resol_join_halves 40 --particle_diameter 360 --ini_high 60
                  --ctf --flatten_solvent --zero_mask --norm --scale
              (c) Class2D (--jobs class2d, not by default), RELION 5's GUI line with 'Use EM algorithm? Yes'
                  and a mask of 360 Å: class2d --iter 25 --ctf --tau2_fudge 2 --particle_diameter 360 --K 100
                  --flatten_solvent --zero_mask --center_classes --oversampling 1 --psi_step 12
                  --offset_range 5 --offset_step 2 --norm --scale (no reference)
              (c') Class2D as RELION 5's GUI line comes (VDAM; --jobs class2d_vdam, not by default): the same
                  with --grad --class_inactivity_threshold 0.1 --grad_write_iter 10 --iter 200
              (d) InitialModel (--jobs initial_model, not by default), RELION 5's GUI line with a mask of 360 Å:
                  initial_model --iter 200 --grad --denovo_3dref --ctf --K 1 --sym C1 --flatten_solvent
                  --zero_mask --pad 1 --particle_diameter 360 --oversampling 1 --healpix_order 1
                  --offset_range 6 --offset_step 2 --auto_sampling --tau2_fudge 4 (no reference), on a stand-in
                  made as users bin their particles for it: --box 128 --angpix 3.77 (the same 482 Å box)
              run in this process through the command line's own option parsing
              (`cli.config_from_arguments`); --iterations N stops each job after N iterations.
4. report     per job: particle-iterations per second of each stage (image preparation, coarse
              diff2, weights, fine diff2, weighted sums + back-projection, reduction, M-step, I/O),
              the GPU arena's high water per allocator scope, the FLOP/s of the diff2 stages against
              the FP32 peak measured on the card, each iteration's E-step against the cheapest
              local-search iteration's (by HEALPix order; the target is at most 1.5×), and the job's
              time extrapolated to 105,247 particles where all its iterations ran (an iteration not
              measured is never stood in for by one that was); printed as Markdown and written
              as JSON (--json) with the device, versions, date and command.

Warm-up: on the GPU each job first runs for 3 iterations on 200 of the particles, so that the
kernels are compiled before the measurement (CuPy keeps compiled kernels on disk, so a machine
pays this once per version); the auto-refine then runs 2 iterations of local searches from HEALPix
order 4 on them, for the local searches' kernels, which its first 3 iterations do not use. Its
time is reported apart (--no-warmup measures a cold start).

Extrapolation (to 105,247 particles, of a job whose iterations all ran: Class3D's and Class2D's 25, VDAM
Class2D's and InitialModel's 200, an auto-refine's to convergence; none after fewer, as with --iterations): each
measured iteration's plan (the particles put in direction order), E-step and the loop's own time for the outputs
(building the tables, waiting for the writer thread when it lags) scale with the particle count, its M-step does
not. The time outside the iterations (the engine made, the particles read, the initial noise spectra over all
images, the last files written: the run's own named stages, reported apart) scales with the particle count.

`--engine numpy` runs the same at a tiny size on the CPU (the example map examples/ribosome_64px.mrc
cropped to 32 px at 12 Å/px, 120 particles at SNR 1, 2 iterations): a check that the script works, not a
measurement. (Beyond iteration 2 a Class3D of so few particles is slow on the CPU: each seeded class
is reconstructed from 20 particles, and against such weak references the posteriors are broad.)

    python benchmarks/empiar10028.py --work /tmp/e10028 --json benchmarks/results/empiar10028_h100.json
    python benchmarks/empiar10028.py --work /tmp/e10028 --jobs class3d --iterations 4     # a quick look
    python benchmarks/empiar10028.py --work /tmp/e10028 --jobs class3d -- --relion_oversampling  # options for every job
    python benchmarks/empiar10028.py --engine numpy --work /tmp/tiny                     # CPU, tiny
    python benchmarks/empiar10028.py --n 105247 --float16 --jobs class2d --model .bench/7p6z.cif.gz --work /tmp/e105k
    python benchmarks/empiar10028.py --n 105247 --float16 --jobs class2d --model .bench/7p6z.cif.gz --work /tmp/e105k \
        --relion_only --relion /tmp/relion/build/bin/relion_refine_mpi --relion_iterations 4 --relion_seconds 420
    python benchmarks/empiar10028.py --n 105247 --box 128 --angpix 3.77 --jobs initial_model \
        --model .bench/7p6z.cif.gz --work /tmp/e105k_128
    python benchmarks/empiar10028.py --n 105247 --box 128 --angpix 3.77 --jobs initial_model \
        --model .bench/7p6z.cif.gz --work /tmp/e105k_128 --relion_only --relion /tmp/relion/build/bin/relion_refine \
        --relion_launcher "" --relion_extra "--gpu 0 --j 4 --pool 30 --dont_combine_weights_via_disc" \
        --relion_seconds 540         # one process: RELION refuses --grad under MPI without --split_random_halves

RELION beside it (--relion PATH, e.g. RELION 5's relion_refine_mpi built by ../shared/device/relion_build.sh):
each job's line (the refine job's with --auto_refine --split_random_halves, which cryorefine's refine implies) on
the same STAR file, launched by --relion_launcher (default `mpirun --allow-run-as-root -n 3`: a leader and two
workers) with --relion_extra (default `--gpu 0:0 --j 4 --pool 30 --pad 2 --dont_combine_weights_via_disc`: both
workers on GPU 0, as RELION's GUI and tutorial run it on one GPU), --iter --relion_iterations, in WORK/relion_JOB;
--relion_seconds stops it and measures the iterations it finished (a VDAM job runs its whole line, whose
schedule follows its --iter, until --relion_seconds). Both programs' seconds per iteration are read alike, from
when each iteration's run_itNNN_model.star was written (WORK/JOB for cryorefine, WORK/relion_JOB for RELION), and
compared from the first iteration both wrote files of to the last (iteration 1, or a VDAM job's 10th, holds
each program's own start: RELION's from its launch or its iteration-0 files; VDAM writes every 10th iteration's).
--relion_only runs RELION alone, set against cryorefine's files of an earlier run of the same jobs in WORK (one
machine call each), and writes WORK/results_relion.json instead of WORK/results.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import logging
import math
import platform
import shlex
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from bench_common import (
    host_cpus,
    iteration_file_times,
    refuse_missing_programs,
    run_logged,
    seconds_between,
    split_at_double_dash,
)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO.parent / "shared" / "data" / "real" / "models" / "7p6z.cif.gz"
EXAMPLE_MAP = REPO / "examples" / "ribosome_64px.mrc"
FULL_PARTICLES, FULL_ITERATIONS = 105_247, 25
PARTICLE_DIAMETER_ANGSTROM = 360.0
WARMUP_PARTICLES, WARMUP_ITERATIONS = 200, 3  # Class3D: the cross-correlation, seeded and all-class iterations
# the auto-refine's second warm-up: local searches from the first iteration (without it, the first measured local
# iteration compiled their kernels: 3.3 s against 2.2 s in the next run on the same H200 machine)
WARMUP_LOCAL_ITERATIONS, WARMUP_LOCAL_OPTIONS = 2, ("--healpix_order", "4")
STAGES = (  # (label, stage names summed) in the order of an iteration
    ("engine set-up (references, cached coarse slices)", ("setup",)),
    ("waits for the image reads", ("read_wait",)),
    ("image preparation", ("images",)),
    ("local-search orientations", ("orientations",)),
    ("upload + shifted images", ("upload", "coarse_images")),
    ("coarse diff2 (local searches: with their slices, local_diff2)", ("coarse",)),
    ("weights", ("weights",)),
    ("fine set-up (the blocks' orientations and pairs)", ("fine_setup",)),
    ("fine slices (projected once a pair where pairs have many blocks)", ("fine_slices",)),
    ("fine diff2 (the kernel)", ("fine",)),
    ("fine weights (priors, per-particle sums, significance)", ("fine_weights",)),
    ("weighted sums + back-projection", ("sums", "backproject")),
    ("per-particle results (to the host, stored)", ("results",)),
)
STAGE_COLUMNS = ("set-up", "read", "images", "orient.", "upload", "coarse", "weights", "fine set-up", "fine slices",
                 "fine", "fine w.", "sums+BP", "results")
JOB_ARGUMENTS = {
    "class3d": ("classify", ["--K", "{K}", "--iter", "25", "--tau2_fudge", "4", "--particle_diameter", "360",
                             "--healpix_order", "2", "--offset_range", "5", "--offset_step", "2", "--oversampling",
                             "1", "--ini_high", "60", "--firstiter_cc", "--ctf", "--flatten_solvent", "--zero_mask",
                             "--norm", "--scale"]),
    "refine": ("refine", ["--healpix_order", "2", "--auto_local_healpix_order", "4", "--offset_range", "5",
                          "--offset_step", "2", "--low_resol_join_halves", "40", "--particle_diameter", "360",
                          "--ini_high", "60", "--ctf", "--flatten_solvent", "--zero_mask", "--norm", "--scale"]),
    # RELION 5's Class2D GUI line with 'Use EM algorithm? Yes' (tests/data/relion5_class2d_gui_lines.txt), its mask
    # diameter 360 Å as the other jobs'; no --ref: the initial class averages come from random subsets
    "class2d": ("class2d", ["--iter", "25", "--ctf", "--tau2_fudge", "2", "--particle_diameter", "360", "--K", "{K}",
                            "--flatten_solvent", "--zero_mask", "--center_classes", "--oversampling", "1",
                            "--psi_step", "12", "--offset_range", "5", "--offset_step", "2", "--norm", "--scale"]),
    # RELION 5's Class2D GUI line as it comes (VDAM: 'Use EM algorithm? No'), its mask diameter 360 Å
    "class2d_vdam": ("class2d", ["--grad", "--class_inactivity_threshold", "0.1", "--grad_write_iter", "10", "--iter",
                                 "200", "--ctf", "--tau2_fudge", "2", "--particle_diameter", "360", "--K", "{K}",
                                 "--flatten_solvent", "--zero_mask", "--center_classes", "--oversampling", "1",
                                 "--psi_step", "12", "--offset_range", "5", "--offset_step", "2", "--norm",
                                 "--scale"]),
    # RELION 5's InitialModel GUI line (tests/data/relion5_initial_model_gui_lines.txt), its mask diameter 360 Å: VDAM,
    # no --ref; run on the stand-in binned as users bin for this job (--box 128 --angpix 3.77: the same 482 Å box)
    "initial_model": ("initial_model", ["--iter", "200", "--grad", "--denovo_3dref", "--ctf", "--K", "{K}", "--sym",
                                        "C1", "--flatten_solvent", "--zero_mask", "--pad", "1", "--particle_diameter",
                                        "360", "--oversampling", "1", "--healpix_order", "1", "--offset_range", "6",
                                        "--offset_step", "2", "--auto_sampling", "--tau2_fudge", "4"]),
}
#: the jobs' --K without --K
DEFAULT_CLASSES = {"class3d": 6, "class2d": 100, "class2d_vdam": 100, "initial_model": 1}
#: the commands that start without a reference (--ref)
WITHOUT_REFERENCE = ("class2d", "initial_model")
#: the jobs whose schedule follows --iter (VDAM's phases): RELION runs their whole line, stopped by --relion_seconds,
#: not a line of --relion_iterations iterations
GRADIENT_JOBS = ("class2d_vdam", "initial_model")
#: RELION's flags for its GPU runs (--relion), as its GUI and tutorial write them for one GPU shared by two workers
RELION_GPU_FLAGS = "--gpu 0:0 --j 4 --pool 30 --pad 2 --dont_combine_weights_via_disc"
#: what relion_refine needs besides a job's line for what cryorefine's command implies
RELION_JOB_FLAGS = {"refine": ["--auto_refine", "--split_random_halves"]}

log = logging.getLogger("empiar10028")


# ---------------------------------------------------------------------------------------------- inputs
def build_reference(work, args):
    """The reference map in WORK (cached): the atomic model's density, or the tiny example map."""
    from cryorefine.io.mrc import read_volume, write_volume

    finer = "" if args.density_oversample == 2 else f"_oversample{args.density_oversample}"
    path = work / f"reference_{args.box}px_{args.angpix:.3f}A{finer}.mrc"
    if path.exists():
        return path, 0.0
    tic = time.perf_counter()
    if args.engine == "numpy":
        from cryorefine.core.fourier import downsample_volume

        volume, pixel = read_volume(EXAMPLE_MAP)
        volume = downsample_volume(volume, args.box)
    else:
        from cryorefine.density import density_from_model

        if not Path(args.model).is_file():
            sys.exit(f"empiar10028: {args.model}: atomic model not found; give one with --model")
        log.info("density of %s at %.3f Å/px in a %d px box (gemmi, sampled %d× finer) ...", args.model, args.angpix,
                 args.box, args.density_oversample)
        volume = density_from_model(args.model, args.box, args.angpix, oversample=args.density_oversample)
    write_volume(path, volume, args.angpix)
    return path, time.perf_counter() - tic


def simulate_particles(work, reference, args, xp):
    """WORK/sim_N/particles_unaligned.star (cached): simulated particles without their poses and origins."""
    import starfile

    from cryorefine.jobs.simulate import SimulationOptions, simulate

    folder = work / f"sim_{args.n}"
    stamp = folder / "settings.json"
    settings = {"n": args.n, "reference": reference.name, "snr": args.snr, "seed": args.seed, "float16": args.float16}
    unaligned = folder / "particles_unaligned.star"
    if unaligned.exists() and stamp.exists() and json.loads(stamp.read_text()) == settings:
        return unaligned, 0.0
    tic = time.perf_counter()
    options = SimulationOptions(n_particles=args.n, snr=args.snr, defocus_range_um=(0.8, 3.0), astigmatism_um=0.05,
                                voltage_kv=300.0, cs_mm=2.7, amplitude_contrast=0.1, seed=args.seed,
                                particle_diameter_angstrom=PARTICLE_DIAMETER_ANGSTROM, float16=args.float16)
    simulate(reference, folder, options, log=log.debug, xp=xp)
    blocks = starfile.read(folder / "particles.star", always_dict=True)
    blocks["particles"] = blocks["particles"].drop(columns=["rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi",
                                                            "rlnOriginXAngst", "rlnOriginYAngst"], errors="ignore")
    starfile.write(blocks, unaligned)
    stamp.write_text(json.dumps(settings))
    return unaligned, time.perf_counter() - tic


# ---------------------------------------------------------------------------------------------- a job
def warm_up(name, star, reference, work, args):
    """The job for WARMUP_ITERATIONS iterations on the first WARMUP_PARTICLES particles (and the auto-refine for
    WARMUP_LOCAL_ITERATIONS of local searches), so that CuPy compiles the kernels (and caches them on disk, as any
    later run on the machine finds them) before the measurement; returns its seconds."""
    import starfile

    blocks = starfile.read(star, always_dict=True)
    blocks["particles"] = blocks["particles"].head(WARMUP_PARTICLES)
    subset = star.parent / "warmup_particles.star"  # beside the full set: the same relative stack names
    starfile.write(blocks, subset)
    tic = time.perf_counter()
    run_job(name, subset, reference, work / "warmup", args, iterations=WARMUP_ITERATIONS)
    if JOB_ARGUMENTS[name][0] == "refine":
        run_job(name, subset, reference, work / "warmup_local", args, iterations=WARMUP_LOCAL_ITERATIONS,
                extra=WARMUP_LOCAL_OPTIONS)
    return time.perf_counter() - tic


def job_arguments(name, star, reference, out_root, classes=None):
    """The command and the arguments of job `name` (JOB_ARGUMENTS) on `star` into `out_root`: --ref `reference`
    where the job takes one (not WITHOUT_REFERENCE), --K `classes` (default DEFAULT_CLASSES) where it has classes."""
    command, template = JOB_ARGUMENTS[name]
    arguments = ["--i", star, *(["--ref", reference] if command not in WITHOUT_REFERENCE else []), "--o", out_root]
    return command, arguments + [a.format(K=classes or DEFAULT_CLASSES.get(name)) for a in template]


def run_job(name, star, reference, work, args, iterations=None, extra=()):
    """Run one job in this process, `extra` options last; returns its measured figures."""
    from cryorefine.cli import config_from_arguments

    command, arguments = job_arguments(name, star, reference, work / name / "run", args.K)
    iterations = iterations or args.iterations
    if iterations:
        arguments += ["--iter", str(iterations)]
    arguments += ["--cpu"] if args.engine == "numpy" else ["--gpu", str(args.gpu)]
    if args.batch:
        arguments += ["--batch", str(args.batch)]
    arguments += [str(a) for a in args.job_options]
    arguments += list(extra)
    if args.arena_gb and args.engine != "numpy":  # leave free all but --arena_gb of what the device has free now
        import cupy

        with cupy.cuda.Device(args.gpu):
            free_bytes = cupy.cuda.runtime.memGetInfo()[0]
        arguments += ["--free_gpu_memory", f"{max(0.0, free_bytes - args.arena_gb * 1e9) / 2 ** 20:.0f}"]
    config = config_from_arguments(command, arguments)
    from cryorefine.estep.backend import make_backend
    from cryorefine.jobs import class2d, classify, initial_model, refine
    from cryorefine.runners.serial import SerialRunner

    log.info("%s: cryorefine %s %s", name, command, " ".join(map(str, arguments)))
    tic = time.perf_counter()
    backend = make_backend(config, None if args.engine == "numpy" else args.gpu)
    runner = SerialRunner(backend, config.batch_size_for, config.preread_images)
    engine_seconds = time.perf_counter() - tic
    job = {"classify": classify, "refine": refine, "class2d": class2d, "initial_model": initial_model}[command]
    progress = None if args.keep_maps is None else MapPruner(work / name, args.keep_maps)
    # the benchmark's own folders: a run again with the same --work replaces the last one's files
    reports = job.run(config, runner, argv=[command, *map(str, arguments)], progress=progress, overwrite=True)
    wall = time.perf_counter() - tic
    if progress is not None:  # the last iteration's maps were written after the last batch
        progress.close()
    iterations = [{
        "iteration": r.iteration, "current_size_px": r.current_size_px, "coarse_size_px": r.coarse_size_px,
        "resolution_angstrom": r.resolution_angstrom, "healpix_order": r.healpix_order,
        "local_searches": r.local_searches, "seconds": dict(r.seconds), "stage_seconds": dict(r.stage_seconds),
        "stage_flops": dict(r.stage_flops)} for r in reports]
    peaks = list(backend.iteration_peak_bytes)
    if iterations and len(peaks) >= len(iterations):  # the arena's peak in use in each iteration (the scopes
        for it, peak in zip(iterations, peaks[-len(iterations):]):  # before them: the initial noise pass)
            it["arena_peak_bytes"] = peak
    return {"command": f"cryorefine {command} " + " ".join(map(str, arguments)), "wall_seconds": wall,
            "start_stages": {"engine made (the device's context, the arena)": engine_seconds,
                             **reports.start_seconds},
            "end_stages": dict(reports.end_seconds), "iterations": iterations,
            "arena_high_water_bytes": dict(backend.high_water_bytes)}


class MapPruner:
    """--keep_maps as a job's progress callback, called after every batch: `prune_half_maps` on a thread of its own,
    one pass at a time (a call while one runs starts none), so that the job's main thread, which drives the GPU,
    neither lists the folder every batch nor waits for the file system to unlink the old maps (1.6 s of a 10k
    Class3D's 25 iterations at 360 px, the main thread sampled); `close` waits for it and prunes once more."""

    def __init__(self, folder, keep):
        self.folder, self.keep = folder, keep
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prune maps")
        self.running = None

    def __call__(self, *_progress):
        if self.running is None or self.running.done():
            self.running = self.pool.submit(prune_half_maps, self.folder, self.keep)

    def close(self):
        self.pool.shutdown(wait=True)
        if self.running is not None:
            self.running.result()  # its error, if it had one
        prune_half_maps(self.folder, self.keep)


def prune_half_maps(folder, keep):
    """Delete the iteration maps (`run_itNNN_*class*.mrc`) of all but the `keep` newest iterations in `folder`
    (--keep_maps, through `MapPruner`): at 800 px RELION's naming writes 4 GB of half maps an iteration."""
    maps = sorted(folder.glob("run_it[0-9][0-9][0-9]_*class*.mrc"))
    iterations = sorted({path.name[6:9] for path in maps})
    kept = set(iterations[-keep:]) if keep > 0 else set()
    for path in maps:
        if path.name[6:9] not in kept:
            path.unlink(missing_ok=True)


def job_iterations(name, capped_at=None):
    """The iterations of job `name` as a user runs it: its line's --iter (JOB_ARGUMENTS; Class3D's and Class2D's 25,
    InitialModel's 200), or None for an auto-refine, which runs to convergence, unless `capped_at` (--iterations)
    stopped it: then math.inf (no run of it is the whole job)."""
    template = [str(a) for a in JOB_ARGUMENTS[name][1]]
    if "--iter" in template:
        return int(template[template.index("--iter") + 1])
    return math.inf if capped_at else None


def summarise(job, n_particles, peak_flops, iterations=FULL_ITERATIONS):
    """Particle-iterations per second per stage, FLOP/s, and the job time extrapolated to the full particle count
    where every one of the job's `iterations` was measured (`job_iterations`; None: as many as it ran, an
    auto-refine to convergence); otherwise none."""
    its = job["iterations"]
    n_its = len(its)
    total = {}
    flops = {}
    for it in its:
        for name, seconds in it["stage_seconds"].items():
            total[name] = total.get(name, 0.0) + seconds
        for name, count in it["stage_flops"].items():
            flops[name] = flops.get(name, 0.0) + count
    m_step = sum(it["seconds"].get("maximization", 0.0) for it in its)
    writing = sum(it["seconds"].get("write", 0.0) for it in its)
    planning = sum(it["seconds"].get("plan", 0.0) for it in its)
    e_step = sum(it["seconds"].get("expectation", 0.0) for it in its)
    work = n_particles * n_its
    rows = []
    for label, names in STAGES:
        seconds = sum(total.get(n, 0.0) for n in names)
        rows.append({"stage": label, "seconds": seconds, "particle_iterations_per_second": work / seconds
                     if seconds > 0 else None})
    accounted = sum(total.values())
    rows.append({"stage": "E-step, other (in no named stage)", "seconds": max(e_step - accounted, 0.0),
                 "particle_iterations_per_second": None})
    rows.append({"stage": "reduction (one process: none)", "seconds": 0.0, "particle_iterations_per_second": None})
    rows.append({"stage": "iteration plans (schedule, work units, particles in direction order)", "seconds": planning,
                 "particle_iterations_per_second": work / planning if planning > 0 else None})
    rows.append({"stage": "M-step", "seconds": m_step, "particle_iterations_per_second": work / m_step
                 if m_step > 0 else None})
    rows.append({"stage": "I/O (iteration outputs)", "seconds": writing, "particle_iterations_per_second":
                 work / writing if writing > 0 else None})
    loop = planning + e_step + m_step + writing
    rows.append({"stage": "whole iterations", "seconds": loop, "particle_iterations_per_second": work / loop
                 if loop > 0 else None})
    achieved = {}
    for name in ("coarse", "fine"):
        if flops.get(name) and total.get(name):
            rate = flops[name] / total[name]
            achieved[name] = {"tflops": rate / 1e12, "fraction_of_fp32_peak": rate / peak_flops if peak_flops else None}
    start = max(job["wall_seconds"] - loop, 0.0)  # the start and the end of the run, outside every iteration
    named = {**job.get("start_stages", {}), **{f"end: {k}": v for k, v in job.get("end_stages", {}).items()}}
    outside = {**named, "in no named stage": max(start - sum(named.values()), 0.0)}
    scale = FULL_PARTICLES / n_particles
    per_iteration = [(it["seconds"].get("expectation", 0.0) + it["seconds"].get("write", 0.0)
                      + it["seconds"].get("plan", 0.0)) * scale + it["seconds"].get("maximization", 0.0) for it in its]
    # only in particles: an iteration not measured is not stood in for by one that was (later iterations cost
    # differently: other sizes, samplings, searches), so fewer measured iterations than the job's give no figure
    whole_job = iterations is None or n_its >= iterations
    # all the particles and every iteration measured: the job's own wall time is the figure, nothing extrapolated
    measured_whole = whole_job and scale <= 1
    counted = per_iteration if iterations is None else per_iteration[:int(min(iterations, n_its))]
    extrapolated = start * scale + sum(counted) if whole_job and not measured_whole else None
    return {"stages": rows, "achieved_flops": achieved, "start_seconds": start, "outside_iterations": outside,
            "estep_relative_to_cheapest_local": relative_to_cheapest_local(its),
            "extrapolated_seconds": extrapolated, "measured_iterations": n_its,
            "extrapolation": ("none: the whole job ran on all the particles" if measured_whole else
                              f"{FULL_PARTICLES} particles from {n_particles} particles × {len(counted)} measured "
                              "iterations" if whole_job else
                              f"none: {n_its} of the job's {iterations} iterations measured" if iterations < math.inf
                              else f"none: the auto-refine was stopped after {n_its} iterations (--iterations)")}


def relative_to_cheapest_local(its):
    """The 1.5× target: each iteration's E-step against that of the cheapest local-search iteration (one job,
    one particle count: per particle alike), as ranges per HEALPix order and search, the last iteration apart (an
    auto-refine's final one, at the whole box). None without a local-search iteration."""
    local = [it for it in its if it["local_searches"]]
    if not local:
        return None
    cheapest = min(local, key=lambda it: it["seconds"]["expectation"])
    base = cheapest["seconds"]["expectation"]
    groups = {}
    for it in its:
        last = it is its[-1]
        key = "last" if last else f"order {it['healpix_order']} {'local' if it['local_searches'] else 'global'}"
        groups.setdefault(key, []).append((it["iteration"], it["seconds"]["expectation"] / base))
    rows = [{"group": key, "iterations": [i for i, _ in v], "min": min(r for _, r in v), "max": max(r for _, r in v)}
            for key, v in groups.items()]
    worst = max(its, key=lambda it: it["seconds"]["expectation"])
    return {"cheapest_iteration": cheapest["iteration"], "cheapest_seconds": base, "groups": rows,
            "worst_iteration": worst["iteration"], "worst_ratio": worst["seconds"]["expectation"] / base}


# ---------------------------------------------------------------------------------------------- RELION
def with_iterations(arguments, iterations):
    """The arguments with --iter set to `iterations` (its value replaced where the line has one: relion_refine
    reads the first --iter of a line)."""
    arguments = [str(a) for a in arguments]
    if "--iter" in arguments:
        at = arguments.index("--iter")
        return arguments[:at + 1] + [str(iterations)] + arguments[at + 2:]
    return arguments + ["--iter", str(iterations)]


def run_relion(name, star, reference, work, args):
    """RELION on job `name`'s line for --relion_iterations iterations (a GRADIENT_JOBS line as it is, its schedule
    following its --iter: stopped by --relion_seconds) in WORK/relion_NAME (run where the STAR file is, whose image
    names are relative to it); its command, exit code ("stopped" after --relion_seconds), wall seconds and the
    seconds from its launch to each iteration's files."""
    folder = work / f"relion_{name}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    _, arguments = job_arguments(name, star.name, Path(reference).absolute(), folder.absolute() / "run", args.K)
    program = shlex.split(args.relion)
    if Path(program[0]).exists():
        program[0] = str(Path(program[0]).absolute())
    line = arguments + RELION_JOB_FLAGS.get(name, [])
    whole = name in GRADIENT_JOBS
    command = [*shlex.split(args.relion_launcher), *program,
               *(map(str, line) if whole else with_iterations(line, args.relion_iterations)),
               *shlex.split(args.relion_extra)]
    log.info("%s: RELION for %s: %s", name,
             "its line's iterations" if whole else f"{args.relion_iterations} iterations", shlex.join(command))
    launched = time.time()
    code, wall = run_logged(command, folder / "relion.log", star.parent, args.relion_seconds)
    times = iteration_file_times(folder)
    return {"command": shlex.join(command), "returncode": code, "wall_seconds": wall,
            "seconds_from_launch": {it: t - launched for it, t in sorted(times.items())}}


def compare_with_relion(name, work, relion, job=None):
    """cryorefine's and RELION's seconds per iteration from their iteration files, and from the first iteration both
    wrote files of (1; a gradient job's every --grad_write_iter-th: 10) to the last one both wrote, the ratio RELION /
    cryorefine over those iterations; with `job` (cryorefine's run in this process) its whole iterations' seconds from
    its own reports beside them. A row's seconds are from the iteration files before it (those of several
    iterations where the files skip some) divided by the iterations between. Iteration 1 alone as well, where both
    wrote its files and iteration 0's (`first_iteration`: at ~400 s a RELION iteration, as the 105k Class2D's, a
    measurement may end before RELION's second)."""
    ours = iteration_file_times(work / name)
    theirs = {int(it): t for it, t in relion["seconds_from_launch"].items()}
    ours_per_iteration = seconds_between(ours)
    theirs_per_iteration = seconds_between({0: 0.0, **theirs})  # RELION's first files: from its launch (time 0)
    rows = []
    for it in sorted(set(ours) | set(theirs)):
        if it < 1:
            continue
        row = {"iteration": it, "cryorefine_seconds": ours_per_iteration.get(it),
               "relion_seconds": theirs_per_iteration.get(it)}
        reports = [r for r in (job or {}).get("iterations", []) if r["iteration"] == it]
        if reports:
            row["cryorefine_reported_seconds"] = sum(reports[0]["seconds"].get(k, 0.0)
                                                     for k in ("plan", "expectation", "maximization", "write"))
        rows.append(row)
    both = sorted(it for it in set(ours) & set(theirs) if it >= 1)
    result = {"iterations": rows, "relion_start_seconds": theirs.get(0)}
    if len(both) >= 2:
        first, last = both[0], both[-1]
        result.update(compared_iterations=[first + 1, last], cryorefine_seconds=ours[last] - ours[first],
                      relion_seconds=theirs[last] - theirs[first])
        result["ratio"] = result["relion_seconds"] / max(result["cryorefine_seconds"], 1e-9)
    if all(0 in times and 1 in times for times in (ours, theirs)):  # iteration 1 alone, from the iteration-0 files
        first = {"cryorefine_seconds": ours[1] - ours[0], "relion_seconds": theirs[1] - theirs[0]}
        result["first_iteration"] = {**first, "ratio": first["relion_seconds"] / max(first["cryorefine_seconds"], 1e-9)}
    return result


def format_relion(results):
    lines = []
    for name, relion in results.get("relion", {}).items():
        c = relion["comparison"]
        lines += ["", f"### RELION, {name}: {relion['command']}", "",
                  f"exit code {relion['returncode']}, wall {relion['wall_seconds']:.0f} s"
                  + ("" if c["relion_start_seconds"] is None else
                     f", its iteration-0 files {c['relion_start_seconds']:.0f} s after its launch"), "",
                  "| iteration | cryorefine s (files) | cryorefine s (its report) | RELION s (files) |", "|---|---|---|---|"]
        for row in c["iterations"]:
            cells = [row.get(k) for k in ("cryorefine_seconds", "cryorefine_reported_seconds", "relion_seconds")]
            lines.append(f"| {row['iteration']} | " + " | ".join("—" if v is None else f"{v:.1f}" for v in cells) + " |")
        if "ratio" in c:
            first, last = c["compared_iterations"]
            lines.append(f"\niterations {first}–{last}: cryorefine {c['cryorefine_seconds']:.1f} s, RELION "
                         f"{c['relion_seconds']:.1f} s: RELION / cryorefine = {c['ratio']:.1f}×")
        else:
            lines.append("\nno iteration after the first finished by both programs: no ratio")
        if "first_iteration" in c:
            f = c["first_iteration"]
            lines.append(f"\niteration 1 alone (from each program's iteration-0 files): cryorefine "
                         f"{f['cryorefine_seconds']:.1f} s, RELION {f['relion_seconds']:.1f} s: RELION / cryorefine = "
                         f"{f['ratio']:.1f}×")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- report
def device_info(args):
    import cryorefine

    info = {"host": platform.node(), "python": platform.python_version(), "numpy": np.__version__,
            "cryorefine": cryorefine.__version__, "engine": args.engine, "host_cpus": host_cpus()}
    if args.engine == "cuda":
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(args.gpu)
        info.update(device=props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
                    cupy=cupy.__version__, cuda_runtime=cupy.cuda.runtime.runtimeGetVersion(),
                    cuda_driver=cupy.cuda.runtime.driverGetVersion())
    else:
        info["device"] = f"CPU ({platform.processor() or platform.machine()})"
    return info


def measured_fp32_peak(args):
    if args.engine != "cuda":
        return None
    import cupy

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from estep_throughput import measure_fp32_peak

    with cupy.cuda.Device(args.gpu):
        return measure_fp32_peak(cupy)


def format_report(results):
    lines = [f"EMPIAR-10028 stand-in: {results['n_particles']} particles, {results['box_px']} px at "
             f"{results['pixel_size_angstrom']} Å/px; {results['info']['device']}"
             + (f", FP32 peak {results['fp32_peak_tflops']:.1f} TFLOP/s (measured)"
                if results.get("fp32_peak_tflops") else "")]
    lines.append(f"inputs: reference {results['reference_seconds']:.1f} s, simulation {results['simulate_seconds']:.1f} s"
                 " (0: cached)")
    for name, job in results["jobs"].items():
        s = job["summary"]
        lines += ["", f"### {name}: {job['command']}", "",
                  "| iteration | size px (coarse) | resolution Å | E-step s | M-step s | write s | arena peak GB |",
                  "|---|---|---|---|---|---|---|"]
        for it in job["iterations"]:
            sec = it["seconds"]
            peak = it.get("arena_peak_bytes")
            lines.append(f"| {it['iteration']} | {it['current_size_px']} ({it['coarse_size_px']}) | "
                         f"{it['resolution_angstrom']:.1f} | {sec.get('expectation', 0):.1f} | "
                         f"{sec.get('maximization', 0):.1f} | {sec.get('write', 0):.1f} | "
                         f"{'—' if peak is None else f'{peak / 1e9:.2f}'} |")
        lines += ["", "E-step seconds per stage and iteration (columns in the order of the stage table below; "
                  "other: in no named stage):", "",
                  "| it. | order | " + " | ".join(short for short in STAGE_COLUMNS) + " | other | E-step |",
                  "|---" * (len(STAGE_COLUMNS) + 4) + "|"]
        for it in job["iterations"]:
            st = it["stage_seconds"]
            cells = [sum(st.get(n, 0.0) for n in names) for _, names in STAGES]
            e_step = it["seconds"].get("expectation", 0.0)
            lines.append(f"| {it['iteration']} | {it['healpix_order']}{' L' if it['local_searches'] else ''} | "
                         + " | ".join(f"{c:.2f}" for c in cells)
                         + f" | {max(e_step - sum(st.values()), 0.0):.2f} | {e_step:.2f} |")
        lines += ["", "| stage | seconds | particle-iterations/s |", "|---|---|---|"]
        for row in s["stages"]:
            rate = row["particle_iterations_per_second"]
            lines.append(f"| {row['stage']} | {row['seconds']:.1f} | {'—' if rate is None else f'{rate:,.0f}'} |")
        for stage, a in s["achieved_flops"].items():
            frac = a["fraction_of_fp32_peak"]
            lines.append(f"\n{stage} diff2 stage: {a['tflops']:.1f} TFLOP/s"
                         + (f" ({100 * frac:.0f} % of the FP32 peak)" if frac else ""))
        hw = job["arena_high_water_bytes"]
        if hw:
            lines.append("\nGPU arena high water (GB): " + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in hw.items()))
        if job.get("warmup_seconds") is not None:
            lines.append(f"\nwarm-up before the measurement (kernel compilation; CuPy caches kernels on disk, so "
                         f"later runs on this machine skip most of it): {job['warmup_seconds']:.0f} s")
        rel = s.get("estep_relative_to_cheapest_local")
        if rel:
            ranges = (f"{g['group']} {g['min']:.2f}" + (f"–{g['max']:.2f}×" if g["max"] > g["min"] else "×")
                      for g in rel["groups"])
            lines.append(f"\nE-step against the cheapest local-search iteration ({rel['cheapest_iteration']}, "
                         f"{rel['cheapest_seconds']:.2f} s; the target: at most 1.5×): " + ", ".join(ranges))
        if s.get("outside_iterations"):
            lines.append("\noutside the iterations (s): " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                                      s["outside_iterations"].items()))
        extrapolated = (f"{s['extrapolated_seconds'] / 60:.1f} min ({s['extrapolation']})"
                        if s["extrapolated_seconds"] is not None else s["extrapolation"])
        lines.append(f"\njob wall time {job['wall_seconds']:.0f} s (start {s['start_seconds']:.0f} s); extrapolated "
                     f"to {FULL_PARTICLES:,} particles: {extrapolated}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/cryorefine_empiar10028"))
    parser.add_argument("--engine", choices=["cuda", "numpy"], default=None,
                        help="cuda (default when CuPy sees a GPU) or numpy (tiny size, CPU)")
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="atomic model of the reference")
    parser.add_argument("--n", type=int, default=None, help="particles (default 20,000; 120 with numpy)")
    parser.add_argument("--box", type=int, default=None, help="box in px (default 360; 32 with numpy)")
    parser.add_argument("--angpix", type=float, default=None, help="Å/px (default 1.34; 12 with numpy)")
    parser.add_argument("--snr", type=float, default=None, help="default 0.05; 1 with numpy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--density_oversample", type=int, default=2,
                        help="gemmi samples the model's density on a grid this many times finer than the box (default "
                             "2; 1 takes an eighth of the time and memory, e.g. for an 800 px box, at the cost of more "
                             "aliasing near Nyquist)")
    parser.add_argument("--K", type=int, default=None,
                        help=f"classes of the Class3D and Class2D jobs (default {DEFAULT_CLASSES['class3d']} and "
                             f"{DEFAULT_CLASSES['class2d']})")
    parser.add_argument("--jobs", nargs="+", choices=sorted(JOB_ARGUMENTS), default=["class3d", "refine"])
    parser.add_argument("--iterations", type=int, default=None,
                        help="stop each job after this many iterations (default: 25 for Class3D, convergence for "
                             "refine; 2 with numpy)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--batch", type=int, default=None, help="the jobs' --batch (particles per E-step batch)")
    parser.add_argument("--float16", action="store_true",
                        help="simulate the stack in float16 (MRC mode 12): 27 GB for 105,247 particles instead of 55")
    parser.add_argument("--arena_gb", type=float, default=None,
                        help="run the jobs in a GPU memory arena of this many GB (--free_gpu_memory set to leave the "
                             "rest of the device's free memory alone)")
    parser.add_argument("--keep_maps", type=int, default=None,
                        help="keep the maps of only this many of the newest iterations as the jobs run (the 800 px "
                             "auto-refine writes 4 GB of half maps an iteration; 2 keeps it on a 64 GB disk)")
    parser.add_argument("--relion", default=None,
                        help="also run RELION's relion_refine_mpi (this path or command) on each job for "
                             "--relion_iterations iterations, and compare the seconds per iteration")
    parser.add_argument("--relion_launcher", default="mpirun --allow-run-as-root -n 3",
                        help="put before RELION's command (default: %(default)s; '' for none)")
    parser.add_argument("--relion_extra", default=RELION_GPU_FLAGS,
                        help="added to RELION's line (default: %(default)s)")
    parser.add_argument("--relion_iterations", type=int, default=3, help="RELION's --iter (default 3)")
    parser.add_argument("--relion_seconds", type=float, default=None,
                        help="stop RELION after this many seconds; the iterations it finished are compared")
    parser.add_argument("--relion_only", action="store_true",
                        help="run RELION alone, against cryorefine's files of an earlier run of the same jobs in "
                             "--work (results in WORK/results_relion.json)")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help=f"measure without first running each job on {WARMUP_PARTICLES} particles for "
                             f"{WARMUP_ITERATIONS} iterations (which compiles the GPU kernels outside the measurement)")
    argv, job_options = split_at_double_dash(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.job_options = job_options  # after `--`: options added to every job's command line
    if args.relion_only and not args.relion:
        parser.error("--relion_only: give RELION's relion_refine_mpi with --relion")
    refuse_missing_programs(parser, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.engine is None:
        from cryorefine.estep.backend import cupy_available

        args.engine = "cuda" if cupy_available() else "numpy"
    tiny = args.engine == "numpy"
    args.n = args.n or (120 if tiny else 20_000)
    args.box = args.box or (32 if tiny else 360)
    args.angpix = args.angpix or (12.0 if tiny else 1.34)
    args.iterations = args.iterations or (2 if tiny else None)
    args.snr = args.snr or (1.0 if tiny else 0.05)
    args.work.mkdir(parents=True, exist_ok=True)

    if args.engine == "cuda":
        import cupy

        xp = cupy
        cupy.cuda.Device(args.gpu).use()
    else:
        xp = np
    reference, reference_seconds = build_reference(args.work, args)
    star, simulate_seconds = simulate_particles(args.work, reference, args, xp)
    if xp is not np:
        xp.get_default_memory_pool().free_all_blocks()  # the jobs' arena takes the card's free memory
    peak = None if args.relion_only else measured_fp32_peak(args)
    results = {"date": datetime.date.today().isoformat(), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
               "info": device_info(args), "n_particles": args.n, "box_px": args.box, "pixel_size_angstrom": args.angpix,
               "fp32_peak_tflops": peak / 1e12 if peak else None, "reference_seconds": reference_seconds,
               "simulate_seconds": simulate_seconds, "jobs": {}}
    saved = args.work / ("results_relion.json" if args.relion_only else "results.json")
    for name in args.jobs:
        job = None
        if not args.relion_only:
            warmup = warm_up(name, star, reference, args.work, args) if args.engine == "cuda" and args.warmup else None
            job = run_job(name, star, reference, args.work, args)
            job["warmup_seconds"] = warmup
            job["summary"] = summarise(job, args.n, peak, job_iterations(name, args.iterations))
            results["jobs"][name] = job
            saved.write_text(json.dumps(results, indent=1))
        if args.relion:
            relion = run_relion(name, star, reference, args.work, args)
            relion["comparison"] = compare_with_relion(name, args.work, relion, job)
            results.setdefault("relion", {})[name] = relion
            saved.write_text(json.dumps(results, indent=1))
    text = format_report(results) + format_relion(results)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
