#!/usr/bin/env bash
# On a GPU machine without a registry: install the carried wheels, then run the GPU checks and timings.
#   bash benchmarks/device_check.sh [tests|quick|full]
# tests: GPU parity tests (kernels, batch, arena; the whole-refinement comparison with `full`)
# quick: tests + throughput at 128 px;  full: everything, incl. 128/256/360 px throughput
set -o pipefail
mode=${1:-quick}
out=${OUT:-/tmp/out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
select="not refinement"
[ "$mode" = full ] && select=""
python3 -m pytest -q -x -s -p no:cacheprovider -m gpu tests/estep/test_cuda.py tests/gpu/test_allocator.py tests/core/test_ctf.py \
    ${select:+-k "$select"} 2>&1 | tee "$out/pytest.log" | tail -40
[ "$mode" = tests ] && exit 0
boxes="128"; particles=128
[ "$mode" = full ] && boxes="128 256 360" && particles=256
python3 benchmarks/estep_throughput.py --boxes $boxes --particles $particles --json "$out/estep.json" 2>&1 \
    | tee "$out/bench.log" | tail -30
