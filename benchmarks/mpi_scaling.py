"""Several GPUs: the Class3D K=6 job and an auto-refine on 1, 2, 4, 8 GPUs of one host, as a user runs them.

The inputs are the EMPIAR-10028 stand-in of empiar10028.py (a 7P6Z ribosome density, --n particles of
360 px at 1.34 Å/px, SNR 0.05; built once and cached in --work). Each job has RELION's settings of that
benchmark (empiar10028.JOB_ARGUMENTS) and runs through the command line, as a user would:

    1 GPU      python -m cryorefine classify|refine ... --gpu 0               (one process)
    W GPUs     mpirun -n W+1 python -m cryorefine ... --gpu 0:1:…:W-1 --j 4 --pool 30 --preread_images
               --dont_combine_weights_via_disc                                 (a master and W workers)

The MPI runs carry the flags RELION's GUI and tutorial write (--gui_flags; '' for none), as users launch them;
the one-process run is the plain line it is compared with.

Before the measurements the Class3D job runs on 200 of the particles for 3 iterations, so that CuPy
compiles the kernels and caches them on disk for every later process (--no-warmup: measure a cold start).

Reported per run: the job's wall time (the process's, start to exit; of it the seconds outside the iterations: from
the launch to the run's own clock, the run's start and end as it logs them, and from its last line to the exit), the
speed-up over one GPU, per iteration the E- and M-step, the E-step's stages summed over the workers (so a stage's
seconds per worker are its sum / W), the MPI stages (broadcast of the plan and model by the master, reduction of
the sums by the workers, sums to their makers, the M-step on the workers (as rank 1 saw it), the new model to
the master; results of older code name the M-step's parts "sums to rank 1" and "M-step on rank 1"), the batches a
worker took over from another's share (which it reads from the stacks), the set-up
before iteration 1 (reading, the initial noise pass, the references), and the GPU arena's high water
of each worker. Parity with one GPU, from the last iteration's files: the class distribution, each
class map's correlation with the one-GPU map, and the particles in the same class.

With --kill K, after the jobs: the Class3D job on the most GPUs of --workers for K+2 iterations, once whole and
once with worker 2 killed (SIGKILL, CRYOREFINE_FAULT) at its first batch of iteration K; reported are the killed
job's exit code, its last lines and the seconds from the kill to the launcher's exit; then --continue from the
last iteration it completed on one GPU (one process) to iteration K+2, and its parity with the whole run.

    python benchmarks/mpi_scaling.py --work /tmp/e10028 --n 20000 --workers 1 2 --json out.json
    python benchmarks/mpi_scaling.py --engine numpy --work /tmp/tiny     # CPU, tiny: the script works
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common  # noqa: E402  (the package's fingerprint, the host's CPUs)
import empiar10028  # noqa: E402  (the stand-in and the jobs' settings)

log = logging.getLogger("mpi_scaling")
ITERATION = re.compile(r"^iteration (\d+): .*, E ([\d.]+) s, M ([\d.]+) s$")
STAGES = re.compile(r"^  ([EM])-step stages \(s\): (.*)$")
WORKER_WALLS = re.compile(r"^  the workers' E-steps \(s, [^)]*\): (.*)$")  # logged before its iteration's line
TAKEN_OVER = re.compile(r"^  batches taken over from another worker's share \([^)]*\): (\d+) of (\d+)$")  # likewise
BETWEEN = re.compile(r"^  between iterations \(s\): plan ([\d.]+), outputs ([\d.]+) \(of which waiting for the previous "
                     r"iteration's files ([\d.]+); those took ([\d.]+) on the writer, ([\d.]+) more waiting for their "
                     r"maps\)$")
RUN_STAGES = re.compile(r"^run (start|end): ([\d.]+) s")
MEMORY = re.compile(r"^GPU (\d+) memory: GPU arena [\d.]+ MB: in use [\d.]+ MB, high water ([\d.]+) MB")
MPI_STAGES = ("broadcast", "last maps to the master", "reduction", "sums to their makers", "M-step on the workers", "model to the master",
              "sums to rank 1", "M-step on rank 1")


def stage_values(text):
    """{name: seconds} of a "name 1.0, other name 2.5" list."""
    values = {}
    for item in text.split(", "):
        name, _, seconds = item.rpartition(" ")
        values[name] = float(seconds)
    return values


def parse_log(text):
    """The iterations (E, M, stages, each MPI worker's E-step, the time between them), the arenas' high water (GB per
    device) and the seconds before and after the iterations ("start", "end") of a run's log."""
    iterations, memory, walls, taken_over, run_seconds = [], {}, [], None, {}
    for line in text.splitlines():
        if m := WORKER_WALLS.match(line):
            walls = [float(w) for w in m[1].split(", ")]
        elif m := TAKEN_OVER.match(line):
            taken_over = [int(m[1]), int(m[2])]
        elif m := ITERATION.match(line):
            iterations.append({"iteration": int(m[1]), "expectation": float(m[2]), "maximization": float(m[3]),
                               "e_stages": {}, "m_stages": {}, "worker_e_seconds": walls,
                               "batches_taken_over_of_handed": taken_over})
            walls, taken_over = [], None
        elif (m := STAGES.match(line)) and iterations:
            iterations[-1]["e_stages" if m[1] == "E" else "m_stages"] = stage_values(m[2])
        elif (m := BETWEEN.match(line)) and iterations:
            iterations[-1]["between"] = dict(zip(("plan", "outputs", "waiting for the files", "previous files written",
                                                  "previous files waiting for maps"), map(float, m.groups())))
        elif m := RUN_STAGES.match(line):
            run_seconds[m[1]] = float(m[2])
        elif m := MEMORY.match(line):
            memory[f"GPU {m[1]}"] = max(memory.get(f"GPU {m[1]}", 0.0), float(m[2]) * 2 ** 20 / 1e9)
    return iterations, memory, run_seconds


def engine_options(workers, args):
    """The engine's options of a run on `workers` workers: --cpu, or --gpu with a device per worker."""
    if args.engine == "numpy":
        return ["--cpu"]
    return ["--gpu", ":".join(str(w % args.gpus) for w in range(workers))]


def command_of(job, star, reference, out, workers, args, iterations=None, mpi=False):
    command_name, arguments = empiar10028.job_arguments(job, star, reference, out / "run", args.K)
    arguments = [command_name, *map(str, arguments)]
    if iterations or args.iterations:
        arguments += ["--iter", str(iterations or args.iterations)]
    cryorefine = [sys.executable, "-m", "cryorefine"]
    engine = engine_options(workers, args)
    if workers == 1 and not mpi:
        return cryorefine + arguments + engine
    return [*args.mpirun.split(), "-n", str(workers + 1), *cryorefine, *arguments, *engine, *args.gui_flags.split()]


#: the environment variables that change how a run runs: MPI's parameters, cryorefine's own, the GPUs it sees
RUN_SETTING_PREFIXES = ("OMPI_MCA_", "PRTE_MCA_", "MPICH_", "CRYOREFINE_", "CUDA_VISIBLE_DEVICES", "NCCL_")


def run_settings(environment):
    """Those of `environment`'s variables that change how a run runs (`RUN_SETTING_PREFIXES`), sorted by name: kept
    with each result, and what a --reuse must find the same (an MPI parameter set for one run changes no command)."""
    return {name: value for name, value in sorted(environment.items()) if name.startswith(RUN_SETTING_PREFIXES)}


def run_one(job, star, reference, workers, args, iterations=None, folder=None, command=None, env=None):
    """One run of `job` with `workers` ("1": one process; "W" or "1mpi": a master and W workers); `command` instead of
    the job's own line (a --continue), `env` added to the environment."""
    mpi, workers = workers.endswith("mpi") or int(workers.removesuffix("mpi")) > 1, int(workers.removesuffix("mpi"))
    out = folder or args.work / "scaling" / f"{job}_{workers}gpu{'_mpi' if mpi and workers == 1 else ''}"
    command = command or command_of(job, star, reference, out, workers, args, iterations, mpi)
    saved = out / "result.json"
    code = bench_common.package_fingerprint()
    environment = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    settings = run_settings(environment)
    if args.reuse and saved.exists():
        earlier = json.loads(saved.read_text())
        if (earlier["command"] == " ".join(command) and earlier.get("code_sha256") == code
                and earlier.get("environment", {}) == settings):
            log.info("%s on %d: the finished run in %s, not run again (--reuse)", job, workers, out)
            return earlier
        log.info("%s on %d: the run in %s had another command, code or environment; run again", job, workers, out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    log.info("%s on %d: %s", job, workers, " ".join(command))
    done, stamps, wall = stamped_run(command, environment)
    (out / "log.txt").write_text(done.stdout + done.stderr)
    if env and "CRYOREFINE_FAULT" in env:  # a run meant to fail: what it said and when it ended
        return {"returncode": done.returncode, "ended_unix": time.time(), "wall_seconds": wall,
                "stderr_tail": done.stderr.splitlines()[-12:], "folder": str(out)}
    if done.returncode != 0:
        sys.exit(f"mpi_scaling: {job} on {workers} failed (exit {done.returncode}); see {out / 'log.txt'}:\n"
                 + done.stderr[-3000:])
    iterations_seen, memory, run_seconds = parse_log(done.stderr)
    between = {}
    for it in iterations_seen:
        for name, seconds in it.get("between", {}).items():
            between[name] = between.get(name, 0.0) + seconds
    loop = sum(it["expectation"] + it["maximization"] for it in iterations_seen)
    totals = {}
    for it in iterations_seen:
        for name, seconds in {**it["e_stages"], **it["m_stages"]}.items():
            totals[name] = totals.get(name, 0.0) + seconds
    label = f"{workers} GPU" if workers <= args.gpus else f"{workers} workers on {args.gpus} GPU"
    result = {"workers": workers, "mpi": mpi, "label": label + (" (MPI)" if mpi and workers == 1 else ""),
            "command": " ".join(command), "wall_seconds": wall, "folder": str(out),
            "iterations": iterations_seen, "stage_totals": totals, "e_step_seconds": sum(it["expectation"] for it in
                                                                                        iterations_seen),
            "m_step_seconds": sum(it["maximization"] for it in iterations_seen),
            "outside_iterations_seconds": wall - loop, "run_start_end_seconds": run_seconds,
            "launch_and_exit_seconds": launch_and_exit(stamps, run_seconds, wall), "code_sha256": code,
            "environment": settings,
            "between_iterations_totals": between, "gpu_high_water_gb": memory}
    saved.write_text(json.dumps(result, indent=1))
    return result


def outside_parts(run):
    """"launch, start, end, exit" seconds of a run's result ("?" for a part it lacks: results of older code)."""
    parts = {**run.get("launch_and_exit_seconds", {}), **run.get("run_start_end_seconds", {})}
    return ", ".join("?" if parts.get(k) is None else f"{parts[k]:.1f}" for k in ("launch", "start", "end", "exit"))


def stamped_run(command, env):
    """`command` run to its end: (its CompletedProcess, [(seconds from the launch, line)] of its stderr as the lines
    came, its wall seconds from the launch to its exit)."""
    tic = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    stdout = []
    reader = threading.Thread(target=lambda: stdout.append(process.stdout.read()), daemon=True)
    reader.start()
    stamps = [(time.perf_counter() - tic, line) for line in process.stderr]
    process.wait()
    wall = time.perf_counter() - tic
    reader.join()
    stderr = "".join(line for _, line in stamps)
    done = subprocess.CompletedProcess(command, process.returncode, "".join(stdout), stderr)
    return done, stamps, wall


def launch_and_exit(stamps, run_seconds, wall):
    """{"launch": seconds from the launch to the start of the run's own clock (the interpreter, the imports, mpirun's
    ranks and MPI's set-up: the "run start" line's time less its seconds), "exit": from the "run end" line to the
    process's exit}: the parts of the wall time the log does not time itself (None where a line is missing)."""
    seen = {m[1]: at for at, line in stamps if (m := RUN_STAGES.match(line))}
    launch = seen["start"] - run_seconds["start"] if "start" in seen and "start" in run_seconds else None
    return {"launch": launch, "exit": wall - seen["end"] if "end" in seen else None}


def parity(one, other):
    """The last iteration's class distributions, per-class map correlations and particles in the same class."""
    import starfile

    from cryorefine.io.mrc import read_volume

    folders = [Path(one["folder"]), Path(other["folder"])]
    found = [sorted(f.glob("run_it[0-9][0-9][0-9]_data.star")) for f in folders]
    if not all(found):  # a run taken from its result.json whose files are gone (--reuse)
        return {"note": f"no iteration files in {' or '.join(str(f) for f, n in zip(folders, found) if not n)}"}
    last = [paths[-1] for paths in found]
    if last[0].name != last[1].name:
        return {"note": f"last iterations differ: {last[0].name} and {last[1].name}"}
    root = last[0].name[: -len("_data.star")]
    tables = [starfile.read(path)["particles"] for path in last]
    result = {"iteration_files": root}
    if "rlnClassNumber" in tables[0]:
        classes = [t["rlnClassNumber"].to_numpy() for t in tables]
        result["same_class_fraction"] = float(np.mean(classes[0] == classes[1]))
        k = int(max(c.max() for c in classes))
        result["class_distribution"] = [np.bincount(c, minlength=k + 1)[1:].tolist() for c in classes]
    maps = sorted(folders[0].glob(f"{root}_*class*.mrc"))
    correlations = {}
    for path in maps:
        a, _ = read_volume(path)
        b, _ = read_volume(folders[1] / path.name)
        correlations[path.name[len(root) + 1:]] = float(np.corrcoef(a.ravel(), b.ravel())[0, 1])
    result["map_correlation"] = correlations
    angles = [t[["rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi"]].to_numpy() for t in tables]
    difference = np.abs((angles[0] - angles[1] + 180.0) % 360.0 - 180.0)
    result["median_angle_difference_deg"] = float(np.median(difference))
    return result


def killed_and_continued(star, reference, worker_counts, args):
    """--kill: the Class3D job on the most GPUs of `worker_counts` (--workers) whole and with worker 2 killed at
    iteration --kill, then --continue'd on one GPU; what the killed job did and the continued run's parity with the
    whole one."""
    workers, last = max(worker_counts, key=lambda w: int(w.removesuffix("mpi"))), args.kill + 2
    folder = args.work / "scaling" / "kill"
    whole = run_one("class3d", star, reference, workers, args, iterations=last, folder=folder / "whole")
    killed = run_one("class3d", star, reference, workers, args, iterations=last, folder=folder / "killed",
                     env={"CRYOREFINE_FAULT": f"2:{args.kill}:kill"})
    said = [line for line in Path(killed["folder"], "log.txt").read_text().splitlines()
            if line.startswith("worker 2 killing itself at unix time ")]
    if said:
        killed["seconds_from_kill_to_exit"] = killed["ended_unix"] - float(said[-1].split()[-1])
    done = sorted(Path(killed["folder"]).glob("run_it[0-9][0-9][0-9]_optimiser.star"))
    result = {"workers": workers, "kill_iteration": args.kill, "iterations": last, "whole_wall_seconds":
              whole["wall_seconds"], "killed": killed, "last_completed": done[-1].name if done else None}
    if done:
        continued_folder = folder / "continued"
        command = [sys.executable, "-m", "cryorefine", "classify", "--continue", str(done[-1]), "--o",
                   str(continued_folder / "run"), "--iter", str(last), *engine_options(1, args)]
        continued = run_one("class3d", star, reference, "1", args, folder=continued_folder, command=command)
        result["continued_on_one_gpu"] = {"command": continued["command"],
                                          "wall_seconds": continued["wall_seconds"],
                                          "parity_with_whole": parity(whole, continued)}
    return result


def _host_text(results):
    """", on N CPUs (model)" of a result's host where it names one (results before 2026-12-01 do not)."""
    host = results.get("host_cpus")
    return f", on {host['cpus']} CPUs ({host['model']})" if host else ""


def format_report(results):
    lines = [f"EMPIAR-10028 stand-in: {results['n_particles']} particles, {results['box_px']} px; "
             f"{results['gpus']} × {results['device']}{_host_text(results)}; {results['date']}"]
    for job, runs in results["jobs"].items():
        one = runs[0]
        shown = [name for name in MPI_STAGES if any(name in run["stage_totals"] for run in runs)]
        lines += ["", f"### {job}: {one['command']}", "",
                  "| GPUs | job s | speed-up | E-step s | M-step s | outside iterations s (launch, start, end, exit) | "
                  + " | ".join(f"{name} s" for name in shown) + " | arena high water GB |",
                  "|---|---|---|---|---|---|" + "---|" * len(shown) + "---|"]
        for run in runs:
            totals = run["stage_totals"]
            memory = ", ".join(f"{v:.1f}" for _, v in sorted(run["gpu_high_water_gb"].items()))
            speed_up = one["wall_seconds"] / run["wall_seconds"]
            lines.append(f"| {run['label']} | {run['wall_seconds']:.0f} | {speed_up:.2f}× | "
                         f"{run['e_step_seconds']:.1f} | {run['m_step_seconds']:.1f} | "
                         f"{run['outside_iterations_seconds']:.1f} ({outside_parts(run)}) | "
                         + " | ".join(f"{totals.get(name, 0.0):.1f}" for name in shown) + f" | {memory} |")
        lines += ["", "E-step stages summed over the workers (s):", "",
                  "| stage | " + " | ".join(run["label"] for run in runs) + " |",
                  "|---|" + "---|" * len(runs)]
        names = [n for n in dict.fromkeys(n for run in runs for n in run["stage_totals"]) if n not in MPI_STAGES]
        for name in names:
            cells = [f"{run['stage_totals'].get(name, 0.0):.1f}" for run in runs]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines += ["", "per iteration, E-step / M-step (s):", "",
                  "| iteration | " + " | ".join(run["label"] for run in runs) + " |",
                  "|---|" + "---|" * len(runs)]
        for i, it in enumerate(one["iterations"]):
            cells = [f"{r['iterations'][i]['expectation']:.1f} / {r['iterations'][i]['maximization']:.1f}"
                     if i < len(r["iterations"]) else "—" for r in runs]
            lines.append(f"| {it['iteration']} | " + " | ".join(cells) + " |")
        for run in runs[1:]:
            lines.append(f"\nparity of {run['label']} with one process: {json.dumps(run['parity'])}")
    if "killed_worker" in results:
        lines += ["", f"### a killed worker and --continue on one GPU: {json.dumps(results['killed_worker'])}"]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/cryorefine_empiar10028"))
    parser.add_argument("--engine", choices=["cuda", "numpy"], default=None)
    parser.add_argument("--model", default=str(empiar10028.DEFAULT_MODEL), help="atomic model of the reference")
    parser.add_argument("--n", type=int, default=None, help="particles (default 20,000; 120 with numpy)")
    parser.add_argument("--K", type=int, default=None, help="classes of the Class3D job (default 6)")
    # class2d not yet: its parity (2D averages, psi alone) and its warm-up are not written
    parser.add_argument("--jobs", nargs="+", choices=["class3d", "refine"], default=["class3d"])
    parser.add_argument("--workers", nargs="+", default=None,
                        help="GPU counts to run (default 1, 2, 4, 8 up to the GPUs present; 1 and 2 with numpy); 1mpi: "
                             "one worker under mpirun -n 2 (the MPI runner's own cost on one GPU)")
    parser.add_argument("--iterations", type=int, default=None, help="stop each job after this many iterations")
    parser.add_argument("--mpirun", default=None,
                        help="the launcher and its options (default: Open MPI's `mpirun --allow-run-as-root --bind-to "
                             "none` on the GPU machine; with numpy the mpiexec beside Python, pip's mpich)")
    parser.add_argument("--gui_flags", default="--j 4 --pool 30 --preread_images --dont_combine_weights_via_disc",
                        help="RELION's flags added to the MPI runs' line, as its GUI and tutorial write them "
                             "(default: %(default)s; '' for none)")
    parser.add_argument("--float16", action="store_true", help="the stand-in's stack in float16 (MRC mode 12)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--no-warmup", dest="warmup", action="store_false")
    parser.add_argument("--kill", type=int, default=None, metavar="K",
                        help="after the jobs: Class3D on the most GPUs with worker 2 killed at iteration K, then "
                             "--continue'd on one GPU, against the whole run (K+2 iterations)")
    parser.add_argument("--reuse", action="store_true",
                        help="take a run finished before in --work with the same command line, the same "
                             "cryorefine code (its sources' SHA-256) and the same MPI, NCCL, CUDA device and "
                             "CRYOREFINE_ variables from its result.json instead of running it again (a lease split "
                             "over several calls); the warm-up always runs")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.engine is None:
        from cryorefine.estep.backend import cupy_available

        args.engine = "cuda" if cupy_available() else "numpy"
    tiny = args.engine == "numpy"
    # the stand-in's settings, as empiar10028.py takes them
    stand_in = argparse.Namespace(engine=args.engine, model=args.model, n=args.n or
                                  (120 if tiny else 20_000), box=32 if tiny else 360, angpix=12.0 if tiny else 1.34,
                                  snr=1.0 if tiny else 0.05, seed=0, density_oversample=2, float16=args.float16)
    args.iterations = args.iterations or (2 if tiny else None)
    args.work.mkdir(parents=True, exist_ok=True)
    if tiny:
        args.gpus, device, xp = 1, "CPU", np
        beside = Path(sys.executable).parent / "mpiexec"
        args.mpirun = args.mpirun or (str(beside) if beside.exists() else "mpiexec")
    else:
        import cupy

        args.gpus = cupy.cuda.runtime.getDeviceCount()
        props = cupy.cuda.runtime.getDeviceProperties(0)
        device = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        xp = cupy
        args.mpirun = args.mpirun or "mpirun --allow-run-as-root --bind-to none"
    workers = args.workers or ([str(w) for w in ((1, 2) if tiny else (1, 2, 4, 8)) if tiny or w <= args.gpus])
    if workers[0] != "1":
        sys.exit("mpi_scaling: --workers must start with 1, the one-process run the others are compared with")
    reference, _ = empiar10028.build_reference(args.work, stand_in)
    star, _ = empiar10028.simulate_particles(args.work, reference, stand_in, xp)
    if xp is not np:
        xp.get_default_memory_pool().free_all_blocks()
    if args.warmup and not tiny:
        import starfile

        blocks = starfile.read(star, always_dict=True)
        blocks["particles"] = blocks["particles"].head(empiar10028.WARMUP_PARTICLES)
        subset = star.parent / "warmup_particles.star"
        starfile.write(blocks, subset)
        tic = time.perf_counter()
        # never taken from an earlier run (--reuse): it compiles the kernels of the code being measured
        run_one("class3d", subset, reference, "1", argparse.Namespace(**{**vars(args), "reuse": False}),
                iterations=empiar10028.WARMUP_ITERATIONS, folder=args.work / "scaling" / "warmup")
        log.info("warm-up (kernel compilation): %.0f s", time.perf_counter() - tic)
    results = {"date": datetime.date.today().isoformat(), "command": " ".join([Path(sys.argv[0]).name,
                                                                               *(argv or sys.argv[1:])]),
               "device": device, "gpus": args.gpus, "host_cpus": bench_common.host_cpus(),
               "n_particles": stand_in.n, "box_px": stand_in.box, "jobs": {}}
    for job in args.jobs:
        runs = results["jobs"][job] = []
        for w in workers:
            runs.append(run_one(job, star, reference, w, args))
            if len(runs) > 1:
                runs[-1]["parity"] = parity(runs[0], runs[-1])
            if args.json:  # after every run: a run cut short by a time limit leaves the others' figures
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(results, indent=1))
    if args.kill:
        results["killed_worker"] = killed_and_continued(star, reference, workers, args)
    report = format_report(results)
    print(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
