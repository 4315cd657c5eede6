"""Sums per Fourier shell on the device in one kernel launch (`core.fourier.shell_sum` for CuPy arrays).

The array-generic form of that sum (drop the coefficients beyond the last shell with a boolean mask, then
`bincount`) makes the host wait for the device three times a call: for the mask's size, and for
`bincount`'s checks of its indices (none negative, their maximum). The M-step makes thousands of such
calls an auto-refine, most on the slabs of a padded volume, and each wait leaves the device idle while
the host prepares the next call. Here one launch does it all and the host does not wait: each block sums
its share of the coefficients into a float64 histogram in shared memory, shells outside [0, n_shells)
skipped, then adds its histogram to the result with one atomic add per shell.

The numpy twin is the numpy path of `core.fourier.shell_sum` (tests/gpu/test_shell_sums.py compares them).
Sums are float64 whatever the values' precision; the order of the additions depends on the scheduling of
the blocks, so results agree with the host's to rounding (within about 1e-14 relative), not bit for bit.
"""

from __future__ import annotations

import functools

from cryorefine.gpu import DeviceArray

SHELL_SUM_THREADS = 256
BLOCKS_PER_SM = 4  # blocks per multiprocessor, over all rows (a block loops over its share of a row)
MAX_SHARED_BYTES = 48 * 1024  # the histogram of a block (n_shells × channels float64) must fit in this

_SOURCE = r"""
// out[(row·n_shells + s)·channels + c] += Σ values[(row·n + i)·channels + c] over the i with shells[i] == s,
// for 0 ≤ s < n_shells; blockIdx.y is the row.
template <typename T, typename S>
__global__ void shell_sums(const T* __restrict__ values, const S* __restrict__ shells, long long n, int n_shells,
                           int channels, double* __restrict__ out)
{
    extern __shared__ double hist[];
    const int bins = n_shells * channels;
    for (int i = threadIdx.x; i < bins; i += blockDim.x) hist[i] = 0.0;
    __syncthreads();
    const T* row_values = values + (size_t)blockIdx.y * (size_t)n * channels;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const long long s = (long long)shells[i];
        if (s < 0 || s >= n_shells) continue;
        for (int c = 0; c < channels; ++c)
            atomicAdd(&hist[s * channels + c], (double)row_values[i * channels + c]);
    }
    __syncthreads();
    double* row_out = out + (size_t)blockIdx.y * bins;
    for (int i = threadIdx.x; i < bins; i += blockDim.x)
        if (hist[i] != 0.0) atomicAdd(&row_out[i], hist[i]);
}
"""
_INSTANCES = {(v, s): f"shell_sums<{v}, {s}>" for v in ("float", "double") for s in ("int", "long long")}
_VALUE_TYPES = {"float32": "float", "float64": "double"}
_SHELL_TYPES = {"int32": "int", "int64": "long long"}


@functools.cache
def _module(device_id):
    import cupy

    with cupy.cuda.Device(device_id):
        return cupy.RawModule(code=_SOURCE, options=("-std=c++17",), name_expressions=tuple(_INSTANCES.values()))


@functools.cache
def _multiprocessors(device_id):
    import cupy

    return int(cupy.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"])


def fits(n_shells: int, is_complex: bool) -> bool:
    """Whether a block's histogram of `n_shells` shells (two channels for complex values) fits in shared memory."""
    return n_shells * (2 if is_complex else 1) * 8 <= MAX_SHARED_BYTES


def shell_sum(values: DeviceArray, shells: DeviceArray, n_shells: int) -> DeviceArray:
    """`core.fourier.shell_sum` of CuPy arrays: `values` (…, *shells.shape) summed per leading index into
    `n_shells` shells -> (…, n_shells), float64 (complex128 for complex values); coefficients in shells
    outside [0, n_shells) are dropped. The caller checks `fits` first."""
    import cupy

    lead = values.shape[: values.ndim - shells.ndim]
    rows = 1
    for size in lead:
        rows *= int(size)
    is_complex = values.dtype.kind == "c"
    real_dtype = values.real.dtype if is_complex else values.dtype
    if real_dtype.name not in _VALUE_TYPES:
        real_dtype = cupy.dtype(cupy.float64)
        values = values.astype(cupy.complex128 if is_complex else cupy.float64)
    values = cupy.ascontiguousarray(values)
    if shells.dtype.name not in _SHELL_TYPES:
        shells = shells.astype(cupy.int64)
    shells = cupy.ascontiguousarray(shells).reshape(-1)
    n = int(shells.size)
    channels = 2 if is_complex else 1
    out = cupy.zeros((rows, n_shells, channels), dtype=cupy.float64)
    if n and rows and n_shells > 0:
        device_id = cupy.cuda.Device().id
        kernel = _module(device_id).get_function(
            _INSTANCES[(_VALUE_TYPES[real_dtype.name], _SHELL_TYPES[shells.dtype.name])])
        # enough blocks to fill the device over all rows, none with less than a pass of its threads
        wanted = -(-BLOCKS_PER_SM * _multiprocessors(device_id) // rows)
        blocks = max(1, min(-(-n // SHELL_SUM_THREADS), wanted))
        if is_complex:
            flat = values.view(real_dtype)  # interleaved (re, im)
        else:
            flat = values
        for row0 in range(0, rows, 65535):  # gridDim.y's limit
            rows_here = min(65535, rows - row0)
            kernel((blocks, rows_here), (SHELL_SUM_THREADS,),
                   (flat.reshape(-1)[row0 * n * channels:], shells, cupy.int64(n), cupy.int32(n_shells),
                    cupy.int32(channels), out[row0:]),
                   shared_mem=n_shells * channels * 8)
    if is_complex:
        out = out.view(cupy.complex128)
    return out.reshape(lead + (n_shells,))
