"""The GPU kernels' compilation is announced, not silent (`estep.kernels`); no GPU needed."""

import logging
import time

from cryorefine.estep import kernels


def test_a_slow_compilation_is_announced_and_timed(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "COMPILE_NOTICE_SECONDS", 0.05)
    with caplog.at_level(logging.INFO, logger=kernels.__name__):
        with kernels.compile_notice("the test kernels"):
            time.sleep(0.3)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0].startswith("compiling the test kernels") and "cached in" in lines[0]
    assert lines[1].startswith("compiled the test kernels in")


def test_a_cache_hit_says_nothing(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "COMPILE_NOTICE_SECONDS", 0.5)
    with caplog.at_level(logging.INFO, logger=kernels.__name__):
        with kernels.compile_notice("the test kernels"):
            pass
        time.sleep(0.7)  # past the notice time: a timer left running would speak now
    assert caplog.records == []


def test_the_first_run_of_a_version_is_announced_until_one_has_ended(monkeypatch, tmp_path, caplog):
    """The notice speaks while no run of this version has ended on the machine, whatever else the cache holds
    (CuPy's kernels compiled by other programs), and a new version (other kernels) speaks again."""
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.INFO, logger=kernels.__name__):
        kernels.first_use_notice()  # no cache folder yet
        (tmp_path / "cache").mkdir()
        (tmp_path / "cache" / "0123.cubin").write_bytes(b"x")  # another program's kernels
        kernels.first_use_notice()
        kernels.mark_kernels_warm()  # a run's iterations ended
        kernels.first_use_notice()  # silent
        monkeypatch.setattr(kernels, "DEFINES", {**kernels.DEFINES, "LOCAL_CK": 64})  # other kernels
        kernels.first_use_notice()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3 and all(str(tmp_path / "cache") in m for m in messages)


def test_a_cache_that_cannot_be_written_is_left_alone(monkeypatch, tmp_path):
    (tmp_path / "file").write_bytes(b"x")
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "file" / "cache"))  # under a file: mkdir fails
    kernels.mark_kernels_warm()
    assert not kernels.warm_marker().exists()
