"""write_atomic: a result written through a temporary file lands as a plain write would leave it."""

import os
import stat
import threading

from redline.atomic import check_writable, write_atomic


def test_a_written_file_has_the_mode_the_umask_gives_not_owner_only(tmp_path):
    old = os.umask(0o022)
    try:
        path = tmp_path / "report.html"
        write_atomic(path, lambda tmp: tmp.write_text("<p>x</p>"))
    finally:
        os.umask(old)
    assert path.read_text() == "<p>x</p>"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # others can read a report, as with open(path, "w")
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]  # no temporary file left beside it


def test_a_named_pipe_is_written_into_not_renamed_over(tmp_path):
    """A rename would put a regular file in place of the pipe (or, as root, of /dev/null for everyone)."""
    fifo = tmp_path / "results"
    os.mkfifo(fifo)
    check_writable(fifo)  # asks, without opening it: that would wait for a reader
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    write_atomic(fifo, lambda target: target.write_text("<html>report</html>"))
    reader.join(timeout=10)
    assert received == [b"<html>report</html>"]
    assert stat.S_ISFIFO(fifo.stat().st_mode) and sorted(p.name for p in tmp_path.iterdir()) == ["results"]
