"""em.loop: what the loop does around the iterations, beside the jobs' own tests."""

import gc

from cryorefine.em.loop import long_lived_objects_frozen


def test_objects_alive_before_the_iterations_are_frozen_until_they_end():
    """The garbage collector's full passes skip what lived before the iterations (the particle table, caches), and
    nothing stays frozen after them: a process that runs several jobs does not keep the earlier ones' objects."""
    gc.unfreeze()
    long_lived = [[i] for i in range(10_000)]  # tracked containers, alive before the iterations
    with long_lived_objects_frozen():
        frozen = gc.get_freeze_count()
        assert frozen >= len(long_lived)
        made_inside = [[i] for i in range(10_000)]  # an iteration's objects stay with the collector
        assert gc.get_freeze_count() == frozen
        del made_inside
    assert gc.get_freeze_count() == 0
    del long_lived


def test_objects_are_let_go_when_the_iterations_fail():
    gc.unfreeze()
    try:
        with long_lived_objects_frozen():
            assert gc.get_freeze_count() > 0
            raise RuntimeError("an iteration failed")
    except RuntimeError:
        pass
    assert gc.get_freeze_count() == 0
