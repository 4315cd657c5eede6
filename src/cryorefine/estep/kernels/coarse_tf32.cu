// The coarse product of coarse_diff2 on tensor cores, FP32-accurate: each operand is split into two TF32 numbers,
// x = hi + lo (hi: x rounded to TF32's 10-bit mantissa, lo: the rest rounded again), and a·b is taken as
// hi_a·hi_b + hi_a·lo_b + lo_a·hi_b ("3xTF32"; the dropped lo_a·lo_b is below 2^-22 of |a·b|). On an H100 or
// H200 the three tensor-core products take 6–15 % less time than the one FP32 product on CUDA cores, with a
// smaller error against float64 (coarse_tensor_cores.py timed both and their errors, docs/benchmark-conclusions.md).
//
// Same operands, tiles, padding and epilogue as coarse_diff2 (coarse.cu): A (K × lda) and B (K × ldb)
// coefficient-major, lda a multiple of GEMM_BM, ldb of GEMM_BN, K of GEMM_BK (8). A block computes a 128 × 128
// tile with 8 warps, each a 64 × 32 part as 4 × 4 `mma.m16n8k8` tiles; K is staged TC_BK = 16 at a time in shared
// memory (rows padded to 136 floats, so a warp's fragment loads meet no bank twice), the next slab fetched into
// registers while the current one is used. On GPUs before compute capability 8.0 (no TF32) the engine launches
// coarse_diff2 instead (`estep.kernels.coarse_kernel_name`); this kernel's body is empty there.

#define TC_BK 16
#define TC_PAD 8
#ifndef TC_FLUSH_SLABS
#define TC_FLUSH_SLABS 1
#endif

__device__ __forceinline__ unsigned cr_tf32(float x)
{
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ void cr_split_tf32(float x, unsigned& hi, unsigned& lo)
{
    hi = cr_tf32(x);
    lo = cr_tf32(x - __uint_as_float(hi));
}

// d += a·b for one m16n8k8 tile (a: 4 TF32 registers of the 16 × 8 tile, b: 2 of the 8 × 8 tile)
__device__ __forceinline__ void cr_mma_tf32(float* d, const unsigned* a, const unsigned* b)
{
    // not volatile: the compiler may interleave the products of independent tiles
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

extern "C" __global__ void __launch_bounds__(256, 1)
coarse_diff2_tf32(const float* __restrict__ A, const float* __restrict__ B, int lda, int ldb, int K, int M, int N,
                  int T, const float* __restrict__ row_term, const float* __restrict__ pair_term, int mode,
                  int n_total, int n_offset, float* __restrict__ out)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    __shared__ __align__(16) float As[2][TC_BK][GEMM_BM + TC_PAD];
    __shared__ __align__(16) float Bs[2][TC_BK][GEMM_BN + TC_PAD];
    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const int group = lane >> 2, tig = lane & 3;
    const int wm = (warp & 1) * 64, wn = (warp >> 1) * 32;  // the warp's part of the block's tile
    const int m0 = blockIdx.y * GEMM_BM;
    const int n0 = blockIdx.x * GEMM_BN;
    // staging: a thread moves one float4 of rows lk and lk + 8 of each operand's slab (K is a multiple of 8, so
    // rows lk + 8 lie either all inside K or all beyond it)
    const CrCoarseStaging st(A, B, lda, ldb, m0, n0);
    const int lk = st.lk, lm = st.lm;
    const float* Ap = st.Ap;
    const float* Bp = st.Bp;
    const float4 zero4 = make_float4(0.f, 0.f, 0.f, 0.f);
    float4 ra0 = *reinterpret_cast<const float4*>(Ap);
    float4 rb0 = *reinterpret_cast<const float4*>(Bp);
    float4 ra1 = 8 < K ? *reinterpret_cast<const float4*>(Ap + (size_t)8 * lda) : zero4;
    float4 rb1 = 8 < K ? *reinterpret_cast<const float4*>(Bp + (size_t)8 * ldb) : zero4;
    *reinterpret_cast<float4*>(&As[0][lk][lm]) = ra0;
    *reinterpret_cast<float4*>(&As[0][lk + 8][lm]) = ra1;
    *reinterpret_cast<float4*>(&Bs[0][lk][lm]) = rb0;
    *reinterpret_cast<float4*>(&Bs[0][lk + 8][lm]) = rb1;
    __syncthreads();

    // The tensor cores add each product to the accumulator rounding toward zero: over tens of thousands of
    // coefficients that loses FP32's accuracy. So the products of TC_FLUSH_SLABS slabs go to `part`, started at 0,
    // and `part` is added to `acc` with FP32 adds (rounded to nearest).
    float acc[4][4][4], part[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[i][j][r] = part[i][j][r] = 0.f;

    int buf = 0, slab = 0;
    for (int k0 = 0; k0 < K; k0 += TC_BK) {
        const bool more = k0 + TC_BK < K;
        if (more) {
            const int k1 = k0 + TC_BK;
            ra0 = *reinterpret_cast<const float4*>(Ap + (size_t)k1 * lda);
            rb0 = *reinterpret_cast<const float4*>(Bp + (size_t)k1 * ldb);
            const bool second = k1 + 8 < K;
            ra1 = second ? *reinterpret_cast<const float4*>(Ap + (size_t)(k1 + 8) * lda) : zero4;
            rb1 = second ? *reinterpret_cast<const float4*>(Bp + (size_t)(k1 + 8) * ldb) : zero4;
        }
#pragma unroll
        for (int kk = 0; kk < TC_BK; kk += 8) {
            unsigned ah[4][4], al[4][4], bh[4][2], bl[4][2];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int n = wn + j * 8 + group;
                cr_split_tf32(Bs[buf][kk + tig][n], bh[j][0], bl[j][0]);
                cr_split_tf32(Bs[buf][kk + tig + 4][n], bh[j][1], bl[j][1]);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int m = wm + i * 16 + group;
                cr_split_tf32(As[buf][kk + tig][m], ah[i][0], al[i][0]);
                cr_split_tf32(As[buf][kk + tig][m + 8], ah[i][1], al[i][1]);
                cr_split_tf32(As[buf][kk + tig + 4][m], ah[i][2], al[i][2]);
                cr_split_tf32(As[buf][kk + tig + 4][m + 8], ah[i][3], al[i][3]);
            }
            // the small products first; 16 independent tiles between two products into one tile
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) cr_mma_tf32(part[i][j], al[i], bh[j]);
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) cr_mma_tf32(part[i][j], ah[i], bl[j]);
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) cr_mma_tf32(part[i][j], ah[i], bh[j]);
        }
        if (++slab == TC_FLUSH_SLABS || !more) {
            slab = 0;
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j)
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        acc[i][j][r] += part[i][j][r];
                        part[i][j][r] = 0.f;
                    }
        }
        if (more) {
            buf ^= 1;
            *reinterpret_cast<float4*>(&As[buf][lk][lm]) = ra0;
            *reinterpret_cast<float4*>(&As[buf][lk + 8][lm]) = ra1;
            *reinterpret_cast<float4*>(&Bs[buf][lk][lm]) = rb0;
            *reinterpret_cast<float4*>(&Bs[buf][lk + 8][lm]) = rb1;
            __syncthreads();
        }
    }

    // epilogue, as coarse_diff2's: accumulator r of tile (i, j) holds row group (+8 for r ≥ 2), column 2·tig (+1)
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int j = 0; j < 4; ++j)
                cr_coarse_write_pair(acc[i][j][half * 2], acc[i][j][half * 2 + 1], m0 + wm + i * 16 + group + half * 8,
                                     n0 + wn + j * 8 + tig * 2, M, N, T, row_term, pair_term, mode, n_total, n_offset,
                                     out);
#endif
}

