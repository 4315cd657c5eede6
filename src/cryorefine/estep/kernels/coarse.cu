// Coarse-pass squared differences as one tiled matrix product per batch of particles.
//
// Rows m = b·T + t are a particle's image moved by translation t (and multiplied by
// CTF/σ², planar: real parts in rows 0..Kc-1 of A, imaginary parts in Kc..2Kc-1);
// columns n are the projected slices of orientation n (planar likewise in B). A block
// computes a GEMM_BM × GEMM_BN tile: every image chunk it stages in shared memory is reused
// against GEMM_BN slices and every slice chunk against GEMM_BM shifted images (Zhang 2018
// §5; RELION-2 appendix 1 tile the same product). Each thread keeps an 8 × 8 tile of sums in
// registers; the next k-slab is fetched into registers while the current one is used.
//
// A (K × lda) and B (K × ldb) are coefficient-major and zero-padded: lda is a multiple of
// GEMM_BM, ldb of GEMM_BN and K of GEMM_BK, so the main loop needs no bounds checks.
//
// Epilogue, for m = b·T + t < M and n < N, written to out[(b·n_total + n_offset + n)·T + t]
// (a chunk of orientations into the (particle, class·orientation, translation) array):
//   mode 0 (likelihood):     row_term[b] + pair_term[b·N + n] − acc
//   mode 1 (correlation):    −acc / (row_term[b] · sqrt(pair_term[b·N + n]))
//   mode 2 (plain product):  acc

#ifndef GEMM_BM
#define GEMM_BM 128
#endif
#ifndef GEMM_BN
#define GEMM_BN 128
#endif
#ifndef GEMM_BK
#define GEMM_BK 8
#endif

// Staging of the k-slabs: 256 threads each move one float4 of row lk of A's and of B's slab, at column lm of the
// block's tile (coarse_diff2_tf32 also moves row lk + 8).
struct CrCoarseStaging {
    int lk, lm;
    const float* Ap;
    const float* Bp;

    __device__ __forceinline__ CrCoarseStaging(const float* __restrict__ A, const float* __restrict__ B, int lda,
                                               int ldb, int m0, int n0)
        : lk(threadIdx.x / (GEMM_BM / 4)), lm((threadIdx.x % (GEMM_BM / 4)) * 4)
    {
        Ap = A + (size_t)lk * lda + m0 + lm;
        Bp = B + (size_t)lk * ldb + n0 + lm;
    }
};

// The epilogue of the sum `acc` of row m = b·T + t (m < M) and column n < N, written to its place in `out` (above).
// The callers divide m by T once a row: a division for each of a thread's outputs cost up to a tenth of a short
// product's time.
__device__ __forceinline__ void cr_coarse_write(float acc, int b, int t, int n, int N, int T,
                                                const float* __restrict__ row_term,
                                                const float* __restrict__ pair_term, int mode, int n_total,
                                                int n_offset, float* __restrict__ out)
{
    float v;
    if (mode == 0) {
        v = row_term[b] + pair_term[(size_t)b * N + n] - acc;
    } else if (mode == 1) {
        v = -acc / (row_term[b] * sqrtf(fmaxf(pair_term[(size_t)b * N + n], 1e-30f)));
    } else {
        v = acc;
    }
    out[((size_t)b * n_total + n_offset + n) * T + t] = v;
}

// The two outputs of an mma fragment's row m, columns n and n + 1 (acc0, acc1): nothing beyond the rows M and the
// columns N (the tensor-core kernels' epilogues).
__device__ __forceinline__ void cr_coarse_write_pair(float acc0, float acc1, int m, int n, int M, int N, int T,
                                                     const float* __restrict__ row_term,
                                                     const float* __restrict__ pair_term, int mode, int n_total,
                                                     int n_offset, float* __restrict__ out)
{
    const int b = m / T;  // unconditional: the unrolled callers' rows share it
    const int t = m - b * T;
    if (m < M && n < N) cr_coarse_write(acc0, b, t, n, N, T, row_term, pair_term, mode, n_total, n_offset, out);
    if (m < M && n + 1 < N)
        cr_coarse_write(acc1, b, t, n + 1, N, T, row_term, pair_term, mode, n_total, n_offset, out);
}

extern "C" __global__ void __launch_bounds__(256, 2)
coarse_diff2(const float* __restrict__ A, const float* __restrict__ B, int lda, int ldb, int K, int M, int N,
             int T, const float* __restrict__ row_term, const float* __restrict__ pair_term, int mode,
             int n_total, int n_offset, float* __restrict__ out)
{
    __shared__ __align__(16) float As[2][GEMM_BK][GEMM_BM];
    __shared__ __align__(16) float Bs[2][GEMM_BK][GEMM_BN];
    const int tid = threadIdx.x;
    const int m0 = blockIdx.y * GEMM_BM;
    const int n0 = blockIdx.x * GEMM_BN;
    const CrCoarseStaging st(A, B, lda, ldb, m0, n0);
    float4 ra = *reinterpret_cast<const float4*>(st.Ap);
    float4 rb = *reinterpret_cast<const float4*>(st.Bp);
    *reinterpret_cast<float4*>(&As[0][st.lk][st.lm]) = ra;
    *reinterpret_cast<float4*>(&Bs[0][st.lk][st.lm]) = rb;
    __syncthreads();

    const int tx = tid % 16;
    const int ty = tid / 16;
    float acc[8][8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;

    int buf = 0;
    for (int k0 = 0; k0 < K; k0 += GEMM_BK) {
        const bool more = k0 + GEMM_BK < K;
        if (more) {
            ra = *reinterpret_cast<const float4*>(st.Ap + (size_t)(k0 + GEMM_BK) * lda);
            rb = *reinterpret_cast<const float4*>(st.Bp + (size_t)(k0 + GEMM_BK) * ldb);
        }
#pragma unroll
        for (int kk = 0; kk < GEMM_BK; ++kk) {
            const float4 a0 = *reinterpret_cast<const float4*>(&As[buf][kk][ty * 4]);
            const float4 a1 = *reinterpret_cast<const float4*>(&As[buf][kk][GEMM_BM / 2 + ty * 4]);
            const float4 b0 = *reinterpret_cast<const float4*>(&Bs[buf][kk][tx * 4]);
            const float4 b1 = *reinterpret_cast<const float4*>(&Bs[buf][kk][GEMM_BN / 2 + tx * 4]);
            const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        if (more) {
            buf ^= 1;
            *reinterpret_cast<float4*>(&As[buf][st.lk][st.lm]) = ra;
            *reinterpret_cast<float4*>(&Bs[buf][st.lk][st.lm]) = rb;
            __syncthreads();
        }
    }

#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int m = m0 + (i < 4 ? ty * 4 + i : GEMM_BM / 2 + ty * 4 + i - 4);
        if (m >= M) continue;
        const int b = m / T;
        const int t = m - b * T;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int n = n0 + (j < 4 ? tx * 4 + j : GEMM_BN / 2 + tx * 4 + j - 4);
            if (n < N) cr_coarse_write(acc[i][j], b, t, n, N, T, row_term, pair_term, mode, n_total, n_offset, out);
        }
    }
}

// A[c·lda + b·T + t] = Re(x[b, c]·e^{−2πi k·s/N}·scale[b, c]), A[(Kc + c)·lda + …] = Im(…),
// with s = residual[b] + trans[t] in pixels: the images moved by every coarse translation.
extern "C" __global__ void shift_images_planar(const float2* __restrict__ x, const float* __restrict__ scale,
                                               const float* __restrict__ kx, const float* __restrict__ ky,
                                               const float* __restrict__ residual,
                                               const float* __restrict__ trans, int n_particles, int T, int Kc,
                                               float two_over_ori, int lda, float* __restrict__ A)
{
    const int m = blockIdx.x * blockDim.x + threadIdx.x;
    if (m >= n_particles * T) return;
    const int b = m / T;
    const int t = m - b * T;
    const float sx = residual[2 * b] + trans[2 * t];
    const float sy = residual[2 * b + 1] + trans[2 * t + 1];
    for (int c = blockIdx.y; c < Kc; c += gridDim.y) {  // beyond the grid's y limit, in turns
        float sn, cs;
        sincospif(-two_over_ori * (kx[c] * sx + ky[c] * sy), &sn, &cs);
        const float2 v = x[(size_t)b * Kc + c];
        const float s = scale[(size_t)b * Kc + c];
        A[(size_t)c * lda + m] = (v.x * cs - v.y * sn) * s;
        A[(size_t)(Kc + c) * lda + m] = (v.x * sn + v.y * cs) * s;
    }
}
