"""atomic_write: a failed save leaves the old file and no temp file."""

from __future__ import annotations

import pytest

from metaopt.atomic import atomic_write


def test_replaces_and_failure_keeps_the_old_file(tmp_path):
    target = tmp_path / "f.bin"
    atomic_write(target, lambda f: f.write(b"one"))
    assert target.read_bytes() == b"one"

    def crash(f):
        f.write(b"half of tw")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, crash)
    assert target.read_bytes() == b"one"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]
    atomic_write(target, lambda f: f.write("two"), binary=False)
    assert target.read_text() == "two"


def test_a_saved_file_gets_the_umasks_mode_not_0600(tmp_path):
    import os
    import stat

    old = os.umask(0o027)
    try:
        path = atomic_write(tmp_path / "f.bin", lambda f: f.write(b"x"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
