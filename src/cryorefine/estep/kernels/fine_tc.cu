// The fine pass's likelihood squared differences on tensor cores, FP32-accurate (3xTF32, as coarse_tf32.cu), for
// blocks of NFO × NFT children with NFO a multiple of FTC_OT (64) and NFT of 16: a 3D search at oversampling 2
// (64 × 16 children a block; `estep.kernels.fine_tensor_core_shape` keeps oversampling 3's 512 × 64, whose several
// row tiles have not run on a GPU, on fine.cu's kernel). The arguments and output of fine_diff2<…, false> (fine.cu),
// and `group_first`: a CUDA block takes the blocks group_first[x] … group_first[x + 1] − 1 (at most
// FTC_GROUP_ROWS / NFT of them, `estep.kernels.fine_groups`), blocks of one particle, class and coarse orientation at
// several coarse translations, which share their child orientations' slices; nullptr: one block each.
//
// A child's ½ Σ_c minv·|x·e^{−2πi k·s/N} − ctf·P|² is taken as
//     ½ Σ minv·|x|²  +  ½ Σ minv·ctf²·|P_io|²  −  Σ Re(a_it · conj(P_io)),   a_it = minv·ctf·x·e^{−2πi k·s_it/N}:
// the first term is the particle's, the second its orientation's, and the third, for all the group's translations ×
// the orientations at once, a product of a (translations × 2C) matrix of the moved images with a (2C × orientations)
// matrix of the slices (real and imaginary parts as two rows of K). A CUDA block takes one group and FTC_OT of its
// child orientations (blockIdx.y); each of its 4 warps 16 orientations as two m16n8k8 tiles of 8, against every 16
// translations (a tile of 16 rows each). Coefficients come FTC_KC at a time: the block writes the chunk's moved
// images into shared memory (one sine-cosine pair per translation and coefficient, split into TF32 parts there),
// then each thread projects (or reads from `slices`) the slice value of its fragment directly into registers, once
// for all the group's row tiles: in a k-step of 8 (4 coefficients, real parts then imaginary), lane (g, tig) holds
// orientation g of a tile at coefficient tig, as an m16n8k8 product's B operand wants it, and adds minv·ctf²·|P|² to
// its orientation's norm. The tensor cores' sums of a chunk are flushed into FP32 registers (as coarse_tf32.cu's).

#ifndef FTC_OT
#define FTC_OT 64
#endif
#ifndef FTC_GROUP_ROWS
#define FTC_GROUP_ROWS 32
#endif
#define FTC_KC 32

template <int NFO, int NFT>
__global__ void __launch_bounds__(128)
fine_diff2_tc(const float2* __restrict__ vol, int g_d, int g_w, int g_origin, float g_pf, float g_r_pad_sq,
              long long g_class_stride, const float* __restrict__ fine_mats, const float2* __restrict__ slices,
              const int* __restrict__ block_row0, const int* __restrict__ block_out, const int* __restrict__ block_b,
              const int* __restrict__ block_k, const int* __restrict__ block_u, const int* __restrict__ block_t,
              const float* __restrict__ fine_shifts, const float2* __restrict__ x, const float* __restrict__ ctf,
              const float* __restrict__ minv, const int* __restrict__ optics, const float* __restrict__ residual,
              const float* __restrict__ x_norm2, const float* __restrict__ kx, const float* __restrict__ ky,
              int n_coef, float two_over_ori, double* __restrict__ out, const int* __restrict__ group_first)
{
    static_assert(NFO % FTC_OT == 0 && NFT % 16 == 0, "fine_diff2_tc takes 64k orientations × 16k translations");
    static_assert(FTC_OT == 64 && FINE_THREADS == 128, "fine_diff2_tc: 4 warps of 16 orientations each");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    constexpr int NF = NFO * NFT;
    constexpr int GB = NFT >= FTC_GROUP_ROWS ? 1 : FTC_GROUP_ROWS / NFT;  // blocks a group at most
    constexpr int MT = NFT / 16;   // row tiles of the moved images a block
    constexpr int GT = GB * MT;    // and a group
    constexpr int RS = GB * NFT + 8;  // their row stride in shared memory: a warp's fragment loads meet no bank twice
    __shared__ float s_mats[FTC_OT * 9];
    __shared__ float s_shift[2 * GB * NFT];
    __shared__ unsigned s_a[4][FTC_KC][RS];  // TF32 parts of the moved images: real hi, real lo, imaginary hi, lo
    __shared__ float s_w[FTC_KC];            // minv·ctf² at the chunk's coefficients
    __shared__ float s_x2[4];                // the warps' parts of Σ minv·|x|²
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, tig = lane & 3;
    const int blk = group_first ? group_first[blockIdx.x] : blockIdx.x, o0 = blockIdx.y * FTC_OT;
    const int n_live = group_first ? group_first[blockIdx.x + 1] - blk : 1;  // the group's blocks, 1 … GB
    const int rows = n_live * NFT, live_tiles = n_live * MT;
    const int b = block_b[blk];
    const float2* P = slices ? slices + (size_t)(block_row0[blk] + o0) * n_coef : nullptr;
    if (!slices)
        for (int i = tid; i < FTC_OT * 9; i += blockDim.x)
            s_mats[i] = fine_mats[((size_t)block_u[blk] * NFO + o0) * 9 + i];
    for (int i = tid; i < rows; i += blockDim.x) {
        const size_t at = ((size_t)block_t[blk + i / NFT] * NFT + i % NFT) * 2;
        s_shift[2 * i] = residual[2 * b] + fine_shifts[at];
        s_shift[2 * i + 1] = residual[2 * b + 1] + fine_shifts[at + 1];
    }
    __syncthreads();
    const float2* V = vol + (size_t)block_k[blk] * g_class_stride;
    const float2* xb = x + (size_t)b * n_coef;
    const float* cb = ctf + (size_t)b * n_coef;
    const float* mb = minv + (size_t)optics[b] * n_coef;

    float acc[GT][2][4], part[GT][2][4];
#pragma unroll
    for (int i = 0; i < GT; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[i][j][r] = part[i][j][r] = 0.f;
    float nrm[2] = {0.f, 0.f};  // Σ minv·ctf²·|P|² of orientations warp·16 + j·8 + g, this lane's coefficients
    float x2 = 0.f;             // Σ minv·|x|², this thread's coefficients

    for (int c0 = 0; c0 < n_coef; c0 += FTC_KC) {
        if (c0 > 0) __syncthreads();  // the previous chunk's images read by every warp
        for (int i = tid; i < FTC_KC * rows; i += blockDim.x) {
            const int it = i % rows, cc = i / rows, c = c0 + cc;
            float ax = 0.f, ay = 0.f;
            if (c < n_coef) {
                const float2 xv = xb[c];
                const float cv = cb[c], mv = mb[c];
                float sn, cs;
                sincospif(-two_over_ori * (kx[c] * s_shift[2 * it] + ky[c] * s_shift[2 * it + 1]), &sn, &cs);
                const float f = mv * cv;
                ax = f * (xv.x * cs - xv.y * sn);
                ay = f * (xv.x * sn + xv.y * cs);
                if (it == 0) {
                    x2 += mv * (xv.x * xv.x + xv.y * xv.y);
                    s_w[cc] = f * cv;
                }
            } else if (it == 0) {
                s_w[cc] = 0.f;
            }
            cr_split_tf32(ax, s_a[0][cc][it], s_a[1][cc][it]);
            cr_split_tf32(ay, s_a[2][cc][it], s_a[3][cc][it]);
        }
        __syncthreads();
#pragma unroll 2
        for (int s = 0; s < FTC_KC / 4; ++s) {
            const int cc = 4 * s + tig, c = c0 + cc;
            unsigned bh[2][2], bl[2][2];
            const float wc = s_w[cc];
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int io = warp * 16 + j * 8 + g;
                float2 p = make_float2(0.f, 0.f);
                if (c < n_coef)
                    p = P ? P[(size_t)io * n_coef + c]
                          : cr_slice_value(V, g_d, g_w, g_origin, g_pf, g_r_pad_sq, s_mats + io * 9, kx[c], ky[c]);
                nrm[j] += wc * (p.x * p.x + p.y * p.y);
                cr_split_tf32(p.x, bh[j][0], bl[j][0]);
                cr_split_tf32(p.y, bh[j][1], bl[j][1]);
            }
#pragma unroll
            for (int i = 0; i < GT; ++i) {
                if (i >= live_tiles) break;  // uniform across the block
                const int r = i * 16 + g;
                const unsigned ah[4] = {s_a[0][cc][r], s_a[0][cc][r + 8], s_a[2][cc][r], s_a[2][cc][r + 8]};
                const unsigned al[4] = {s_a[1][cc][r], s_a[1][cc][r + 8], s_a[3][cc][r], s_a[3][cc][r + 8]};
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    cr_mma_tf32(part[i][j], al, bh[j]);
                    cr_mma_tf32(part[i][j], ah, bl[j]);
                    cr_mma_tf32(part[i][j], ah, bh[j]);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < GT; ++i)
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    acc[i][j][r] += part[i][j][r];
                    part[i][j][r] = 0.f;
                }
    }
    x2 = cr_warp_sum(x2);
    if (lane == 0) s_x2[warp] = x2;
#pragma unroll
    for (int j = 0; j < 2; ++j) {  // an orientation's norm over its four lanes' coefficients
        nrm[j] += __shfl_xor_sync(0xffffffffu, nrm[j], 1);
        nrm[j] += __shfl_xor_sync(0xffffffffu, nrm[j], 2);
    }
    __syncthreads();
    const double half_x2 = 0.5 * ((double)s_x2[0] + (double)s_x2[1] + (double)s_x2[2] + (double)s_x2[3]);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        // accumulator r holds translation g (+8 for r ≥ 2) and orientation 2·tig (+1 for odd r) of the tile,
        // whose norm lane 4·(2·tig) (4·(2·tig + 1)) holds
        const float n_even = __shfl_sync(0xffffffffu, nrm[j], 8 * tig);
        const float n_odd = __shfl_sync(0xffffffffu, nrm[j], 8 * tig + 4);
#pragma unroll
        for (int i = 0; i < GT; ++i) {
            if (i >= live_tiles) break;
            const int m = blk + i / MT;  // the group's block of this row tile
            const size_t row = (size_t)(block_out ? block_out[m] : m) * NF;
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int io = o0 + warp * 16 + j * 8 + 2 * tig + (r & 1);
                const int it = (i % MT) * 16 + g + (r >= 2 ? 8 : 0);
                out[row + (size_t)io * NFT + it] =
                    half_x2 + 0.5 * (double)((r & 1) ? n_odd : n_even) - (double)acc[i][j][r];
            }
        }
    }
#endif
}
