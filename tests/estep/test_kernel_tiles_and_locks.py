"""How the fine kernels tile a block's children, how the local search's coarse kernel tiles each particle's own
orientations, and how `kernel_module` serialises compilations (`estep.kernels`);
no GPU needed: the loader runs against a stand-in for CuPy."""

import re
import sys
import threading
import types

import pytest

from cryorefine.estep import kernels


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_the_tiles_cover_every_child_of_a_block_once_and_stay_small(k):
    nfo, nft = 8 ** k, 4 ** k
    to, tt = kernels.fine_tile(nfo, nft)
    assert nfo % to == 0 and nft % tt == 0
    assert to * tt <= kernels.FINE_TILE_CHILDREN and tt <= kernels.FINE_TILE_TRANSLATIONS
    assert kernels.fine_tiles(nfo, nft) * to * tt == nfo * nft
    if k <= 1:  # oversampling 0 and 1: the whole block in one tile, as before tiling
        assert (to, tt) == (nfo, nft)
    names = kernels.fine_kernel_names(nfo, nft)
    assert all(f"<{nfo}, {nft}, {to}, {tt}" in n for n in names[:3])
    # at oversampling 2 (64 × 16 children) also the likelihood's diff2 on tensor cores
    assert names[3:] == ((f"fine_diff2_tc<{nfo}, {nft}>",) if k == 2 else ())
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("nfo,nft,do_cc,capability,want", [
    (64, 16, False, 90, ("fine_diff2_tc<64, 16>", 1)),
    (64, 16, False, "80", ("fine_diff2_tc<64, 16>", 1)),  # CuPy gives the capability as a string
    (512, 64, False, 90, ("fine_diff2<512, 64, 4, 16, false>", 512)),  # several row tiles: not yet
    (64, 16, True, 90, ("fine_diff2<64, 16, 4, 16, true>", 16)),  # cross-correlation: fine.cu's
    (64, 16, False, 75, ("fine_diff2<64, 16, 4, 16, false>", 16)),  # no TF32 before 8.0
    (8, 4, False, 90, ("fine_diff2<8, 4, 8, 4, false>", 1)),  # oversampling 1: the products too small
    (4, 16, False, 90, ("fine_diff2<4, 16, 4, 16, false>", 1)),  # 2D references at oversampling 2
])
def test_the_fine_diff2_kernel_and_grid_follow_the_children_the_score_and_the_device(nfo, nft, do_cc, capability,
                                                                                   want):
    """fine_diff2_launch names one of the instances `fine_kernel_names` compiles, and its grid's second size covers
    the block's children: the tensor-core kernel takes 64 orientations and every translation a CUDA block, and groups
    blocks (as many as FINE_TC_GROUP_ROWS translations hold); fine.cu's kernel one block a CUDA block."""
    name, tiles, group_blocks = kernels.fine_diff2_launch(nfo, nft, do_cc, capability)
    assert (name, tiles) == want
    assert name in kernels.fine_kernel_names(nfo, nft)
    if name.startswith("fine_diff2_tc"):
        assert group_blocks >= 1 and group_blocks * nft <= max(kernels.FINE_TC_GROUP_ROWS, nft)
    else:
        assert group_blocks == 0


@pytest.mark.parametrize("keys,group_blocks", [([], 4), ([7], 4), ([3, 3, 3, 3, 3, 3, 3, 3, 3], 4),
                                               ([5, 1, 5, 2, 1, 5, 5, 5, 9, 1], 2), ([4, 2, 4, 2, 4], 1)])
def test_fine_groups_hold_blocks_of_one_key_at_most_the_group_size(keys, group_blocks):
    """Every block is in exactly one group; a group's blocks share their key; no group is larger than asked; and
    the blocks of a key fill as few groups as the size allows."""
    import numpy as np

    keys = np.asarray(keys, dtype=np.int64)
    order, first = kernels.fine_groups(keys, group_blocks)
    assert first.dtype == np.int32 and first[0] == 0 and first[-1] == keys.size
    assert sorted(order.tolist()) == list(range(keys.size))
    sizes = np.diff(first)
    assert np.all((sizes >= 1) & (sizes <= group_blocks))
    groups = [keys[order[a:b]] for a, b in zip(first[:-1], first[1:])]
    assert all(np.all(g == g[0]) for g in groups)
    for key in np.unique(keys):
        assert sum(1 for g in groups if g[0] == key) == -(-int(np.sum(keys == key)) // group_blocks)


@pytest.mark.parametrize("counts,tile", [([1, 64, 65, 128, 130, 0, 3], 64), ([198, 162, 177], 64), ([31, 32, 33], 32)])
def test_a_particle_has_the_tiles_its_own_orientations_need(counts, tile):
    """Each orientation r < count of particle b lies in exactly one of b's tiles, and a particle has no tile beyond
    the one that holds its last orientation (a narrow neighbourhood is not padded to the widest)."""
    import numpy as np

    particle, first, count_arg = kernels.local_tiles(counts, tile)
    assert particle.dtype == first.dtype == count_arg.dtype == np.int32
    assert count_arg.tolist() == list(counts)
    for b, count in enumerate(counts):
        starts = first[particle == b]
        covered = np.concatenate([np.arange(f, f + tile) for f in starts]) if starts.size else np.zeros(0, int)
        assert sorted(covered[covered < count].tolist()) == list(range(count))
        assert starts.size == -(-count // tile)
    assert np.all(np.diff(particle) >= 0)


def _fake_cupy(monkeypatch, slow_key, release):
    """A CuPy whose RawModule blocks on `release` while compiling `slow_key`'s name expressions."""
    compiled = []

    class RawModule:
        def __init__(self, code, options, name_expressions):
            if tuple(name_expressions) == slow_key:
                assert release.wait(10)
            compiled.append(tuple(name_expressions))

        def get_function(self, name):
            return name

    class Device:
        compute_capability = "80"

        def __init__(self, i):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    cupy = types.SimpleNamespace(RawModule=RawModule, cuda=types.SimpleNamespace(Device=Device))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(kernels, "_modules", {})
    monkeypatch.setattr(kernels, "_key_locks", {})
    return compiled


def test_a_long_compilation_does_not_hold_up_other_kernels_and_runs_once(monkeypatch):
    slow = kernels.fine_kernel_names(64, 16)
    release = threading.Event()
    compiled = _fake_cupy(monkeypatch, slow, release)
    waiting = [threading.Thread(target=kernels.kernel_module, args=(slow, 0)) for _ in range(2)]
    for t in waiting:
        t.start()
    # while the slow module compiles, another set of kernels loads at once
    assert kernels.kernel_module(kernels.fine_kernel_names(8, 4), 0) == kernels.kernel_module(
        kernels.fine_kernel_names(8, 4), 0)
    assert compiled == [kernels.fine_kernel_names(8, 4)]
    assert all(t.is_alive() for t in waiting)
    release.set()
    for t in waiting:
        t.join(10)
    assert compiled.count(slow) == 1  # two threads asked, one compiled
    assert kernels.kernel_module(slow, 0) is kernels.kernel_module(list(slow), 0)
    assert compiled.count(slow) == 1


def test_the_coarse_product_runs_on_tensor_cores_only_where_tf32_exists():
    """coarse_diff2_tf32 needs TF32 (compute capability 8.0); older GPUs get the FP32 kernel, whose source is the
    same module's. coarse_diff2_wgmma needs sm_90a, which 9.0 alone has: only there is the module compiled for it,
    and only there does the kernel take dynamic shared memory."""
    assert kernels.coarse_kernel_name("70") == kernels.coarse_kernel_name("75") == "coarse_diff2"
    assert kernels.coarse_kernel_name("80") == kernels.coarse_kernel_name("89") == "coarse_diff2_tf32"
    assert kernels.coarse_kernel_name("100") == kernels.coarse_kernel_name("120") == "coarse_diff2_tf32"
    assert kernels.coarse_kernel_name("90") == "coarse_diff2_wgmma"
    assert set(kernels.COARSE_KERNELS) == {"coarse_diff2", "coarse_diff2_tf32", "coarse_diff2_wgmma"}
    assert "-arch=sm_90a" in kernels.compile_options("90")
    assert not any(o.startswith("-arch") for c in ("80", "89", "100") for o in kernels.compile_options(c))
    assert kernels.coarse_shared_bytes("coarse_diff2_wgmma") > 48 * 1024
    assert kernels.coarse_shared_bytes("coarse_diff2_tf32") == kernels.coarse_shared_bytes("coarse_diff2") == 0
    source = kernels.kernel_source()
    for name in kernels.COARSE_KERNELS:  # each an entry point of the module
        assert re.search(rf'extern "C" __global__[^(]*\(\d+, \d+\)\s+{name}\(', source), name


def _fake_hopper_cupy(monkeypatch, capability, takes_sm90a, accepts_sm90a=True):
    """A CuPy on one device of `capability` whose compiler refuses -arch=sm_90a (CompileException) unless
    `accepts_sm90a`, and, accepting it, builds the code for it (cr_wgmma_compiled 1) only if `takes_sm90a`."""
    import numpy as np

    builds, functions = [], {}

    class CompileException(Exception):
        pass

    class Function:
        max_dynamic_shared_size_bytes = 0

    class RawModule:
        def __init__(self, code, options, name_expressions):
            self.sm90a = "-arch=sm_90a" in options
            self.options = options

        def get_function(self, name):
            if name == "segment_reduce":  # the compilation
                if self.sm90a and not accepts_sm90a:
                    raise CompileException("nvrtc: error: invalid value for --gpu-architecture (-arch)")
                builds.append(self.options)
            return functions.setdefault(name, Function())

        def get_global(self, name):
            assert name == "cr_wgmma_compiled"
            return np.array([int(self.sm90a and takes_sm90a)], dtype=np.int32)

    class Device:
        compute_capability = capability

        def __init__(self, i=0):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def ndarray(shape, dtype, memptr):
        return types.SimpleNamespace(get=lambda: memptr)

    cupy = types.SimpleNamespace(
        RawModule=RawModule, ndarray=ndarray, int32=np.int32,
        cuda=types.SimpleNamespace(Device=Device, compiler=types.SimpleNamespace(CompileException=CompileException),
                                   runtime=types.SimpleNamespace(getDevice=lambda: 0)))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(kernels, "_modules", {})
    monkeypatch.setattr(kernels, "_key_locks", {})
    monkeypatch.setattr(kernels, "_sm90a_refused", set())
    return builds, functions


@pytest.mark.parametrize("capability, accepts, takes, kernel", [
    ("90", True, True, "coarse_diff2_wgmma"),
    ("90", False, False, "coarse_diff2_tf32"),  # the compiler refuses the option: compiled again without it
    ("90", True, False, "coarse_diff2_tf32"),  # it takes CuPy's architecture instead: the wgmma kernel is empty
    ("80", True, False, "coarse_diff2_tf32"),
])
def test_the_engine_gets_the_wgmma_kernel_only_where_the_module_holds_it(monkeypatch, caplog, capability, accepts,
                                                                          takes, kernel):
    builds, functions = _fake_hopper_cupy(monkeypatch, capability, takes, accepts)
    assert kernels.device_coarse_kernel(0) == kernel
    assert kernels.device_coarse_kernel(0) == kernel  # the module and the verdict are kept
    assert builds == [kernels.compile_options(capability if accepts else "80")]  # one build, kept
    warned = [r for r in caplog.records if "sm_90a" in r.getMessage()]
    assert len(warned) == (1 if capability == "90" and kernel != "coarse_diff2_wgmma" else 0)
    shared = functions.get("coarse_diff2_wgmma")
    assert (shared is not None and shared.max_dynamic_shared_size_bytes > 48 * 1024) == (kernel == "coarse_diff2_wgmma")
    kernels.kernel_module(("fine_sums<8, 4, 8, 4>",), 0)  # another module of the device: no second try of sm_90a
    assert builds[-1] == kernels.compile_options(capability if kernel == "coarse_diff2_wgmma" else "80")
    assert len([r for r in caplog.records if "sm_90a" in r.getMessage()]) == len(warned)


def test_2d_references_have_a_module_of_their_own(monkeypatch):
    """The kernels of 2D references (REF_DIM 2: bilinear slices and 2D back-projection, project.cu) are a module of
    their own, compiled once, beside the 3D module; the two sources differ in REF_DIM alone."""
    sources = []
    release = threading.Event()
    release.set()
    _fake_cupy(monkeypatch, (), release)
    real_module = sys.modules["cupy"].RawModule

    class Recording(real_module):
        def __init__(self, code, options, name_expressions):
            sources.append(code)
            super().__init__(code, options, name_expressions)

    monkeypatch.setattr(sys.modules["cupy"], "RawModule", Recording)
    flat = kernels.kernel_module((), 0)
    planar = kernels.kernel_module((), 0, ref_dim=2)
    assert planar is not flat and kernels.kernel_module((), 0, 2) is planar and kernels.kernel_module((), 0) is flat
    assert len(sources) == 2
    assert "#define REF_DIM 3\n" in sources[0] and "#define REF_DIM 2\n" in sources[1]
    assert sources[0].replace("#define REF_DIM 3\n", "", 1) == sources[1].replace("#define REF_DIM 2\n", "", 1)
    assert "#if REF_DIM == 2" in kernels.kernel_source(2)  # the switch the source holds
    with pytest.raises(ValueError, match="2D or 3D"):
        kernels.kernel_source(4)
