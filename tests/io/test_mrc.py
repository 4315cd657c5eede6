import os
from pathlib import Path

import mrcfile
import numpy as np
import pytest
from conftest import write_mrc

from cryorefine.errors import InputError
from cryorefine.io import mrc


@pytest.mark.parametrize("dtype,mode", [(np.int8, 0), (np.int16, 1), (np.float32, 2), (np.uint16, 6), (np.float16, 12)])
def test_modes_read_as_float32(tmp_path, dtype, mode):
    data = (np.arange(5 * 4 * 4) % 50).reshape(5, 4, 4).astype(dtype)
    write_mrc(tmp_path / "s.mrcs", data)
    with mrcfile.open(tmp_path / "s.mrcs") as m:
        assert int(m.header.mode) == mode
    with mrc.StackReader() as reader:
        images = reader.read([str(tmp_path / "s.mrcs")] * 2, [5, 2])
    assert images.dtype == np.float32
    np.testing.assert_array_equal(images, data[[4, 1]].astype(np.float32))


def test_reader_keeps_request_order_across_stacks(tmp_path):
    a = np.random.default_rng(1).normal(size=(4, 8, 8)).astype(np.float32)
    b = np.random.default_rng(2).normal(size=(3, 8, 8)).astype(np.float32)
    write_mrc(tmp_path / "a.mrcs", a)
    write_mrc(tmp_path / "b.mrcs", b)
    paths = [str(tmp_path / n) for n in ("b.mrcs", "a.mrcs", "b.mrcs", "a.mrcs")]
    with mrc.StackReader() as reader:
        got = reader.read(paths, [3, 4, 1, 1])
    np.testing.assert_array_equal(got, np.stack([b[2], a[3], b[0], a[0]]))


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("byte_order", ["<", ">"])
def test_runs_of_images_read_into_a_given_buffer_match_the_stack(tmp_path, monkeypatch, byte_order, threads):
    """Consecutive images are read as blocks (preadv for native float32, memory-map slices otherwise); with threads,
    a batch's blocks are cut and shared out among them (every batch here, however small)."""
    monkeypatch.setattr(mrc, "PARALLEL_READ_BYTES", 0)
    rng = np.random.default_rng(3)
    a = rng.normal(size=(40, 12, 12)).astype(f"{byte_order}f4")
    b = rng.normal(size=(9, 12, 12)).astype(f"{byte_order}f4")
    with mrcfile.new(tmp_path / "a.mrcs") as m:
        m.set_extended_header(np.zeros(7, dtype=[("x", "i4")]))  # the data start after 1024 + 28 bytes
        m.set_data(a)
    write_mrc(tmp_path / "b.mrcs", b)
    # runs, a gap, a reversed stretch, a repeat and the other stack in between
    want = [("a", i) for i in range(1, 11)] + [("b", 4), ("b", 5)] + [("a", i) for i in (20, 21, 22, 30, 29, 28, 28)]
    want += [("b", i) for i in range(1, 10)] + [("a", 40)]
    paths = [str(tmp_path / f"{name}.mrcs") for name, _ in want]
    indices = [i for _, i in want]
    expected = np.stack([(a if name == "a" else b)[i - 1] for name, i in want]).astype(np.float32)
    buffer = np.full((len(want) + 5, 12, 12), -7.0, np.float32)
    with mrc.StackReader(threads=threads) as reader:
        got = reader.read(paths, indices, out=buffer)
        again = reader.read(paths[::-1], indices[::-1])
        raw_reads = dict(reader._verified)  # stacks read with preadv, and whether the check against the map held
    assert raw_reads == ({paths[0]: True, str(tmp_path / "b.mrcs"): True} if byte_order == "<" else {})
    assert np.shares_memory(got, buffer) and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(again, expected[::-1])
    assert np.all(buffer[len(want):] == -7.0)


def test_threads_read_random_batches_as_one_thread_does(tmp_path, monkeypatch):
    """Batches of random images, consecutive stretches and single images, some twice, read by 4 threads (each batch
    cut in pieces that split long runs and group short ones): the images asked for, in the order asked."""
    monkeypatch.setattr(mrc, "PARALLEL_READ_BYTES", 0)
    rng = np.random.default_rng(5)
    stack = rng.normal(size=(97, 6, 6)).astype(np.float32)
    write_mrc(tmp_path / "s.mrcs", stack)
    with mrc.StackReader(threads=4) as reader:
        for size in (1, 2, 5, 13, 40, 97):
            for _ in range(5):
                if rng.random() < 0.5:
                    start = int(rng.integers(0, 98 - size))
                    rows = np.arange(start, start + size)
                else:
                    rows = np.sort(rng.choice(97, size, replace=True))
                got = reader.read([str(tmp_path / "s.mrcs")] * size, rows + 1)
                np.testing.assert_array_equal(got, stack[rows])


def test_index_beyond_stack(tmp_path):
    write_mrc(tmp_path / "s.mrcs", np.zeros((3, 8, 8), np.float32))
    with mrc.StackReader() as reader, pytest.raises(InputError, match=r"4@.*beyond the stack, which holds 3"):
        reader.read([str(tmp_path / "s.mrcs")], [4])


def test_nan_pixels_named(tmp_path):
    data = np.zeros((3, 8, 8), np.float32)
    data[1, 2, 3] = np.nan
    write_mrc(tmp_path / "s.mrcs", data)
    with mrc.StackReader() as reader, pytest.raises(InputError, match=r"2@.*NaN or Inf"):
        reader.read([str(tmp_path / "s.mrcs")] * 3, [1, 2, 3])


def test_truncated_and_garbage_files(tmp_path):
    write_mrc(tmp_path / "s.mrcs", np.ones((5, 16, 16), np.float32))
    raw = (tmp_path / "s.mrcs").read_bytes()
    (tmp_path / "t.mrcs").write_bytes(raw[:-300])
    with pytest.raises(InputError, match="truncated"):
        mrc.open_mrc(tmp_path / "t.mrcs")
    (tmp_path / "g.mrc").write_bytes(b"not an mrc")
    with pytest.raises(InputError, match="not a readable MRC"):
        mrc.open_mrc(tmp_path / "g.mrc")
    with pytest.raises(InputError, match="file not found"):
        mrc.open_mrc(tmp_path / "missing.mrc")


def test_volume_round_trip_has_pixel_size_and_stats(tmp_path):
    vol = np.random.default_rng(0).normal(size=(12, 12, 12)).astype(np.float32)
    mrc.write_volume(tmp_path / "v.mrc", vol, 2.5)
    with mrcfile.open(tmp_path / "v.mrc") as m:  # strict mode: the header is valid
        assert m.voxel_size.x == pytest.approx(2.5)
        assert m.header.dmin == pytest.approx(vol.min())
        assert m.header.dmax == pytest.approx(vol.max())
        assert m.header.dmean == pytest.approx(vol.mean(), abs=1e-6)
        assert m.header.rms == pytest.approx(vol.std(), rel=1e-5)
    assert mrcfile.validate(str(tmp_path / "v.mrc"), print_file=open("/dev/null", "w"))
    back, pixel = mrc.read_volume(tmp_path / "v.mrc")
    np.testing.assert_array_equal(back, vol)
    assert pixel == pytest.approx(2.5)


def test_non_cubic_reference(tmp_path):
    mrc.write_volume(tmp_path / "v.mrc", np.zeros((10, 12, 12), np.float32), 1.0)
    with pytest.raises(InputError, match="not cubic"):
        mrc.read_volume(tmp_path / "v.mrc")


def test_placeholder_pixel_sizes_not_trusted(tmp_path):
    for value in (0.0, 1.0):
        write_mrc(tmp_path / "s.mrcs", np.zeros((2, 4, 4), np.float32), pixel_size=value)
        assert mrc.mrc_info(tmp_path / "s.mrcs").header_pixel_size_angstrom is None


def test_real_zeroed_header_reference_opens(real_data):
    vol, pixel = mrc.read_volume(real_data / "relion_outputs/ref_model.mrc")
    assert vol.shape == (100, 100, 100)
    assert pixel == pytest.approx(3.54)
    assert vol.std() > 0


def test_real_stacks_without_map_id_open(real_data):
    info = mrc.mrc_info(real_data / "relion31/relion31.mrcs")
    assert info.shape == (5, 256, 256)
    assert info.header_pixel_size_angstrom is None  # placeholder 1.0


def test_image_name_parsing():
    assert mrc.parse_image_name("000012@Extract/job1/a.mrcs") == (12, "Extract/job1/a.mrcs")
    assert mrc.parse_image_name("a.mrc") == (1, "a.mrc")
    with pytest.raises(InputError, match="not an image number"):
        mrc.parse_image_name("x@a.mrcs")
    with pytest.raises(InputError, match="count from 1"):
        mrc.parse_image_name("0@a.mrcs")


def test_stack_path_resolution_prefers_project_directory(tmp_path, monkeypatch):
    project = tmp_path / "project"
    (project / "Extract").mkdir(parents=True)
    (project / "Refine" / "Extract").mkdir(parents=True)
    write_mrc(project / "Extract" / "a.mrcs", np.zeros((1, 4, 4), np.float32))
    write_mrc(project / "Refine" / "Extract" / "a.mrcs", np.ones((1, 4, 4), np.float32))
    monkeypatch.chdir(project)
    assert mrc.resolve_stack_path("Extract/a.mrcs", project / "Refine") == mrc.Path("Extract/a.mrcs")
    monkeypatch.chdir(tmp_path)
    assert mrc.resolve_stack_path("Extract/a.mrcs", project / "Refine") == project / "Refine" / "Extract" / "a.mrcs"


def test_written_files_do_not_depend_on_the_time(tmp_path, monkeypatch):
    import datetime

    import mrcfile.mrcobject

    class LaterClock(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime.datetime(2031, 1, 2, 3, 4, 5)

    vol = np.random.default_rng(3).normal(size=(6, 6, 6)).astype(np.float32)
    mrc.write_volume(tmp_path / "a.mrc", vol, 1.5)
    monkeypatch.setattr(mrcfile.mrcobject, "datetime", LaterClock)  # the clock mrcfile stamps labels with
    mrc.write_volume(tmp_path / "b.mrc", vol, 1.5)
    assert (tmp_path / "a.mrc").read_bytes() == (tmp_path / "b.mrc").read_bytes()
    with mrcfile.open(tmp_path / "a.mrc") as m:
        assert m.header.nlabl == 1 and m.header.label[0].startswith(b"cryorefine")


def test_preread_images_copy_random_batches_in_parts(tmp_path, monkeypatch):
    """--preread_images: batches of the held images in any order, some twice, copied into a buffer by 3 threads
    (runs of consecutive held images as blocks): the images asked for, in the order asked."""
    monkeypatch.setattr(mrc, "PARALLEL_READ_BYTES", 0)
    monkeypatch.setattr(mrc, "READ_THREADS", 3)
    rng = np.random.default_rng(6)
    stack = rng.normal(size=(50, 6, 6)).astype(np.float32)
    write_mrc(tmp_path / "s.mrcs", stack)
    path = str(tmp_path / "s.mrcs")
    held = np.r_[np.arange(10, 30), rng.permutation(10)]  # a stretch of the stack, then some in no order
    with mrc.PrereadImages([path] * held.size, held + 1) as reader:
        for size in (1, 3, 17, held.size):
            for _ in range(5):
                pick = np.sort(rng.choice(held.size, size)) if rng.random() < 0.5 else rng.choice(held.size, size)
                out = np.full((size + 2, 6, 6), np.nan, np.float32)
                got = reader.read([path] * size, held[pick] + 1, out=out)
                assert np.shares_memory(got, out)
                np.testing.assert_array_equal(got, stack[held[pick]])


def test_preread_images_read_the_images_they_do_not_hold_from_their_stacks(tmp_path):
    """Under MPI a worker holds its own share and may take over a batch of another's: a batch of held images, of
    images not held, and of both mixed, in any order, is the stack's images (held ones copied, the others read)."""
    rng = np.random.default_rng(8)
    stack = rng.normal(size=(30, 6, 6)).astype(np.float32)
    write_mrc(tmp_path / "s.mrcs", stack)
    path = str(tmp_path / "s.mrcs")
    held = np.arange(5, 15)
    with mrc.PrereadImages([path] * held.size, held + 1) as reader:
        for pick in (np.arange(5, 9), np.arange(20, 26), np.array([3, 7, 21, 6, 29, 5]), rng.permutation(30)):
            out = np.full((pick.size, 6, 6), np.nan, np.float32)
            got = reader.read([path] * pick.size, pick + 1, out=out)
            np.testing.assert_array_equal(got, stack[pick])
        np.testing.assert_array_equal(reader.read([path] * 3, np.array([1, 2, 6])), stack[[0, 1, 5]])


def test_preread_images_ask_the_system_for_the_bytes_of_the_images_held(tmp_path, monkeypatch):
    """--preread_images asks the system to read in exactly the held images' bytes of each stack (one request per
    run of consecutive images), and reads every image through the stacks: a stack changed after the request is
    read as it is now (the images live in the host's file cache, not in a copy of the process)."""
    asked = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: asked.append(
        (os.readlink(f"/proc/self/fd/{fd}"), offset, length, advice)), raising=False)
    rng = np.random.default_rng(9)
    stacks = [rng.normal(size=(12, 6, 6)).astype(np.float32) for _ in range(2)]
    for k, stack in enumerate(stacks):
        write_mrc(tmp_path / f"s{k}.mrcs", stack)
    paths = [str(tmp_path / "s0.mrcs")] * 5 + [str(tmp_path / "s1.mrcs")] * 3
    held = np.array([2, 3, 4, 8, 9, 0, 1, 11])  # s0: runs 2-4 and 8-9; s1: 0-1 and 11
    reader = mrc.PrereadImages(paths, held + 1)
    assert reader.nbytes == 8 * 6 * 6 * 4
    assert reader.advised_bytes == sum(length for _, _, length, _ in asked) == reader.nbytes
    assert all(advice == os.POSIX_FADV_WILLNEED for *_, advice in asked)
    for path, offset, length, _ in asked:
        k = int(Path(path).stem[1:])
        raw = (tmp_path / f"s{k}.mrcs").read_bytes()[offset:offset + length]
        got = np.frombuffer(raw, np.float32).reshape(-1, 6, 6)
        first = [i for i in range(12) if np.array_equal(stacks[k][i], got[0])]
        assert len(first) == 1 and np.array_equal(stacks[k][first[0]:first[0] + len(got)], got)
    assert sorted(length // (6 * 6 * 4) for *_, length, _ in asked) == [1, 2, 2, 3]  # images per run
    with reader:
        np.testing.assert_array_equal(reader.read(paths[:2], held[:2] + 1), stacks[0][[2, 3]])
    write_mrc(tmp_path / "s0.mrcs", stacks[0] + 100.0)
    with reader:  # the next iteration
        np.testing.assert_array_equal(reader.read(paths[:2], held[:2] + 1), stacks[0][[2, 3]] + 100.0)


def test_preread_images_take_no_memory_of_the_process(tmp_path):
    """--preread_images keeps no copy of the images in the process (the host's file cache holds them, once for
    all its processes): making the reader takes a small part of the images' bytes, and its reads are the stacks'
    images."""
    import tracemalloc

    rng = np.random.default_rng(4)
    stacks = [rng.normal(size=(40, 32, 32)).astype(np.float32) for _ in range(2)]
    for k, stack in enumerate(stacks):
        write_mrc(tmp_path / f"s{k}.mrcs", stack)
    paths = [str(tmp_path / f"s{k}.mrcs") for k in (0, 1) for _ in range(40)]
    indices = np.r_[np.arange(40), np.arange(40)] + 1
    assert mrc.PrereadImages.held_bytes(paths) == 80 * 32 * 32 * 4
    tracemalloc.start()
    try:
        preread = mrc.PrereadImages(paths, indices)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert preread.nbytes == 80 * 32 * 32 * 4
    assert peak < 0.25 * preread.nbytes, (peak, preread.nbytes)  # a copy of its own: 1.0 or more
    with preread:
        np.testing.assert_array_equal(preread.read(paths, indices), np.concatenate(stacks))


def test_a_stack_of_another_box_read_into_a_buffer_is_named(tmp_path):
    """A batch whose second stack has another box, read into a buffer sized from the first (read ahead, or
    --preread_images): one InputError naming that stack, not an internal error."""
    write_mrc(tmp_path / "a.mrcs", np.zeros((3, 8, 8), np.float32))
    write_mrc(tmp_path / "b.mrcs", np.zeros((3, 10, 10), np.float32))
    out = np.empty((4, 8, 8), np.float32)
    with mrc.StackReader() as reader:
        with pytest.raises(InputError, match="b.mrcs.*10×10 px.*8×8 px"):
            reader.read([str(tmp_path / "a.mrcs")] * 2 + [str(tmp_path / "b.mrcs")] * 2, [1, 2, 1, 2], out=out)
        with pytest.raises(InputError, match="b.mrcs.*10×10 px"):
            reader.read([str(tmp_path / "b.mrcs")], [1], out=out)
