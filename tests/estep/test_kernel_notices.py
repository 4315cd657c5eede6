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


def test_the_first_run_on_a_machine_is_announced_once_the_cache_is_empty(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.INFO, logger=kernels.__name__):
        kernels.first_use_notice()  # no cache folder yet
        (tmp_path / "cache").mkdir()
        kernels.first_use_notice()  # an empty one
        (tmp_path / "cache" / "0123.cubin").write_bytes(b"x")
        kernels.first_use_notice()  # a used one: silent
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and all(str(tmp_path / "cache") in m for m in messages)
