#!/usr/bin/env bash
# Side by side on one GPU machine: the EMPIAR-10028 Class3D stand-in with an earlier tree and with this one.
# Here (with git):   rm -rf .bench/old && mkdir -p .bench/old && git archive COMMIT src benchmarks | tar -x -C .bench/old
#                    cp ../shared/data/real/models/7p6z.cif.gz .bench/
# There (carry .whl and .bench):  bash benchmarks/ab_empiar10028.sh [N_PARTICLES] [ITERATIONS]
set -o pipefail
n=${1:-10000}; iters=${2:-10}; out=${OUT:-/tmp/out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null || exit 1
root=$PWD
args="--work /tmp/e10028 --model $root/.bench/7p6z.cif.gz --n $n --jobs class3d --iterations $iters"
(cd .bench/old && PYTHONPATH=/tmp/site:$PWD/src python3 benchmarks/empiar10028.py $args --json "$out/old.json" \
    > "$out/old.log" 2>&1); echo "old rc=$?"
PYTHONPATH=/tmp/site:$root/src python3 benchmarks/empiar10028.py $args --json "$out/new.json" > "$out/new.log" 2>&1
echo "new rc=$?"
for v in old new; do grep "job wall time" "$out/$v.log" | sed "s/^/$v: /"; done
