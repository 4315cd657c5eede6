#!/usr/bin/env bash
# On one GPU machine: the GPU parity tests of the engine, then the converged auto-refine of 10,000 particles of the
# 360 px stand-in (empiar10028.py --jobs refine), its per-iteration stage table last.
# Here:  mkdir -p .bench && cp ../shared/data/real/models/7p6z.cif.gz .bench/
# There (carry .whl and .bench):  bash benchmarks/refine10k_check.sh [N_PARTICLES] [extra empiar10028.py options]
# SKIP_TESTS=1 leaves the tests out; TESTS_K="expr" runs only the tests pytest -k selects
set -o pipefail
n=${1:-10000}; shift; out=${OUT:-/tmp/out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ -z "$SKIP_TESTS" ]; then
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/estep/test_cuda.py tests/gpu -k "${TESTS_K:-not relative_error_below_1e5}" \
        > "$out/pytest.log" 2>&1; echo "GPU tests rc=$?"; grep -E "passed|failed|FAILED|Error" "$out/pytest.log" | tail -8
fi
python3 benchmarks/empiar10028.py --n "$n" --jobs refine --keep_maps 2 --model .bench/7p6z.cif.gz --work /tmp/e10k \
    --json "$out/refine.json" "$@" > "$out/refine.log" 2>&1; echo "refine rc=$?"
grep -E "job wall time|arena high water" "$out/refine.log"
sed -n '/E-step seconds per stage/,/^$/p;/^| it\./,/^$/p' "$out/refine.log" | grep "^|" | cut -c1-160
