// Coarse-pass squared differences of a local search, with the slices projected inside the kernel.
//
// Each particle b has its own count[b] ≤ width orientations (rotation matrices mats[(b·width + r)·9 ..],
// rows count[b] … width − 1 the padding of a narrower neighbourhood) and its own images moved by T
// translations. Block x takes the tile of RT orientations tile_first[x] … + RT − 1 of particle
// tile_particle[x] × TT translations: a particle has as many tiles as its own count needs, not as
// many as the sub-batch's widest neighbourhood (`estep.kernels.local_tiles`), and the padding rows
// are neither projected nor written. Per chunk of LOCAL_CK coefficients a block projects its
// orientations' slices into shared memory (cr_slice_value, the values of project_slices_of_classes) and
// stages the moved images beside them, then every thread adds a 2 × 2 tile of
// cross terms Σ_c Re(moved_t(c)·conj(P_r(c))). The slices never reach device memory: the
// neighbourhood of one particle is seen by no other, so there is nothing to share, and writing the
// slices out and reading them back twice (|P|², then the product) cost more than projecting them.
// Sums run in float32 over a chunk and in float64 across chunks.
//
// The translation tile TT is the smallest of 16, 32, 64 that holds the search's translations (64
// in several grid layers beyond), so that the few translations of a late local search (9 or 13)
// are not padded to 32; the block's LOCAL_THREADS threads then take RT = 4·LOCAL_THREADS / TT
// orientations. Each layer projects its orientations again: the largest tile keeps that rare.
// Instances local_diff2_t16, _t32, _t64 (`estep.kernels.local_tile` picks one).
//
// moved: (B, n_coef, ldt) complex, the image moved by translation t and multiplied by
//        minv·CTF (mode 0) or CTF (mode 1); translations n_t..ldt-1 are padding (any finite value),
//        ldt a multiple of TT
// pair:  (B, n_coef), ½·minv·CTF² (mode 0) or CTF² (mode 1)
// row_term: (B,) float64, ½·Σ minv·|X|² (mode 0) or ‖X‖ (mode 1)
// out:   out[((b·n_class + k)·width + r)·n_t + t] for r < count[b], t < n_t (the rest untouched):
//   mode 0 (likelihood):   row_term[b] + Σ_c pair·|P_r|² − cross
//   mode 1 (correlation):  −cross / (row_term[b] · sqrt(Σ_c pair·|P_r|²))
// Numpy twin: NumpyEngine._diff2_dense on each particle's own projections.

#ifndef LOCAL_CK
#define LOCAL_CK 32
#endif
#ifndef LOCAL_THREADS
#define LOCAL_THREADS 256
#endif

template <int TT>
__device__ __forceinline__ void local_diff2_tile(
    const float2* __restrict__ vol, int d, int w, int origin, float pf, float r_pad_sq,
    const float* __restrict__ mats, const int* __restrict__ tile_particle, const int* __restrict__ tile_first,
    const int* __restrict__ count, const float* __restrict__ kx, const float* __restrict__ ky, int n_coef,
    const float2* __restrict__ moved, int ldt, const float* __restrict__ pair, const double* __restrict__ row_term,
    int width, int n_t, int mode, int n_class, int k, float* __restrict__ out)
{
    constexpr int RT = 4 * LOCAL_THREADS / TT;  // (RT / 2) × (TT / 2) threads, 2 × 2 outputs each
    constexpr int PS_STRIDE = RT + 2;  // float2 per staged coefficient: 16-byte rows, fewer bank conflicts
    // projecting: OL neighbouring lanes take OL orientations at one coefficient. The orientations of a
    // neighbourhood are a fraction of a degree to a few degrees apart, so the lanes read the same or adjacent
    // voxels; lanes along the coefficients (a padding factor of voxels apart) would each read their own.
    constexpr int OL = RT < 32 ? RT : 32;
    constexpr int CS = LOCAL_THREADS / RT;  // threads per orientation: the chunk's coefficients in turns
    static_assert(LOCAL_THREADS % LOCAL_CK == 0 && LOCAL_CK % CS == 0 && RT % OL == 0, "projection shape");
    static_assert((RT / 2) * (TT / 2) == LOCAL_THREADS, "tile shape");
    __shared__ __align__(16) float2 ps[LOCAL_CK * PS_STRIDE];
    __shared__ __align__(16) float4 ms[LOCAL_CK][TT / 2];
    __shared__ double power_part[CS][RT];
    __shared__ double power_s[RT];

    const int tid = threadIdx.x;
    const long long b = tile_particle[blockIdx.x];
    const int r0 = tile_first[blockIdx.x], t0 = blockIdx.y * TT, n_r = count[b];
    const int lane = tid % 32, warp = tid / 32;
    const int pr = (warp % (RT / OL)) * OL + lane % OL;        // this thread's orientation in the tile
    const int slot = (warp / (RT / OL)) * (32 / OL) + lane / OL;  // its first coefficient of each chunk
    const bool projects = r0 + pr < n_r;  // whole warps beyond the particle's count skip the projection
    float a[6];
#pragma unroll
    for (int i = 0; i < 6; ++i) a[i] = projects ? mats[(b * width + r0 + pr) * 9 + i] : 0.f;
    double power = 0.0;
    // accumulating: orientations 2·tr, 2·tr + 1 and translations 2·tt, 2·tt + 1 of the tile
    const int tr = tid / (TT / 2), tt = tid % (TT / 2);
    double cross[2][2] = {{0.0, 0.0}, {0.0, 0.0}};
    const float2* moved_b = moved + b * n_coef * ldt + t0;
    const float* pair_b = pair + b * n_coef;

    for (int c0 = 0; c0 < n_coef; c0 += LOCAL_CK) {
#pragma unroll
        for (int j = 0; j < LOCAL_CK / CS; ++j) {
            const int cc = slot + j * CS, c = c0 + cc;
            float2 v = make_float2(0.f, 0.f);
            if (projects && c < n_coef) {
                v = cr_slice_value(vol, d, w, origin, pf, r_pad_sq, a, kx[c], ky[c]);
                power += (double)(pair_b[c] * (v.x * v.x + v.y * v.y));
            }
            ps[cc * PS_STRIDE + pr] = v;
        }
        for (int i = tid; i < LOCAL_CK * (TT / 2); i += LOCAL_THREADS) {
            const int cc = i / (TT / 2), pairt = i % (TT / 2);
            float4 m = make_float4(0.f, 0.f, 0.f, 0.f);
            if (c0 + cc < n_coef)
                m = *reinterpret_cast<const float4*>(moved_b + (size_t)(c0 + cc) * ldt + 2 * pairt);
            ms[cc][pairt] = m;
        }
        __syncthreads();
        float acc[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
#pragma unroll 8
        for (int cc = 0; cc < LOCAL_CK; ++cc) {
            const float4 p = *reinterpret_cast<const float4*>(&ps[cc * PS_STRIDE + 2 * tr]);
            const float4 m = ms[cc][tt];
            acc[0][0] += p.x * m.x + p.y * m.y;
            acc[0][1] += p.x * m.z + p.y * m.w;
            acc[1][0] += p.z * m.x + p.w * m.y;
            acc[1][1] += p.z * m.z + p.w * m.w;
        }
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 2; ++j) cross[i][j] += (double)acc[i][j];
        __syncthreads();
    }
    // Σ_c pair·|P_r|²: the CS threads of each orientation hold a share each, added in a fixed order
    power_part[slot][pr] = power;
    __syncthreads();
    if (tid < RT) {
        double v = 0.0;
#pragma unroll
        for (int s = 0; s < CS; ++s) v += power_part[s][tid];
        power_s[tid] = v;
    }
    __syncthreads();
    const double row = row_term[b];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = r0 + 2 * tr + i;
        if (r >= n_r) continue;
        const double pw = power_s[2 * tr + i];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int t = t0 + 2 * tt + j;
            if (t >= n_t) continue;
            const double value = mode == 0 ? row + pw - cross[i][j]
                                           : -cross[i][j] / (sqrt(fmax(pw, 1e-300)) * row);
            out[((b * n_class + k) * width + r) * n_t + t] = (float)value;
        }
    }
}

#define LOCAL_DIFF2_INSTANCE(TT)                                                                                   \
    extern "C" __global__ void __launch_bounds__(LOCAL_THREADS) local_diff2_t##TT(                                 \
        const float2* __restrict__ vol, int d, int w, int origin, float pf, float r_pad_sq,                         \
        const float* __restrict__ mats, const int* __restrict__ tile_particle, const int* __restrict__ tile_first, \
        const int* __restrict__ count, const float* __restrict__ kx, const float* __restrict__ ky, int n_coef,     \
        const float2* __restrict__ moved, int ldt, const float* __restrict__ pair,                                 \
        const double* __restrict__ row_term, int width, int n_t, int mode, int n_class, int k,                     \
        float* __restrict__ out)                                                                                   \
    {                                                                                                              \
        local_diff2_tile<TT>(vol, d, w, origin, pf, r_pad_sq, mats, tile_particle, tile_first, count, kx, ky,      \
                             n_coef, moved, ldt, pair, row_term, width, n_t, mode, n_class, k, out);               \
    }

LOCAL_DIFF2_INSTANCE(16)
LOCAL_DIFF2_INSTANCE(32)
LOCAL_DIFF2_INSTANCE(64)

// The moved images of local_diff2_t*: moved[(b·kc + c)·ldt + t] = xs[b, c]·e^{iθ},
// θ = scale·(sx·kx[c] + sy·ky[c]) with (sx, sy) = shifts[b, t] (px, float64); the phase and the product in
// float64, the result rounded to float32 (numpy twin `Coefficients.phase`, then complex64); translations
// n_t … ldt − 1 are zeros. Grid (ceil(kc·ldt / blockDim.x), particles): one output a thread.
extern "C" __global__ void local_shift_images(const float2* __restrict__ xs, const double* __restrict__ shifts,
                                              const float* __restrict__ kx, const float* __restrict__ ky,
                                              double scale, int n_t, int ldt, int kc, float2* __restrict__ moved)
{
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= kc * ldt) return;
    const long long b = blockIdx.y;
    const int c = j / ldt, t = j - c * ldt;
    float2* out = moved + b * kc * ldt + j;
    if (t >= n_t) {
        *out = make_float2(0.f, 0.f);
        return;
    }
    const float2 x = xs[b * kc + c];
    const double* s = shifts + (b * n_t + t) * 2;
    double sn, cs;
    sincos(scale * (s[0] * (double)kx[c] + s[1] * (double)ky[c]), &sn, &cs);
    *out = make_float2((float)(x.x * cs - x.y * sn), (float)(x.x * sn + x.y * cs));
}
