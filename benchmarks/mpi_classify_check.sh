#!/usr/bin/env bash
# `cryorefine classify` in one process and under MPI on the GPU machine: the same class distribution?
#   bash benchmarks/mpi_classify_check.sh [N_EACH] [ITERATIONS] [RANKS ...]
# Two states of a 64 px ribosome (the example map, and the same map with a ball of density erased),
# N_EACH particles each (SNR 0.2, CTF), classified from their average into K = 2. One process on
# GPU 0, then each RANKS under mpirun with the workers on the visible GPUs (round robin); prints
# the class distribution of every run and the share of particles in the same class as one process.
set -o pipefail
n=${1:-500}; iters=${2:-8}; shift 2 2>/dev/null; ranks=${*:-3}
work=${WORK:-/tmp/mpi_classify}; out=${OUT:-$work}; mkdir -p "$work" "$out"
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null; fi
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
mpirun=${MPIRUN:-mpirun --allow-run-as-root --oversubscribe}
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l); echo "GPUs: $ngpu"  # none: the numpy engine (a dry run of this script)
python3 - "$work" "$n" <<'PY'
import subprocess, sys
import numpy as np, pandas as pd, starfile
from cryorefine.io.mrc import read_volume, write_volume
work, n = sys.argv[1], sys.argv[2]
a, pixel = read_volume("examples/ribosome_64px.mrc")
z, y, x = np.mgrid[:64, :64, :64] - 32
b = a.copy(); b[(x - 10) ** 2 + (y - 4) ** 2 + (z + 6) ** 2 < 12 ** 2] = 0.0
for name, v in (("a", a), ("b", b), ("avg", (a + b) / 2)):
    write_volume(f"{work}/{name}.mrc", v.astype(np.float32), pixel)
tables = []
for seed, name in ((1, "a"), (2, "b")):
    subprocess.run([sys.executable, "-m", "cryorefine", "simulate", "--ref", f"{work}/{name}.mrc", "--n", n, "--snr",
                    "0.2", "--seed", str(seed), "--o", f"{work}/sim_{name}"], check=True, capture_output=True)
    t = starfile.read(f"{work}/sim_{name}/particles.star")
    t["particles"]["rlnImageName"] = t["particles"]["rlnImageName"].str.replace("@", f"@sim_{name}/")
    t["particles"] = t["particles"].drop(columns=["rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi"])
    tables.append(t)
starfile.write({"optics": tables[0]["optics"], "particles": pd.concat([t["particles"] for t in tables])},
               f"{work}/mix.star")
PY
args="--i $work/mix.star --ref $work/avg.mrc --K 2 --iter $iters --tau2_fudge 4 --particle_diameter 300 --ini_high 40
      --ctf --zero_mask --flatten_solvent --healpix_order 2 --offset_range 5 --offset_step 2 --random_seed 1"
tic=$(date +%s%N)
one_gpu="--gpu 0"; [ "$ngpu" = 0 ] && one_gpu="--cpu"
python3 -m cryorefine classify $args --o "$work/n1/run" $one_gpu 2>&1 | grep "^iteration\|error" | tee "$out/classify_n1.log"
echo "one process: $(( ($(date +%s%N) - tic) / 1000000 )) ms"
for r in $ranks; do
  engine="--cpu"
  if [ "$ngpu" != 0 ]; then
    ids=$(for ((w = 0; w < r - 1; w++)); do printf "%d:" $(( w % ngpu )); done); engine="--gpu ${ids%:}"
  fi
  tic=$(date +%s%N)
  $mpirun -n "$r" python3 -m cryorefine classify $args --o "$work/n$r/run" $engine \
      2>&1 | grep "^iteration\|error\|rank" | tee "$out/classify_n$r.log"
  echo "mpirun -n $r ($engine): $(( ($(date +%s%N) - tic) / 1000000 )) ms"
done
python3 - "$work" "$iters" $ranks <<'PY'
import sys
import numpy as np, starfile
work, iters, ranks = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def read(r):
    path = f"{work}/n{r}/run_it{iters:03d}_data.star"
    try:
        return starfile.read(path)["particles"]["rlnClassNumber"].to_numpy()
    except FileNotFoundError:
        sys.exit(f"{path}: missing (the run failed)")
one = read(1)
truth = np.r_[np.zeros(one.size // 2), np.ones(one.size - one.size // 2)]
print(f"{'run':>8} {'class 1':>8} {'class 2':>8} {'same as n1':>10} {'accuracy':>9}")
for r in ["1", *ranks]:
    c = read(r)
    acc = max(np.mean((c - 1) == truth), np.mean((c - 1) != truth))
    print(f"{'n' + r:>8} {np.mean(c == 1):8.3f} {np.mean(c == 2):8.3f} {np.mean(c == one):10.3f} {acc:9.3f}")
PY
