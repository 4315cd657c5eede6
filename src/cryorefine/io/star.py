"""RELION STAR files (3.0 single table, 3.1+ and 5 with data_optics) through starfile.

`read_star` / `write_star` handle any STAR file as {block name: DataFrame or dict}: read as starfile reads them
(`star_blocks`: its rules, with the file's lines taken at once, where starfile looks each up again: a
100,000-particle file in a fraction of a second instead of seconds), written as starfile writes them.
`read_particle_star` / `write_particle_star` handle particle files: a RELION 3.0 table is
turned into the 3.1 layout (optics columns moved to an optics table, pixel origins converted
to Å), and every other column, known to us or not, is kept as it was.
"""

from __future__ import annotations

import io
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pandas as pd
import starfile

from cryorefine.errors import InputError
from cryorefine.io.atomic import atomic_path

#: RELION 5's MetaDataTable version (CURRENT_MDT_VERSION). RELION 3.1 and 4 write 30001; their readers use the number
#: only to convert RELION 3.0 particle files (those without an optics table), which are never written here
STAR_VERSION = 50001
FLOAT_FORMAT = "%.12g"
FORMAT_CHUNK = 8192  # values formatted in one step of a loop (`io.relion_outputs`)
FORMAT_CHUNK_ROWS = 16384  # rows of a loop block made in one step (`_loop_text`)

# Columns that a RELION 3.0 particle table repeats per particle and 3.1+ keeps per optics group.
OPTICS_COLUMNS_30 = ("rlnVoltage", "rlnSphericalAberration", "rlnAmplitudeContrast",
                     "rlnMagnification", "rlnDetectorPixelSize", "rlnImagePixelSize", "rlnImageSize")

# Numeric columns of particle files that are read, with the values RELION accepts: (low, high, low is allowed,
# integer). None: no bound. Every value must be a finite number.
NUMERIC_COLUMNS = {
    "rlnDefocusU": (None, None, True, False), "rlnDefocusV": (None, None, True, False),
    "rlnDefocusAngle": (None, None, True, False), "rlnPhaseShift": (None, None, True, False),
    "rlnCtfBfactor": (None, None, True, False), "rlnCtfScalefactor": (None, None, True, False),
    "rlnAngleRot": (None, None, True, False), "rlnAngleTilt": (None, None, True, False),
    "rlnAnglePsi": (None, None, True, False), "rlnOriginXAngst": (None, None, True, False),
    "rlnOriginYAngst": (None, None, True, False), "rlnOriginX": (None, None, True, False),
    "rlnOriginY": (None, None, True, False), "rlnOriginXPriorAngst": (None, None, True, False),
    "rlnOriginYPriorAngst": (None, None, True, False), "rlnOriginXPrior": (None, None, True, False),
    "rlnOriginYPrior": (None, None, True, False), "rlnNormCorrection": (0.0, None, False, False),
    "rlnRandomSubset": (0, None, True, True), "rlnClassNumber": (0, None, True, True),
    "rlnOpticsGroup": (1, None, True, True), "rlnImagePixelSize": (0.0, None, False, False),
    "rlnImageSize": (1, None, True, True), "rlnVoltage": (0.0, None, False, False),
    "rlnSphericalAberration": (None, None, True, False), "rlnAmplitudeContrast": (0.0, 1.0, True, False),
    "rlnMagnification": (0.0, None, False, False), "rlnDetectorPixelSize": (0.0, None, False, False),
}


def read_star(path: Path | str) -> dict[str, pd.DataFrame | dict]:
    """Every block of a STAR file: {name: DataFrame (loops) or dict (single values)}."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: file not found; check the path (relative paths start from {Path.cwd()})")
    try:
        with open(path, encoding="utf-8") as f:
            return star_blocks(f.readlines())
    except Exception as exc:  # the parser's and pandas' assorted errors, a file that is not text
        raise InputError(f"{path}: not a readable STAR file ({type(exc).__name__}: {exc})") from None


def star_blocks(lines: Sequence[str]) -> dict[str, pd.DataFrame | dict]:
    """The blocks of a STAR file's `lines` by starfile's rules (starfile.read(..., always_dict=True)): a `data_NAME`
    line opens block NAME, a loop (`loop_`, its `_label` lines, then rows up to the next `data_` line, read by
    pandas as starfile does) or single `_label value` pairs (up to a line starting with `data`); numbers where a
    whole column (a value) reads as numbers."""
    text = [line.strip() for line in lines]
    n = len(text)

    def line(i: int) -> str:  # 1-based, '' outside the file
        return text[i - 1] if 1 <= i <= n else ""

    blocks: dict[str, pd.DataFrame | dict] = {}
    i = 0
    while i <= n:
        if not line(i).startswith("data_"):
            i += 1
            continue
        name = line(i)[5:]
        while True:
            i += 1
            if i > n:
                raise ValueError(f"block data_{name} has neither a loop nor values")
            if line(i).startswith("loop_"):
                blocks[name], i = _loop_block(line, i + 1, n)
                break
            if line(i).startswith("_"):
                blocks[name], i = _single_values(line, i, n)
                break
    return blocks


def _single_values(line, i, n):
    """(a block's `_label value` pairs from line i on, up to a line starting with `data`; the line after them)."""
    values: dict[str, int | float | str] = {}
    while i <= n and not line(i).startswith("data"):
        if line(i).startswith("_"):
            label, value = shlex.split(line(i))
            values[label[1:]] = _number_or_text(value)
        i += 1
    return values, i


def _number_or_text(value: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def _loop_block(line, i, n):
    """(a loop's table from its first label line i on, the line after its rows)."""
    labels = []
    while line(i).startswith("_"):
        labels.append(line(i).split()[0][1:])
        i += 1
    while line(i) == "":
        i += 1
        if i > n:
            break
    first = i
    while i <= n and not line(i).startswith("data_"):
        i += 1
    body = "\n".join(line(k) for k in range(first, i)) + "\n"
    if body.startswith("\n"):
        return pd.DataFrame(np.zeros((0, len(labels))), columns=labels), i
    table = pd.read_csv(io.StringIO(body.replace("'", '"')), delimiter=r"\s+", header=None, comment="#",
                        keep_default_na=False, na_values=["nan", "NaN", "<NA>"], engine="c")
    table.columns = labels
    numeric = table.apply(_numbers_where_they_read)
    texts = numeric.columns[numeric.isna().all()]
    numeric[texts] = table[texts]  # a column of no numbers keeps its text
    return numeric, i


def _numbers_where_they_read(column: pd.Series) -> pd.Series:
    try:
        return pd.to_numeric(column)
    except ValueError:
        return column


def star_to_string(blocks: Mapping[str, pd.DataFrame | dict]) -> str:
    """STAR text for {name: DataFrame or dict}, each block headed by RELION's version comment."""
    parts = []
    for name, block in blocks.items():
        body = _loop_text(name, block) if isinstance(block, pd.DataFrame) else None
        if body is None:
            text = starfile.to_string({name: block}, float_format=FLOAT_FORMAT)
            body = text[text.index("data_"):] if "data_" in text else text
        parts.append(f"\n# version {STAR_VERSION}\n\n{body.rstrip()}\n")
    return "".join(parts) + "\n"


def _loop_text(name, table):
    """A loop block as starfile writes it (labels numbered, rows tab-separated, floats as FLOAT_FORMAT, NaN as
    <NA>, strings that are empty or hold a space in double quotes), made column by column in whole-array numpy
    steps (`_float_cells`, `_int_cells`): a 100,000-row data.star or a 786,432-row table is written in a fraction
    of starfile's time, which goes cell by cell while holding the interpreter. These files are written on a thread
    beside the E-step, whose thread launches the GPU's work and needs the interpreter back after every wait: numpy
    lets go of it while it computes, and a block is made FORMAT_CHUNK_ROWS rows at a time, so no one step keeps it
    long. None for a table with a column of another kind (starfile writes it)."""
    lines = [f"data_{name}", "", "loop_", *(f"_{label} #{i}" for i, label in enumerate(table.columns, 1))]
    columns = [table[label].to_numpy() for label in table.columns]
    kinds = [_cell_kind(values) for values in columns]
    if not all(kinds):
        return None
    parts = ["\n".join(lines) + "\n"]
    for start in range(0, len(table), FORMAT_CHUNK_ROWS):
        rows = slice(start, start + FORMAT_CHUNK_ROWS)
        cells = [_cells(values[rows], kind) for values, kind in zip(columns, kinds)]
        matrix = _rows_matrix(cells, min(len(table) - start, FORMAT_CHUNK_ROWS)).ravel()
        parts.append(matrix[matrix != 0].tobytes().decode("utf-8"))
    return "".join(parts)


def _rows_matrix(fields, n_rows):
    """Byte matrices of a table's fields (n_rows, width each) joined into its lines: a tab between fields, a
    newline after each row."""
    tab = np.full((n_rows, 1), ord("\t"), dtype=np.uint8)
    newline = np.full((n_rows, 1), ord("\n"), dtype=np.uint8)
    pieces = [piece for field in fields for piece in (tab, field)][1:]
    return np.concatenate(pieces + [newline], axis=1)


def _cell_kind(values):
    """"f", "i" or "s" for a column `_cells` writes; None for one of another kind."""
    if values.dtype.kind in "fiu":
        return "i" if values.dtype.kind in "iu" else "f"
    if values.dtype.kind == "O" and all(type(v) is str for v in values):
        return "s"
    return None


def _cells(values, kind):
    """A column's cells (of `_cell_kind` `kind`) as a (rows, width) byte matrix, NUL after each cell's text
    (UTF-8)."""
    if kind == "f":
        return _float_cells(values)
    if kind == "i":
        return _int_cells(values)
    quoted = [f'"{v}"' if (not v or " " in v) else v for v in values]
    return _text_cells([v.encode("utf-8") for v in quoted])


def _text_cells(encoded):
    """Byte strings as a (rows, longest) byte matrix, NUL after each."""
    width = max((len(b) for b in encoded), default=0)
    return np.array(encoded, dtype=f"S{max(width, 1)}").view(np.uint8).reshape(len(encoded), max(width, 1))


#: cells of `_float_cells`: a sign, up to 12 digits before the point (a leading 0 below 1), the point, and up to 15
#: decimals (a value of 1e-4 has three zeros before its 12 significant digits): 18; "%.12g" with an exponent
#: ("-1.23456789012e-308") takes 19
_FLOAT_CELL = 20
_POWERS = 10 ** np.arange(11, -1, -1, dtype=np.int64)


def _float_cells(values):
    """FLOAT_FORMAT ("%.12g") of a float column, text for text, as `_cells` gives it. Values from 1e-4 to below
    1e12, which "%.12g" writes without an exponent, are made in numpy steps: their 12 significant digits m from
    v·10^(11−e), e the decimal exponent, then the digits around the point with trailing zeros dropped. A value
    whose 13th digit is too close to a half for float64 to tell which way it rounds (about 1 in 500), and every
    other value but zero (NaN as <NA>, ±inf, those written with an exponent), is formatted by Python's own
    "%.12g", one by one."""
    v = np.asarray(values, dtype=np.float64)
    n = v.size
    a = np.abs(v)
    fast = np.isfinite(v) & (a >= 1e-4) & (a < 1e12)
    a = np.where(fast, a, 1.0)
    e = np.floor(np.log10(a)).astype(np.int64)
    for _ in range(2):  # log10 can be one off next to a power of ten
        scaled = a * 10.0 ** (11 - e)  # exact powers: 11 − e is 0 … 15
        e += scaled >= 1e12
        e -= scaled < 1e11
    scaled = a * 10.0 ** (11 - e)
    fast &= (scaled >= 1e11) & (scaled < 1e12) & (np.abs(scaled - np.floor(scaled) - 0.5) > 1e-3)
    m = np.rint(scaled).astype(np.int64)
    carried = m == 10 ** 12  # 999…9.5 rounds up to the next power of ten
    m[carried] = 10 ** 11
    x = e + carried  # the exponent of the value rounded to 12 digits: "%.12g" writes it without one below 12
    fast &= x < 12
    digits = np.zeros((n, 16), dtype=np.uint8)  # four zeros, then the 12 digits of m
    digits[:, 4:] = (m[:, None] // _POWERS) % 10
    start = 4 + np.minimum(x, 0)  # the text's digits are digits[start:]: one 0 and −x − 1 zeros before m below 1
    point = start + np.maximum(x, 0) + 1  # the digit the point goes before
    last = np.maximum(15 - np.argmax(digits[:, ::-1] != 0, axis=1), point - 1)  # the last digit written
    cells = np.zeros((n, _FLOAT_CELL), dtype=np.uint8)
    cells[:, 0] = np.where(v < 0, ord("-"), 0)
    flat = cells.reshape(-1)
    row = np.arange(n, dtype=np.int64) * _FLOAT_CELL
    shift = 1 - start  # digit j goes to column j + shift, one further from the point on
    for j in range(16):
        write = (j >= start) & (j <= last)
        flat[(row + j + shift + (j >= point))[write]] = ord("0") + digits[write, j]
    has_point = last >= point
    flat[(row + point + shift)[has_point]] = ord(".")
    zero = v == 0
    cells[zero, 0] = np.where(np.signbit(v[zero]), ord("-"), 0)  # "0" or "-0"
    cells[zero, 1] = ord("0")
    for i in np.flatnonzero(~fast & ~zero).tolist():
        text = "<NA>" if np.isnan(v[i]) else FLOAT_FORMAT % float(v[i])
        cells[i] = 0
        cells[i, :len(text)] = np.frombuffer(text.encode("ascii"), dtype=np.uint8)
    return cells


def _int_cells(values):
    """str() of an integer column as `_cells` gives it, in numpy steps (values beyond int64 one by one)."""
    int64 = np.iinfo(np.int64)
    if values.size and (values.max() > int64.max if values.dtype.kind == "u" else values.min() == int64.min):
        return _text_cells([str(i).encode("ascii") for i in values.tolist()])
    v = values.astype(np.int64)
    a = np.abs(v)
    powers = 10 ** np.arange(18, -1, -1, dtype=np.int64)
    digits = (a[:, None] // powers) % 10
    shown = (a[:, None] >= powers) | (powers == 1)  # no leading zeros; 0 is "0"
    cells = np.zeros((v.size, 20), dtype=np.uint8)
    cells[:, 1:] = np.where(shown, ord("0") + digits, 0)
    cells[:, 0] = np.where(v < 0, ord("-"), 0)
    return cells


def fixed_point_rows(columns: Sequence[npt.ArrayLike], decimals: int) -> str:
    """Rows of float `columns` (equal lengths, finite, |value|·10^decimals below 2^53) as fixed-point text with
    `decimals` decimals, the columns tab-separated, a line a row (no newline after the last), right-aligned.

    Made with whole-array numpy steps, a few milliseconds per 100,000 values, where formatting value by value
    takes seconds for the tables of hundreds of thousands of rows that a run rewrites (the sampling's directions)
    and keeps the interpreter from the E-step's thread for all of it. Values are rounded to the nearest
    10^−decimals (a last digit may differ from "%.*f"'s by one where value·10^decimals is a hair from a half)."""
    cols = [np.asarray(c, dtype=np.float64).ravel() for c in columns]
    n = cols[0].size if cols else 0
    if not n:
        return ""
    fields = []
    for col in cols:
        if col.size != n or not np.isfinite(col).all():
            raise ValueError("fixed_point_rows needs finite columns of one length")
        scaled = np.rint(np.abs(col) * 10.0 ** decimals)
        if scaled.max() >= 2.0 ** 53:
            raise ValueError(f"fixed_point_rows: {np.abs(col).max()!r} is too large for {decimals} decimals")
        scaled = scaled.astype(np.int64)
        int_part = scaled // 10 ** decimals
        n_int = len(str(int(int_part.max())))
        width = 1 + n_int + 1 + decimals  # sign, integer digits, point, decimals
        text = np.full((n, width), ord(" "), dtype=np.uint8)
        digits = scaled
        for pos in range(width - 1, width - 1 - decimals, -1):
            text[:, pos] = ord("0") + digits % 10
            digits = digits // 10
        text[:, width - 1 - decimals] = ord(".")
        shown = np.ones(n, dtype=np.int64)  # integer digits written: 1 for 0
        for k in range(n_int):
            pos = width - 2 - decimals - k
            keep = (digits > 0) | (k == 0)
            text[:, pos] = np.where(keep, ord("0") + digits % 10, ord(" "))
            shown = np.where(keep, k + 1, shown)
            digits = digits // 10
        negative = np.flatnonzero((col < 0) & (scaled > 0))
        text[negative, width - 2 - decimals - shown[negative]] = ord("-")
        fields.append(text)
    return _rows_matrix(fields, n).tobytes()[:-1].decode("ascii")


def write_star(blocks: Mapping[str, pd.DataFrame | dict], path: Path | str) -> None:
    """Write {name: DataFrame or dict} as a STAR file, atomically."""
    with atomic_path(path) as tmp:
        Path(tmp).write_text(star_to_string(blocks))


@dataclass
class ParticleStar:
    """A particle STAR file in the RELION 3.1 layout: `optics` one row per optics group."""

    path: Path
    particles: pd.DataFrame
    optics: pd.DataFrame
    source_version: str  # "3.0" or "3.1+"


def read_particle_star(path: Path | str) -> ParticleStar:
    """Read a RELION 3.0, 3.1+ or 5 particle file into the 3.1 layout."""
    path = Path(path)
    blocks = read_star(path)
    if "optics" in blocks and "particles" in blocks:
        particles = _numeric(_as_table(blocks["particles"], path, "data_particles"), path, "data_particles")
        optics = _numeric(_as_table(blocks["optics"], path, "data_optics"), path, "data_optics")
        _require(particles, "rlnOpticsGroup", path, "data_particles")
        _require(optics, "rlnOpticsGroup", path, "data_optics")
        unknown = sorted(set(particles["rlnOpticsGroup"]) - set(optics["rlnOpticsGroup"]))
        if unknown:
            raise InputError(f"{path}: data_particles uses rlnOpticsGroup {unknown[0]}, which data_optics does not "
                             f"define; add it to data_optics")
        if "rlnImagePixelSize" not in optics.columns:
            optics = optics.assign(rlnImagePixelSize=_pixel_size_from_detector(optics, path, "data_optics"))
        else:
            _check_pixel_conflict(optics, path, "data_optics")
        return ParticleStar(path, particles.reset_index(drop=True), optics.reset_index(drop=True), "3.1+")
    tables = [(name, b) for name, b in blocks.items() if isinstance(b, pd.DataFrame) and "rlnImageName" in b.columns]
    if not tables:
        raise InputError(f"{path}: no particle table found (no block with column rlnImageName); "
                         f"give a RELION particles STAR file")
    name, table = tables[0]
    return _from_relion30(_numeric(table.reset_index(drop=True), path, f"data_{name}"), path, f"data_{name}")


def write_particle_star(star: ParticleStar, path: Path | str, particles: pd.DataFrame | None = None) -> None:
    """Write optics + particles as a RELION 3.1+ data.star (all columns kept), atomically."""
    table = star.particles if particles is None else particles
    write_star({"optics": star.optics, "particles": table}, path)


def _from_relion30(table, path, block):
    pixel_size = _pixel_size_from_detector(table, path, block)
    present = [c for c in OPTICS_COLUMNS_30 if c in table.columns]
    values = table[present].copy()
    values["rlnImagePixelSize"] = pixel_size
    keys = values.round(6)
    first = ~keys.duplicated()
    unique = keys[first].reset_index(drop=True)
    group = keys.merge(unique.reset_index(names="_group"), how="left", on=list(keys.columns))["_group"].to_numpy() + 1
    optics = values[first].reset_index(drop=True)
    optics.insert(0, "rlnOpticsGroupName", [f"opticsGroup{i + 1}" for i in range(len(unique))])
    optics.insert(0, "rlnOpticsGroup", np.arange(1, len(unique) + 1))
    if "rlnImageDimensionality" not in optics.columns:
        optics["rlnImageDimensionality"] = 2
    particles = table.drop(columns=present)
    particles["rlnOpticsGroup"] = group
    for axis in ("X", "Y"):  # origins and their priors from pixels to Å (RELION's conversion of 3.0 files)
        for col in (f"rlnOrigin{axis}", f"rlnOrigin{axis}Prior"):
            if col in particles.columns:
                particles[f"{col}Angst"] = particles.pop(col).to_numpy(np.float64) * pixel_size
    return ParticleStar(path, particles, optics, "3.0")


def _pixel_size_from_detector(table, path, block):
    if "rlnImagePixelSize" in table.columns:
        _check_pixel_conflict(table, path, block)
        return table["rlnImagePixelSize"].to_numpy(np.float64)
    if "rlnDetectorPixelSize" in table.columns and "rlnMagnification" in table.columns:
        mag = table["rlnMagnification"].to_numpy(np.float64)
        if (mag <= 0).any():
            raise InputError(f"{path}: {block} has rlnMagnification ≤ 0; fix it or give rlnImagePixelSize")
        return table["rlnDetectorPixelSize"].to_numpy(np.float64) * 1e4 / mag
    raise InputError(f"{path}: {block} has no pixel size: add column rlnImagePixelSize (Å), or "
                     f"rlnDetectorPixelSize (µm) with rlnMagnification")


def _check_pixel_conflict(table, path, block):
    if not {"rlnDetectorPixelSize", "rlnMagnification", "rlnImagePixelSize"} <= set(table.columns):
        return
    derived = table["rlnDetectorPixelSize"].to_numpy(np.float64) * 1e4 / table["rlnMagnification"].to_numpy(np.float64)
    given = table["rlnImagePixelSize"].to_numpy(np.float64)
    bad = np.flatnonzero(np.abs(derived - given) > 1e-3 * given)
    if bad.size:
        i = bad[0]
        raise InputError(f"{path}: {block} row {i + 1}: conflicting pixel sizes, rlnImagePixelSize {given[i]:g} Å but "
                         f"rlnDetectorPixelSize·1e4/rlnMagnification = {derived[i]:g} Å; remove one of them")


def _numeric(table, path, block):
    """`table` with its known numeric columns (NUMERIC_COLUMNS) as numbers; InputError naming the file, block,
    column, row and value of the first one that is not a finite number in RELION's range."""
    if table.empty:
        raise InputError(f"{path}: {block} has no rows; give a STAR file with particles")
    table = table.copy()
    for column, (low, high, low_allowed, integer) in NUMERIC_COLUMNS.items():
        if column not in table.columns:
            continue
        raw = table[column]
        values = pd.to_numeric(raw, errors="coerce").to_numpy(np.float64)
        if integer:
            bad = ~np.isfinite(values) | (values != np.round(values))
        else:
            bad = ~np.isfinite(values)
        if low is not None:
            bad |= (values < low) if low_allowed else (values <= low)
        if high is not None:
            bad |= values > high
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            wanted = "a whole number" if integer else "a finite number"
            if low is not None or high is not None:
                span = (f"{'≥' if low_allowed else '>'} {low:g}" if low is not None else "") + \
                       (f"{' and ' if low is not None else ''}≤ {high:g}" if high is not None else "")
                wanted += f" {span}"
            value = raw.iloc[i]
            shown = repr(value) if isinstance(value, str) else str(value)  # text quoted, numbers as written
            raise InputError(f"{path}: {block} row {i + 1}, column {column}: {shown} is not {wanted}; fix the value or "
                             f"remove the row")
        table[column] = values.astype(np.int64) if integer else values
    return table


def _as_table(block, path, name):
    if isinstance(block, pd.DataFrame):
        return block
    return pd.DataFrame([block]) if isinstance(block, dict) else _fail(path, name)


def _fail(path, name):
    raise InputError(f"{path}: block {name} is not a table")


def _require(table, column, path, block):
    if column not in table.columns:
        raise InputError(f"{path}: column {column} is missing from {block}; add it (RELION 3.1+ layout)")
