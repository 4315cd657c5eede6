"""The writer thread of iteration outputs: order, waiting, errors surfacing in the loop, the drawing process."""

import multiprocessing
import os
import threading
import time
from functools import partial
from pathlib import Path

import pytest

from cryorefine.io.background import BackgroundWriter, InOwnProcess, Together, WaitFor


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


def test_an_iteration_with_nothing_to_write_does_not_wait_for_the_previous_files():
    """VDAM writes its files every tenth iteration: the iterations between go on while they are written, and a
    write's error still reaches the loop at one of them."""
    done, release = [], threading.Event()
    with BackgroundWriter() as writer:
        writer.submit([lambda: release.wait(10), lambda: done.append("files")])
        assert writer.submit([]) == 0.0  # waiting would have taken the 10 s of the event's timeout
        assert done == []
        release.set()
    assert done == ["files"]

    def fail():
        raise OSError("disk full")

    writer = BackgroundWriter()
    writer.submit([fail])
    with pytest.raises(OSError, match="disk full"):
        for _ in range(1000):
            writer.submit([])
            time.sleep(0.01)


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


def test_writes_together_run_side_by_side_and_the_next_write_after_them_all():
    """An iteration's maps and STAR files are written side by side; the optimiser STAR file after all of them."""
    started, done = [], []

    def write(name):
        started.append(name)
        time.sleep(0.3)
        done.append(name)

    tic = time.perf_counter()
    with BackgroundWriter() as writer:
        writer.submit([Together([partial(write, f"map{k}") for k in range(4)]), lambda: done.append("optimiser")])
    assert time.perf_counter() - tic < 0.9  # one after the other: 1.2 s
    assert sorted(done[:4]) == ["map0", "map1", "map2", "map3"] and done[4] == "optimiser"


def test_an_error_among_writes_together_is_raised_after_the_others_end_and_stops_the_next():
    done = []

    def fail():
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"), BackgroundWriter() as writer:
        writer.submit([Together([fail, lambda: (time.sleep(0.2), done.append("map"))]),
                       lambda: done.append("optimiser")])
    assert done == ["map"]


def test_writes_after_a_wait_for_run_once_it_is_ready():
    """An MPI master's maps arrive while the next E-step runs: the iteration's files wait for them."""
    done, arrived = [], threading.Event()
    with BackgroundWriter() as writer:
        writer.submit([lambda: done.append("model"), WaitFor(arrived.is_set), lambda: done.append("maps")])
        time.sleep(0.2)
        assert done == ["model"]
        arrived.set()
    assert done == ["model", "maps"]


def test_an_error_in_the_loop_ends_a_wait_for_what_will_not_come():
    done = []
    tic = time.perf_counter()
    with pytest.raises(RuntimeError, match="worker"), BackgroundWriter() as writer:
        writer.submit([WaitFor(lambda: False), lambda: done.append("maps")])
        raise RuntimeError("a worker failed")
    assert done == [] and time.perf_counter() - tic < 5


def _write_pid(path):
    """A drawing-process write: the pid of the process that ran it, in `path`."""
    Path(path).write_text(str(os.getpid()))


def _die_in_a_child(path):
    """Ends the drawing process that runs it; in the writer's own process, writes `path`."""
    if multiprocessing.parent_process() is not None:
        os._exit(3)
    Path(path).write_text("drawn on the thread")


def test_a_write_in_its_own_process_runs_there_in_its_place_among_the_others(tmp_path):
    """The report's write runs in the writer's drawing process, not in this one, and the writes after it wait for
    it: the E-step's thread never waits for the interpreter while a report is drawn."""
    order = []
    with BackgroundWriter() as writer:
        writer.submit([lambda: order.append("maps"), InOwnProcess(partial(_write_pid, tmp_path / "report")),
                       lambda: order.append(("optimiser", (tmp_path / "report").is_file()))])
        writer.submit([InOwnProcess(partial(_write_pid, tmp_path / "second"))])
    first, second = (int((tmp_path / name).read_text()) for name in ("report", "second"))
    assert first != os.getpid() and second == first  # one drawing process for the run
    assert order == ["maps", ("optimiser", True)]


def test_a_drawing_process_that_dies_leaves_its_writes_to_the_thread(tmp_path, caplog):
    with BackgroundWriter() as writer:
        writer.submit([InOwnProcess(partial(_die_in_a_child, tmp_path / "report"))])
        writer.submit([InOwnProcess(partial(_write_pid, tmp_path / "next"))])
    assert (tmp_path / "report").read_text() == "drawn on the thread"
    assert int((tmp_path / "next").read_text()) == os.getpid()
    assert "the drawing process ended" in caplog.text


def test_a_drawing_process_that_cannot_start_leaves_its_writes_to_the_thread(tmp_path, caplog, monkeypatch):
    """Where no process can be started (a limit on processes), the write runs on the thread, with a warning."""
    import multiprocessing.context

    def refuse(self):
        raise OSError("Resource temporarily unavailable")

    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", refuse)
    with BackgroundWriter() as writer:
        writer.submit([InOwnProcess(partial(_write_pid, tmp_path / "report"))])
    assert int((tmp_path / "report").read_text()) == os.getpid()
    assert "no drawing process" in caplog.text
