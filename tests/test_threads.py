"""kvpop.threads: the thread count is chosen from free cores, an environment variable or a flag."""

import pytest

from kvpop.threads import ENV, auto_threads, busy_cores, choose_threads, stage_threads, usable_cores


@pytest.mark.parametrize(("cores", "busy", "want"), [(2, 0.0, 2), (2, 0.9, 1), (2, 3.0, 1), (16, 4.4, 12), (16, 4.6, 11), (1, 0.0, 1)])
def test_auto_takes_the_free_cores(cores, busy, want):
    assert auto_threads(cores, busy) == want


def test_busy_cores_sees_a_busy_process():
    import subprocess
    import sys

    idle = busy_cores(0.5)
    if idle is None:
        pytest.skip("no /proc/stat on this platform")
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        import time

        time.sleep(0.3)
        busy = busy_cores(0.5)
    finally:
        spin.kill()
    assert busy is not None and busy >= 0.8 and busy > idle - 0.5


def test_explicit_env_and_errors(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert choose_threads(3) == 3 and choose_threads("2") == 2
    assert 1 <= choose_threads(None) == choose_threads("auto")
    monkeypatch.setenv(ENV, "5")
    assert choose_threads(None) == 5
    for bad in (0, "-1", "many"):
        with pytest.raises(ValueError, match="positive integer or 'auto'"):
            choose_threads(bad)


def test_stages_take_a_fixed_count(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert stage_threads() == usable_cores()  # whatever the load
    monkeypatch.setenv(ENV, "auto")
    assert stage_threads() == usable_cores()
    monkeypatch.setenv(ENV, "1")
    assert stage_threads() == 1
