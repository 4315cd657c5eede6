"""The --ini_high low-pass of a job's start (`core.fourier.lowpass_band_limited`) on the host: the band's Fourier sums
as matrix products against the band-limited FFTs, on a random float64 volume of the box, for bands of a few shells.

    python benchmarks/lowpass_band.py --box 360 --bands 9 15 21 --repeat 3
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from cryorefine.core import fourier


def seconds(volume, band, repeat):
    gain = lambda r: fourier.raised_cosine(r, band - 2.0, 2.0)  # noqa: E731 — 0 beyond the band
    times = []
    for _ in range(repeat):
        tic = time.perf_counter()
        out = fourier.lowpass_band_limited(volume, gain, float(band))
        times.append(time.perf_counter() - tic)
    return times, out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--box", type=int, default=360)
    parser.add_argument("--bands", type=int, nargs="+", default=[9, 15, 21])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    volume = np.random.default_rng(0).standard_normal((args.box,) * 3)
    by_matrices = fourier.DFT_BAND_FRACTION
    for band in args.bands:
        fourier.DFT_BAND_FRACTION = 10 ** 9  # the FFTs
        fft_times, want = seconds(volume, band, args.repeat)
        fourier.DFT_BAND_FRACTION = by_matrices
        path = "matrix products" if (band + 1) * by_matrices <= args.box else "FFTs (band too wide for the products)"
        times, got = seconds(volume, band, args.repeat)
        print(f"box {args.box}, band {band}: FFTs {min(fft_times):.2f}–{max(fft_times):.2f} s, {path} "
              f"{min(times):.2f}–{max(times):.2f} s; largest difference {np.abs(got - want).max():.1e} "
              f"(values up to {np.abs(want).max():.1e})", flush=True)


if __name__ == "__main__":
    main()
