// Atomic adds shared by the kernels that accumulate complex sums (fine.cu, backproject.cu).
//
// -DSCALAR_ATOMICS: scalar atomics only; -DUNPAIRED_ATOMICS: no float4 for x-neighbour voxels;
// -DINTERLEAVED_VOXELS: a volume of one float4 (re, im, weight, 0) a voxel in `data`, `weight` unused, so that an x
// edge's two voxels share one 32-byte sector; -DGROUPED_VOXELS: x-runs of four voxels, their data (re, im) × 4 then
// their four weights, 48 bytes, in `data` (12 bytes a voxel, as the two volumes), `weight` unused
// (backproject_atomics.py compared them all, docs/benchmark-conclusions.md; the package's volumes are not laid out so).

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

// Sums added to the x-neighbour voxels i and i + 1 of a data volume (interleaved re, im) and its weight volume:
// d = (re_i, im_i, re_i+1, im_i+1), wsum = (weight_i, weight_i+1). Where i is even, both voxels' data lie in one
// aligned 16 bytes and their weights in one aligned 8: one float4 and one float2 atomic on Hopper instead of two of
// each.
__device__ __forceinline__ void atomic_add_x_pair(float* data, float* weight, size_t i, float4 d, float2 wsum)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(INTERLEAVED_VOXELS)
    atomicAdd(reinterpret_cast<float4*>(data + 4 * i), make_float4(d.x, d.y, wsum.x, 0.f));
    atomicAdd(reinterpret_cast<float4*>(data + 4 * (i + 1)), make_float4(d.z, d.w, wsum.y, 0.f));
    return;
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(GROUPED_VOXELS)
    {
        float* group = data + 12 * (i >> 2);
        const int j = (int)(i & 3);
        if ((j & 1) == 0) {
            atomicAdd(reinterpret_cast<float4*>(group + 2 * j), d);
            atomicAdd(reinterpret_cast<float2*>(group + 8 + j), wsum);
        } else {
            float* next = data + 12 * ((i + 1) >> 2);
            const int k = (int)((i + 1) & 3);
            atomicAdd(reinterpret_cast<float2*>(group + 2 * j), make_float2(d.x, d.y));
            atomicAdd(group + 8 + j, wsum.x);
            atomicAdd(reinterpret_cast<float2*>(next + 2 * k), make_float2(d.z, d.w));
            atomicAdd(next + 8 + k, wsum.y);
        }
        return;
    }
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(SCALAR_ATOMICS) && !defined(UNPAIRED_ATOMICS)
    if ((i & 1) == 0) {
        atomicAdd(reinterpret_cast<float4*>(data + 2 * i), d);
        atomicAdd(reinterpret_cast<float2*>(weight + i), wsum);
        return;
    }
#endif
    atomic_add_complex(data + 2 * i, d.x, d.y);
    atomicAdd(weight + i, wsum.x);
    atomic_add_complex(data + 2 * (i + 1), d.z, d.w);
    atomicAdd(weight + i + 1, wsum.y);
}
