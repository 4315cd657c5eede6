"""Shared fixtures: the real files under ../shared/data/real and small generated particle sets."""

from __future__ import annotations

import contextlib
import importlib
import re
import shutil
import sys
from pathlib import Path

import mrcfile
import numpy as np
import pandas as pd
import pytest
import starfile

REPO = Path(__file__).resolve().parents[1]
REAL_DATA = REPO.parent / "shared" / "data" / "real"
EXAMPLE_MAP = REPO / "examples" / "ribosome_64px.mrc"


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


def make_particle_set(folder, n=6, box=16, pixel_size=1.5, seed=0, relion30=False, stack_name="stack.mrcs",
                      origin_priors=False):
    """A small RELION particle file with its stack in `folder`; returns (star path, images). With `origin_priors`, the
    offsets' prior centres too (rlnOriginX/YPrior in px in a 3.0 file, rlnOriginX/YPriorAngst in Å), drawn after
    everything else."""
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
    if origin_priors:
        suffix = "" if relion30 else "Angst"
        particles[f"rlnOriginXPrior{suffix}"] = rng.uniform(-3, 3, n)
        particles[f"rlnOriginYPrior{suffix}"] = rng.uniform(-3, 3, n)
    star_path = folder / "particles.star"
    starfile.write(blocks, star_path)
    return star_path, images


#: the benchmark scripts, which import each other and bench_common by name
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@contextlib.contextmanager
def benchmark_modules(*names):
    """The benchmark scripts `names` imported (a tuple, in order), benchmarks/ on sys.path while the block runs."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield tuple(importlib.import_module(name) for name in names)
    finally:
        sys.path.remove(str(BENCHMARKS))


def mpiexec_or_skip() -> str:
    """The MPI launcher of the `mpi` tests: pip's mpich beside this Python, else the machine's mpiexec (Open MPI on the
    GPU machine); a skip of the calling test where there is none."""
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if not found:
        pytest.skip("no mpiexec (pip install mpich, part of the test extra)")
    return found


def run_cli(*args):
    """`cryorefine ARGS` in this process; its exit code."""
    from cryorefine.cli import main

    try:
        main([str(a) for a in args])
    except SystemExit as exc:
        return exc.code
    return 0


@pytest.fixture(autouse=True)
def gpu_pool_released(request):
    """After a `gpu` test, CuPy's cached device blocks go back to the device: a pytest-xdist worker keeps its
    process, and with it the pool's blocks, until the whole run ends, where another worker's job test sizes its
    arena from the memory the device has free."""
    yield
    if request.node.get_closest_marker("gpu") and "cupy" in sys.modules:
        cupy = sys.modules["cupy"]
        cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()


def cupy_or_skip():
    """CuPy, or a skip of the calling test when CuPy or a CUDA device is missing (the `gpu` tests)."""
    cp = pytest.importorskip("cupy")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except cp.cuda.runtime.CUDARuntimeError:
        pytest.skip("no CUDA device")
    return cp


@pytest.fixture(scope="module")
def cp():
    """CuPy for the GPU engine's tests (cupy_or_skip)."""
    return cupy_or_skip()


@pytest.fixture(params=["slices projected once a pair", "slices projected in every block"])
def fine_slices(request, monkeypatch):
    """Both ways of the GPU's fine pass to a block's child slices (`estep.cuda._PairGroups.project_once`), whatever
    the number of blocks a (class, coarse orientation) pair has."""
    from cryorefine.estep import cuda

    monkeypatch.setattr(cuda, "FINE_BLOCKS_PER_PAIR_PROJECTED_ONCE", 0 if request.param.endswith("a pair") else 1 << 40)
    return request.param


def significance_by_full_sort(weights, adaptive_fraction, max_significants=0):
    """The significance rule stated plainly, the brute force the engines are checked against: per row,
    sort all weights, cumulate, keep the fewest samples holding `adaptive_fraction` of the row's mass
    (at a fraction of 1 every sample above the smallest normal float64, `estep.common.WEIGHT_FLOOR`), at most
    `max_significants`; ties at the cut are kept. Returns the mask and the counts."""
    order = np.argsort(-weights, axis=1, kind="stable")
    sorted_w = np.take_along_axis(weights, order, axis=1)
    if adaptive_fraction >= 1.0:
        n_sig = np.maximum((weights > np.finfo(np.float64).tiny).sum(axis=1), 1)
    else:
        cum = np.cumsum(sorted_w, axis=1)
        n_sig = np.sum(cum < adaptive_fraction * cum[:, -1:], axis=1) + 1
    n_sig = np.minimum(n_sig, weights.shape[1])
    if max_significants > 0:
        n_sig = np.minimum(n_sig, max_significants)
    threshold = sorted_w[np.arange(weights.shape[0]), n_sig - 1]
    return (weights >= threshold[:, None]) & (weights > 0), n_sig


def make_mixture(folder, n_each):
    """Particles of two different maps (the ribosome, and the ribosome with a piece removed and a blob added),
    n_each of each (a first, then b) in folder/mix.star, and their average map folder/avg.mrc."""
    from cryorefine.core.fourier import downsample_volume
    from cryorefine.io.mrc import read_volume, write_volume

    a = downsample_volume(read_volume(EXAMPLE_MAP)[0], 32)
    z, y, x = np.mgrid[:32, :32, :32] - 16
    b = a.copy()
    b[(x - 6) ** 2 + (y - 2) ** 2 + (z + 3) ** 2 < 36] = 0.0
    b += 0.6 * a.max() * np.exp(-((x + 9) ** 2 + (y + 4) ** 2 + (z - 5) ** 2) / 8.0)
    for name, volume in (("a", a), ("b", b), ("avg", (a + b) / 2)):
        write_volume(folder / f"{name}.mrc", volume, 12.0)
    for seed, name in ((1, "a"), (2, "b")):
        assert run_cli("simulate", "--ref", folder / f"{name}.mrc", "--n", n_each, "--snr", 0.5, "--seed", seed,
                       "--o", folder / f"sim_{name}") == 0
    tables = [starfile.read(folder / f"sim_{n}" / "particles.star") for n in ("a", "b")]
    mixed = pd.concat([t["particles"].assign(rlnImageName=t["particles"]["rlnImageName"].str.replace("@", f"@sim_{n}/"))
                       for t, n in zip(tables, ("a", "b"))]).reset_index(drop=True)
    starfile.write({"optics": tables[0]["optics"], "particles": mixed}, folder / "mix.star")


CLASSIFY_ARGS = ("--K", 2, "--ini_high", 40, "--ctf", "--particle_diameter", 320, "--flatten_solvent", "--zero_mask",
                 "--offset_range", 3, "--offset_step", 1, "--healpix_order", 1, "--cpu")


#: GPU test modules whose tests make no arena sized from the GPU's free memory (kernels and their parity with the
#: numpy engine, fixed-size arenas at most): under pytest-xdist they spread over the workers; a test among them that
#: does size one is marked xdist_group("gpu") itself
GPU_MODULES_WITHOUT_RUN_ARENAS = ("tests/core/", "tests/estep/test_cuda.py", "tests/estep/test_cuda_2d.py",
                                  "tests/gpu/test_shell_sums.py", "tests/gpu/test_bin_sums.py")


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`make test` runs two workers, `--dist loadgroup`), the GPU tests that run jobs or size an
    arena from what the GPU has free run on one worker, one after the other (side by side, the first would leave the
    others no memory); the kernels' tests spread over the workers.

    That is not enough on a GPU: with `pytest -m gpu tests -n 4 --dist loadgroup` on one H200 (2026-11-29), 12 tests
    failed and one errored near the run's end (it was cut before its summary named them; on 49c7141 such a run's
    failures were job tests that found too little free memory for their arenas). What passed there, all of it: the
    kernels side by side, `pytest -m gpu tests/estep -n 4` (98 passed, 200 s), then the rest in one process,
    `pytest -m gpu tests --ignore tests/estep` (91 passed, 2 skipped, 290 s). `gpu_pool_released` below hands each
    GPU test's cached blocks back to the device when it ends, so an idle worker holds none."""
    root = Path(str(config.rootpath))
    for item in items:
        if not item.get_closest_marker("gpu"):
            continue
        where = Path(str(item.fspath)).relative_to(root).as_posix()
        if not where.startswith(GPU_MODULES_WITHOUT_RUN_ARENAS):
            item.add_marker(pytest.mark.xdist_group("gpu"))


def assert_m_step_parts_within_the_m_step(log_text: str, iterations, names: set[str]) -> None:
    """Each of `iterations` in a run's log has one line of the job's M-step parts (under MPI as rank 1 ran them),
    naming at least `names` and the seconds in none of them (`em.mstep.REST_PART`), whose seconds add up to no more
    than the iteration's M."""
    from cryorefine.em.mstep import REST_PART

    lines = log_text.splitlines()
    for it in iterations:
        at = next(i for i, line in enumerate(lines) if f"iteration {it}: resolution" in line)
        m_seconds = float(re.search(r", M ([\d.]+) s$", lines[at])[1])
        parts_lines = [line for line in lines[at + 1:at + 6] if "M-step parts (s):" in line]
        assert len(parts_lines) == 1, lines[at:at + 6]
        parts = dict(item.rsplit(" ", 1) for item in parts_lines[0].split("M-step parts (s): ")[1].split(", "))
        assert names | {REST_PART} <= set(parts), parts
        assert sum(float(v) for v in parts.values()) <= m_seconds + 0.05 + 0.005 * len(parts), (parts, m_seconds)
