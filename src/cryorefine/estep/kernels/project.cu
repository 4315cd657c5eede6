// Central slices of a padded 3D Fourier reference by trilinear interpolation.
// Twin of core.projector.Projector.project (float32 geometry): the point of image frequency
// (kx, ky) in a slice at rotation A is q = pf·Aᵀ(kx, ky, 0) in padded Fourier pixels; points
// with x < 0 are mirrored and conjugated (Friedel); |q|² beyond r_pad_sq gives zero. The
// volume is RELION's compact layout (d, d, w) with frequency 0 at index `origin` on z and y.
//
// REF_DIM 2 (the module of 2D references, RELION's ref_dim 2: `estep.kernels.kernel_module`): each reference
// is a padded 2D transform (d, w) with frequency 0 at index `origin` on y, and the "slice" at rotation A is
// that transform read at q = pf·A₂ᵀ(kx, ky) (A₂ the upper left 2 × 2 block of A; an in-plane rotation by psi)
// by bilinear interpolation, the twin of Projector.project on a 2D grid. Every kernel reading slices
// (project_slices*, local_diff2_t*, fine_diff2, fine_sums) does so through cr_slice_value, and takes the
// same arguments in either module: d and w are the grid's first and last sizes, a class's stride its size.

#ifndef REF_DIM
#define REF_DIM 3
#endif

__device__ __forceinline__ float2 cr_lerp2(float2 lo, float2 hi, float f)
{
    return make_float2(lo.x + (hi.x - lo.x) * f, lo.y + (hi.y - lo.y) * f);
}

// Value of the slice at rotation `a` (9 floats, row-major A) and frequency (kx, ky).
#if REF_DIM == 2
__device__ __forceinline__ float2 cr_slice_value(const float2* __restrict__ vol, int d, int w, int origin,
                                                 float pf, float r_pad_sq, const float* a, float kx, float ky)
{
    float qx = pf * (kx * a[0] + ky * a[3]);
    float qy = pf * (kx * a[1] + ky * a[4]);
    if (qx * qx + qy * qy > r_pad_sq) return make_float2(0.f, 0.f);
    bool neg = qx < 0.f;
    if (neg) { qx = -qx; qy = -qy; }
    float x0 = floorf(qx), y0 = floorf(qy);
    float fx = qx - x0, fy = qy - y0;
    int ix = min(max((int)x0, 0), w - 2);
    int iy = min(max((int)y0 + origin, 0), d - 2);
    size_t sy = (size_t)w;
    size_t base = (size_t)iy * sy + ix;
    // x first, then y (the numpy twin's order)
    float2 c0 = cr_lerp2(__ldg(vol + base), __ldg(vol + base + 1), fx);
    float2 c1 = cr_lerp2(__ldg(vol + base + sy), __ldg(vol + base + sy + 1), fx);
    float2 v = cr_lerp2(c0, c1, fy);
    if (neg) v.y = -v.y;
    return v;
}
#else
__device__ __forceinline__ float2 cr_slice_value(const float2* __restrict__ vol, int d, int w, int origin,
                                                 float pf, float r_pad_sq, const float* a, float kx, float ky)
{
    float qx = pf * (kx * a[0] + ky * a[3]);
    float qy = pf * (kx * a[1] + ky * a[4]);
    float qz = pf * (kx * a[2] + ky * a[5]);
    if (qx * qx + qy * qy + qz * qz > r_pad_sq) return make_float2(0.f, 0.f);
    bool neg = qx < 0.f;
    if (neg) { qx = -qx; qy = -qy; qz = -qz; }
    float x0 = floorf(qx), y0 = floorf(qy), z0 = floorf(qz);
    float fx = qx - x0, fy = qy - y0, fz = qz - z0;
    int ix = min(max((int)x0, 0), w - 2);
    int iy = min(max((int)y0 + origin, 0), d - 2);
    int iz = min(max((int)z0 + origin, 0), d - 2);
    size_t sy = (size_t)w, sz = (size_t)d * w;
    size_t base = (size_t)iz * sz + (size_t)iy * sy + ix;
    // x first, then y, then z (RELION's order)
    float2 c00 = cr_lerp2(__ldg(vol + base), __ldg(vol + base + 1), fx);
    float2 c01 = cr_lerp2(__ldg(vol + base + sy), __ldg(vol + base + sy + 1), fx);
    float2 c10 = cr_lerp2(__ldg(vol + base + sz), __ldg(vol + base + sz + 1), fx);
    float2 c11 = cr_lerp2(__ldg(vol + base + sz + sy), __ldg(vol + base + sz + sy + 1), fx);
    float2 v = cr_lerp2(cr_lerp2(c00, c01, fy), cr_lerp2(c10, c11, fy), fz);
    if (neg) v.y = -v.y;
    return v;
}
#endif

// out[r, c] (n_rot, n_coef) complex: the slice at rotation r of `mats` (n_rot, 9), coefficients (kx, ky), of class
// row_class[r] of the references `vols` (class_stride values a class): the slices of several classes in one launch
// (one class: row_class all 0).
extern "C" __global__ void project_slices_of_classes(const float2* __restrict__ vols, int d, int w, int origin,
                                                     float pf, float r_pad_sq, long long class_stride,
                                                     const int* __restrict__ row_class, const float* __restrict__ mats,
                                                     const float* __restrict__ kx, const float* __restrict__ ky,
                                                     int n_coef, int n_rot, float2* __restrict__ out)
{
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= n_coef) return;
    for (int r = blockIdx.y; r < n_rot; r += gridDim.y) {  // beyond the grid's y limit, in turns
        float a[6];
#pragma unroll
        for (int i = 0; i < 6; ++i) a[i] = mats[r * 9 + i];
        out[(size_t)r * n_coef + c] = cr_slice_value(vols + (size_t)row_class[r] * (size_t)class_stride, d, w, origin,
                                                     pf, r_pad_sq, a, kx[c], ky[c]);
    }
}

// The same slices written for the coarse matrix product, coefficient-major and planar:
// B[c·ldb + r] = Re, B[(n_coef + c)·ldb + r] = Im, P2[c·ldb + r] = |value|².
// Threads run along rotations so that the writes are coalesced.
extern "C" __global__ void project_slices_planar(const float2* __restrict__ vol, int d, int w, int origin,
                                                 float pf, float r_pad_sq, const float* __restrict__ mats,
                                                 const float* __restrict__ kx, const float* __restrict__ ky,
                                                 int n_coef, int n_rot, int ldb, float* __restrict__ B,
                                                 float* __restrict__ P2)
{
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= n_rot) return;
    float a[6];
#pragma unroll
    for (int i = 0; i < 6; ++i) a[i] = mats[r * 9 + i];
    for (int c = blockIdx.y * blockDim.y + threadIdx.y; c < n_coef; c += gridDim.y * blockDim.y) {
        float2 v = cr_slice_value(vol, d, w, origin, pf, r_pad_sq, a, kx[c], ky[c]);
        B[(size_t)c * ldb + r] = v.x;
        B[(size_t)(n_coef + c) * ldb + r] = v.y;
        P2[(size_t)c * ldb + r] = v.x * v.x + v.y * v.y;
    }
}
