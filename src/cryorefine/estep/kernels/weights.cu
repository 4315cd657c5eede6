// Coarse weights of a global or local search without the (B, S) float64 weights array: one CUDA block per
// particle reads its row of S = K·R·T float32 diff2 and recomputes each weight where it needs it,
//   w(s) = exp(lw(s) − max lw),  lw(s) = (prior_ko[row·ko_stride + s / T] + prior_t[b·T + s % T]) − diff2[b·S + s]
// (the numpy engine's order of operations; ko_stride 0 when the class and orientation priors are the
// same for every particle). The candidates are the weights above ε = (1 − fraction)·total / (2·S)
// (`common.significant_samples`). Two kernels, three passes over a row:
// - coarse_weight_stats: the row's max lw (pass 1), then its total weight and an upper bound on its count of
//   candidates (pass 2): the samples within reach of the lowest ε a row can have, that of a total of 1 (the
//   maximum's own weight), so that the packed rows can be sized before ε is known;
// - coarse_candidates (pass 3): each row's candidates (weight and sample index) packed in the order of s, and their
//   count; the significance cut then sorts only them.
// The passes wait on their loads: a row is read Q samples a load where it can be (`coarse_significant` passes Q).

#ifndef WEIGHT_THREADS
#define WEIGHT_THREADS 1024
#endif

// exp(x) where it is not 0 (x above ln of the smallest double, about −745.13): a sharp row's samples lie thousands
// below its maximum, and their exponentials are skipped
#define CR_EXP_ZERO_BELOW (-746.0)
// no weight at or below the smallest normal double is a candidate (`estep.common.WEIGHT_FLOOR`): numpy's and CUDA's
// exponentials round subnormal results differently
#define CR_WEIGHT_FLOOR 2.2250738585072014e-308

// The (class·orientation, translation) pair (kr, t: s = kr·T + t) of a thread's samples s = first, first + stride, …,
// carried from one to the next instead of divided out (the division of 64-bit integers cost more than the rest of a
// weight).
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
};

// lw(s) − m of the sample (kr, t) of row b with diff2 d, in the numpy engine's order of operations
__device__ __forceinline__ double cr_log_weight(const double* __restrict__ prior_ko, const double* __restrict__ prior_t,
                                                int b, long long ko_stride, int n_t, long long kr, int t, float d,
                                                double m)
{
    return ((prior_ko[b * ko_stride + kr] + prior_t[(long long)b * n_t + t]) - (double)d) - m;
}

// Q consecutive samples of a row, group g: samples Q·g … Q·g + Q − 1. Q = 4 or 8 are read as one or two float4
// (every row 16-byte aligned and S a multiple of Q), Q = 1 a float at a time.
template <int Q>
struct CrGroup {
    float d[Q];
    __device__ __forceinline__ void load(const float* __restrict__ row, long long g)
    {
        if constexpr (Q % 4 == 0) {
            const float4* p = reinterpret_cast<const float4*>(row) + g * (Q / 4);
#pragma unroll
            for (int j = 0; j < Q / 4; ++j) {
                const float4 v = __ldg(p + j);
                d[4 * j] = v.x, d[4 * j + 1] = v.y, d[4 * j + 2] = v.z, d[4 * j + 3] = v.w;
            }
        } else {
            d[0] = __ldg(row + g);
        }
    }
};

// visit(i, s, kr, t, diff2) for the samples i = 0 … Q − 1 of a group, in increasing s; `it` holds the group's first
template <int Q, typename Visit>
__device__ __forceinline__ void cr_visit_group(const CrRowSamples& it, const CrGroup<Q>& group, Visit&& visit)
{
    long long kr = it.kr;
    int t = it.t;
#pragma unroll
    for (int i = 0; i < Q; ++i) {
        visit(i, it.s + i, kr, t, group.d[i]);
        if (++t == it.n_t) {
            t = 0;
            ++kr;
        }
    }
}

// visit(i, s, kr, t, diff2) for the samples of a row this thread takes: the groups g = threadIdx.x, + blockDim.x, …,
// two groups' loads in flight before either is used.
template <int Q, typename Visit>
__device__ __forceinline__ void cr_visit_row(const float* __restrict__ row, long long n_samples, int n_t, Visit visit)
{
    const long long n_groups = n_samples / Q;
    const int stride = Q * blockDim.x;
    CrRowSamples it(Q * threadIdx.x, stride, n_t);
    long long g = threadIdx.x;
    for (; g + blockDim.x < n_groups; g += 2LL * blockDim.x) {
        CrGroup<Q> first, second;
        first.load(row, g);
        second.load(row, g + blockDim.x);
        cr_visit_group(it, first, visit);
        it.next(stride);
        cr_visit_group(it, second, visit);
        it.next(stride);
    }
    if (g < n_groups) {
        CrGroup<Q> last;
        last.load(row, g);
        cr_visit_group(it, last, visit);
    }
}

// ε of a row and the reach of its test (ln ε less a margin far wider than the rounding of exp and log: below it no
// weight can be above ε); total ≥ 1 gives the lowest ε and the widest reach
__device__ __forceinline__ double cr_epsilon(double adaptive_fraction, double total, long long n_samples)
{
    return fmax((1.0 - adaptive_fraction) * total / (2.0 * (double)n_samples), CR_WEIGHT_FLOOR);
}

__device__ __forceinline__ double cr_epsilon_reach(double epsilon, double margin) { return log(epsilon) - margin; }

// w = exp(x) > ε, exponentiated only where x is within reach of ln ε (the test itself is the exponential's, so a
// sample is a candidate exactly when its weight is above ε); returns w, or 0 where it is not
__device__ __forceinline__ double cr_candidate_weight(double x, double epsilon, double log_epsilon_reach)
{
    if (!(x > log_epsilon_reach)) return 0.0;
    const double w = exp(x);
    return w > epsilon ? w : 0.0;
}

template <int Q>
__device__ __forceinline__ void weight_stats_row(const float* __restrict__ row, const double* __restrict__ prior_ko,
                                                 long long ko_stride, const double* __restrict__ prior_t,
                                                 long long n_samples, int n_t, double adaptive_fraction, int b,
                                                 double* __restrict__ row_max, double* __restrict__ row_total,
                                                 long long* __restrict__ bound)
{
    __shared__ double s_red[32];
    const double ninf = cr_negative_infinity();
    double m = ninf;
    cr_visit_row<Q>(row, n_samples, n_t, [&](int, long long, long long kr, int t, float d) {
        m = fmax(m, cr_log_weight(prior_ko, prior_t, b, ko_stride, n_t, kr, t, d, 0.0));
    });
    m = cr_block_reduce(m, 1, s_red);
    // a candidate lies above the reach of its row's ε, which is at or above the reach of the lowest ε (total 1),
    // taken with twice the margin so that log's rounding cannot put a candidate below it
    const double widest = cr_epsilon_reach(cr_epsilon(adaptive_fraction, 1.0, n_samples), 2e-6);
    double total = 0.0, within = 0.0;
    if (m > ninf)
        cr_visit_row<Q>(row, n_samples, n_t, [&](int, long long, long long kr, int t, float d) {
            const double x = cr_log_weight(prior_ko, prior_t, b, ko_stride, n_t, kr, t, d, m);
            if (x > CR_EXP_ZERO_BELOW) total += exp(x);
            within += x > widest ? 1.0 : 0.0;
        });
    total = cr_block_reduce(total, 0, s_red);
    within = cr_block_reduce(within, 0, s_red);
    if (threadIdx.x == 0) {
        row_max[b] = m;
        row_total[b] = total;
        bound[b] = (long long)within;
    }
}

// Row b's max lw, total weight and a bound on its count of candidates (packed rows of that width hold them).
// q: the samples a load (8, 4: every row 16-byte aligned and S a multiple of q; else 1).
extern "C" __global__ void __launch_bounds__(WEIGHT_THREADS)
coarse_weight_stats(const float* __restrict__ d2, const double* __restrict__ prior_ko, long long ko_stride,
                    const double* __restrict__ prior_t, long long n_samples, int n_t, double adaptive_fraction, int q,
                    double* __restrict__ row_max, double* __restrict__ row_total, long long* __restrict__ bound)
{
    const int b = blockIdx.x;
    const float* row = d2 + (long long)b * n_samples;
    if (q == 8)
        weight_stats_row<8>(row, prior_ko, ko_stride, prior_t, n_samples, n_t, adaptive_fraction, b, row_max,
                            row_total, bound);
    else if (q == 4)
        weight_stats_row<4>(row, prior_ko, ko_stride, prior_t, n_samples, n_t, adaptive_fraction, b, row_max,
                            row_total, bound);
    else
        weight_stats_row<1>(row, prior_ko, ko_stride, prior_t, n_samples, n_t, adaptive_fraction, b, row_max,
                            row_total, bound);
}

// Row b's candidates at packed_w / packed_s[b·width …], in the order of s (the rest of the row untouched), and their
// count: each chunk of Q·blockDim.x samples, thread i holding Q consecutive ones, is packed by a scan of the threads'
// counts; a chunk without a candidate (most, in a sharp row) costs one barrier. The next chunk's group is loaded
// before this one's barriers, so that loads are in flight while they wait.
template <int Q>
__device__ __forceinline__ void candidates_row(const float* __restrict__ row, const double* __restrict__ prior_ko,
                                               long long ko_stride, const double* __restrict__ prior_t,
                                               long long n_samples, int n_t, double adaptive_fraction, int b,
                                               const double* __restrict__ row_max,
                                               const double* __restrict__ row_total, long long width,
                                               double* __restrict__ packed_w, int* __restrict__ packed_s,
                                               long long* __restrict__ counts)
{
    __shared__ int s_warp[32];
    __shared__ int s_chunk;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = (blockDim.x + 31) >> 5;
    const double m = row_max[b];
    if (!(m > cr_negative_infinity())) {  // no sample allowed: no candidate (uniform over the block)
        if (threadIdx.x == 0) counts[b] = 0;
        return;
    }
    const double epsilon = cr_epsilon(adaptive_fraction, row_total[b], n_samples);
    const double reach = cr_epsilon_reach(epsilon, 1e-6);
    const long long n_groups = n_samples / Q;
    const int stride = Q * blockDim.x;
    CrRowSamples it(Q * threadIdx.x, stride, n_t);
    long long base = 0, g = threadIdx.x;
    CrGroup<Q> next;
    if (g < n_groups) next.load(row, g);
    for (long long g0 = 0; g0 < n_groups; g0 += blockDim.x, g += blockDim.x, it.next(stride)) {
        const CrGroup<Q> group = next;
        if (g + blockDim.x < n_groups) next.load(row, g + blockDim.x);
        double w[Q];
        int mine = 0;
#pragma unroll
        for (int i = 0; i < Q; ++i) w[i] = 0.0;
        if (g < n_groups)
            cr_visit_group(it, group, [&](int i, long long, long long kr, int t, float d) {
                w[i] = cr_candidate_weight(cr_log_weight(prior_ko, prior_t, b, ko_stride, n_t, kr, t, d, m), epsilon,
                                           reach);
                mine += w[i] > 0.0;
            });
        if (!__syncthreads_or(mine)) continue;  // also the barrier before s_warp and s_chunk are rewritten
        int inclusive = mine;  // scan of the threads' counts: within the warp, then over the warps
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int u = __shfl_up_sync(0xffffffffu, inclusive, o);
            if (lane >= o) inclusive += u;
        }
        if (lane == 31) s_warp[warp] = inclusive;
        __syncthreads();
        if (warp == 0) {
            const int v = lane < n_warps ? s_warp[lane] : 0;
            int warp_inclusive = v;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int u = __shfl_up_sync(0xffffffffu, warp_inclusive, o);
                if (lane >= o) warp_inclusive += u;
            }
            if (lane < n_warps) s_warp[lane] = warp_inclusive - v;
            if (lane == 31) s_chunk = warp_inclusive;
        }
        __syncthreads();
        long long at = (long long)b * width + base + s_warp[warp] + (inclusive - mine);
#pragma unroll
        for (int i = 0; i < Q; ++i)
            if (w[i] > 0.0) {
                packed_w[at] = w[i];
                packed_s[at] = (int)(it.s + i);
                ++at;
            }
        base += s_chunk;
    }
    if (threadIdx.x == 0) counts[b] = base;
}

// q as coarse_weight_stats's; width at least every row's bound
extern "C" __global__ void __launch_bounds__(WEIGHT_THREADS)
coarse_candidates(const float* __restrict__ d2, const double* __restrict__ prior_ko, long long ko_stride,
                  const double* __restrict__ prior_t, long long n_samples, int n_t, double adaptive_fraction, int q,
                  const double* __restrict__ row_max, const double* __restrict__ row_total, long long width,
                  double* __restrict__ packed_w, int* __restrict__ packed_s, long long* __restrict__ counts)
{
    const int b = blockIdx.x;
    const float* row = d2 + (long long)b * n_samples;
    if (q == 8)
        candidates_row<8>(row, prior_ko, ko_stride, prior_t, n_samples, n_t, adaptive_fraction, b, row_max,
                          row_total, width, packed_w, packed_s, counts);
    else if (q == 4)
        candidates_row<4>(row, prior_ko, ko_stride, prior_t, n_samples, n_t, adaptive_fraction, b, row_max,
                          row_total, width, packed_w, packed_s, counts);
    else
        candidates_row<1>(row, prior_ko, ko_stride, prior_t, n_samples, n_t, adaptive_fraction, b, row_max,
                          row_total, width, packed_w, packed_s, counts);
}
