"""Where CuPy compiles its own kernels in a job: from a profile of it,

    python -m cProfile -o job.prof benchmarks/empiar10028.py ... --json job.json
    python benchmarks/compile_sites.py job.prof

the seconds in CuPy's compiler (cupy/cuda/compiler.py, cumulative) charged to the nearest frames of the
cryorefine package up the callers' chain, split by the callers' shares (each function's split worked out once).
cProfile sees the main thread only, and a slower run under it."""
import pstats
import sys
from collections import defaultdict


def compiler_functions(stats):
    """The pstats keys of CuPy's compiler functions, the most cumulative time first."""
    return sorted((k for k in stats if k[0].endswith("cuda/compiler.py")), key=lambda k: -stats[k][3])


def compile_sites(stats):
    """(the compiler's cumulative seconds, {package frame: seconds}) of a pstats table, or None without CuPy's
    compiler in it."""
    roots = compiler_functions(stats)
    if not roots:
        return None
    root = roots[0]
    memo, busy = {}, set()

    def split(key):
        if key in memo:
            return memo[key]
        if "/cryorefine/" in key[0] and "site-packages" not in key[0]:
            return {f"{key[0].split('/cryorefine/')[-1]}:{key[1]} {key[2]}": 1.0}
        if key in busy:  # a cycle of callers: its share goes to the other callers
            return {}
        busy.add(key)
        callers = stats[key][4]
        total = sum(v[3] for v in callers.values())
        out = defaultdict(float)
        if not callers or total <= 0:
            out[f"(no package frame) {key[0].split('/')[-1]}:{key[2]}"] = 1.0
        else:
            for caller, v in callers.items():
                for frame, share in split(caller).items():
                    out[frame] += share * v[3] / total
        busy.discard(key)
        memo[key] = dict(out)
        return memo[key]

    seconds = stats[root][3]
    return seconds, {frame: share * seconds for frame, share in split(root).items()}


def main(path):
    stats = pstats.Stats(path).stats
    for r in compiler_functions(stats)[:6]:
        print("compiler function", r[2], "calls", stats[r][1], "cumulative", round(stats[r][3], 2))
    found = compile_sites(stats)
    if found is None:
        print(f"{path}: CuPy's compiler does not appear in this profile (its kernels came from the cache)")
        return
    for frame, seconds in sorted(found[1].items(), key=lambda kv: -kv[1])[:30]:
        print(f"{seconds:7.2f} s  {frame}")


if __name__ == "__main__":
    main(sys.argv[1])
