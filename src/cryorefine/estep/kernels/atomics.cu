// Atomic adds shared by the kernels that accumulate complex sums (fine.cu, backproject.cu).
//
// -DSCALAR_ATOMICS: scalar atomics only; -DUNPAIRED_ATOMICS: no float4 for x-neighbour voxels
// (benchmarks/backproject_atomics.py compares the three).

// (re, im) added at `at` (two consecutive floats, 8-byte aligned): one vector atomic on Hopper and later
// (compute capability 9.0 has float2 atomicAdd in global memory), two scalar ones before or with
// -DSCALAR_ATOMICS.
__device__ __forceinline__ void atomic_add_complex(float* at, float re, float im)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(SCALAR_ATOMICS)
    atomicAdd(reinterpret_cast<float2*>(at), make_float2(re, im));
#else
    atomicAdd(at, re);
    atomicAdd(at + 1, im);
#endif
}

// Weighted value v and weight wv added to the x-neighbour voxels i (factor c0) and i + 1 (c1) of a data volume
// (interleaved re, im) and its weight volume. Where i is even, both voxels' data lie in one aligned 16 bytes
// and their weights in one aligned 8: one float4 and one float2 atomic on Hopper instead of two of each.
__device__ __forceinline__ void atomic_add_x_pair(float* data, float* weight, size_t i, float c0, float c1, float2 v,
                                                  float wv)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(SCALAR_ATOMICS) && !defined(UNPAIRED_ATOMICS)
    if ((i & 1) == 0) {
        atomicAdd(reinterpret_cast<float4*>(data + 2 * i), make_float4(c0 * v.x, c0 * v.y, c1 * v.x, c1 * v.y));
        atomicAdd(reinterpret_cast<float2*>(weight + i), make_float2(c0 * wv, c1 * wv));
        return;
    }
#endif
    atomic_add_complex(data + 2 * i, c0 * v.x, c0 * v.y);
    atomicAdd(weight + i, c0 * wv);
    atomic_add_complex(data + 2 * (i + 1), c1 * v.x, c1 * v.y);
    atomicAdd(weight + i + 1, c1 * wv);
}
