// Back-projection of weighted slices into padded data/weight volumes with atomic adds.
// Twin of core.projector.BackProjector.backproject: coefficient (kx, ky) of slice r goes to
// q = pf·Aᵀ(kx, ky, 0) with trilinear weights (conjugated at the mirrored point where x < 0);
// coefficients with weight ≤ 0 or |q|² beyond r_pad_sq are skipped. The sums are float32 (data
// interleaved re, im), as RELION's GPU back-projector keeps them through an iteration: half the
// memory of float64 and cheaper atomics; the M-step sums them per shell in float64.
//
// The rows come in groups of `group` consecutive rows (the NFO child orientations of one coarse orientation, a
// fraction of a degree apart), and a thread takes one coefficient of every row of a group in turn. Where a row's
// coefficient falls in the same voxel cube as the one before it, its shares are added in registers, and the
// cube's sums go to memory once, when the cube changes: one `atomic_add_x_pair` per x edge of the cube for
// several rows. With group 1 every row's shares go to memory alone.
//
// REF_DIM 2 (2D references, project.cu): coefficient (kx, ky) goes to q = pf·A₂ᵀ(kx, ky) of the class's padded 2D
// grid (d, w) with bilinear weights, the twin of BackProjector.backproject on a 2D grid: the "cube" is the square
// (x0, y0), its two x edges (dy) the first two of the cube's four, z = 0 and fz = 0 throughout.

#if REF_DIM == 2
#define CR_CUBE_EDGES 2  // the square's x edges: dy = 0, 1
#else
#define CR_CUBE_EDGES 4  // the cube's x edges: (dz, dy)
#endif

// The shares of one voxel cube (base: the index of its corner (x0, y0, z0)) summed over consecutive rows.
struct CrCubeSums {
    size_t base;
    float4 d[CR_CUBE_EDGES];   // per x edge (dz, dy): the data of voxels x0 and x0 + 1
    float2 wt[CR_CUBE_EDGES];  // and their weights

    __device__ __forceinline__ void flush(float* data, float* weight, size_t sy, size_t sz) const
    {
#pragma unroll
        for (int edge = 0; edge < CR_CUBE_EDGES; ++edge)
            atomic_add_x_pair(data, weight, base + (edge >> 1) * sz + (edge & 1) * sy, d[edge], wt[edge]);
    }

    __device__ __forceinline__ void add(float fx, float fy, float fz, float2 v, float wv)
    {
#pragma unroll
        for (int edge = 0; edge < CR_CUBE_EDGES; ++edge) {
            const int dz = edge >> 1, dy = edge & 1;
            const float cyz = (dz ? fz : 1.f - fz) * (dy ? fy : 1.f - fy);
            const float c0 = cyz * (1.f - fx), c1 = cyz * fx;
            d[edge].x += c0 * v.x;
            d[edge].y += c0 * v.y;
            d[edge].z += c1 * v.x;
            d[edge].w += c1 * v.y;
            wt[edge].x += c0 * wv;
            wt[edge].y += c1 * wv;
        }
    }

    __device__ __forceinline__ void start(size_t at)
    {
        base = at;
#pragma unroll
        for (int edge = 0; edge < CR_CUBE_EDGES; ++edge) {
            d[edge] = make_float4(0.f, 0.f, 0.f, 0.f);
            wt[edge] = make_float2(0.f, 0.f);
        }
    }
};

extern "C" __global__ void backproject_slices(const float2* __restrict__ slice_data,
                                              const float* __restrict__ slice_weight, const float* __restrict__ mats,
                                              const int* __restrict__ row_class, int n_rows, int group,
                                              const float* __restrict__ kx, const float* __restrict__ ky, int n_coef,
                                              int d, int w, int origin, float pf, float r_pad_sq,
                                              long long class_stride, float* __restrict__ data,
                                              float* __restrict__ weight)
{
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= n_coef) return;
    const float kxc = kx[c], kyc = ky[c];
    const size_t sy = (size_t)w, sz = (size_t)d * w;
    const int n_groups = (n_rows + group - 1) / group;
    // groups beyond the grid's y limit (65,535) are taken in turns
    for (int g = blockIdx.y; g < n_groups; g += gridDim.y) {
        CrCubeSums cube;
        bool open = false;
        const int r_end = min((g + 1) * group, n_rows);
        for (int r = g * group; r < r_end; ++r) {
            const size_t at = (size_t)r * n_coef + c;
            const float wv = slice_weight[at];
            if (!(wv > 0.f)) continue;
            const float* a = mats + (size_t)r * 9;
            float qx = pf * (kxc * a[0] + kyc * a[3]);
            float qy = pf * (kxc * a[1] + kyc * a[4]);
#if REF_DIM == 2
            float qz = 0.f;
#else
            float qz = pf * (kxc * a[2] + kyc * a[5]);
#endif
            if (qx * qx + qy * qy + qz * qz > r_pad_sq) continue;
            float2 v = slice_data[at];
            if (qx < 0.f) { qx = -qx; qy = -qy; qz = -qz; v.y = -v.y; }
            const float x0 = floorf(qx), y0 = floorf(qy), z0 = floorf(qz);
            const int ix = min(max((int)x0, 0), w - 2);
            const int iy = min(max((int)y0 + origin, 0), d - 2);
#if REF_DIM == 2
            const int iz = 0;
#else
            const int iz = min(max((int)z0 + origin, 0), d - 2);
#endif
            const size_t base = (size_t)row_class[r] * class_stride + (size_t)iz * sz + (size_t)iy * sy + ix;
            if (!open || base != cube.base) {
                if (open) cube.flush(data, weight, sy, sz);
                cube.start(base);
                open = true;
            }
            cube.add(qx - x0, qy - y0, qz - z0, v, wv);
        }
        if (open) cube.flush(data, weight, sy, sz);
    }
}
