// Fine pass: squared differences and weighted sums over compressed blocks of children.
//
// A block of the fine pass is one significant coarse sample (particle b, class k, coarse
// orientation, coarse translation t) with its NFO × NFT children (8 × 4 at oversampling 1):
// one base index per block, the children implied (Zhang 2018's compressed weights). The
// children are taken in tiles of TO orientations × TT translations (the whole block at
// oversampling 1; 4 × 16 of the 64 × 16 at oversampling 2), so that a thread's sums stay in
// registers at every order. Where many blocks share a (class, coarse orientation) pair, its NFO
// child slices are projected once beforehand (project_slices_of_classes), rows row0 … row0 + NFO − 1 of
// `slices`, and every block of the pair reads them; otherwise (slices null) each block projects
// its slices on the fly from the padded reference, at rotations staged in shared memory, FINE_THREADS
// coefficients at a time into shared memory with neighbouring lanes on neighbouring child orientations
// (a fraction of a degree apart, they read the same or adjacent voxels; as local.cu). A CUDA
// block handles one tile of one block (blockIdx.x the block, blockIdx.y the tile): every thread
// walks the coefficients with a stride, taking the TO slices, moving the image by the TT
// translations as phase ramps, and accumulating all TO·TT sums in registers; a warp-shuffle and
// shared memory reduction ends it. Child f = io·NFT + it (RELION's oversampled order).

#ifndef FINE_THREADS
#define FINE_THREADS 128
#endif

__device__ __forceinline__ float cr_warp_sum(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    return v;
}

// The first child orientation and translation of this CUDA block's tile (blockIdx.y).
template <int NFT, int TO, int TT>
__device__ __forceinline__ int2 cr_tile_origin()
{
    constexpr int N_TT = NFT / TT;
    return make_int2((int)(blockIdx.y / N_TT) * TO, (int)(blockIdx.y % N_TT) * TT);
}

// Where a tile's TO child slices come from: rows of `slices` projected beforehand (P non-null), or
// projected here from the class's padded volume V at the rotations staged in `mats` (9 floats each),
// a chunk of FINE_THREADS coefficients at a time into shared memory (`project_chunk`).
struct CrTileSlices {
    const float2* P;
    const float2* V;
    int d, w, origin;
    float pf, r_pad_sq;
    const float* mats;
    int n_coef;

    // The TO slices at coefficients c0 … c0 + FINE_THREADS − 1 into s_p[io][c − c0], projected by the whole
    // block, lane i of TO consecutive ones on orientation i; orientations with need[io] ≤ 0 (need may be null)
    // are left alone. Called by every thread of the block for every chunk in turn: it waits until the previous
    // chunk's slices are read by all before it overwrites them, and until the new ones are all written before it
    // returns, so `at` may read them. Nothing to do when P is non-null (the same for the whole block).
    template <int TO>
    __device__ __forceinline__ void project_chunk(int c0, const float* __restrict__ kx, const float* __restrict__ ky,
                                                  float2 (*s_p)[FINE_THREADS + 1], const float* need) const
    {
        if (P) return;
        if (c0 > 0) __syncthreads();
#pragma unroll
        for (int j = 0; j < TO; ++j) {
            const int i = threadIdx.x + j * FINE_THREADS;
            const int io = i % TO, cc = i / TO, c = c0 + cc;
            if (c < n_coef && (!need || need[io] > 0.f))
                s_p[io][cc] = cr_slice_value(V, d, w, origin, pf, r_pad_sq, mats + io * 9, kx[c], ky[c]);
        }
        __syncthreads();
    }

    // Slice io at coefficient c of the chunk starting at c0 (after project_chunk).
    __device__ __forceinline__ float2 at(int io, int c, int c0, float2 (*s_p)[FINE_THREADS + 1]) const
    {
        return P ? P[(size_t)io * n_coef + c] : s_p[io][c - c0];
    }
};

// The tile's slices; without `slices`, the tile's rotations staged into s_mats (made visible by the
// __syncthreads of cr_stage_shifts, which must follow).
template <int NFO, int TO>
__device__ __forceinline__ CrTileSlices cr_tile_slices(const float2* __restrict__ slices, int row0, int2 tile,
                                                       const float2* __restrict__ vol, int g_d, int g_w, int g_origin,
                                                       float g_pf, float g_r_pad_sq, long long g_class_stride, int k,
                                                       int u, const float* __restrict__ fine_mats, float* s_mats,
                                                       int n_coef)
{
    if (!slices)
        for (int i = threadIdx.x; i < TO * 9; i += blockDim.x) s_mats[i] = fine_mats[((size_t)u * NFO + tile.x) * 9 + i];
    return CrTileSlices{slices ? slices + (size_t)(row0 + tile.x) * n_coef : nullptr, vol + (size_t)k * g_class_stride,
                        g_d, g_w, g_origin, g_pf, g_r_pad_sq, s_mats, n_coef};
}

// Stage the tile's translations (px): the particle's residual offset plus the child translations.
template <int NFT, int TT>
__device__ __forceinline__ void cr_stage_shifts(int b, int t, int2 tile, const float* __restrict__ fine_shifts,
                                                const float* __restrict__ residual, float* s_shift)
{
    for (int i = threadIdx.x; i < TT; i += blockDim.x) {
        const size_t at = ((size_t)t * NFT + tile.y + i) * 2;
        s_shift[2 * i] = residual[2 * b] + fine_shifts[at];
        s_shift[2 * i + 1] = residual[2 * b + 1] + fine_shifts[at + 1];
    }
    __syncthreads();
}

// out[row·NFO·NFT + f]: ½ Σ_c minv·|x·e^{−2πi k·s_it/N} − ctf·P_io|² (likelihood), or
// −Σ Re(x_s·conj(ctf·P)) / sqrt(Σ|ctf·P|² · |x|²) with CC (x_norm2[b] = Σ|x|²); P_io is row
// block_row0[blk] + io of `slices` (or projected here when slices is null); row is block_out[blk],
// or blk when block_out is null.
template <int NFO, int NFT, int TO, int TT, bool CC>
__global__ void __launch_bounds__(FINE_THREADS)
fine_diff2(const float2* __restrict__ vol, int g_d, int g_w, int g_origin, float g_pf, float g_r_pad_sq,
           long long g_class_stride, const float* __restrict__ fine_mats, const float2* __restrict__ slices,
           const int* __restrict__ block_row0, const int* __restrict__ block_out, const int* __restrict__ block_b,
           const int* __restrict__ block_k, const int* __restrict__ block_u, const int* __restrict__ block_t,
           const float* __restrict__ fine_shifts, const float2* __restrict__ x, const float* __restrict__ ctf, const float* __restrict__ minv,
           const int* __restrict__ optics, const float* __restrict__ residual, const float* __restrict__ x_norm2,
           const float* __restrict__ kx, const float* __restrict__ ky, int n_coef, float two_over_ori,
           double* __restrict__ out)
{
    constexpr int NF = NFO * NFT;
    constexpr int TF = TO * TT;
    __shared__ float s_mats[TO * 9];
    __shared__ float s_shift[2 * TT];
    __shared__ float s_red[FINE_THREADS / 32][TF * (CC ? 2 : 1)];
    __shared__ float2 s_p[TO][FINE_THREADS + 1];
    const int blk = blockIdx.x;
    const int2 tile = cr_tile_origin<NFT, TO, TT>();
    const int b = block_b[blk];
    const CrTileSlices P = cr_tile_slices<NFO, TO>(slices, slices ? block_row0[blk] : 0, tile, vol, g_d, g_w, g_origin,
                                                   g_pf, g_r_pad_sq, g_class_stride, block_k[blk], block_u[blk],
                                                   fine_mats, s_mats, n_coef);
    cr_stage_shifts<NFT, TT>(b, block_t[blk], tile, fine_shifts, residual, s_shift);
    const float2* xb = x + (size_t)b * n_coef;
    const float* cb = ctf + (size_t)b * n_coef;
    const float* mb = minv + (size_t)optics[b] * n_coef;

    float acc[TF];
    float acc2[CC ? TF : 1];
#pragma unroll
    for (int f = 0; f < TF; ++f) acc[f] = 0.f;
#pragma unroll
    for (int f = 0; f < (CC ? TF : 1); ++f) acc2[f] = 0.f;

    for (int c0 = 0; c0 < n_coef; c0 += FINE_THREADS) {
        P.project_chunk<TO>(c0, kx, ky, s_p, nullptr);
        const int c = c0 + threadIdx.x;
        if (c >= n_coef) continue;  // in the last chunk only
        const float kxc = kx[c], kyc = ky[c];
        const float2 xv = xb[c];
        const float cv = cb[c];
        const float mv = mb[c];
        float2 sh[TT];
#pragma unroll
        for (int it = 0; it < TT; ++it) {
            float sn, cs;
            sincospif(-two_over_ori * (kxc * s_shift[2 * it] + kyc * s_shift[2 * it + 1]), &sn, &cs);
            sh[it] = make_float2(xv.x * cs - xv.y * sn, xv.x * sn + xv.y * cs);
        }
#pragma unroll
        for (int io = 0; io < TO; ++io) {
            float2 p = P.at(io, c, c0, s_p);
            p.x *= cv;
            p.y *= cv;
#pragma unroll
            for (int it = 0; it < TT; ++it) {
                if (CC) {
                    acc[io * TT + it] += sh[it].x * p.x + sh[it].y * p.y;
                    acc2[CC ? io * TT + it : 0] += p.x * p.x + p.y * p.y;
                } else {
                    const float dx = sh[it].x - p.x, dy = sh[it].y - p.y;
                    acc[io * TT + it] += mv * (dx * dx + dy * dy);
                }
            }
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int f = 0; f < TF; ++f) {
        const float v = cr_warp_sum(acc[f]);
        if (lane == 0) s_red[warp][f] = v;
        if (CC) {
            const float v2 = cr_warp_sum(acc2[CC ? f : 0]);
            if (lane == 0) s_red[warp][CC ? TF + f : 0] = v2;
        }
    }
    __syncthreads();
    for (int f = threadIdx.x; f < TF; f += FINE_THREADS) {
        double s = 0.0, s2 = 0.0;
        for (int wi = 0; wi < FINE_THREADS / 32; ++wi) {
            s += s_red[wi][f];
            if (CC) s2 += s_red[wi][CC ? TF + f : 0];
        }
        const size_t at = (size_t)(block_out ? block_out[blk] : blk) * NF + (size_t)(tile.x + f / TT) * NFT + tile.y + f % TT;
        if (CC) {
            out[at] = -s / sqrt(fmax(s2, 1e-300) * fmax((double)x_norm2[b], 1e-300));
        } else {
            out[at] = 0.5 * s;
        }
    }
}

// Weighted sums of one block's kept children (weights normalised per particle, zero if not kept), a
// tile of TO × TT children per CUDA block as in fine_diff2 (a tile with no kept child returns at once):
//   noise[row_b[blk], shell]  += Σ_f w_f |x_s − ctf·P|²           (per-particle noise spectra)
//   scale_xa/aa[row_b[blk]]   += Σ_f w_f use·Re(ctf·P·conj(x_s)), Σ_f w_f use·|ctf·P|²
//   slice_data[row0 + io, c]  += minv_store·ctf · Σ_it w x_nomask·e^{−2πi k·s_it/N}
//   slice_weight[row0 + io, c]+= minv_store·ctf² · Σ_it w
// (row0 = block_row0[blk]; the slices P_io the rows of `slices` in the same places, or projected here
// when slices is null)
// `scale_use` (per class, per coefficient; read when use_scale) is 1 where the data-vs-prior ratio exceeds 3 (RELION's scale sums).
template <int NFO, int NFT, int TO, int TT>
__global__ void __launch_bounds__(FINE_THREADS)
fine_sums(const float2* __restrict__ vol, int g_d, int g_w, int g_origin, float g_pf, float g_r_pad_sq,
          long long g_class_stride, const float* __restrict__ fine_mats, const float2* __restrict__ slices,
          const int* __restrict__ block_row0, const int* __restrict__ block_b, const int* __restrict__ block_k,
          const int* __restrict__ block_u, const int* __restrict__ block_t, const float* __restrict__ fine_shifts, const float2* __restrict__ x, const float2* __restrict__ x_nomask,
          const float* __restrict__ ctf, const float* __restrict__ minv_store, const int* __restrict__ optics,
          const float* __restrict__ residual, const double* __restrict__ weights, const int* __restrict__ shell,
          int n_shells, const float* __restrict__ scale_use, int use_scale, const float* __restrict__ kx,
          const float* __restrict__ ky, int n_coef, float two_over_ori, float2* __restrict__ slice_data,
          float* __restrict__ slice_weight, double* __restrict__ noise, double* __restrict__ scale_xa,
          double* __restrict__ scale_aa)
{
    constexpr int NF = NFO * NFT;
    constexpr int TF = TO * TT;
    extern __shared__ float s_hist[];  // n_shells floats
    __shared__ float s_mats[TO * 9];
    __shared__ float s_shift[2 * TT];
    __shared__ float s_w[TF];
    __shared__ float s_wsum[TO];  // Σ_it of each child orientation's weights
    __shared__ float s_red[FINE_THREADS / 32][2];
    __shared__ float2 s_p[TO][FINE_THREADS + 1];
    __shared__ int s_any;
    const int blk = blockIdx.x;
    const int2 tile = cr_tile_origin<NFT, TO, TT>();
    if (threadIdx.x == 0) s_any = 0;
    __syncthreads();
    for (int f = threadIdx.x; f < TF; f += FINE_THREADS) {
        const float wf = (float)weights[(size_t)blk * NF + (size_t)(tile.x + f / TT) * NFT + tile.y + f % TT];
        s_w[f] = wf;
        if (wf > 0.f) s_any = 1;
    }
    for (int i = threadIdx.x; i < n_shells; i += FINE_THREADS) s_hist[i] = 0.f;
    __syncthreads();
    if (!s_any) return;
    for (int io = threadIdx.x; io < TO; io += FINE_THREADS) {
        float wsum = 0.f;
        for (int it = 0; it < TT; ++it) wsum += s_w[io * TT + it];
        s_wsum[io] = wsum;
    }
    const int b = block_b[blk];
    const int k = block_k[blk];
    const int row0 = block_row0[blk] + tile.x;
    const CrTileSlices P = cr_tile_slices<NFO, TO>(slices, block_row0[blk], tile, vol, g_d, g_w, g_origin, g_pf,
                                                   g_r_pad_sq, g_class_stride, k, block_u[blk], fine_mats, s_mats,
                                                   n_coef);
    cr_stage_shifts<NFT, TT>(b, block_t[blk], tile, fine_shifts, residual, s_shift);
    const float2* xb = x + (size_t)b * n_coef;
    const float2* xnb = x_nomask + (size_t)b * n_coef;
    const float* cb = ctf + (size_t)b * n_coef;
    const float* mb = minv_store + (size_t)optics[b] * n_coef;
    const float* use = use_scale ? scale_use + (size_t)k * n_coef : nullptr;
    float xa = 0.f, aa = 0.f;

    for (int c0 = 0; c0 < n_coef; c0 += FINE_THREADS) {
        P.project_chunk<TO>(c0, kx, ky, s_p, s_wsum);
        const int c = c0 + threadIdx.x;
        if (c >= n_coef) continue;  // in the last chunk only
        const float kxc = kx[c], kyc = ky[c];
        const float2 xv = xb[c], xn = xnb[c];
        const float cv = cb[c];
        const float store = mb[c] * cv;
        const float u = use ? use[c] : 0.f;
        float2 sh[TT], shn[TT];
#pragma unroll
        for (int it = 0; it < TT; ++it) {
            float sn, cs;
            sincospif(-two_over_ori * (kxc * s_shift[2 * it] + kyc * s_shift[2 * it + 1]), &sn, &cs);
            sh[it] = make_float2(xv.x * cs - xv.y * sn, xv.x * sn + xv.y * cs);
            shn[it] = make_float2(xn.x * cs - xn.y * sn, xn.x * sn + xn.y * cs);
        }
        float wd2 = 0.f;
#pragma unroll
        for (int io = 0; io < TO; ++io) {
            const float wsum = s_wsum[io];
            if (wsum <= 0.f) continue;
            float2 p = P.at(io, c, c0, s_p);
            p.x *= cv;
            p.y *= cv;
            float2 dsum = make_float2(0.f, 0.f);
#pragma unroll
            for (int it = 0; it < TT; ++it) {
                const float wf = s_w[io * TT + it];
                if (wf <= 0.f) continue;
                const float dx = sh[it].x - p.x, dy = sh[it].y - p.y;
                wd2 += wf * (dx * dx + dy * dy);
                xa += u * wf * (p.x * sh[it].x + p.y * sh[it].y);
                aa += u * wf * (p.x * p.x + p.y * p.y);
                dsum.x += wf * shn[it].x;
                dsum.y += wf * shn[it].y;
            }
            const size_t at = (size_t)(row0 + io) * n_coef + c;
            atomic_add_complex(&slice_data[at].x, store * dsum.x, store * dsum.y);
            atomicAdd(&slice_weight[at], store * cv * wsum);
        }
        atomicAdd(&s_hist[min(shell[c], n_shells - 1)], wd2);
    }
    if (use_scale) {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
        xa = cr_warp_sum(xa);
        aa = cr_warp_sum(aa);
        if (lane == 0) { s_red[warp][0] = xa; s_red[warp][1] = aa; }
    }
    __syncthreads();
    const int row_b = b;
    for (int i = threadIdx.x; i < n_shells; i += FINE_THREADS)
        if (s_hist[i] != 0.f) atomicAdd(&noise[(size_t)row_b * n_shells + i], (double)s_hist[i]);
    if (use_scale && threadIdx.x == 0) {
        double sxa = 0.0, saa = 0.0;
        for (int wi = 0; wi < FINE_THREADS / 32; ++wi) { sxa += s_red[wi][0]; saa += s_red[wi][1]; }
        atomicAdd(&scale_xa[row_b], sxa);
        atomicAdd(&scale_aa[row_b], saa);
    }
}
