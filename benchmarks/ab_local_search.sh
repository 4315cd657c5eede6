#!/usr/bin/env bash
# Side by side on one GPU machine: the GPU parity tests of the local search and of image preparation, then the
# local-search E-step (local_search_estep.py) with an earlier tree and with this one, one after the other, with 29
# translations (offset range 3 px) and with 9 (1.5 px, as the stand-in's late auto-refine iterations).
# Here (with git):   rm -rf .bench/old && mkdir -p .bench/old && git archive COMMIT src benchmarks | tar -x -C .bench/old
#                    cp ../shared/data/real/models/7p6z.cif.gz .bench/
# There (carry .whl and .bench):  bash benchmarks/ab_local_search.sh [PARTICLES] [ORDERS ...]
set -o pipefail
n=${1:-2000}; shift; orders=${*:-4 5 6 7}; out=${OUT:-/tmp/out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null || exit 1
root=$PWD
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
PYTHONPATH=/tmp/site:$root/src python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/estep/test_cuda.py \
    -k "local or batch_results or sub_batches or projection_kernel or prepared" 2>&1 | tee "$out/pytest.log" | grep -E "error|passed|failed|FAIL"
for range in 3 1.5; do
    args="--model $root/.bench/7p6z.cif.gz --orders $orders --particles $n --offset_range $range"
    for v in old new; do
        if [ $v = old ]; then dir=$root/.bench/old; else dir=$root; fi
        [ -d "$dir/src" ] || continue
        (cd "$dir" && PYTHONPATH=/tmp/site:$dir/src python3 $root/benchmarks/local_search_estep.py $args \
            --json "$out/${v}_range$range.json" > "$out/${v}_range$range.log" 2>&1); echo "$v range $range rc=$?"
        grep "^order" "$out/${v}_range$range.log" | sed "s/^/$v: /" | cut -c1-420
    done
done
