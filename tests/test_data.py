from pathlib import Path

import numpy as np
import pytest
from conftest import make_particle_set, write_mrc

from cryorefine.data import load_particles
from cryorefine.errors import InputError
from cryorefine.io.mrc import StackReader


@pytest.mark.parametrize("relion30", [False, True])
def test_particle_arrays_match_the_file(tmp_path, relion30):
    path, images = make_particle_set(tmp_path, n=7, box=12, pixel_size=1.75, relion30=relion30)
    parts = load_particles(path)
    assert len(parts) == 7
    assert parts.geometry() == (12, pytest.approx(1.75))
    table = parts.star.particles
    np.testing.assert_allclose(parts.defocus_u_angstrom, table["rlnDefocusU"])
    np.testing.assert_allclose(parts.psi_deg, table["rlnAnglePsi"])
    np.testing.assert_allclose(parts.voltage_kv, 300.0)
    np.testing.assert_allclose(parts.cs_mm, 2.7)
    parts.require_ctf()
    with StackReader() as reader:
        got = parts.read_images([6, 0, 3], reader)
    np.testing.assert_array_equal(got, images[[6, 0, 3]])


def test_relion30_origins_in_angstrom(tmp_path):
    path, _ = make_particle_set(tmp_path, relion30=True, pixel_size=2.0)
    import starfile

    raw = starfile.read(path)
    parts = load_particles(path)
    np.testing.assert_allclose(parts.origin_x_angstrom, raw["rlnOriginX"] * 2.0)


def test_half_sets(tmp_path):
    path, _ = make_particle_set(tmp_path, n=101)
    parts = load_particles(path)
    halves = parts.half_sets(seed=3)
    assert set(halves) == {1, 2} and abs((halves == 1).sum() - (halves == 2).sum()) <= 1
    assert np.array_equal(halves, parts.half_sets(seed=3))
    assert not np.array_equal(halves, parts.half_sets(seed=4))
    parts.random_subset = np.where(np.arange(101) < 30, 1, 2)
    assert (parts.half_sets(seed=3) == parts.random_subset).all()


def test_batches_cover_each_particle_once(tmp_path):
    path, _ = make_particle_set(tmp_path, n=23)
    parts = load_particles(path)
    batches = list(parts.batches(5))
    assert [b.size for b in batches] == [5, 5, 5, 5, 3]
    assert np.array_equal(np.concatenate(batches), np.arange(23))
    # given indices: consecutive runs of them, each batch in stack order
    order = np.random.default_rng(2).permutation(23)
    batches = list(parts.batches(5, order))
    for start, batch in zip(range(0, 23, 5), batches, strict=True):
        np.testing.assert_array_equal(batch, np.sort(order[start:start + 5]))


def test_batch_reads_only_its_images(tmp_path, monkeypatch):
    path, _ = make_particle_set(tmp_path, n=9)
    parts = load_particles(path)
    seen = []
    with StackReader() as reader:
        original = reader.read

        def spy(paths, indices, **options):
            seen.extend(indices)
            return original(paths, indices, **options)

        reader.read = spy
        parts.read_images(np.array([2, 5]), reader)
    assert sorted(seen) == [3, 6]


def test_stack_missing(tmp_path):
    path, _ = make_particle_set(tmp_path)
    (tmp_path / "stack.mrcs").unlink()
    with pytest.raises(InputError, match="stack.mrcs not found"):
        load_particles(path)


def test_index_beyond_stack(tmp_path):
    path, _ = make_particle_set(tmp_path, n=4)
    write_mrc(tmp_path / "stack.mrcs", np.zeros((3, 16, 16), np.float32))
    with pytest.raises(InputError, match=r"4@.*beyond the stack, which holds 3"):
        load_particles(path)


def test_box_mismatch_with_optics_table(tmp_path):
    path, _ = make_particle_set(tmp_path, n=4, box=16)
    write_mrc(tmp_path / "stack.mrcs", np.zeros((4, 20, 20), np.float32))
    with pytest.raises(InputError, match="20 px but data_optics rlnImageSize"):
        load_particles(path)


def test_mixed_box_sizes_between_groups(tmp_path):
    import pandas as pd
    import starfile

    a, _ = make_particle_set(tmp_path / "a", n=3, box=16)
    b, _ = make_particle_set(tmp_path / "b", n=3, box=20)
    ta, tb = starfile.read(a), starfile.read(b)
    tb["particles"]["rlnOpticsGroup"] = 2
    tb["optics"]["rlnOpticsGroup"] = 2
    for t, sub in ((ta, "a"), (tb, "b")):
        t["particles"]["rlnImageName"] = t["particles"]["rlnImageName"].str.replace("@", f"@{sub}/")
    starfile.write({"optics": pd.concat([ta["optics"], tb["optics"]]),
                    "particles": pd.concat([ta["particles"], tb["particles"]])}, tmp_path / "mixed.star")
    parts = load_particles(tmp_path / "mixed.star")
    with pytest.raises(InputError, match=r"different box sizes \[16, 20\]"):
        parts.geometry()


def test_header_pixel_size_conflict(tmp_path):
    path, _ = make_particle_set(tmp_path, pixel_size=1.5)
    write_mrc(tmp_path / "stack.mrcs", np.zeros((6, 16, 16), np.float32), pixel_size=2.0)
    with pytest.raises(InputError, match="conflicting pixel sizes"):
        load_particles(path)


def test_real_particle_sets_load(real_data):
    for name, n, box, pix in [("relion31/relion31.star", 5, 256, 2.806),
                              ("relion30_empiar10076/empiar_10076_7.star", 7, 320, 1.31),
                              ("relion30_80s_subset/sample_particles_relion30.star", 17, 200, 1.338)]:
        parts = load_particles(real_data / name)
        assert len(parts) == n
        box_px, pixel = parts.geometry()
        assert box_px == box and pixel == pytest.approx(pix, abs=1e-3)
        with StackReader() as reader:
            images = parts.read_images(np.arange(n), reader)
        assert images.shape == (n, box, box) and np.isfinite(images).all() and images.std() > 0


def test_half_sets_ignore_a_subset_column_that_does_not_split(tmp_path):
    path, _ = make_particle_set(tmp_path, n=10)
    parts = load_particles(path)
    parts.random_subset = np.ones(10, np.int64)  # all in half 1, as in some real files
    halves = parts.half_sets(seed=1)
    assert set(halves) == {1, 2}


def test_preread_images_read_like_the_stacks(tmp_path):
    star, images = make_particle_set(tmp_path, n=9)
    particles = load_particles(star)
    preread = particles.image_reader(np.arange(2, 9))  # --preread_images: a share of the particles in memory
    assert preread.nbytes == 7 * images[0].nbytes
    assert particles.image_reader() is preread  # kept for the following iterations
    batch = np.array([8, 3, 5])
    np.testing.assert_array_equal(particles.read_images(batch, preread), images[batch])
    with StackReader() as reader:
        np.testing.assert_array_equal(particles.read_images(batch, reader), particles.read_images(batch, preread))


def test_preread_images_that_would_not_fit_the_memory_are_read_from_the_stacks_with_a_warning(tmp_path, monkeypatch,
                                                                                               caplog):
    """--preread_images where the images take more than the machine's available memory allows: one warning with the
    sizes, and every batch read from the stacks (the run goes on as without the option)."""
    from cryorefine import data
    from cryorefine.core import arrays

    star, images = make_particle_set(tmp_path, n=9)
    particles = load_particles(star)
    need = 9 * images[0].nbytes
    share = data.PREREAD_SHARE_OF_AVAILABLE_MEMORY
    monkeypatch.setattr(arrays, "available_memory_bytes", lambda: int(need / share) - 1)
    with caplog.at_level("WARNING", logger="cryorefine"):
        reader = particles.image_reader(np.arange(9))
        assert isinstance(reader, StackReader)
        assert isinstance(particles.image_reader(np.arange(9)), StackReader)  # asked again: no second warning
    warnings = [r.getMessage() for r in caplog.records if "--preread_images" in r.getMessage()]
    assert len(warnings) == 1 and "9 images" in warnings[0], warnings
    np.testing.assert_array_equal(particles.read_images(np.array([8, 3]), reader), images[[8, 3]])
    room = load_particles(star)  # just enough memory: held
    monkeypatch.setattr(arrays, "available_memory_bytes", lambda: int(need / share) + 1)
    assert room.image_reader(np.arange(9)).nbytes == need
    shared = load_particles(star)  # the same memory for two MPI workers of one node, each holding its own: not held
    caplog.clear()
    with caplog.at_level("WARNING", logger="cryorefine"):
        assert isinstance(shared.image_reader(np.arange(9), sharers=2), StackReader)
    assert any("each of this node's 2 workers" in r.getMessage() for r in caplog.records)


def test_read_ahead_yields_every_batch_with_its_own_images(tmp_path):
    from conftest import make_particle_set

    from cryorefine.data import load_particles
    from cryorefine.io import mrc

    star, images = make_particle_set(tmp_path, n=11, box=8)
    particles = load_particles(star)
    batches = list(particles.batches(4, np.arange(10, -1, -1)))
    with mrc.StackReader() as reader:  # a batch's images are valid until the next batch is asked for: copied
        got = [(indices, read.copy()) for indices, read in particles.read_ahead(batches, reader)]
    assert [list(i) for i, _ in got] == [list(b) for b in batches]
    for indices, read in got:
        np.testing.assert_array_equal(read, images[indices])



class CountingReader:
    """A StackReader that counts the images read through it."""

    def __init__(self, reader):
        self.reader, self.images_read = reader, 0

    def wire_dtype(self, paths):
        return self.reader.wire_dtype(paths)

    def read(self, paths, indices, **kwargs):
        self.images_read += len(indices)
        return self.reader.read(paths, indices, **kwargs)


def read_through(particles, batches, reader, kept, xp=np):
    """(indices, a host copy of the images) of each batch read_ahead yields with `kept`."""
    to_host = (lambda a: np.asarray(a)) if xp is np else xp.asnumpy
    return [(indices, to_host(xp.asarray(read)).copy())
            for indices, read in particles.read_ahead(iter(batches), reader, xp, kept=kept)]


def test_kept_images_are_read_once_and_then_come_from_where_they_are_kept(tmp_path):
    """Batches of owned particles are kept while there is room for the whole batch; a batch all held is not read
    again, whether cut as when it was kept (a view of its slots) or otherwise (gathered); a batch with a particle
    not owned, or one too many for the room left, is read each time."""
    from cryorefine.data import KeptImages

    star, images = make_particle_set(tmp_path, n=11, box=8)
    particles = load_particles(star)
    kept = KeptImages(owned=np.arange(9), n_particles=11, capacity=7, image_shape=(8, 8), dtype=np.float32)
    batches = [np.arange(0, 3), np.arange(3, 6), np.arange(6, 9), np.array([8, 9, 10])]
    with StackReader() as stacks:
        reader = CountingReader(stacks)
        first = read_through(particles, batches, reader, kept)
        assert reader.images_read == 12 and kept.filled == 6  # 0-5 kept; 6-8 not (room for 1), 8-10 not owned
        assert kept.holds([5, 0]) and not kept.holds([5, 6])
        again = read_through(particles, batches + [np.array([4, 1, 2])], reader, kept)
        assert reader.images_read == 12 + 6  # the last two batches only
    for indices, read in first + again:
        np.testing.assert_array_equal(read, images[indices])
    assert np.shares_memory(kept.take(np.arange(3, 6)), kept.images)  # a view
    assert not np.shares_memory(kept.take(np.array([4, 1, 2])), kept.images)  # gathered
    kept.own(np.arange(9))  # the same share: kept as they are
    assert kept.filled == 6 and kept.holds(np.arange(6))
    kept.own(np.arange(3, 11))  # another share (an MPI worker's after its first E-step's): kept again from now on
    assert kept.filled == 0 and not kept.holds([3])
    with StackReader() as stacks:
        reader = CountingReader(stacks)
        read_through(particles, batches, reader, kept)
        assert reader.images_read == 12 and kept.holds(np.arange(3, 9)) and not kept.holds([0])


def test_read_ahead_leaves_kept_images_of_another_dtype_alone(tmp_path):
    """Images kept in another dtype than the stacks are read in (float16 slots, float32 images on the host) are
    neither filled nor taken: every batch is read."""
    from cryorefine.data import KeptImages

    star, images = make_particle_set(tmp_path, n=6, box=8)
    particles = load_particles(star)
    kept = KeptImages(np.arange(6), 6, 6, (8, 8), np.float16)
    with StackReader() as stacks:
        reader = CountingReader(stacks)
        for _ in range(2):
            got = read_through(particles, [np.arange(3), np.arange(3, 6)], reader, kept)
    assert reader.images_read == 12 and kept.filled == 0
    for indices, read in got:
        np.testing.assert_array_equal(read, images[indices])


@pytest.mark.gpu
def test_kept_images_on_the_device_are_uploaded_once(tmp_path):
    """On the GPU, with the slots in the arena's run scope as a runner makes them: the first iteration reads every
    batch, uploads it through the upload slots and keeps it; the second reads none and yields the same images, on
    the device."""
    from conftest import cupy_or_skip

    from cryorefine.data import KeptImages
    from cryorefine.estep.backend import CudaBackend

    cp = cupy_or_skip()
    star, images = make_particle_set(tmp_path, n=11, box=64)
    particles = load_particles(star)
    batches = [np.arange(0, 4), np.arange(4, 8), np.arange(8, 11)]
    backend = CudaBackend(0, free_gpu_memory_mb=(cp.cuda.runtime.memGetInfo()[0] - (256 << 20)) / 2 ** 20)
    with backend.run_scope(), StackReader() as stacks:
        kept = KeptImages(np.arange(11), 11, 11, (64, 64), np.float32, cp)
        reader = CountingReader(stacks)
        for images_read in (11, 11):
            with backend.iteration_scope():
                seen = []
                for indices, read in particles.read_ahead(iter(batches), reader, cp, device_bytes=1 << 30,
                                                          kept=kept):
                    assert isinstance(read, cp.ndarray)
                    seen.append((indices, cp.asnumpy(read)))
            assert reader.images_read == images_read
            for indices, read in seen:
                np.testing.assert_array_equal(read, images[indices])
        del kept


@pytest.mark.gpu
def test_read_ahead_uploads_on_its_thread_into_slots_the_caller_has_let_go(tmp_path):
    """With room for the device slots, batches come on the device, each with its own images,
    although the caller overwrites every batch's images on the device (queued GPU work) before asking for the
    next: an upload into a slot waits for the caller's work on it. A batch larger than the first comes on the
    host; without room, every batch does."""
    from conftest import cupy_or_skip, make_particle_set

    from cryorefine.data import load_particles
    from cryorefine.io import mrc

    cp = cupy_or_skip()
    star, images = make_particle_set(tmp_path, n=11, box=64)
    particles = load_particles(star)
    batches = [np.arange(0, 4), np.arange(4, 8), np.arange(8, 11), np.arange(0, 5), np.arange(7, 11),
               np.arange(3, 7), np.arange(1, 5)]
    for room, on_device in ((1 << 30, [True, True, True, False, True, True, True]), (0, [False] * 7)):
        seen = []
        with mrc.StackReader() as reader:
            for indices, read in particles.read_ahead(iter(batches), reader, cp, device_bytes=room):
                seen.append(isinstance(read, cp.ndarray))
                np.testing.assert_array_equal(cp.asnumpy(cp.asarray(read)), images[indices])
                if seen[-1]:
                    for _ in range(20):  # queued work that writes the slot well after the reading thread moved on
                        read *= 1.0001
                    read[...] = -1.0
        assert seen == on_device, (room, seen)


def test_scratch_copy_reads_the_same_images_from_copies_and_removes_them(tmp_path):
    import logging

    from cryorefine.data import scratch_copy

    star, images = make_particle_set(tmp_path / "project", n=5, box=16)
    particles = load_particles(star)
    scratch = tmp_path / "scratch"
    with scratch_copy(particles, scratch, logging.getLogger("test")) as staged:
        copies = set(staged.stack_paths.tolist())
        assert all(Path(c).parent.parent == scratch and Path(c).is_file() for c in copies)
        with StackReader() as reader:
            np.testing.assert_array_equal(staged.read_images(np.arange(5), reader), images)
    assert list(scratch.iterdir()) == []  # removed at the end
    assert all(Path(p).parent == tmp_path / "project" for p in particles.stack_paths.tolist())


def test_refine_with_a_scratch_dir_gives_the_same_map(tmp_path):
    from conftest import run_cli

    from cryorefine.io.mrc import read_volume

    star, _ = make_particle_set(tmp_path, n=6, box=16, pixel_size=4.0, seed=5)
    write_mrc(tmp_path / "ref.mrc", np.random.default_rng(6).normal(size=(16, 16, 16)).astype(np.float32),
              pixel_size=4.0, stack=False)
    args = ["refine", "--i", star, "--ref", tmp_path / "ref.mrc", "--particle_diameter", 40, "--cpu", "--iter", 1]
    assert run_cli(*args, "--o", tmp_path / "a" / "run") == 0
    assert run_cli(*args, "--o", tmp_path / "b" / "run", "--scratch_dir", tmp_path / "scratch") == 0
    for half in (1, 2):
        name = f"run_it001_half{half}_class001.mrc"
        np.testing.assert_array_equal(read_volume(tmp_path / "a" / name)[0], read_volume(tmp_path / "b" / name)[0])
    assert list((tmp_path / "scratch").iterdir()) == []


def test_float16_stacks_can_be_read_as_they_are_stored(tmp_path):
    """Mode-12 stacks: read as float16 (the GPU's read-ahead uploads those bytes and converts on the device), the
    preread copy stays float16, and float32 reads of either give the same values; a set with any float32 stack
    travels as float32."""
    star, images = make_particle_set(tmp_path, n=9, box=8)
    half = images.astype(np.float16)
    write_mrc(tmp_path / "stack.mrcs", half)  # the same file, now MRC mode 12
    write_mrc(tmp_path / "other.mrcs", images)
    particles = load_particles(star)
    batch = np.array([7, 2, 3, 4])
    with StackReader() as reader:
        assert reader.wire_dtype(particles.stack_paths) == np.float16
        assert reader.wire_dtype([*particles.stack_paths, str(tmp_path / "other.mrcs")]) == np.float32
        raw = particles.read_images(batch, reader, dtype=np.float16)
        assert raw.dtype == np.float16
        np.testing.assert_array_equal(raw, half[batch])
        buffer = np.full((6, 8, 8), np.nan, np.float16)
        np.testing.assert_array_equal(particles.read_images(batch, reader, out=buffer), half[batch])
        wide = particles.read_images(batch, reader)
        assert wide.dtype == np.float32
        np.testing.assert_array_equal(wide, half[batch].astype(np.float32))
    preread = particles.image_reader(np.arange(9))
    assert preread.nbytes == half.nbytes and preread.wire_dtype(particles.stack_paths) == np.float16
    np.testing.assert_array_equal(particles.read_images(batch, preread), wide)
    np.testing.assert_array_equal(particles.read_images(batch, preread, out=np.zeros((5, 8, 8), np.float32)), wide)
