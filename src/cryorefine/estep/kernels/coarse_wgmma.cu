// The coarse product of coarse_diff2 on Hopper's warp-group tensor-core products (`wgmma`), FP32-accurate by the
// same 3xTF32 split as coarse_tf32.cu: a·b = lo_a·hi_b + hi_a·lo_b + hi_a·hi_b. `mma.sync` (coarse_diff2_tf32) keeps
// the tensor cores of an H100 or H200 about a third busy; `wgmma` reads both operands from shared memory itself and
// runs asynchronously while the threads stage the next slab.
//
// Same operands, padding and epilogue as coarse_diff2 (coarse.cu), and the same 128 × 128 tile a block: A (K × lda)
// and B (K × ldb) coefficient-major, lda a multiple of GEMM_BM, ldb of GEMM_BN, K of GEMM_BK (8). Two warp groups
// take 64 rows each, all 128 columns: one `wgmma.m64n128k8` per 8 coefficients and TF32 part.
//
// Shared memory (dynamic, WGMMA_SHARED_BYTES): two buffers of one slab of WG_BK coefficients, each holding four parts
// (A hi, A lo, B hi, B lo) of 128 rows × WG_BK coefficients, stored in wgmma's "core matrices" without swizzling: a
// core matrix is 8 rows × 4 coefficients (128 bytes, a row's 4 coefficients contiguous); the core matrices of one
// 8-row group follow each other along the coefficients (WG_LBO bytes apart), and the groups are WG_SBO bytes apart:
// 16 bytes more than the 1,024 of their core matrices. A thread loads a 4 × 4 block (4 coefficients of 4 rows, one
// 16-byte load a coefficient) and stores each row's 4 coefficients as one 16-byte store; the 16 bytes between
// groups let a quarter warp's stores (rows 4 apart, in 4 groups) meet no bank twice.
//
// Accuracy: the tensor cores add into their accumulator without rounding to nearest (coarse_tf32.cu); so each slab's
// products go to `part`, which the first product of a slab starts afresh (scale-d 0), and `part` is added to `acc`
// in FP32 after the slab: WG_BK = 32 coefficients a flush, measured as accurate as 16 (docs/benchmark-conclusions.md).
//
// Compiled for sm_90a only (`kernel_module` passes -arch=sm_90a on a compute capability 9.0 device, and the engine
// launches this kernel there alone: `device_coarse_kernel`); elsewhere its body is empty. Where a compiler given
// -arch=sm_90a took another architecture (cr_wgmma_compiled 0) or refused the option, the engine launches
// coarse_diff2_tf32 instead.

// 1 in a module whose code was compiled for sm_90a (coarse_diff2_wgmma has its body), else 0: `kernel_module` reads
// it, since a compiler given -arch=sm_90a after CuPy's own option might take CuPy's
__device__ int cr_wgmma_compiled =
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    1;
#else
    0;
#endif

#ifndef WGMMA_BK
#define WGMMA_BK 32
#endif
#define WG_BK WGMMA_BK
#define WG_LBO 128
// an 8-row group's 8 core matrices, then 16 bytes more: the stores of a quarter warp (rows 4 apart) meet no bank twice
#define WG_SBO (WG_BK / 4 * 128 + 16)
#define WG_PART_FLOATS (GEMM_BM / 8 * WG_SBO / 4)
static_assert(WG_BK == 32 && GEMM_BM == 128 && GEMM_BN == 128,
              "coarse_diff2_wgmma stages 32 coefficients of 128 rows a slab, 4 × 4 blocks over 256 threads");
#ifdef WGMMA_SHARED_BYTES
static_assert(2 * 4 * WG_PART_FLOATS * 4 == WGMMA_SHARED_BYTES, "the host's WGMMA_SHARED_BYTES is not this layout's");
#endif

// a shared-memory matrix descriptor (no swizzle): start address, leading byte offset (between core matrices along
// the coefficients), stride byte offset (between 8-row groups), each in 16-byte units
__device__ __forceinline__ unsigned long long cr_wg_descriptor(const float* p)
{
    const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(p));
    return (unsigned long long)((address & 0x3FFFF) >> 4) | ((unsigned long long)(WG_LBO >> 4) << 16)
         | ((unsigned long long)(WG_SBO >> 4) << 32);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// d (+)= a·b over 8 coefficients for the warp group's 64 × 128 tile; scale_d 0 starts d afresh
__device__ __forceinline__ void cr_wgmma_tf32(float* d, unsigned long long a, unsigned long long b, int scale_d)
{
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63},"
        " %64, %65, p, 1, 1;\n}\n"
        :
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(a), "l"(b), "r"(scale_d));
}

// keeps the compiler from moving accesses of the accumulators across the asynchronous products
__device__ __forceinline__ void cr_wg_fence_registers(float* d)
{
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
#endif

extern "C" __global__ void __launch_bounds__(256, 1)
coarse_diff2_wgmma(const float* __restrict__ A, const float* __restrict__ B, int lda, int ldb, int K, int M, int N,
                   int T, const float* __restrict__ row_term, const float* __restrict__ pair_term, int mode,
                   int n_total, int n_offset, float* __restrict__ out)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(128) float wg_shared[];
    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const int group = lane >> 2, tig = lane & 3;
    const int wg = warp >> 2;  // the warp group: rows 64·wg ... of the tile
    const int m0 = blockIdx.y * GEMM_BM;
    const int n0 = blockIdx.x * GEMM_BN;
    // staging: a thread moves a 4 × 4 block of both operands' slabs, coefficients 4·kq ... 4·kq + 3 of rows
    // 4·r4 ... 4·r4 + 3, one 16-byte load a coefficient (a warp's load reads 128 consecutive floats), then a row's 4
    // coefficients as one 16-byte store a part
    const int r4 = tid & 31, kq = tid >> 5;
    const float* Ap = A + m0 + 4 * r4;
    const float* Bp = B + n0 + 4 * r4;
    const float4 zero4 = make_float4(0.f, 0.f, 0.f, 0.f);

    float4 ra[4], rb[4];
    auto load = [&](int k0) {
        const int k = k0 + 4 * kq;  // K is a multiple of 8: the 4 coefficients lie all inside K or all beyond it
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            ra[j] = k < K ? *reinterpret_cast<const float4*>(Ap + (size_t)(k + j) * lda) : zero4;
            rb[j] = k < K ? *reinterpret_cast<const float4*>(Bp + (size_t)(k + j) * ldb) : zero4;
        }
    };
    auto column = [](const float4* v, int i, float* out) {  // element i of each of the 4 loads
#pragma unroll
        for (int j = 0; j < 4; ++j) out[j] = i == 0 ? v[j].x : i == 1 ? v[j].y : i == 2 ? v[j].z : v[j].w;
    };
    auto store = [&](int buf) {
        float* base = wg_shared + buf * 4 * WG_PART_FLOATS;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float a[4], b[4];
            column(ra, i, a);
            column(rb, i, b);
            unsigned ah[4], al[4], bh[4], bl[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                cr_split_tf32(a[j], ah[j], al[j]);
                cr_split_tf32(b[j], bh[j], bl[j]);
            }
            const int r = 4 * r4 + i;
            const int at = (r >> 3) * (WG_SBO / 4) + (r & 7) * 4 + kq * (WG_LBO / 4);
            *reinterpret_cast<uint4*>(base + at) = make_uint4(ah[0], ah[1], ah[2], ah[3]);
            *reinterpret_cast<uint4*>(base + WG_PART_FLOATS + at) = make_uint4(al[0], al[1], al[2], al[3]);
            *reinterpret_cast<uint4*>(base + 2 * WG_PART_FLOATS + at) = make_uint4(bh[0], bh[1], bh[2], bh[3]);
            *reinterpret_cast<uint4*>(base + 3 * WG_PART_FLOATS + at) = make_uint4(bl[0], bl[1], bl[2], bl[3]);
        }
        // the products read shared memory through the async proxy: make these stores visible to it
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    };

    float acc[64], part[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = part[i] = 0.f;

    load(0);
    store(0);
    __syncthreads();
    int buf = 0;
    for (int k0 = 0; k0 < K; k0 += WG_BK) {
        const bool more = k0 + WG_BK < K;
        if (more) load(k0 + WG_BK);  // in flight while the products run
        const float* base = wg_shared + buf * 4 * WG_PART_FLOATS;
        const float* a_hi = base + wg * 8 * (WG_SBO / 4);  // the warp group's 64 rows: 8 groups of WG_SBO bytes
        const float* a_lo = a_hi + WG_PART_FLOATS;
        const float* b_hi = base + 2 * WG_PART_FLOATS;
        const float* b_lo = base + 3 * WG_PART_FLOATS;
        cr_wg_fence_registers(part);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int s = 0; s < WG_BK / 8; ++s) {  // 8 coefficients: 2 core matrices, WG_LBO bytes each
            const int o = s * 2 * (WG_LBO / 4);
            cr_wgmma_tf32(part, cr_wg_descriptor(a_lo + o), cr_wg_descriptor(b_hi + o), s > 0);
            cr_wgmma_tf32(part, cr_wg_descriptor(a_hi + o), cr_wg_descriptor(b_lo + o), 1);
            cr_wgmma_tf32(part, cr_wg_descriptor(a_hi + o), cr_wg_descriptor(b_hi + o), 1);
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        if (more) store(buf ^ 1);  // the other buffer: its last products were waited for before the barrier
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        cr_wg_fence_registers(part);
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[i] += part[i];
        __syncthreads();
        buf ^= 1;
    }

    // epilogue: accumulator 4·j + 2·half + c holds row 16·(warp in group) + group + 8·half of the warp group's 64,
    // column 8·j + 2·tig + c
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int j = 0; j < 16; ++j)
            cr_coarse_write_pair(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1],
                                 m0 + wg * 64 + (warp & 3) * 16 + group + half * 8, n0 + j * 8 + tig * 2, M, N, T,
                                 row_term, pair_term, mode, n_total, n_offset, out);
#endif
}
