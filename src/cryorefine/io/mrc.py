"""MRC volumes and image stacks through mrcfile (memory-mapped), RELION's `N@stack` names.

Data come back as float32 arrays ordered (z, y, x) for volumes and (image, y, x) for stacks,
whatever the file's mode (0 int8, 1 int16, 2 float32, 6 uint16, 12 float16). Header pixel
sizes of 0 or 1.0 are placeholders and are reported as None ("not trusted").
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import mrcfile
import numpy as np
import numpy.typing as npt

from cryorefine.errors import InputError
from cryorefine.io.atomic import atomic_path

SUPPORTED_MODES = {0, 1, 2, 6, 12}
UNTRUSTED_PIXEL_SIZES = (0.0, 1.0)
#: threads a `StackReader` reads one large batch with (at most the CPU count): one thread's `preadv` from the page
#: cache copies at a few GB/s, less than a GPU consumes images (docs/benchmark-conclusions.md, stack_reads.py)
READ_THREADS = min(4, os.cpu_count() or 1)
#: a batch's raw reads are split over the threads when it holds at least this many bytes
PARALLEL_READ_BYTES = 8 << 20


@dataclass(frozen=True)
class MrcInfo:
    path: Path
    shape: tuple  # (z, y, x) or (n_images, y, x)
    mode: int
    header_pixel_size_angstrom: float | None  # None when 0 or 1.0 (a placeholder)


def open_mrc(path: Path | str) -> mrcfile.mrcmemmap.MrcMemmap:
    """Open an MRC file memory-mapped, read-only; InputError if missing, unreadable or truncated."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: file not found; check the path (relative paths start from {Path.cwd()})")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            handle = mrcfile.mmap(path, mode="r", permissive=True)
        except (ValueError, OSError) as exc:
            raise InputError(f"{path}: not a readable MRC file ({exc}); re-export or re-extract it") from None
    if handle.data is None:
        handle.close()
        why = "; ".join(str(w.message) for w in caught) or "no data block"
        raise InputError(f"{path}: truncated or unreadable MRC data ({why}); the file is shorter than its "
                         f"header says: copy it again or re-extract it")
    if int(handle.header.mode) not in SUPPORTED_MODES:
        handle.close()
        raise InputError(f"{path}: MRC mode {int(handle.header.mode)} is not supported (use mode 0, 1, 2, 6 or 12)")
    return handle


def header_pixel_size(handle: mrcfile.mrcfile.MrcFile) -> float | None:
    """The header pixel size in Å, or None where it is a placeholder (0 or 1.0) or anisotropic."""
    vx = float(handle.voxel_size.x)
    if any(abs(vx - u) < 1e-6 for u in UNTRUSTED_PIXEL_SIZES) or not np.isfinite(vx):
        return None
    return vx


def mrc_info(path: Path | str) -> MrcInfo:
    with open_mrc(path) as m:
        return MrcInfo(Path(path), tuple(int(s) for s in m.data.shape), int(m.header.mode), header_pixel_size(m))


def read_volume(path: Path | str, require_cubic: bool = True) -> tuple[np.ndarray, float | None]:
    """A 3D map as float32 (z, y, x) and its header pixel size (None if a placeholder)."""
    with open_mrc(path) as m:
        data = np.asarray(m.data)
        pixel = header_pixel_size(m)
        if data.ndim != 3:
            raise InputError(f"{path}: expected a 3D map, found shape {data.shape}; give a volume, not an image")
        if require_cubic and len(set(data.shape)) != 1:
            raise InputError(f"{path}: the map is {data.shape[2]}×{data.shape[1]}×{data.shape[0]} voxels, not cubic; "
                             f"resize or pad it to a cube (e.g. relion_image_handler --new_box)")
        volume = data.astype(np.float32)
    require_finite(volume, path)
    return volume, pixel


def read_stack(path: Path | str) -> np.ndarray:
    """An image stack (.mrcs) as float32 (n, y, x); a stack of one image, which the file cannot tell from an image,
    as (1, y, x)."""
    with open_mrc(path) as m:
        data = np.asarray(m.data)
        if data.ndim not in (2, 3):
            raise InputError(f"{path}: expected a stack of images, found shape {data.shape}")
        stack = data.reshape((-1,) + data.shape[-2:]).astype(np.float32)
    require_finite(stack, path)
    return stack


def write_volume(path: Path | str, volume: npt.ArrayLike, pixel_size_angstrom: float) -> None:
    """Write a float32 map with its pixel size and up-to-date header statistics, atomically."""
    _write(path, np.asarray(volume, dtype=np.float32), pixel_size_angstrom, stack=False)


def write_stack(path: Path | str, images: npt.ArrayLike, pixel_size_angstrom: float) -> None:
    """Write a float32 image stack (.mrcs) with its pixel size and statistics, atomically."""
    _write(path, np.asarray(images, dtype=np.float32), pixel_size_angstrom, stack=True)


def _write(path, data, pixel_size_angstrom, stack):
    with atomic_path(path) as tmp:
        with mrcfile.new(tmp, overwrite=True) as m:
            m.set_data(data)
            if stack:
                m.set_image_stack()
            else:
                m.set_volume()
            m.voxel_size = float(pixel_size_angstrom)  # set_data has made the header statistics
            set_label(m)


def set_label(handle: mrcfile.mrcfile.MrcFile) -> None:
    """One fixed header label instead of mrcfile's time-stamped one: same data, same bytes."""
    from cryorefine import __version__

    handle.header.label[:] = b""
    handle.header.label[0] = f"cryorefine {__version__}".encode()
    handle.header.nlabl = 1


def parse_image_name(name: object) -> tuple[int, str]:
    """Split RELION's `N@path` into (index counted from 1, path); a bare path means image 1."""
    name = str(name)
    if "@" not in name:
        return 1, name
    number, _, path = name.partition("@")
    try:
        index = int(number)
    except ValueError:
        raise InputError(f"rlnImageName '{name}': '{number}' before '@' is not an image number") from None
    if index < 1:
        raise InputError(f"rlnImageName '{name}': image numbers count from 1")
    return index, path


def resolve_stack_path(stack: Path | str, star_dir: Path | str | None) -> Path:
    """RELION's rule: relative to the current (project) directory first, then to the STAR file's folder."""
    p = Path(stack)
    if p.is_absolute() or p.exists() or star_dir is None:
        return p
    beside = Path(star_dir) / p
    return beside if beside.exists() else p


def _held_shape_and_dtype(reader, paths):
    """The shape and dtype of the images `paths` held in memory: the first stack's box (a stack of another box
    is named when it is read), in the dtype they travel in (`StackReader.wire_dtype`)."""
    box = tuple(reader.handle(paths[0]).data.shape[-2:]) if paths else (0, 0)
    return (len(paths),) + box, reader.wire_dtype(paths)


class PrereadImages:
    """The images of some particles read once into this host's memory (--preread_images): the system's cache of their
    stacks, which every process of the host shares, rather than a copy in each process. Reads like a StackReader.

    On creation the system is asked to read in the stacks' bytes of those images (posix_fadvise WILLNEED for each
    run of consecutive images, where the system has it; a network file system's client keeps them as well) while
    the batches go on reading them through the stacks' files, from memory once they are in. A copy of its own in
    each MPI worker held up the first iteration: on a host of four H200s, each worker's 6.8 GB float16 share of
    the 105k 360 px stand-in took 10.4 s to read in page by page, 7.4 s with its memory mapped in one call."""

    def __init__(self, paths: Sequence[Path | str], indices_1based: npt.ArrayLike, threads: int | None = None) -> None:
        names = [str(p) for p in paths]
        indices = np.asarray(indices_1based, dtype=np.int64)
        self._reader = StackReader(threads)
        shape, dtype = _held_shape_and_dtype(self._reader, names)
        self.nbytes = int(np.prod(shape)) * dtype.itemsize  # the images' bytes, in the dtype they are read in
        self.advised_bytes = self._advise(names, indices)

    @staticmethod
    def held_bytes(paths: Sequence[Path | str]) -> int:
        """The bytes the images of `paths` take in memory, in the dtype they are read in."""
        with StackReader() as reader:
            shape, dtype = _held_shape_and_dtype(reader, [str(p) for p in paths])
        return int(np.prod(shape)) * dtype.itemsize

    def _advise(self, paths: list[str], indices: np.ndarray) -> int:
        """Ask the system to read in each run of consecutive images of each stack; the bytes asked for (0 where the
        system has no posix_fadvise)."""
        advise = getattr(os, "posix_fadvise", None)
        if advise is None:
            return 0
        asked = 0
        by_stack: dict[str, list[int]] = {}
        for path, index in zip(paths, indices.tolist()):
            by_stack.setdefault(path, []).append(index)
        for path, wanted in by_stack.items():
            stack = self._reader.handle(path).data
            if not isinstance(stack, np.memmap):  # not a plain file's bytes (the images are read as without)
                continue
            image_bytes = int(np.prod(stack.shape[-2:])) * stack.dtype.itemsize
            first = np.unique(np.asarray(wanted, dtype=np.int64)) - 1
            breaks = np.flatnonzero(np.diff(first) != 1) + 1
            fd = os.open(path, os.O_RDONLY)
            try:
                for a, b in zip(np.r_[0, breaks], np.r_[breaks, first.size]):
                    length = int(b - a) * image_bytes
                    advise(fd, stack.offset + int(first[a]) * image_bytes, length, os.POSIX_FADV_WILLNEED)
                    asked += length
            finally:
                os.close(fd)
        return asked

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """The stacks close and the reading threads end (the object stays usable: the next read opens them again)."""
        self._reader.close()

    def wire_dtype(self, paths: Sequence[Path | str]) -> np.dtype:
        """The dtype the images are read in (see StackReader.wire_dtype)."""
        return self._reader.wire_dtype(paths)

    def read(self, paths: Sequence[Path | str], indices_1based: npt.ArrayLike, out: np.ndarray | None = None,
             check_finite: bool = True, dtype: npt.DTypeLike = np.float32) -> np.ndarray:
        """As StackReader.read."""
        return self._reader.read(paths, indices_1based, out=out, check_finite=check_finite, dtype=dtype)


class StackReader:
    """Reads images by (stack path, 1-based index), keeping each stack open once.

    Images that follow each other in a stack and in the batch are read as one block: with `os.preadv`
    straight into the output where the stack holds the output's native dtype (no page faults of a fresh memory
    map each iteration, no intermediate copy), else as one slice of the memory map. A batch of
    PARALLEL_READ_BYTES or more is read in `threads` parts at once (READ_THREADS by default).
    """

    def __init__(self, threads: int | None = None) -> None:
        self._open: dict[str, mrcfile.mrcmemmap.MrcMemmap] = {}
        self._fd: dict[str, int] = {}
        self._verified: dict[str, bool] = {}  # path -> whether preadv at the memory map's offset reads the same bytes
        self._reads = _Pieces(READ_THREADS if threads is None else threads)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self._reads.close()
        for handle in self._open.values():
            handle.close()
        for fd in self._fd.values():
            os.close(fd)
        self._open.clear()
        self._fd.clear()
        self._verified.clear()

    def handle(self, path: Path | str) -> mrcfile.mrcmemmap.MrcMemmap:
        key = str(path)
        if key not in self._open:
            self._open[key] = open_mrc(path)
        return self._open[key]

    def n_images(self, path: Path | str) -> int:
        data = self.handle(path).data
        return 1 if data.ndim == 2 else int(data.shape[0])

    def wire_dtype(self, paths: Sequence[Path | str]) -> np.dtype:
        """float16 when every stack in `paths` holds native float16 (MRC mode 12), else float32: the dtype in
        which images can travel to where they are prepared without a conversion on the host (which costs more
        than the read itself)."""
        kinds = {self.handle(p).data.dtype for p in dict.fromkeys(str(p) for p in paths)}
        return np.dtype(np.float16) if kinds == {np.dtype(np.float16)} else np.dtype(np.float32)

    def read(self, paths: Sequence[Path | str], indices_1based: npt.ArrayLike, out: np.ndarray | None = None,
             check_finite: bool = True, dtype: npt.DTypeLike = np.float32) -> np.ndarray:
        """Images (B, y, x) for parallel sequences of stack paths and 1-based indices, float32 (or `dtype`).

        `out`: an array of at least B images of the right box to read into (e.g. pinned host memory; its dtype
        is the result's); the first B are returned. `check_finite=False` leaves the NaN/Inf check to the caller
        (`require_finite`).
        """
        dtype = np.dtype(dtype if out is None else out.dtype)
        paths = [str(p) for p in paths]
        indices = np.asarray(indices_1based, dtype=np.int64)
        path_array = np.asarray(paths, dtype=object)
        result = None
        for path in dict.fromkeys(paths):
            rows = np.flatnonzero(path_array == path)
            data = self.handle(path).data
            stack = data[None] if data.ndim == 2 else data
            wanted = indices[rows]
            bad = wanted[(wanted < 1) | (wanted > stack.shape[0])]
            if bad.size:
                raise InputError(f"{bad[0]}@{path}: image {bad[0]} is beyond the stack, which holds "
                                 f"{stack.shape[0]} images; fix rlnImageName in the STAR file")
            if result is None:
                shape = (len(paths),) + stack.shape[1:]
                if out is not None and out.shape[0] < len(paths):
                    raise ValueError(f"read buffer {out.shape} {out.dtype} cannot take {shape}")
                result = np.empty(shape, dtype) if out is None else out[:len(paths)]
            if stack.shape[1:] != result.shape[1:]:  # another stack of the batch, or a buffer sized from other images
                raise InputError(f"{path}: images are {stack.shape[2]}×{stack.shape[1]} px but others in the "
                                 f"set are {result.shape[2]}×{result.shape[1]} px; mixed box sizes cannot be "
                                 f"refined together")
            self._read_runs(path, stack, wanted, rows, result)
            if check_finite:
                require_finite(result[rows], path, wanted)
        return result if result is not None else np.empty((0, 0, 0), dtype)

    def _read_runs(self, path, stack, wanted, rows, result):
        raw = isinstance(stack, np.memmap) and stack.dtype == result.dtype and stack.dtype.isnative
        image_bytes = int(np.prod(stack.shape[1:])) * stack.dtype.itemsize
        runs = _runs(wanted - 1, rows)

        def read(piece: list[tuple[int, int, int]]) -> None:
            for i, r, n in piece:
                target = result[r:r + n]
                if not (raw and self._read_raw(path, stack, i, target, image_bytes)):
                    target[...] = stack[i:i + n]

        if not raw:  # a conversion on the way: one thread
            read(runs)
            return
        i, r, n = runs[0]
        read([(i, r, 1)])  # the stack's file opened, and its first raw read checked, on this thread
        self._reads.run(read, ([(i + 1, r + 1, n - 1)] if n > 1 else []) + runs[1:], (wanted.size - 1) * image_bytes)

    def _read_raw(self, path, stack, first, target, image_bytes):
        """os.preadv of images first… into `target`; False where the file cannot be read so (then the
        memory map is used). The first raw read of each stack is checked against its memory map."""
        if path not in self._fd:
            self._fd[path] = os.open(path, os.O_RDONLY)
        view = memoryview(target).cast("B")
        if os.preadv(self._fd[path], [view], stack.offset + first * image_bytes) != view.nbytes:
            return False
        verified = self._verified.get(path)
        if verified is None:
            verified = self._verified[path] = target[0].tobytes() == np.asarray(stack[first]).tobytes()
        return verified


def _runs(source, row):
    """Runs (first source image, first batch row, images) of images consecutive both in their source and in the
    batch, in the source's order, for the batch rows `row` of the source images `source` (0-based)."""
    if len(source) == 0:
        return []
    order = np.argsort(source, kind="stable")
    first, row = np.asarray(source)[order], np.asarray(row)[order]
    breaks = np.flatnonzero((np.diff(first) != 1) | (np.diff(row) != 1)) + 1
    return [(int(first[a]), int(row[a]), int(b - a)) for a, b in zip(np.r_[0, breaks], np.r_[breaks, first.size])]


class _Pieces:
    """`threads` threads that copy a batch's runs of images at once: a batch of PARALLEL_READ_BYTES or more is cut
    into one piece a thread (`_split_runs`), a smaller one copied on the calling thread."""

    def __init__(self, threads):
        self.threads = max(1, int(threads))
        self._pool = None  # made on the first parallel copy

    def run(self, copy: Callable[[list[tuple[int, int, int]]], None], runs: list[tuple[int, int, int]],
            nbytes: int) -> None:
        """copy(piece) for the pieces of `runs`; returns when all are done (an error in one is raised here)."""
        if self.threads == 1 or nbytes < PARALLEL_READ_BYTES:
            copy(runs)
            return
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="image-copy")
        list(self._pool.map(copy, _split_runs(runs, self.threads)))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def _split_runs(runs, parts):
    """Runs (first image in the stack, first row of the batch, images) cut into at most `parts` pieces of equal size
    (the last one smaller): a long run is cut, short ones are grouped (a piece is a list of runs, read in turn)."""
    total = sum(n for _, _, n in runs)
    size = max(1, -(-total // parts))
    pieces, current, room = [], [], size
    for i, r, n in runs:
        while n > 0:
            take = min(n, room)
            current.append((i, r, take))
            i, r, n, room = i + take, r + take, n - take, room - take
            if room == 0:
                pieces.append(current)
                current, room = [], size
    if current:
        pieces.append(current)
    return pieces


def require_finite(array: np.ndarray, path: Path | str, indices_1based: npt.ArrayLike | None = None) -> None:
    """InputError naming the first image of `array` (read from `path`) with NaN or Inf pixels, if any."""
    if np.isfinite(array).all():
        return
    if indices_1based is None:
        raise InputError(f"{path}: contains NaN or Inf values; fix or regenerate the file")
    flat = array.reshape(array.shape[0], -1)
    first = int(np.flatnonzero(~np.isfinite(flat).all(axis=1))[0])
    index = np.asarray(indices_1based)[first]
    raise InputError(f"{index}@{path}: image contains NaN or Inf pixels; remove the particle from the STAR file or "
                     f"re-extract it")
