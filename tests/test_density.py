"""Tests of density.density_from_model on a hand-made model and on the 70S ribosome 7P6Z."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

gemmi = pytest.importorskip("gemmi")

from cryorefine.density import density_from_model  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RIBOSOME = Path(__file__).resolve().parents[2] / "shared/data/real/models/7p6z.cif.gz"
EXAMPLE_MAP = REPO / "examples/ribosome_64px.mrc"

# (element, x, y, z in Å): one atom displaced along each axis from the first.
ATOMS = [("C", 0.0, 0.0, 0.0), ("P", 24.0, 0.0, 0.0), ("O", 0.0, -20.0, 0.0), ("N", 0.0, 0.0, 16.0)]


def _write_model(path, atoms, b_iso=200.0):
    st = gemmi.Structure()
    st.cell = gemmi.UnitCell(1, 1, 1, 90, 90, 90)
    model = gemmi.Model("1")
    chain = gemmi.Chain("A")
    for i, (element, x, y, z) in enumerate(atoms):
        res = gemmi.Residue()
        res.name, res.seqid = "UNK", gemmi.SeqId(i + 1, " ")
        atom = gemmi.Atom()
        atom.name, atom.element, atom.pos = element, gemmi.Element(element), gemmi.Position(x, y, z)
        atom.occ, atom.b_iso = 1.0, b_iso
        res.add_atom(atom)
        chain.add_residue(res)
    model.add_chain(chain)
    st.add_model(model)
    st.setup_entities()
    st.write_pdb(str(path))
    return path


def _expected_voxels_zyx(atoms, box_px, pixel_size):
    """Atom positions in voxels (z, y, x) when the mass-weighted centre sits on voxel N//2."""
    xyz = np.array([a[1:] for a in atoms])
    mass = np.array([gemmi.Element(a[0]).weight for a in atoms])
    com = (mass[:, None] * xyz).sum(0) / mass.sum()
    return ((xyz - com) / pixel_size + box_px // 2)[:, ::-1]


def _local_centroid(density, centre_zyx, half=3):
    c = np.rint(centre_zyx).astype(int)
    sl = tuple(slice(i - half, i + half + 1) for i in c)
    block = np.clip(density[sl], 0, None)
    grids = np.meshgrid(*[np.arange(i - half, i + half + 1) for i in c], indexing="ij")
    return np.array([(g * block).sum() / block.sum() for g in grids])


@pytest.mark.parametrize("box", [40, 41])
def test_placement_axis_order_and_electron_count(tmp_path, box):
    path = _write_model(tmp_path / "four.pdb", ATOMS)
    pix = 2.0
    dens = density_from_model(path, box, pix)
    assert dens.shape == (box, box, box) and dens.dtype == np.float32
    # Each atom's blob sits where (z, y, x) axis order and centring on voxel N//2 put it.
    for atom, expected in zip(ATOMS, _expected_voxels_zyx(ATOMS, box, pix)):
        np.testing.assert_allclose(_local_centroid(dens, expected), expected, atol=0.15, err_msg=atom[0])
    # X-ray scattering: the integral is the number of electrons, 6 + 15 + 8 + 7.
    assert dens.sum() * pix ** 3 == pytest.approx(36.0, rel=0.01)
    # The heavier atom gives the higher peak.
    peaks = [dens[tuple(np.rint(e).astype(int))] for e in _expected_voxels_zyx(ATOMS, box, pix)]
    assert peaks[1] == max(peaks)


def test_bfactors_resolution_and_electron_scattering(tmp_path):
    path = _write_model(tmp_path / "four.pdb", ATOMS, b_iso=400.0)
    box, pix = 40, 2.0
    sharp = density_from_model(path, box, pix, use_bfactors=False)
    blurred = density_from_model(path, box, pix)
    low = density_from_model(path, box, pix, resolution_angstrom=10.0)
    for d in (sharp, blurred, low):  # the number of electrons does not depend on blurring
        assert d.sum() * pix ** 3 == pytest.approx(36.0, rel=0.01)
    assert sharp.max() > 1.5 * blurred.max() > 1.5 * low.max()
    electron = density_from_model(path, box, pix, scattering="electron")
    assert electron.sum() > 0
    assert np.corrcoef(electron.ravel(), blurred.ravel())[0, 1] > 0.95
    with pytest.raises(ValueError):
        density_from_model(path, box, pix, scattering="neutron")


@pytest.fixture(scope="module")
def ribosome():
    if not RIBOSOME.is_file():
        pytest.skip(f"{RIBOSOME} not present")
    start = time.perf_counter()
    dens = density_from_model(RIBOSOME, 64, 6.0, resolution_angstrom=15.0)
    seconds = time.perf_counter() - start
    st = gemmi.read_structure(str(RIBOSOME))
    atoms = {"xyz": np.array([c.atom.pos.tolist() for c in st[0].all()]),
             "mass": np.array([c.atom.element.weight for c in st[0].all()]),
             "electrons": np.array([c.atom.element.atomic_number * c.atom.occ for c in st[0].all()])}
    return dens, seconds, atoms


def test_ribosome_density(ribosome):
    dens, seconds, atoms = ribosome
    box, pix = 64, 6.0
    assert seconds < 30.0
    assert dens.shape == (box,) * 3 and dens.dtype == np.float32
    assert len(atoms["xyz"]) == 142534
    # Electrons: Σ Z·occupancy over the atoms, within 1 %.
    assert dens.sum() * pix ** 3 == pytest.approx(atoms["electrons"].sum(), rel=0.01)
    # Centred: the density's centre of mass within one voxel of N//2 on every axis.
    grids = np.indices(dens.shape)
    centre = np.array([(g * dens).sum() / dens.sum() for g in grids])
    np.testing.assert_allclose(centre, box // 2, atol=1.0)
    # Fits: the faces of the box hold next to nothing.
    faces = [dens[0], dens[-1], dens[:, 0], dens[:, -1], dens[:, :, 0], dens[:, :, -1]]
    assert max(np.abs(f).max() for f in faces) < 0.05 * dens.max()
    # The density lies on the atoms: positive at (nearly) every atom, small away from them.
    xyz, mass = atoms["xyz"], atoms["mass"]
    com = (mass[:, None] * xyz).sum(0) / mass.sum()
    vox = np.rint((xyz - com) / pix + box // 2).astype(int)[:, ::-1]  # (z, y, x)
    at_atoms = dens[vox[:, 0], vox[:, 1], vox[:, 2]]
    assert np.mean(at_atoms > 0) > 0.99
    occupied = np.zeros(dens.shape, bool)
    occupied[vox[:, 0], vox[:, 1], vox[:, 2]] = True
    near = occupied.copy()
    for axis in range(3):
        for step in (-2, -1, 1, 2):
            near |= np.roll(occupied, step, axis=axis)
    assert np.abs(dens[~near]).mean() < 0.05 * at_atoms.mean()


def test_example_map_is_reproducible(ribosome):
    mrcfile = pytest.importorskip("mrcfile")
    if not EXAMPLE_MAP.is_file():
        pytest.skip(f"{EXAMPLE_MAP} not present")
    dens = ribosome[0]
    with mrcfile.open(EXAMPLE_MAP) as mrc:
        data = np.asarray(mrc.data)
        np.testing.assert_allclose([mrc.voxel_size.x, mrc.voxel_size.y, mrc.voxel_size.z], 6.0)
        header = mrc.header
        assert header.dmax == pytest.approx(data.max()) and header.dmin == pytest.approx(data.min())
        assert header.dmean == pytest.approx(data.mean(), rel=1e-4, abs=1e-6)
    np.testing.assert_allclose(data, dens, atol=1e-5 * np.abs(dens).max())
