// Back-projection of weighted slices into padded data/weight volumes with atomic adds.
// Twin of core.projector.BackProjector.backproject: coefficient (kx, ky) of slice r goes to
// q = pf·Aᵀ(kx, ky, 0) with trilinear weights (conjugated at the mirrored point where x < 0);
// coefficients with weight ≤ 0 or |q|² beyond r_pad_sq are skipped. The sums are float32 (data
// interleaved re, im), as RELION's GPU back-projector keeps them through an iteration: half the
// memory of float64 and cheaper atomics; the M-step sums them per shell in float64. Each of the cube's
// x edges is one `atomic_add_x_pair`.

extern "C" __global__ void backproject_slices(const float2* __restrict__ slice_data,
                                              const float* __restrict__ slice_weight, const float* __restrict__ mats,
                                              const int* __restrict__ row_class, int n_rows,
                                              const float* __restrict__ kx, const float* __restrict__ ky, int n_coef,
                                              int d, int w, int origin, float pf, float r_pad_sq,
                                              long long class_stride, float* __restrict__ data,
                                              float* __restrict__ weight)
{
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= n_coef) return;
    // rows beyond the grid's y limit (65,535) are taken in turns
    for (int r = blockIdx.y; r < n_rows; r += gridDim.y) {
        const size_t at = (size_t)r * n_coef + c;
        const float wv = slice_weight[at];
        if (!(wv > 0.f)) continue;
        const float* a = mats + (size_t)r * 9;
        const float kxc = kx[c], kyc = ky[c];
        float qx = pf * (kxc * a[0] + kyc * a[3]);
        float qy = pf * (kxc * a[1] + kyc * a[4]);
        float qz = pf * (kxc * a[2] + kyc * a[5]);
        if (qx * qx + qy * qy + qz * qz > r_pad_sq) continue;
        float2 v = slice_data[at];
        if (qx < 0.f) { qx = -qx; qy = -qy; qz = -qz; v.y = -v.y; }
        const float x0 = floorf(qx), y0 = floorf(qy), z0 = floorf(qz);
        const float fx = qx - x0, fy = qy - y0, fz = qz - z0;
        const int ix = min(max((int)x0, 0), w - 2);
        const int iy = min(max((int)y0 + origin, 0), d - 2);
        const int iz = min(max((int)z0 + origin, 0), d - 2);
        const size_t sy = (size_t)w, sz = (size_t)d * w;
        const size_t base = (size_t)row_class[r] * class_stride + (size_t)iz * sz + (size_t)iy * sy + ix;
#pragma unroll
        for (int edge = 0; edge < 4; ++edge) {  // the cube's four x edges, each a pair of neighbour voxels
            const int dz = edge >> 1, dy = edge & 1;
            const float cyz = (dz ? fz : 1.f - fz) * (dy ? fy : 1.f - fy);
            atomic_add_x_pair(data, weight, base + dz * sz + dy * sy, cyz * (1.f - fx), cyz * fx, v, wv);
        }
    }
}
