// Reductions over contiguous segments (one particle's samples): one CUDA block per segment.
// op 0: minimum, op 1: maximum, op 2: sum; `arg` (if not null) receives the index of the
// first extreme element (lowest index among ties), as numpy's stable sorts would pick it, or the
// segment's end where it is empty (and for sums). A minimum is the maximum of the negated values.

#ifndef SEG_THREADS
#define SEG_THREADS 256
#endif

extern "C" __global__ void __launch_bounds__(SEG_THREADS)
segment_reduce(const double* __restrict__ v, const long long* __restrict__ starts, int op, double* __restrict__ out,
               long long* __restrict__ arg)
{
    __shared__ double s_val[32];
    __shared__ long long s_idx[32];
    const long long lo = starts[blockIdx.x], hi = starts[blockIdx.x + 1];
    if (op == 2) {
        double sum = 0.0;
        for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x) sum += v[i];
        sum = cr_block_reduce(sum, 0, s_val);
        if (threadIdx.x == 0) {
            out[blockIdx.x] = sum;
            if (arg) arg[blockIdx.x] = hi;
        }
        return;
    }
    const double sign = op == 0 ? -1.0 : 1.0;
    double best = cr_negative_infinity();
    long long idx = hi;  // "none"
    for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const double x = sign * v[i];
        if (idx == hi || x > best) {  // i grows: ties keep the first
            best = x;
            idx = i;
        }
    }
    cr_block_argmax(best, idx, hi, s_val, s_idx);
    if (threadIdx.x == 0) {
        out[blockIdx.x] = sign * best;
        if (arg) arg[blockIdx.x] = idx;
    }
}
