"""Option defaults that follow the run: the E-step batch."""

from cryorefine.config import GPU_BATCH_PARTICLES, RefineConfig, default_batch_size


def test_the_gpu_batch_holds_a_fixed_number_of_pixels_within_its_bounds():
    low, high = GPU_BATCH_PARTICLES
    assert default_batch_size(360, on_gpu=True) == 1024
    assert default_batch_size(512, on_gpu=True) == 506  # 1024·360² / 512²
    assert default_batch_size(800, on_gpu=True) == 207
    assert default_batch_size(64, on_gpu=True) == high  # small images: at most 1024
    assert default_batch_size(4096, on_gpu=True) == low
    sizes = [default_batch_size(box, on_gpu=True) for box in range(32, 2000, 7)]
    assert all(a >= b for a, b in zip(sizes, sizes[1:]))  # never more particles for larger images


def test_a_given_batch_wins_and_the_cpu_keeps_its_own_default():
    files = dict(input_star="p.star", output_root="out/run", reference_map="ref.mrc")
    gpu = RefineConfig(**files, engine="cuda")
    cpu = RefineConfig(**files, engine="numpy")
    assert gpu.batch_size_for(360) == 1024 and gpu.batch_size_for(800) == 207
    assert cpu.batch_size_for(360) == cpu.batch_size_for(800) == 128
    assert cpu.batch_size_for(360, on_gpu=True) == 1024  # what `plan` asks for a GPU run, wherever it plans
    for config in (gpu, cpu):
        given = RefineConfig(**files, engine=config.engine, batch_size=7)
        assert given.batch_size_for(360) == given.batch_size_for(800) == 7
