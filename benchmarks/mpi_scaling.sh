#!/usr/bin/env bash
# Time per iteration of `cryorefine refine` on one GPU (one process, both halves) and under MPI with
# one worker per GPU, on a 360 px simulated set. Run on a machine with ≥ 2 GPUs (Open MPI's mpirun):
#   bash benchmarks/mpi_scaling.sh [N_PARTICLES] [ITERATIONS]
# The 360 px map is examples/ribosome_64px.mrc Fourier-padded to 360 px (1.067 Å/px).
set -o pipefail
n=${1:-400}; iters=${2:-2}
work=${WORK:-/tmp/mpi_scaling}; out=${OUT:-$work}; mkdir -p "$work" "$out"
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null; fi
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
ngpu=$(nvidia-smi -L | wc -l); echo "GPUs: $ngpu"
python3 - "$work" <<'PY'
import sys
import numpy as np
from cryorefine.core import fourier
from cryorefine.io.mrc import read_volume, write_volume
small, pixel = read_volume("examples/ribosome_64px.mrc")
ft = fourier.rfft3_centered(small.astype(np.float64))
big = np.zeros((360, 360, 181), complex)
k = fourier.signed_frequencies(64).astype(int)
big[np.ix_(k % 360, k % 360, np.arange(33))] = ft
write_volume(f"{sys.argv[1]}/map360.mrc", fourier.irfft3_centered(big, 360).astype(np.float32), 6.0 * 64 / 360)
PY
tic=$(date +%s)
python3 -m cryorefine simulate --ref "$work/map360.mrc" --n "$n" --snr 0.05 --seed 1 --o "$work/sim" | tail -1
echo "simulate: $(( $(date +%s) - tic )) s"
args="--i $work/sim/particles.star --ref $work/map360.mrc --ini_high 15 --ctf --particle_diameter 330 --iter $iters"
python3 -m cryorefine refine $args --o "$work/one/run" --gpu 0 2>&1 | grep "^iteration\|E-step stages" | tee "$out/one_gpu.log"
ranks=$(( ngpu + 1 )); ids=$(seq -s: 0 $(( ngpu - 1 )))
mpirun --allow-run-as-root -n $ranks python3 -m cryorefine refine $args --o "$work/mpi/run" --gpu "$ids" 2>&1 \
    | grep "^iteration\|E-step stages\|error" | tee "$out/mpi_${ngpu}gpu.log"
