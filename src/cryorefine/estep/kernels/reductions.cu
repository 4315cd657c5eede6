// Block-wide reductions shared by the kernels that reduce one particle's samples per CUDA block
// (segments.cu, weights.cu). Every thread of the block must call them, and gets the result. `s_val`
// and `s_idx` are shared arrays of 32 (one entry per warp).

__device__ __forceinline__ double cr_negative_infinity() { return -__longlong_as_double(0x7ff0000000000000LL); }

// Sum (op 0) or maximum (op 1) of v over the block.
__device__ __forceinline__ double cr_block_reduce(double v, int op, double* s_val)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const double u = __shfl_down_sync(0xffffffffu, v, o);
        v = op ? fmax(v, u) : v + u;
    }
    __syncthreads();  // s_val may still be read from a previous call
    if (lane == 0) s_val[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const int n_warps = (blockDim.x + 31) >> 5;
        v = lane < n_warps ? s_val[lane] : (op ? cr_negative_infinity() : 0.0);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const double u = __shfl_down_sync(0xffffffffu, v, o);
            v = op ? fmax(v, u) : v + u;
        }
        if (lane == 0) s_val[0] = v;
    }
    __syncthreads();
    return s_val[0];
}

// Whether candidate (u, j) replaces (v, i) as the maximum with the lowest index; index `none`: no element.
__device__ __forceinline__ bool cr_takes(double u, long long j, double v, long long i, long long none)
{
    return j != none && (i == none || u > v || (u == v && j < i));
}

// The maximum v over the block and the lowest index i holding it (numpy's argmax: ties keep the first), from
// each thread's own (v, i); i == none where a thread has no element, and on return where the block has none.
__device__ __forceinline__ void cr_block_argmax(double& v, long long& i, long long none, double* s_val,
                                                long long* s_idx)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const double u = __shfl_down_sync(0xffffffffu, v, o);
        const long long j = __shfl_down_sync(0xffffffffu, i, o);
        if (cr_takes(u, j, v, i, none)) { v = u; i = j; }
    }
    __syncthreads();  // s_val, s_idx may still be read from a previous call
    if (lane == 0) { s_val[warp] = v; s_idx[warp] = i; }
    __syncthreads();
    if (warp == 0) {
        const int n_warps = (blockDim.x + 31) >> 5;
        v = lane < n_warps ? s_val[lane] : cr_negative_infinity();
        i = lane < n_warps ? s_idx[lane] : none;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const double u = __shfl_down_sync(0xffffffffu, v, o);
            const long long j = __shfl_down_sync(0xffffffffu, i, o);
            if (cr_takes(u, j, v, i, none)) { v = u; i = j; }
        }
        if (lane == 0) { s_val[0] = v; s_idx[0] = i; }
    }
    __syncthreads();
    v = s_val[0];
    i = s_idx[0];
}
