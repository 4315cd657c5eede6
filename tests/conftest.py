"""Shared fixtures: the real files under ../shared/data/real and small generated particle sets."""

from __future__ import annotations

from pathlib import Path

import mrcfile
import numpy as np
import pandas as pd
import pytest
import starfile

REAL_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "real"


@pytest.fixture
def real_data():
    if not REAL_DATA.is_dir():
        pytest.skip(f"real data folder {REAL_DATA} is absent")
    return REAL_DATA


def write_mrc(path, data, pixel_size=1.5, stack=True):
    with mrcfile.new(path, overwrite=True) as m:
        m.set_data(np.asarray(data))
        if stack:
            m.set_image_stack()
        m.voxel_size = pixel_size


def make_particle_set(folder, n=6, box=16, pixel_size=1.5, seed=0, relion30=False, stack_name="stack.mrcs"):
    """A small RELION particle file with its stack in `folder`; returns (star path, images)."""
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(n, box, box)).astype(np.float32)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_mrc(folder / stack_name, images, pixel_size)
    particles = pd.DataFrame({
        "rlnImageName": [f"{i + 1:06d}@{stack_name}" for i in range(n)],
        "rlnDefocusU": rng.uniform(10000, 20000, n),
        "rlnDefocusV": rng.uniform(10000, 20000, n),
        "rlnDefocusAngle": rng.uniform(-180, 180, n),
        "rlnAngleRot": rng.uniform(-180, 180, n),
        "rlnAngleTilt": rng.uniform(0, 180, n),
        "rlnAnglePsi": rng.uniform(-180, 180, n),
        "rlnMyUnknownColumn": [f"tag{i}" for i in range(n)],
    })
    if relion30:
        particles["rlnOriginX"] = rng.uniform(-3, 3, n)
        particles["rlnOriginY"] = rng.uniform(-3, 3, n)
        particles["rlnVoltage"] = 300.0
        particles["rlnSphericalAberration"] = 2.7
        particles["rlnAmplitudeContrast"] = 0.1
        particles["rlnMagnification"] = 10000.0
        particles["rlnDetectorPixelSize"] = pixel_size
        blocks = {"": particles}
    else:
        particles["rlnOriginXAngst"] = rng.uniform(-3, 3, n)
        particles["rlnOriginYAngst"] = rng.uniform(-3, 3, n)
        particles["rlnOpticsGroup"] = 1
        optics = pd.DataFrame({"rlnOpticsGroup": [1], "rlnOpticsGroupName": ["opticsGroup1"],
                               "rlnAmplitudeContrast": [0.1], "rlnSphericalAberration": [2.7],
                               "rlnVoltage": [300.0], "rlnImagePixelSize": [pixel_size],
                               "rlnImageSize": [box], "rlnImageDimensionality": [2]})
        blocks = {"optics": optics, "particles": particles}
    star_path = folder / "particles.star"
    starfile.write(blocks, star_path)
    return star_path, images


def run_cli(*args):
    """`cryorefine ARGS` in this process; its exit code."""
    from cryorefine.cli import main

    try:
        main([str(a) for a in args])
    except SystemExit as exc:
        return exc.code
    return 0


def cupy_or_skip():
    """CuPy, or a skip of the calling test when CuPy or a CUDA device is missing (the `gpu` tests)."""
    cp = pytest.importorskip("cupy")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except cp.cuda.runtime.CUDARuntimeError:
        pytest.skip("no CUDA device")
    return cp
