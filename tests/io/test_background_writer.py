"""The writer thread of iteration outputs: order, waiting, errors surfacing in the loop."""

import threading
import time

import pytest

from cryorefine.io.background import BackgroundWriter


def test_writes_run_in_order_on_another_thread_and_the_block_waits_for_them():
    done, threads = [], set()

    def write(name, pause=0.0):
        time.sleep(pause)
        threads.add(threading.get_ident())
        done.append(name)

    with BackgroundWriter() as writer:
        writer.submit([lambda: write("a", 0.2), lambda: write("b")])
        assert done == []  # submit returns before the writes ran
        writer.submit([lambda: write("c")])  # waits for the first iteration's writes
        assert done[:2] == ["a", "b"]
    assert done == ["a", "b", "c"]
    assert threading.get_ident() not in threads


def test_an_error_in_a_write_is_raised_in_the_loop_and_stops_that_iteration_s_later_writes():
    done = []

    def fail():
        raise OSError("disk full")

    writer = BackgroundWriter()
    writer.submit([fail, lambda: done.append("after")])
    with pytest.raises(OSError, match="disk full"):
        writer.submit([lambda: done.append("next")])
    assert done == []
    with pytest.raises(OSError, match="disk full"), BackgroundWriter() as other:
        other.submit([fail])


def test_an_error_in_the_loop_still_lets_the_last_iteration_s_writes_finish():
    done = []
    with pytest.raises(RuntimeError, match="E-step"), BackgroundWriter() as writer:
        writer.submit([lambda: time.sleep(0.2), lambda: done.append("maps")])
        raise RuntimeError("E-step failed")
    assert done == ["maps"]
