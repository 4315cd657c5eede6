"""What a job pays the first time it runs on a machine: the difference, stage by stage, between `empiar10028.py
--json` results of one job run on empty kernel caches and the same job run again after it.

    export CUPY_CACHE_DIR=$(mktemp -d) CUDA_CACHE_PATH=$(mktemp -d)   # CuPy's and the driver's caches, empty
    E="--n 2000 --jobs refine --no-warmup --keep_maps 2 --model MODEL --work /tmp/e2k"
    python benchmarks/empiar10028.py $E --json cold.json
    python benchmarks/empiar10028.py $E --json warm.json
    python benchmarks/first_use_compare.py cold.json warm.json [more pairs ...]

Prints each run's wall time, its whole iterations and E-steps, the stages outside the iterations, then for each
pair (cold, warm) the iterations whose stages differ by more than 0.2 s.
"""
import json
import sys


def main(paths):
    runs = {}
    for path in paths:
        job = json.load(open(path))["jobs"]["refine"]
        runs[path] = job
        its = job["iterations"]
        print(f"{path}: wall {job['wall_seconds']:.1f} s, {len(its)} iterations, whole iterations "
              f"{sum(sum(i['seconds'].values()) for i in its):.1f} s, E-step "
              f"{sum(i['seconds'].get('expectation', 0) for i in its):.1f} s")
        print("  start", {k: round(v, 2) for k, v in job["start_stages"].items()})
        print("  end", {k: round(v, 2) for k, v in job["end_stages"].items()})
    names = list(runs)
    for cold, warm in zip(names[0::2], names[1::2]):
        print(f"--- {cold} minus {warm}, stages differing by more than 0.2 s")
        for a, b in zip(runs[cold]["iterations"], runs[warm]["iterations"]):
            stages = {k: round(v - b["stage_seconds"].get(k, 0), 2) for k, v in a["stage_seconds"].items()
                      if v - b["stage_seconds"].get(k, 0) > 0.2}
            steps = {k: round(v - b["seconds"].get(k, 0), 2) for k, v in a["seconds"].items()
                     if abs(v - b["seconds"].get(k, 0)) > 0.2}
            if stages or steps:
                print(f"  it {a['iteration']} order {a['healpix_order']} {a['current_size_px']}/"
                      f"{a['coarse_size_px']} px:", stages, steps)


if __name__ == "__main__":
    main(sys.argv[1:])
