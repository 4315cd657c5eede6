from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from cryorefine.errors import InputError
from cryorefine.io.atomic import atomic_path
from cryorefine.io.star import read_particle_star, read_star, write_particle_star, write_star

PARTICLE_FILES = [
    "relion31/relion31.star", "relion31/relion31.v2.star", "relion30_empiar10076/empiar_10076_7.star",
    "relion30_80s_subset/sample_particles_relion30.star", "relion_outputs/ref_it002_data.star",
    "star_flavours/relion31.6opticsgroups.star", "star_flavours/relion5.star",
]


def test_every_real_star_file_reads_and_round_trips(real_data, tmp_path):
    files = sorted(real_data.rglob("*.star"))
    assert len(files) >= 15
    for path in files:
        blocks = read_star(path)
        assert blocks, path
        write_star(blocks, tmp_path / "out.star")
        again = read_star(tmp_path / "out.star")
        assert list(again) == list(blocks), path
        for name, block in blocks.items():
            if isinstance(block, pd.DataFrame):
                pd.testing.assert_frame_equal(again[name], block, check_dtype=False, obj=f"{path}:{name}")
            else:
                assert again[name] == pytest.approx(block) if all(
                    isinstance(v, float) for v in block.values()) else again[name] == block


@pytest.mark.parametrize("name", PARTICLE_FILES)
def test_real_particle_files_round_trip(real_data, tmp_path, name):
    star = read_particle_star(real_data / name)
    assert len(star.particles) > 0 and len(star.optics) >= 1
    assert "rlnImagePixelSize" in star.optics.columns
    write_particle_star(star, tmp_path / "data.star")
    text = (tmp_path / "data.star").read_text()
    assert text.count("# version 50001") == 2
    again = read_particle_star(tmp_path / "data.star")
    pd.testing.assert_frame_equal(again.particles, star.particles, check_dtype=False)
    pd.testing.assert_frame_equal(again.optics, star.optics, check_dtype=False)


def test_block_order_does_not_matter(real_data):
    a = read_particle_star(real_data / "relion31/relion31.star")
    b = read_particle_star(real_data / "relion31/relion31.v2.star")
    pd.testing.assert_frame_equal(a.particles, b.particles)
    pd.testing.assert_frame_equal(a.optics, b.optics)


def test_relion30_pixel_size_and_origins_converted(real_data):
    star = read_particle_star(real_data / "relion30_80s_subset/sample_particles_relion30.star")
    assert star.source_version == "3.0"
    np.testing.assert_allclose(star.optics["rlnImagePixelSize"], 5.0 * 1e4 / 37369.207031, rtol=1e-9)
    raw = read_star(real_data / "relion30_80s_subset/sample_particles_relion30.star")["model_class_1"]
    np.testing.assert_allclose(star.particles["rlnOriginXAngst"], raw["rlnOriginX"] * 1.338, rtol=1e-3)
    assert "rlnOriginX" not in star.particles.columns
    # the file mixes 300 kV and 200 kV particles: two optics groups
    assert sorted(star.optics["rlnVoltage"]) == [200.0, 300.0]
    voltage = star.optics.set_index("rlnOpticsGroup").loc[star.particles["rlnOpticsGroup"], "rlnVoltage"].to_numpy()
    np.testing.assert_array_equal(voltage, raw["rlnVoltage"].to_numpy())


def test_relion30_origin_priors_converted_to_angstrom_and_checked(tmp_path):
    """RELION's conversion of a 3.0 file (star_converter): rlnOriginX/YPrior in pixels become rlnOriginX/YPriorAngst,
    times the pixel size; a prior that is not a number is named."""
    import starfile
    from conftest import make_particle_set

    path, _ = make_particle_set(tmp_path, pixel_size=1.5, relion30=True, origin_priors=True)
    raw = starfile.read(path)
    star = read_particle_star(path)
    for axis in "XY":
        np.testing.assert_allclose(star.particles[f"rlnOrigin{axis}PriorAngst"], raw[f"rlnOrigin{axis}Prior"] * 1.5)
        assert f"rlnOrigin{axis}Prior" not in star.particles.columns
    raw["rlnOriginYPrior"] = raw["rlnOriginYPrior"].astype(object)
    raw.loc[2, "rlnOriginYPrior"] = "none"
    starfile.write(raw, path)
    with pytest.raises(InputError, match="row 3, column rlnOriginYPrior"):
        read_particle_star(path)


def test_empiar10076_pixel_size_from_detector(real_data):
    star = read_particle_star(real_data / "relion30_empiar10076/empiar_10076_7.star")
    assert star.optics["rlnImagePixelSize"].iloc[0] == pytest.approx(1.31, abs=1e-3)


def test_unknown_columns_survive(tmp_path):
    from conftest import make_particle_set

    path, _ = make_particle_set(tmp_path)
    star = read_particle_star(path)
    write_particle_star(star, tmp_path / "out.star")
    again = read_particle_star(tmp_path / "out.star")
    assert list(again.particles["rlnMyUnknownColumn"]) == [f"tag{i}" for i in range(6)]


def test_missing_optics_group_is_an_error(tmp_path):
    from conftest import make_particle_set

    path, _ = make_particle_set(tmp_path)
    text = path.read_text().replace("\t1\n", "\t7\n")  # particles point at optics group 7
    path.write_text(text)
    with pytest.raises(InputError, match="rlnOpticsGroup 7"):
        read_particle_star(path)


def test_conflicting_pixel_sizes(tmp_path):
    table = pd.DataFrame({"rlnImageName": ["1@a.mrcs"], "rlnImagePixelSize": [1.0],
                          "rlnDetectorPixelSize": [5.0], "rlnMagnification": [10000.0]})
    write_star({"": table}, tmp_path / "p.star")
    with pytest.raises(InputError, match="conflicting pixel sizes"):
        read_particle_star(tmp_path / "p.star")


def test_no_pixel_size(tmp_path):
    write_star({"": pd.DataFrame({"rlnImageName": ["1@a.mrcs"]})}, tmp_path / "p.star")
    with pytest.raises(InputError, match="rlnImagePixelSize"):
        read_particle_star(tmp_path / "p.star")


def test_write_is_atomic(tmp_path):
    target = tmp_path / "x.star"
    write_star({"a": pd.DataFrame({"rlnX": [1.0]})}, target)
    before = target.read_text()
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half a file")
            raise RuntimeError("interrupted")
    assert target.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["x.star"]


@pytest.mark.parametrize("chunk", [None, 64, 7])
def test_loop_blocks_are_written_as_starfile_writes_them(monkeypatch, chunk):
    """Loops are formatted column by column (fast); the text must be starfile's, cell for cell: floats as %.12g,
    NaN as <NA>, ±inf, float32 and unsigned columns, names with a space or empty in quotes, an empty loop; and
    the same when rows are formatted in chunks smaller than the table (64, 7: NaNs, infinities and the last rows
    fall in different chunks)."""
    import starfile

    from cryorefine.io import star
    from cryorefine.io.star import FLOAT_FORMAT, star_to_string

    if chunk is not None:
        monkeypatch.setattr(star, "FORMAT_CHUNK_ROWS", chunk)

    rng = np.random.default_rng(3)
    n = 500
    table = pd.DataFrame({
        "rlnAngleRot": rng.normal(size=n) * 1e5,
        "rlnClassNumber": rng.integers(-3, 7, n),
        "rlnImageName": [f"{i}@a b.mrcs" if i % 7 == 0 else ("" if i % 11 == 0 else f"{i}@x.mrcs") for i in range(n)],
        "rlnDefocusU": np.where(rng.random(n) < 0.1, np.nan, rng.normal(size=n)),
        "rlnOriginXAngst": np.r_[np.inf, -np.inf, 1e-300, 123456789012345.0, np.zeros(n - 4)],
        "rlnNormCorrection": rng.normal(size=n).astype(np.float32),
        "rlnRandomSubset": rng.integers(1, 3, n).astype(np.uint8),
    })
    blocks = {"general": {"rlnX": 1, "rlnY": "a"}, "particles": table, "empty": table.iloc[:0],
              "strings": pd.DataFrame({"rlnAngleRot": ["1.5", "nan"]})}
    expected = []
    for name, block in blocks.items():
        text = starfile.to_string({name: block}, float_format=FLOAT_FORMAT)
        expected.append(f"\n# version 50001\n\n{text[text.index('data_'):].rstrip()}\n")
    assert star_to_string(blocks) == "".join(expected) + "\n"


def test_float_cells_are_python_s_format_at_every_magnitude():
    """The loop writer's whole-array "%.12g" gives Python's text for every value: random values from 1e-8 to 1e15,
    powers of ten and their neighbours (where log10 is one off), values that round up to the next power, halves
    at the 13th digit, integers, zeros of both signs, NaN (<NA>), ±inf, subnormals, and the largest int64s and
    unsigned values in integer columns."""
    from cryorefine.io.star import FLOAT_FORMAT, star_to_string

    rng = np.random.default_rng(11)
    powers = 10.0 ** np.arange(-8, 16)
    values = np.concatenate([
        rng.standard_normal(40_000) * 10.0 ** rng.integers(-8, 16, 40_000), powers, -powers,
        np.nextafter(powers, 0), np.nextafter(powers, np.inf), np.round(rng.standard_normal(5_000) * 1e3, 3),
        rng.integers(-10 ** 6, 10 ** 6, 5_000).astype(float),
        [0.0, -0.0, np.nan, np.inf, -np.inf, 999999999999.5, 999999999999.4, 99999999999.95, 0.000099999999999995,
         1e-4, 0.125, 2.5, 1099511627775.0, 123456789012.0, 1e-300, 1.23456789012e-308, 5e-324]])
    ints = np.concatenate([rng.integers(-10 ** 18, 10 ** 18, values.size - 4), [0, -1, np.iinfo(np.int64).max,
                                                                                np.iinfo(np.int64).min]])
    unsigned = np.r_[np.iinfo(np.uint64).max, np.zeros(values.size - 1, dtype=np.uint64)].astype(np.uint64)
    text = star_to_string({"t": pd.DataFrame({"rlnA": values, "rlnB": ints, "rlnC": unsigned})})
    rows = text.split("loop_\n")[1].strip().split("\n")[3:]
    assert len(rows) == values.size
    for row, v, i, u in zip(rows, values.tolist(), ints.tolist(), unsigned.tolist()):
        assert row == "\t".join(["<NA>" if v != v else FLOAT_FORMAT % v, str(i), str(u)]), (v, row)


def test_fixed_point_rows_are_the_columns_rounded():
    """Signs, zeros, carries into a new integer digit and values that round to zero, against Python's "%.*f" (away
    from ties, where value·10^10 is not within 1 % of a half), read back within half a last digit."""
    from cryorefine.io.star import fixed_point_rows

    rng = np.random.default_rng(5)
    a = np.r_[0.0, -0.0, 1.5, -1.5, 179.99999999999, -179.999999999996, -4e-11, -6e-11, 9.5, 100.0, -123.456,
              rng.uniform(-360, 360, 2000)]
    b = np.r_[rng.uniform(-1, 1, 11) * 10.0 ** rng.integers(-3, 4, 11), rng.uniform(0, 180, 2000)]
    text = fixed_point_rows([a, b], 10)
    lines = text.split("\n")
    assert len(lines) == a.size
    for x, y, line in zip(a, b, lines):
        for field, v in zip(line.split("\t"), (x, y)):
            if abs(abs(v) * 1e10 % 1.0 - 0.5) > 0.01:
                assert field.strip() == f"{v:.10f}".replace("-0.0000000000", "0.0000000000")
            assert abs(float(field) - v) <= 0.5e-10 + 1e-12
    assert len({len(f) for line in lines for f in line.split("\t")[:1]}) == 1  # right-aligned, one width
    with pytest.raises(ValueError):
        fixed_point_rows([np.array([np.nan])], 3)


STAR_FLAVOURS = """
# a comment before any block
data_general

_rlnFinalResolution   3.52
_rlnImageName "with space.mrcs"
_rlnCount 7
_rlnName text

data_optics

loop_
_rlnOpticsGroup #1
_rlnOpticsGroupName #2
_rlnImagePixelSize #3
1 opticsGroup1 1.34
2 'quoted group' 1.5

data_particles

loop_
_rlnImageName #1
_rlnDefocusU #2
_rlnClassNumber #3
_rlnComment #4

000001@a.mrcs   10000.5  1 x
# a comment row
000002@a.mrcs 9000 2 "two words"

   000003@a.mrcs  8000 1 y

data_empty

loop_
_rlnA #1
_rlnB #2

data_last
loop_
_rlnOnly
nan
3
"""


@pytest.mark.parametrize("source", ["flavours", "shared"])
def test_star_files_read_as_starfile_reads_them(tmp_path, source):
    """read_star's blocks are starfile.read's (always_dict), value for value and type for type: a file of several
    flavours (single values, quoted strings, comments and blank lines among the rows, an indented row, an empty
    loop, NaN), and every STAR file among the real ones of ../shared/data/real where that folder is."""
    import starfile

    if source == "flavours":
        (tmp_path / "flavours.star").write_text(STAR_FLAVOURS)
        paths = [tmp_path / "flavours.star"]
    else:
        real = Path(__file__).resolve().parents[3] / "shared" / "data" / "real"
        paths = sorted(real.rglob("*.star"))
        if not paths:
            pytest.skip(f"no STAR files under {real}")
    for path in paths:
        want, got = starfile.read(path, always_dict=True), read_star(path)
        assert list(got) == list(want), path
        for name, block in want.items():
            if isinstance(block, pd.DataFrame):
                pd.testing.assert_frame_equal(got[name], block, check_exact=True, obj=f"{path} {name}")
            else:
                assert got[name] == block and [type(v) for v in got[name].values()] == [
                    type(v) for v in block.values()], (path, name)
