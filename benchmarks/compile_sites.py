"""Where CuPy compiles its own kernels in a job: from a profile of it,

    python -m cProfile -o job.prof benchmarks/empiar10028.py ... --json job.json
    python benchmarks/compile_sites.py job.prof

the seconds in CuPy's compiler (cupy/cuda/compiler.py, cumulative) charged to the nearest frames of the
cryorefine package up the callers' chain, split by the callers' shares (each function's split worked out once).
cProfile sees the main thread only, and a slower run under it."""
import pstats
import sys
from collections import defaultdict

stats = pstats.Stats(sys.argv[1]).stats
roots = [k for k in stats if k[0].endswith("cuda/compiler.py")]
for r in sorted(roots, key=lambda k: -stats[k][3])[:6]:
    print("compiler function", r[2], "calls", stats[r][1], "cumulative", round(stats[r][3], 2))
root = max(roots, key=lambda k: stats[k][3])
memo, busy = {}, set()


def split(key):
    if key in memo:
        return memo[key]
    if "/cryorefine/" in key[0] and "site-packages" not in key[0]:
        return {f"{key[0].split('/cryorefine/')[-1]}:{key[1]} {key[2]}": 1.0}
    if key in busy:
        return {}
    busy.add(key)
    callers = stats[key][4]
    total = sum(v[3] for v in callers.values())
    out = defaultdict(float)
    if not callers or total <= 0:
        out[f"(no package frame) {key[0].split('/')[-1]}:{key[2]}"] = 1.0
    else:
        for c, v in callers.items():
            for frame, f in split(c).items():
                out[frame] += f * v[3] / total
    busy.discard(key)
    memo[key] = dict(out)
    return memo[key]


for frame, f in sorted(split(root).items(), key=lambda kv: -kv[1])[:30]:
    print(f"{f * stats[root][3]:7.2f} s  {frame}")
