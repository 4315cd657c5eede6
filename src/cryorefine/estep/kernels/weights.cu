// Coarse weights of a global or local search without the (B, S) float64 weights array: one CUDA block per
// particle reads its row of S = K·R·T float32 diff2 and recomputes each weight where it needs it,
//   w(s) = exp(lw(s) − max lw),  lw(s) = (prior_ko[row·ko_stride + s / T] + prior_t[b·T + s % T]) − diff2[b·S + s]
// (the numpy engine's order of operations; ko_stride 0 when the class and orientation priors are the
// same for every particle). coarse_weight_stats gives each row its max lw, total weight and the count of
// candidates, the weights above ε = (1 − fraction)·total / (2·S) (`common.significant_samples`);
// coarse_candidates then packs each row's candidates (weight and sample index) in the order of s, so that
// the significance cut sorts only them.

#ifndef WEIGHT_THREADS
#define WEIGHT_THREADS 1024
#endif

// The samples s = threadIdx.x, + blockDim.x, … of a row, with the (class·orientation, translation) pair of each
// (kr, t: s = kr·T + t) carried from one to the next instead of divided out (the division of 64-bit integers cost
// more than the rest of a weight), and lw(s) read at each.
struct CrRowSamples {
    long long s, kr;
    int t;
    long long step_kr;
    int step_t, n_t;

    __device__ __forceinline__ CrRowSamples(int first, int stride, int n_t_) : s(first), n_t(n_t_)
    {
        kr = first / n_t_;
        t = first - (int)kr * n_t_;
        step_kr = stride / n_t_;
        step_t = stride - (int)step_kr * n_t_;
    }

    __device__ __forceinline__ void next(int stride)
    {
        s += stride;
        kr += step_kr;
        t += step_t;
        if (t >= n_t) {
            t -= n_t;
            ++kr;
        }
    }

    // lw(s) − m, in the numpy engine's order of operations
    __device__ __forceinline__ double log_weight(const float* __restrict__ row, const double* __restrict__ prior_ko,
                                                 const double* __restrict__ prior_t, int b, long long ko_stride,
                                                 double m) const
    {
        return ((prior_ko[b * ko_stride + kr] + prior_t[(long long)b * n_t + t]) - (double)row[s]) - m;
    }
};

// exp(x) where it is not 0 (x above ln of the smallest double, about −745.13): a sharp row's samples lie thousands
// below its maximum, and their exponentials are skipped
#define CR_EXP_ZERO_BELOW (-746.0)

// w = exp(x) > ε, exponentiated only where x is within reach of ln ε (the test itself is the exponential's, so a
// sample is a candidate exactly when its weight is above ε); returns w, or 0 where it is not
__device__ __forceinline__ double cr_candidate_weight(double x, double epsilon, double log_epsilon_reach)
{
    if (!(x > log_epsilon_reach)) return 0.0;
    const double w = exp(x);
    return w > epsilon ? w : 0.0;
}

extern "C" __global__ void __launch_bounds__(WEIGHT_THREADS)
coarse_weight_stats(const float* __restrict__ d2, const double* __restrict__ prior_ko, long long ko_stride,
                    const double* __restrict__ prior_t, long long n_samples, int n_t, double adaptive_fraction,
                    double* __restrict__ row_max, double* __restrict__ row_total, long long* __restrict__ counts)
{
    __shared__ double s_red[32];
    const int b = blockIdx.x;
    const float* row = d2 + (long long)b * n_samples;
    const double ninf = cr_negative_infinity();
    double m = ninf;
    for (CrRowSamples it(threadIdx.x, blockDim.x, n_t); it.s < n_samples; it.next(blockDim.x))
        m = fmax(m, it.log_weight(row, prior_ko, prior_t, b, ko_stride, 0.0));
    m = cr_block_reduce(m, 1, s_red);
    double total = 0.0;
    if (m > ninf)
        for (CrRowSamples it(threadIdx.x, blockDim.x, n_t); it.s < n_samples; it.next(blockDim.x)) {
            const double x = it.log_weight(row, prior_ko, prior_t, b, ko_stride, m);
            if (x > CR_EXP_ZERO_BELOW) total += exp(x);
        }
    total = cr_block_reduce(total, 0, s_red);
    const double epsilon = (1.0 - adaptive_fraction) * total / (2.0 * (double)n_samples);
    // ln ε less a margin far wider than the rounding of exp and log: below it no weight can be above ε
    const double reach = epsilon > 0.0 ? log(epsilon) - 1e-6 : CR_EXP_ZERO_BELOW;
    double count = 0.0;
    if (m > ninf)
        for (CrRowSamples it(threadIdx.x, blockDim.x, n_t); it.s < n_samples; it.next(blockDim.x))
            count += cr_candidate_weight(it.log_weight(row, prior_ko, prior_t, b, ko_stride, m), epsilon, reach) > 0.0
                         ? 1.0 : 0.0;
    count = cr_block_reduce(count, 0, s_red);
    if (threadIdx.x == 0) {
        row_max[b] = m;
        row_total[b] = total;
        counts[b] = (long long)count;
    }
}

// Row b's candidates at packed_w / packed_s[b·width …], in the order of s (the rest of the row untouched).
extern "C" __global__ void __launch_bounds__(WEIGHT_THREADS)
coarse_candidates(const float* __restrict__ d2, const double* __restrict__ prior_ko, long long ko_stride,
                  const double* __restrict__ prior_t, long long n_samples, int n_t, double adaptive_fraction,
                  const double* __restrict__ row_max, const double* __restrict__ row_total, long long width,
                  double* __restrict__ packed_w, int* __restrict__ packed_s)
{
    __shared__ int s_warp[32];
    __shared__ int s_chunk;
    const int b = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = (blockDim.x + 31) >> 5;
    const float* row = d2 + (long long)b * n_samples;
    const double m = row_max[b];
    const double ninf = cr_negative_infinity();
    if (!(m > ninf)) return;  // no sample allowed: no candidate (uniform over the block)
    const double epsilon = (1.0 - adaptive_fraction) * row_total[b] / (2.0 * (double)n_samples);
    const double reach = epsilon > 0.0 ? log(epsilon) - 1e-6 : CR_EXP_ZERO_BELOW;  // as coarse_weight_stats's
    long long base = 0;
    CrRowSamples it(threadIdx.x, blockDim.x, n_t);
    for (long long c0 = 0; c0 < n_samples; c0 += blockDim.x, it.next(blockDim.x)) {
        const long long s = it.s;
        const double w = s < n_samples
                             ? cr_candidate_weight(it.log_weight(row, prior_ko, prior_t, b, ko_stride, m), epsilon, reach)
                             : 0.0;
        const bool keep = w > 0.0;
        const unsigned ballot = __ballot_sync(0xffffffffu, keep);
        if (lane == 0) s_warp[warp] = __popc(ballot);
        __syncthreads();
        if (warp == 0) {  // exclusive scan of the warps' counts
            const int v = lane < n_warps ? s_warp[lane] : 0;
            int inclusive = v;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int u = __shfl_up_sync(0xffffffffu, inclusive, o);
                if (lane >= o) inclusive += u;
            }
            if (lane < n_warps) s_warp[lane] = inclusive - v;
            if (lane == 31) s_chunk = inclusive;
        }
        __syncthreads();
        if (keep) {
            const long long at = (long long)b * width + base + s_warp[warp] + __popc(ballot & ((1u << lane) - 1u));
            packed_w[at] = w;
            packed_s[at] = (int)s;
        }
        base += s_chunk;
        __syncthreads();  // s_warp and s_chunk are rewritten by the next chunk
    }
}
