"""kvpop.io: atomic outputs appear whole, with the permissions the umask gives a new file or folder."""

from __future__ import annotations

import os

import pytest

from kvpop.io import atomic_dir, atomic_file


@pytest.fixture(params=[0o022, 0o077])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def test_atomic_file_replaces_whole_with_the_umask_mode(tmp_path, umask):
    path = tmp_path / "sub" / "metrics.json"
    with atomic_file(path) as f:
        f.write("{}\n")
        assert not path.exists()  # nothing at the path until the file is whole
    assert path.read_text() == "{}\n" and path.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600
    assert os.umask(umask) == umask  # the process's umask left as it was
    with pytest.raises(RuntimeError), atomic_file(path) as f:
        f.write("half")
        raise RuntimeError("stopped")
    assert path.read_text() == "{}\n" and sorted(p.name for p in path.parent.iterdir()) == ["metrics.json"]  # no temp file left


def test_atomic_dir_gets_the_umask_mode(tmp_path, umask):
    with atomic_dir(tmp_path / "export") as tmp:
        (tmp / "w.bin").write_bytes(b"x")
    assert (tmp_path / "export").stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700 (unless the umask says so)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
