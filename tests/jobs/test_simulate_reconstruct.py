"""`cryorefine simulate` and `cryorefine reconstruct`, end to end, called in-process.

The ground truth is a map built here (random Gaussian blobs); a reconstruction from the true
poses must reproduce it (FSC against the truth), and the image geometry is checked against
RELION's conventions directly: a lone off-centre blob at map position r must appear in a
particle image at N//2 + (A r)_xy − origin/pixel.
"""

from __future__ import annotations

import mrcfile
import numpy as np
import pytest
import starfile

from cryorefine.cli import main

BOX_PX = 40
PIXEL_ANGSTROM = 4.0
NYQUIST_SHELL = BOX_PX // 2


def call(*args):
    """Run the CLI in-process; returns the exit code (0 when it returns normally)."""
    try:
        return main([str(a) for a in args])
    except SystemExit as exc:
        return exc.code


def write_map(path, volume, pixel_size=PIXEL_ANGSTROM):
    with mrcfile.new(path, overwrite=True) as m:
        m.set_data(np.asarray(volume, dtype=np.float32))
        m.voxel_size = pixel_size
    return path


def blob_map(n=BOX_PX, n_blobs=40, seed=3, scale=1.0):
    """Random Gaussian blobs (σ 1–1.6 px) within 11 px of voxel N//2: signal out to Nyquist.

    `scale` multiplies every length: the same object sampled with pixels 1/scale as large.
    """
    rng = np.random.default_rng(seed)
    z, y, x = np.mgrid[:n, :n, :n] - n // 2
    vol = np.zeros((n, n, n))
    for _ in range(n_blobs):
        p = rng.normal(size=3)
        p *= rng.uniform(0, 11) / np.linalg.norm(p)
        p *= scale
        s = rng.uniform(1.0, 1.6) * scale
        vol += rng.uniform(0.5, 1.0) * np.exp(-((x - p[0]) ** 2 + (y - p[1]) ** 2 + (z - p[2]) ** 2) / (2 * s * s))
    return vol.astype(np.float32)


def read_map(path):
    with mrcfile.open(path) as m:
        return np.asarray(m.data, dtype=np.float64), float(m.voxel_size.x)


def fsc(a, b):
    """FSC per shell round(|k|), written out here so that the check does not rest on core.fsc."""
    fa, fb = np.fft.rfftn(np.fft.ifftshift(a)), np.fft.rfftn(np.fft.ifftshift(b))
    n = a.shape[0]
    k = np.fft.fftfreq(n, 1.0 / n)
    kz, ky, kx = np.meshgrid(k, k, np.arange(n // 2 + 1), indexing="ij")
    shell = np.rint(np.sqrt(kx ** 2 + ky ** 2 + kz ** 2)).astype(int).ravel()
    keep = shell <= n // 2

    def total(v):
        return np.bincount(shell[keep], weights=v.ravel()[keep], minlength=n // 2 + 1)

    return total((fa * np.conj(fb)).real) / np.sqrt(total(np.abs(fa) ** 2) * total(np.abs(fb) ** 2))


@pytest.fixture(autouse=True)
def _elsewhere(tmp_path, monkeypatch):
    """Run from an empty folder: RELION resolves image paths against the current folder first."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def truth(tmp_path_factory):
    folder = tmp_path_factory.mktemp("truth")
    volume = blob_map()
    return write_map(folder / "blobs.mrc", volume), volume.astype(np.float64)


@pytest.fixture(scope="module")
def simulated(truth, tmp_path_factory):
    """3,000 particles with CTF (0.8–2.5 µm defocus) at SNR 100."""
    out = tmp_path_factory.mktemp("sim")
    assert call("simulate", "--ref", truth[0], "--n", 3000, "--o", out, "--snr", 100, "--seed", 1) == 0
    return out


def test_reconstruction_from_true_poses_matches_truth(simulated, truth, tmp_path, capsys):
    out = tmp_path / "rec.mrc"
    assert call("reconstruct", "--i", simulated / "particles.star", "--o", out, "--ctf", "--half_maps") == 0
    volume, pixel = read_map(out)
    assert pixel == pytest.approx(PIXEL_ANGSTROM)
    curve = fsc(volume, truth[1])
    shells = np.arange(1, int(0.75 * NYQUIST_SHELL) + 1)
    assert curve[shells].min() >= 0.9, np.round(curve, 3)

    # Half maps and their FSC table beside the output; the printed resolution is the table's.
    half1, _ = read_map(tmp_path / "rec_half1.mrc")
    half2, _ = read_map(tmp_path / "rec_half2.mrc")
    table = starfile.read(tmp_path / "rec_fsc.star")
    assert list(table.columns) == ["rlnSpectralIndex", "rlnResolution", "rlnAngstromResolution",
                                   "rlnFourierShellCorrelation"]
    expected = fsc(half1, half2)
    np.testing.assert_allclose(table["rlnFourierShellCorrelation"].to_numpy()[1:], expected[1:], atol=1e-6)
    np.testing.assert_allclose(table["rlnAngstromResolution"].to_numpy()[1:],
                               BOX_PX * PIXEL_ANGSTROM / np.arange(1, NYQUIST_SHELL + 1))
    assert "resolution at FSC 0.143" in capsys.readouterr().out
    # Each half alone is a good map too (1,500 particles).
    assert fsc(half1, truth[1])[1:11].min() > 0.9


def test_origin_sign_matters(simulated, truth, tmp_path):
    blocks = starfile.read(simulated / "particles.star")
    particles = blocks["particles"]
    assert np.hypot(particles["rlnOriginXAngst"], particles["rlnOriginYAngst"]).max() > 2 * PIXEL_ANGSTROM
    particles["rlnOriginXAngst"] *= -1
    particles["rlnOriginYAngst"] *= -1
    flipped = simulated / "flipped_origins.star"  # beside particles.mrcs
    starfile.write(blocks, flipped)
    right, wrong = tmp_path / "right.mrc", tmp_path / "wrong.mrc"
    assert call("reconstruct", "--i", simulated / "particles.star", "--o", right, "--ctf") == 0
    assert call("reconstruct", "--i", flipped, "--o", wrong, "--ctf") == 0
    shells = slice(4, int(0.75 * NYQUIST_SHELL) + 1)
    good = fsc(read_map(right)[0], truth[1])[shells]
    bad = fsc(read_map(wrong)[0], truth[1])[shells]
    assert good.min() > 0.95
    assert bad.mean() < 0.5, np.round(bad, 3)


def test_image_geometry_follows_relion_conventions(tmp_path):
    """A blob at map offset r appears at N//2 + (A r)_xy − origin/pixel (no CTF, no noise)."""
    r_px = np.array([6.0, -4.0, 3.0])  # (x, y, z) from voxel N//2
    z, y, x = np.mgrid[:BOX_PX, :BOX_PX, :BOX_PX] - BOX_PX // 2
    volume = np.exp(-((x - r_px[0]) ** 2 + (y - r_px[1]) ** 2 + (z - r_px[2]) ** 2) / (2 * 1.5 ** 2))
    ref = write_map(tmp_path / "one_blob.mrc", volume)
    out = tmp_path / "sim"
    assert call("simulate", "--ref", ref, "--n", 200, "--o", out, "--snr", "inf", "--no_ctf",
                "--max_shift", 3 * PIXEL_ANGSTROM, "--seed", 5) == 0

    from cryorefine.core.euler import euler_to_matrix
    from cryorefine.data import load_particles
    from cryorefine.io.mrc import StackReader

    particles = load_particles(out / "particles.star")
    assert len(particles) == 200
    with StackReader() as reader:
        images = particles.read_images(np.arange(200), reader).astype(np.float64)
    a = euler_to_matrix(particles.rot_deg, particles.tilt_deg, particles.psi_deg)
    projected = a @ r_px
    expected_x = BOX_PX // 2 + projected[:, 0] - particles.origin_x_angstrom / PIXEL_ANGSTROM
    expected_y = BOX_PX // 2 + projected[:, 1] - particles.origin_y_angstrom / PIXEL_ANGSTROM
    # Centroid within 5 px of each image's brightest pixel (interpolation leaves a faint background).
    iy, ix = np.mgrid[:BOX_PX, :BOX_PX]
    peak_y, peak_x = np.unravel_index(images.reshape(len(images), -1).argmax(axis=1), (BOX_PX, BOX_PX))
    near = (ix - peak_x[:, None, None]) ** 2 + (iy - peak_y[:, None, None]) ** 2 <= 25
    weights = images * near
    mass = weights.sum(axis=(1, 2))
    centroid_x = (weights * ix).sum(axis=(1, 2)) / mass
    centroid_y = (weights * iy).sum(axis=(1, 2)) / mass
    np.testing.assert_allclose(centroid_x, expected_x, atol=0.1)
    np.testing.assert_allclose(centroid_y, expected_y, atol=0.1)
    assert "rlnDefocusU" not in particles.star.particles.columns


def test_star_file_layout_and_distributions(simulated):
    from cryorefine.data import load_particles

    particles = load_particles(simulated / "particles.star")
    n = len(particles)
    assert n == 3000
    assert particles.geometry() == (BOX_PX, PIXEL_ANGSTROM)
    group = particles.optics_groups[0]
    assert (group.voltage_kv, group.cs_mm, group.amplitude_contrast) == (300.0, 2.7, 0.1)
    table = particles.star.particles
    written = starfile.read(simulated / "particles.star")["particles"]["rlnImageName"]  # the stack beside the file
    assert written.iloc[0] == "000001@particles.mrcs" and written.iloc[-1] == "003000@particles.mrcs"
    assert set(particles.stack_paths) == {str(simulated / "particles.mrcs")}
    # read, the names give the stack from the project (current) directory, as the run's own files will
    assert table["rlnImageName"].iloc[-1] == f"003000@{simulated / 'particles.mrcs'}"
    for column in ("rlnPhaseShift", "rlnCtfBfactor"):
        assert (table[column] == 0).all()
    assert (particles.class_number == 1).all() and (table["rlnOpticsGroup"] == 1).all()
    # Halves: both present, balanced, not simply alternating.
    counts = np.bincount(particles.random_subset, minlength=3)
    assert counts[0] == 0 and abs(counts[1] - counts[2]) <= 1
    assert not (particles.random_subset == np.arange(n) % 2 + 1).all()
    # Poses uniform on SO(3): cos(tilt) uniform on [−1, 1], rot and psi uniform on the circle.
    cos_tilt = np.cos(np.deg2rad(particles.tilt_deg))
    assert abs(cos_tilt.mean()) < 4 / np.sqrt(3 * n)
    assert abs((cos_tilt ** 2).mean() - 1 / 3) < 0.03
    for angle in (particles.rot_deg, particles.psi_deg):
        assert abs(np.exp(1j * np.deg2rad(angle)).mean()) < 4 / np.sqrt(n)
    # Origins in a disc of 3 px; defocus in 0.8–2.5 µm with |U − V| ≤ 0.05 µm.
    radius = np.hypot(particles.origin_x_angstrom, particles.origin_y_angstrom)
    assert radius.max() <= 3 * PIXEL_ANGSTROM + 1e-9 and radius.max() > 2.5 * PIXEL_ANGSTROM
    mean_defocus = (particles.defocus_u_angstrom + particles.defocus_v_angstrom) / 2
    assert mean_defocus.min() >= 8000 and mean_defocus.max() <= 25000
    assert mean_defocus.max() - mean_defocus.min() > 15000
    assert np.abs(particles.defocus_u_angstrom - particles.defocus_v_angstrom).max() <= 500 + 1e-6
    with mrcfile.open(simulated / "particles.mrcs") as m:
        assert m.data.shape == (3000, BOX_PX, BOX_PX) and m.data.dtype == np.float32
        assert float(m.voxel_size.x) == pytest.approx(PIXEL_ANGSTROM)
        assert m.is_image_stack()
        assert float(m.header.dmean) == pytest.approx(float(m.data.mean(dtype=np.float64)), rel=1e-4, abs=1e-6)


def test_same_seed_same_files(truth, tmp_path):
    runs = {}
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        assert call("simulate", "--ref", truth[0], "--n", 40, "--o", tmp_path / name, "--seed", seed,
                    "--batch", 16) == 0
        runs[name] = [(tmp_path / name / f).read_bytes() for f in ("particles.mrcs", "particles.star")]
    assert runs["a"] == runs["b"]
    assert runs["a"][0] != runs["c"][0] and runs["a"][1] != runs["c"][1]
    # The batch size changes nothing either.
    assert call("simulate", "--ref", truth[0], "--n", 40, "--o", tmp_path / "d", "--seed", 7, "--batch", 7) == 0
    assert (tmp_path / "d" / "particles.mrcs").read_bytes() == runs["a"][0]


@pytest.mark.parametrize("noise", ["white", "coloured"])
def test_noise_level_and_spectrum(truth, tmp_path, noise):
    """Same seed with and without noise: the difference is the noise, at the requested SNR."""
    common = ["--ref", truth[0], "--n", 200, "--seed", 4, "--noise", noise]
    assert call("simulate", *common, "--o", tmp_path / "clean", "--snr", "inf") == 0
    assert call("simulate", *common, "--o", tmp_path / "noisy", "--snr", 0.5) == 0
    with mrcfile.open(tmp_path / "clean" / "particles.mrcs") as m:
        clean = np.asarray(m.data, dtype=np.float64)
    with mrcfile.open(tmp_path / "noisy" / "particles.mrcs") as m:
        noisy = np.asarray(m.data, dtype=np.float64)
    noise_images = noisy - clean
    iy, ix = np.mgrid[:BOX_PX, :BOX_PX] - BOX_PX // 2
    circle = ix ** 2 + iy ** 2 <= (BOX_PX / 2) ** 2
    ratio = clean[:, circle].var(axis=1) / noise_images[:, circle].var(axis=1)
    assert np.median(ratio) == pytest.approx(0.5, rel=0.1)
    power = np.abs(np.fft.rfft2(noise_images)) ** 2
    k = np.hypot(*np.meshgrid(np.fft.fftfreq(BOX_PX, 1 / BOX_PX), np.arange(BOX_PX // 2 + 1), indexing="ij"))
    low, high = power[:, (k >= 2) & (k < 5)].mean(), power[:, (k >= 15) & (k < 19)].mean()
    if noise == "white":
        assert low / high == pytest.approx(1.0, rel=0.15)
    else:
        assert low / high > 2.0


def test_symmetry_improves_reconstruction(truth, tmp_path):
    out = tmp_path / "sim"
    assert call("simulate", "--ref", truth[0], "--n", 300, "--o", out, "--snr", 1, "--sym", "C4", "--seed", 2) == 0
    reference, _ = read_map(out / "reference_symmetrised.mrc")
    results = {}
    for sym in ("C1", "C4"):
        path = tmp_path / f"rec_{sym}.mrc"
        assert call("reconstruct", "--i", out / "particles.star", "--o", path, "--ctf", "--sym", sym) == 0
        results[sym] = fsc(read_map(path)[0], reference)
    mid = slice(6, 16)
    assert (results["C4"][mid] > results["C1"][mid]).all(), (np.round(results["C1"], 3), np.round(results["C4"], 3))


def test_maxres_limits_the_map(simulated, truth, tmp_path):
    out = tmp_path / "low.mrc"
    assert call("reconstruct", "--i", simulated / "particles.star", "--o", out, "--ctf", "--maxres", 16) == 0
    volume, _ = read_map(out)
    curve = fsc(volume, truth[1])
    assert curve[1:9].min() > 0.95  # r_max = ceil(40·4/16) = 10 shells
    # Beyond r_max only what cropping the padded box and the gridding correction spread there:
    # about 1 % of the truth's power per shell (a full-resolution map has about 100 %).
    n = BOX_PX
    k = np.fft.fftfreq(n, 1.0 / n)
    kz, ky, kx = np.meshgrid(k, k, np.arange(n // 2 + 1), indexing="ij")
    shell = np.rint(np.sqrt(kx ** 2 + ky ** 2 + kz ** 2)).astype(int).ravel()
    power = np.bincount(shell, (np.abs(np.fft.rfftn(volume)) ** 2).ravel())
    truth_power = np.bincount(shell, (np.abs(np.fft.rfftn(truth[1])) ** 2).ravel())
    assert (power[12:16] / truth_power[12:16]).max() < 0.05


def test_angpix_sets_the_output_pixel_size(simulated, tmp_path):
    """--angpix 4.4 on 4 Å/px particles: the same object sampled on 4.4 Å voxels (box kept)."""
    out = tmp_path / "coarse.mrc"
    assert call("reconstruct", "--i", simulated / "particles.star", "--o", out, "--ctf", "--angpix", 4.4) == 0
    volume, pixel = read_map(out)
    assert pixel == pytest.approx(4.4) and volume.shape == (BOX_PX,) * 3
    resampled = blob_map(scale=PIXEL_ANGSTROM / 4.4)
    assert fsc(volume, resampled)[1:16].min() > 0.9
    assert fsc(volume, blob_map())[11:16].max() < 0.85  # and not the 4 Å/px sampling


def assert_one_line_error(capsys, code, *fragments):
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cryorefine: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_non_cubic_reference_is_refused(tmp_path, capsys):
    ref = write_map(tmp_path / "flat.mrc", np.zeros((32, 40, 40)))
    code = call("simulate", "--ref", ref, "--n", 10, "--o", tmp_path / "out")
    assert_one_line_error(capsys, code, str(ref), "cubic")
    assert not (tmp_path / "out" / "particles.star").exists()


def test_reference_without_pixel_size_needs_angpix(truth, tmp_path, capsys):
    ref = write_map(tmp_path / "nopix.mrc", read_map(truth[0])[0], pixel_size=1.0)
    code = call("simulate", "--ref", ref, "--n", 10, "--o", tmp_path / "out")
    assert_one_line_error(capsys, code, str(ref), "--angpix")
    assert call("simulate", "--ref", ref, "--n", 10, "--o", tmp_path / "out", "--angpix", 2.5) == 0
    with mrcfile.open(tmp_path / "out" / "particles.mrcs") as m:
        assert float(m.voxel_size.x) == pytest.approx(2.5)


def test_reconstruct_without_angles_is_refused(simulated, tmp_path, capsys):
    blocks = starfile.read(simulated / "particles.star")
    blocks["particles"] = blocks["particles"].drop(columns=["rlnAngleRot"])
    star = simulated / "no_rot.star"
    starfile.write(blocks, star)
    out = tmp_path / "map.mrc"
    code = call("reconstruct", "--i", star, "--o", out, "--half_maps")
    assert_one_line_error(capsys, code, "rlnAngleRot", str(star))
    assert list(tmp_path.iterdir()) == []


def test_float16_stack_is_the_float32_stack_rounded(truth, tmp_path):
    """--float16 writes MRC mode 12 holding the float32 images rounded to float16 (same seed, same images)."""
    wide, half = tmp_path / "f32", tmp_path / "f16"
    assert call("simulate", "--ref", truth[0], "--n", 20, "--o", wide, "--seed", 4, "--cpu") == 0
    assert call("simulate", "--ref", truth[0], "--n", 20, "--o", half, "--seed", 4, "--cpu", "--float16") == 0
    with mrcfile.open(wide / "particles.mrcs") as a, mrcfile.open(half / "particles.mrcs") as b:
        assert (int(a.header.mode), int(b.header.mode)) == (2, 12)
        np.testing.assert_array_equal(b.data, a.data.astype(np.float16))
    assert (half / "particles.star").read_text() == (wide / "particles.star").read_text()


def test_float16_overflow_is_refused_without_outputs(tmp_path, capsys):
    ref = write_map(tmp_path / "bright.mrc", blob_map(n_blobs=5) * 1e6)
    out = tmp_path / "sim"
    assert call("simulate", "--ref", ref, "--n", 4, "--o", out, "--snr", "inf", "--cpu", "--float16") == 2
    assert "float16" in capsys.readouterr().err
    assert not (out / "particles.mrcs").exists() and not (out / "particles.star").exists()
