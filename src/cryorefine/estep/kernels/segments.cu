// Reductions over contiguous segments (one particle's samples): one CUDA block per segment.
// op 0: minimum, op 1: maximum, op 2: sum; `arg` (if not null) receives the index of the
// first extreme element (lowest index among ties), as numpy's stable sorts would pick it.

#ifndef SEG_THREADS
#define SEG_THREADS 256
#endif

extern "C" __global__ void segment_reduce(const double* __restrict__ v, const long long* __restrict__ starts,
                                          int op, double* __restrict__ out, long long* __restrict__ arg)
{
    __shared__ double s_val[SEG_THREADS];
    __shared__ long long s_idx[SEG_THREADS];
    const long long lo = starts[blockIdx.x], hi = starts[blockIdx.x + 1];
    const double inf = __longlong_as_double(0x7ff0000000000000LL);
    const double init = op == 0 ? inf : (op == 1 ? -inf : 0.0);
    double best = init;
    long long idx = hi;  // "none"
    for (long long i = lo + threadIdx.x; i < hi; i += SEG_THREADS) {
        const double x = v[i];
        if (op == 2) {
            best += x;
        } else if (idx == hi || (op == 0 ? x < best : x > best)) {  // i grows: ties keep the first
            best = x;
            idx = i;
        }
    }
    s_val[threadIdx.x] = best;
    s_idx[threadIdx.x] = idx;
    __syncthreads();
    for (int s = SEG_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            const double a = s_val[threadIdx.x], b = s_val[threadIdx.x + s];
            const long long ia = s_idx[threadIdx.x], ib = s_idx[threadIdx.x + s];
            if (op == 2) {
                s_val[threadIdx.x] = a + b;
            } else {
                const bool take_b = ib != hi && (ia == hi || (op == 0 ? b < a : b > a) || (b == a && ib < ia));
                if (take_b) { s_val[threadIdx.x] = b; s_idx[threadIdx.x] = ib; }
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        out[blockIdx.x] = s_val[0];
        if (arg) arg[blockIdx.x] = s_idx[0];
    }
}
