// Atomic adds shared by the kernels that accumulate complex sums (fine.cu, backproject.cu).

// (re, im) added at `at` (two consecutive floats, 8-byte aligned): one vector atomic on Hopper and later
// (compute capability 9.0 has float2 atomicAdd in global memory), two scalar ones before or with
// -DSCALAR_ATOMICS (benchmarks/backproject_atomics.py compares the two).
__device__ __forceinline__ void atomic_add_complex(float* at, float re, float im)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(SCALAR_ATOMICS)
    atomicAdd(reinterpret_cast<float2*>(at), make_float2(re, im));
#else
    atomicAdd(at, re);
    atomicAdd(at + 1, im);
#endif
}
