#!/usr/bin/env bash
# Side by side on one GPU machine: the GPU parity tests of the local search, then the local-search E-step
# (local_search_estep.py) with an earlier tree and with this one, one after the other.
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
    -k "local or batch_results or sub_batches or projection_kernel" 2>&1 | tee "$out/pytest.log" | grep -E "error|passed|failed|FAIL"
args="--model $root/.bench/7p6z.cif.gz --orders $orders --particles $n"
for v in old new; do
    if [ $v = old ]; then dir=$root/.bench/old; else dir=$root; fi
    [ -d "$dir/src" ] || continue
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir/src python3 benchmarks/local_search_estep.py $args --json "$out/$v.json" \
        > "$out/$v.log" 2>&1); echo "$v rc=$?"
    grep "^order" "$out/$v.log" | sed "s/^/$v: /" | cut -c1-400
done
